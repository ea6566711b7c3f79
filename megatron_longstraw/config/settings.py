"""LongStrawConfig: the settings of a LongStraw run, one section per phase (the `--longstraw-*`
flags, or a YAML `longstraw:` section).

Each setting is declared once, as a field of its section with its docstring (config/fields.py):
the flag (`--longstraw-<key>`), its type, its help (the docstring's first paragraph), the YAML key
(`<key>`, in the flat `longstraw:` mapping) and the value checks all come from the field. A
phase receives its section: capture `cfg.capture`, the loss `cfg.loss` (as `loss_config()`),
generation `cfg.rollout`, environments `cfg.environment`, the launcher's guards `cfg.guards`, its
adapters `cfg.adapters`; the step, which drives them all, the whole config.

    cfg = LongStrawConfig.of(group_size=4, page_tokens=8192)      # flat keys, as in the YAML
    cfg.group.group_size, cfg.capture.page_tokens                 # 4, 8192
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from megatron_longstraw.config.choices import PAGE_FORMATS, PromptGrad
from megatron_longstraw.config.fields import Section, section_settings, setting
from megatron_longstraw.config.loss import LOSS_AGGREGATIONS, TIS_MODES, GRPOLossConfig
from megatron_longstraw.config.sampling import CONTROLS, SamplingParams


@dataclass
class GroupSettings(Section):
    """What a group is: its size, the longest response, and where rewards come from."""

    group_size: int = setting(4, low=2)
    """G: responses per prompt (>= 2).

    GRPO compares the members of a group, so a group has at least two."""
    max_response_len: int = setting(4096, low=1)
    """Longest response accepted; longer ones are rejected before any work."""
    reward: str | None = setting(None, metavar="MODULE:FUNCTION")
    """Reward function fn(prompt_ids, response_ids, response_text, meta) -> float for records
    without 'rewards' (built-ins: longstraw:exact_match, longstraw:marker_majority, marker_copy,
    marker_missing, marker_first; docs/usage.md "Rewards").

    `module:function` or `longstraw:<built-in>` (rollout/rewards.py); None: every record must
    carry its rewards."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reward is not None and ":" not in self.reward:
            raise ValueError(f"longstraw reward must be 'module:function' or 'longstraw:<name>', "
                             f"got {self.reward!r} (--longstraw-reward, YAML longstraw.reward).")


@dataclass
class LossSettings(Section):
    """The GRPO loss and the off-policy correction (grpo/; `LongStrawConfig.loss_config()` is the
    loss's `GRPOLossConfig`)."""

    clip_eps_low: float = setting(0.2)
    """PPO clip below 1 (ratio >= 1 - eps)."""
    clip_eps_high: float = setting(0.2)
    """PPO clip above 1 (ratio <= 1 + eps)."""
    kl_coef: float = setting(0.0)
    """k3 KL coefficient to the reference policy (0 disables it).

    Above 0 the step scores the reference policy too (a LoRA run's base with adapters off)."""
    adv_eps: float = setting(1e-6)
    """Added to the group's reward std in the advantage denominator, A_i = (r_i - mean(r)) /
    (std(r) + eps) (> 0; default 1e-6)."""
    std_unbiased: bool = setting(False)
    """Advantages divide by the sample std of the group's rewards (G - 1) instead of the
    population std (G; the default)."""
    loss_aggregation: str = setting("sequence_mean", choices=LOSS_AGGREGATIONS)
    """sequence_mean (default): each member's token mean, then the mean over the group;
    token_mean (DAPO): the mean over all the group's tokens; constant (Dr. GRPO): each member's
    token sum / C (--longstraw-loss-constant), then the mean over the group.

    grpo/loss.py states each formula; under token_mean a long response weighs more."""
    loss_constant: int | None = setting(None, low=1, metavar="C")
    """C of --longstraw-loss-aggregation constant, in tokens (default:
    --longstraw-max-new-tokens, else --longstraw-max-response-len)."""
    dual_clip: float | None = setting(None, const=3.0, metavar="C")
    """Dual clip for negative advantages: a token's policy loss is at most C |A| (C > 1; the
    flag alone: 3)."""
    log_ratio_clamp: float | None = setting(None, metavar="D")
    """Clamp logp - logp_old to [-D, D] before the exp of the PPO ratio (default: off).

    D > 0: the ratio is exp(clamp(logp - logp_old, -D, D))."""
    kl_clamp: float | None = setting(None, metavar="K")
    """Cap each token's k3 KL estimate at K (default: off)."""
    tis: str = setting("truncate", choices=TIS_MODES)
    """Engine-trainer correction when the data carries the engine's logprobs_old: truncate
    (default) weights each token's policy term by min(pi_old / pi_engine, C), mask by the ratio
    inside [1/C, C] and 0 outside, off by 1. The PPO ratio's denominator is always the trainer's
    own pi_old; the mismatch is logged either way.

    Without the data's `logprobs_old` there is nothing to correct (grpo/offpolicy.py)."""
    tis_cap: float = setting(2.0, low=1, metavar="C")
    """C of --longstraw-tis (>= 1; default 2.0)."""


@dataclass
class CaptureSettings(Section):
    """How the prompt's state is computed and stored (context/capture.py), and the block sizes
    every pass over it uses (scoring, replay, generation, the prompt backward)."""

    mode: str = setting("streamed", key="capture", choices=("streamed", "whole"))
    """Streamed capture (token blocks, the residual stream in host memory, under CP the layer's
    rows exchanged through host memory; default) or whole (each layer over the rank's whole shard
    on the device: the reference).

    Streamed keeps nothing of the prompt's size on the device; whole is the earlier schedule,
    kept as the reference streamed capture is tested against."""
    page_tokens: int = setting(65536, low=1)
    """Rows per page of captured state."""
    offload_pages: bool = setting(True)
    """Keep prompt pages in host memory and stream them.

    Pinned with CUDA, streamed layer by layer."""
    index_key_pages: str = setting("model", choices=PAGE_FORMATS)
    """DSA index-key pages (GLM-5.2): model (the model's dtype; default) or fp8 (e4m3 + one fp32
    scale per token, 132 B at index_head_dim 128: changes only which keys the top-k selects).

    Families without index keys ignore it. fp8 is DeepGEMM's layout (d + 4 bytes a row); index
    keys get no gradient, and DeepGEMM's indexer casts the keys the same way. "model" is the
    default because the CPU parity tests compare with transformers at fp64 and need exact
    selections."""
    token_block: int = setting(8192, low=1)
    """Tokens per chunk for token-wise work in capture.

    Projections, FFN and MoE run in chunks of this many tokens; it is also the token block of
    streamed capture and of the prompt backward."""
    query_block: int = setting(1024, low=1)
    """Queries per sparse-attention block."""
    key_block: int = setting(4096, low=1)
    """Keys per indexer-score block (running top-k)."""

    def page_formats(self) -> dict[str, str]:
        """Page kind -> storage format for the capture's `PageStore` (`formats`): "index_key" is
        the GLM-5.2 mixer's kind (models/glm52/attention.py INDEX_KEY)."""
        return {"index_key": self.index_key_pages} if self.index_key_pages != "model" else {}


@dataclass
class ReplaySettings(Section):
    """Scoring and replay of the members' branches over the captured prompt (step/)."""

    prompt_grad: PromptGrad = setting(PromptGrad.DETACHED)
    """detached: the gradient at fixed prompt state (default); exact: also back-propagate
    through the prompt (standard GRPO's update; keeps every layer's prompt input in host
    memory).

    EXACT: replay accumulates d loss / d state into the pages' cotangents, then a prompt
    backward runs the prompt's layers in reverse (context/prompt_backward.py)."""
    response_block: int = setting(8192, low=1)
    """Tokens per block of a response in scoring and replay: longer responses run block by
    block (device memory bounded by a block; the same update).

    A longer branch's earlier blocks' state is kept in host pages like the prompt's, and replay
    walks the blocks in reverse (step/replay.py). Under CP a block is rounded up to a multiple of
    the CP size."""
    reuse_branch_pages: bool = setting(False)
    """Blockwise responses: scoring keeps every member's branch pages (host memory) so replay
    skips one forward of the branch.

    The same weights and selections write the same pages; the cost is G members' branch pages
    in host memory instead of one's (the planner's `branch pages` line, times G)."""
    checkpoint_layers: bool = setting(True)
    """Whole-decoder-layer activation checkpointing in replay."""


@dataclass
class ReuseSettings(Section):
    """Several optimizer steps over one capture of each prompt (step/schedule.py
    `train_on_capture`), and how stale the kept capture gets (step/staleness.py)."""

    updates_per_capture: int = setting(1, low=1, metavar="K")
    """K: optimizer steps per capture of each prompt; each prompt gets G x K members and update k
    trains members [kG, (k+1)G) over the kept capture (default 1: a capture per step).

    Every member is scored once, before the first update: those log-probs are every update's PPO
    denominator. --train-iters, --save-interval, --eval-interval and --exit-interval count
    updates and must be multiples of K (saves and exits happen at capture boundaries)."""
    epochs: int = setting(1, low=1, metavar="E")
    """PPO-style epochs: the capture's K mini-batches are trained E times, in order, so a capture
    serves E x K optimizer steps over its G x K members (default 1).

    Each pass replays every mini-batch over the kept capture at the current weights; the ratio's
    denominator stays the capture-time log-probs. --train-iters and the intervals then count in
    multiples of E x K."""
    advantage_scope: str = setting("capture", choices=("capture", "update"))
    """With K > 1: capture (default): advantages over the prompt's G x K members; update: over
    each update's G members."""
    drift_every: int = setting(0, low=0, metavar="N")
    """With K > 1: before every N-th update of a capture, capture the prompt again at the current
    weights and report how far the kept state has drifted (drift/* in the step line and
    TensorBoard; default 0: never).

    |delta log-prob| mean and max, a k3 estimate and the cosine and relative norm of the update's
    gradient over the kept against the fresh state, over the update's members (staleness.py).
    Each measurement costs a capture."""
    drift_first_last: bool = setting(False)
    """With K > 2: also measure the drift before the first update that can differ (update 1, one
    optimizer step after the capture) and before the last (update K - 1, the stalest), as
    --longstraw-drift-every does (default: off). Two captures per capture of the prompt, whatever K."""
    drift_bound: float | None = setting(None, metavar="D")
    """With --longstraw-drift-every or --longstraw-drift-first-last: when the measured mean |delta log-prob| is above D, the fresh
    capture replaces the kept one for the capture's remaining updates (default: never)."""


@dataclass
class RolloutSettings(Section):
    """Where the step's groups come from, and how the online loop samples them
    (rollout/online.py, rollout/decode.py)."""

    mode: str = setting("offline", key="rollout", choices=("offline", "online"))
    """offline (default): train on the groups of --longstraw-data; online: --longstraw-data holds
    prompts, each step generates the group's responses from its own capture and rewards them
    with --longstraw-reward (docs/usage.md "Generation and the online loop")."""
    max_new_tokens: int | None = setting(None, low=1)
    """Online: most tokens per generated response (default: --longstraw-max-response-len)."""
    temperature: float = setting(1.0)
    """Online sampling temperature (default 1; 0: greedy)."""
    top_p: float = setting(1.0)
    """Online nucleus sampling (default 1: off)."""
    top_k: int = setting(0)
    """Online top-k sampling (default 0: off)."""
    stop_ids: tuple[int, ...] = setting(())
    """Online: token ids that end a response (kept in it)."""
    control: str = setting("none", choices=CONTROLS)
    """Online control run: zeros replaces the captured prompt state by zeros (the policy sees
    nothing of the prompt but its last token); blind (with --longstraw-env) calls the
    environments as usual but feeds none of their observations (the policy is told nothing by
    its tools; their rewards count as usual)."""
    dynamic_sampling: bool = setting(False)
    """Online (DAPO): drop generated groups whose rewards are all equal and generate more from
    the next prompts until the step's batch is full."""
    dynamic_sampling_rounds: int = setting(4, low=0, metavar="N")
    """The most extra generation rounds per step of dynamic sampling, each over the next
    --global-batch-size prompts (default 4); past it the batch is filled with dropped groups.

    A step generates at most (1 + rounds) x --global-batch-size groups; the remaining slots are
    counted as short."""
    trajectories: str = setting("auto", choices=("auto", "on", "off"))
    """Online: write every group trained on to <out-dir>/<run-name>/trajectories/ (auto, the
    default: with --longstraw-env; on: also without one; off: never), one JSONL line per group
    in the offline data format that tools/score.py and the offline trainer read: its members'
    tokens, loss masks, rewards and sampling log-probs, and under 'trajectory' each member's
    turns, end reason and where its reward came from (training/trajectories.py)."""
    trajectories_max_mb: float = setting(1024.0, low=0, metavar="MB")
    """The trajectories' files stop growing past MB (default 1024): the first step that would
    pass it and every later one are not written, and the log and the receipt say from which
    step on."""

    def __post_init__(self) -> None:
        super().__post_init__()
        SamplingParams(max_new_tokens=self.max_new_tokens or 1, temperature=self.temperature,
                       top_p=self.top_p, top_k=self.top_k)   # its checks name the bad value


@dataclass
class EnvironmentSettings(Section):
    """Online multi-turn rollouts: the environment each member talks to (rollout/env.py)."""

    env: str | None = setting(None, metavar="MODULE:FACTORY")
    """Online: an environment per member, made by FACTORY(meta, prompt_ids, tokenizer)
    (rollout/env.py): multi-turn trajectories, the tool observations prefilled and masked out of
    the loss. Built-in example: megatron_longstraw.rollout.example_env:lookup."""
    env_max_turns: int = setting(8, low=1, metavar="N")
    """Environment calls per member (default 8)."""
    env_turn_tokens: int = setting(0, low=0, metavar="N")
    """A turn also ends after N policy tokens (default 0: only at the environment's stop ids)."""
    env_timeout: float = setting(30.0, metavar="SECONDS")
    """Seconds one environment call may take; past it the member ends with a record (default
    30).

    The call's worker process is killed (rollout/env_workers.py)."""
    env_max_concurrency: int = setting(16, low=1, metavar="N")
    """Environment calls in flight at once: the members whose turns end at the same decode step
    call their environments (each in its own worker process) concurrently, at most N at a time
    (default 16)."""
    env_prefill_block: int = setting(2048, low=1, metavar="N")
    """Observation tokens fed into a member's state in one pass (default 2048): an observation
    enters as blocks of up to N rows beside the other members' sampled rows, the same tokens and
    log-probs as one row per decode step (1), in about 1/N of the passes."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.env is not None and ":" not in self.env:
            raise ValueError(f"longstraw env must be 'module:factory', got {self.env!r} "
                             "(--longstraw-env, YAML longstraw.env).")
        if not self.env_timeout > 0:
            raise ValueError(f"longstraw env_timeout must be a number of seconds > 0, got "
                             f"{self.env_timeout!r} (--longstraw-env-timeout, YAML "
                             "longstraw.env_timeout).")


@dataclass
class GuardSettings(Section):
    """The launcher's guards on a run that stops learning (training/guards.py)."""

    entropy_floor: float = setting(0.01, low=0, metavar="NATS")
    """Warn once when the policy's mean entropy over a step's trained tokens falls below NATS
    (entropy collapse; default 0.01; 0: off)."""
    stop_after_no_signal: int = setting(0, low=0, metavar="N")
    """Stop (saving with --save) after N consecutive steps in which every group's rewards were
    all equal (zero advantage; default 0: never)."""


@dataclass
class RunSettings(Section):
    """Process-wide choices, made once at set-up: the seed and the kernel backends."""

    seed: int = setting(1234)
    """Seed for initialisation and synthetic data (defaults to --seed)."""
    kernels: str = setting("auto")
    """Kernel backend (auto picks the fastest available and logs it).

    auto | ref | a backend name | a per-part spec such as "auto,indexer=ref" or
    "sparse_mla=flashmla,sparse_mla_grad=triton" (kernels/select.py, which checks it)."""


@dataclass
class AdapterSettings(Section):
    """The launcher's LoRA / QLoRA / FP8-base request (adapters/; training/arguments.py turns it
    into a `LoRASettings`, checked against the family)."""

    lora: bool | None = setting(None)
    """Train LoRA adapters on a frozen base instead of every parameter.

    None (not given) is off; an explicit false (`--no-longstraw-lora`, `lora: false`) also
    switches off the other LoRA keys a YAML carries (a toggle), where without it they are
    refused as a forgotten --longstraw-lora."""
    qlora: bool = setting(False)
    """LoRA with the frozen base in NF4 (bitsandbytes, block size 64, double quantisation);
    implies --longstraw-lora."""
    fp8_base: bool = setting(False)
    """With --longstraw-lora: keep the frozen base's linears in FP8 e4m3 with one fp32 scale per
    128 x 128 block (megatron_longstraw/kernels/fp8.py): the FP8 weights of a converted FP8
    checkpoint as they ship, or, for a bf16 / fp32 base, the family's FP8 linears quantised at
    load. Not with --longstraw-qlora; not for full-parameter training."""
    lora_rank: int = setting(64, low=1)
    """Adapter rank r (default 64)."""
    lora_alpha: float = setting(16.0)
    """The update is scaled by alpha / rank (default 16).

    Rank and alpha default to the QLoRA paper's r = 64, alpha = 16."""
    lora_dropout: float = setting(0.0, low=0)
    """Dropout on the adapters' input, in [0, 1) (default 0); applied in replay only (capture and
    scoring run without it)."""
    lora_targets: tuple[str, ...] | None = setting(None, metavar="PATTERN")
    """Linear layers that get adapters: names or fnmatch patterns matched against a module's last
    name component or its full name (default: the family's: Family.lora_targets,
    models/<family>/family.py). Each must match a linear layer of the model."""
    lora_exclude: tuple[str, ...] = setting((), metavar="PATTERN")
    """Modules to leave without adapters, e.g. '*.experts.*'."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.lora_alpha > 0:
            raise ValueError(f"longstraw lora_alpha must be a number > 0, got {self.lora_alpha!r} "
                             "(--longstraw-lora-alpha, YAML longstraw.lora_alpha).")
        if not self.lora_dropout < 1:
            raise ValueError(f"longstraw lora_dropout must be a number in [0, 1), got "
                             f"{self.lora_dropout!r} (--longstraw-lora-dropout, YAML "
                             "longstraw.lora_dropout).")

    def given(self) -> dict[str, object]:
        """The settings that differ from their defaults (key -> value)."""
        return {s.key: getattr(self, s.name) for s in section_settings(type(self))
                if getattr(self, s.name) != s.default}


def capture_section(settings: "CaptureSettings | LongStrawConfig") -> CaptureSettings:
    """The capture section of `settings` (the section itself, or a whole config's): what the
    public `capture_prompt` and `generate` accept."""
    section = getattr(settings, "capture", settings)
    if not isinstance(section, CaptureSettings):
        raise TypeError(f"expected CaptureSettings or a LongStrawConfig, got "
                        f"{type(settings).__name__}.")
    return section


SECTIONS: dict[str, type[Section]] = {
    "group": GroupSettings, "loss": LossSettings, "capture": CaptureSettings,
    "replay": ReplaySettings, "reuse": ReuseSettings, "rollout": RolloutSettings, "environment": EnvironmentSettings,
    "guards": GuardSettings, "run": RunSettings, "adapters": AdapterSettings}
"""Section attribute -> class, in the order `--help` lists them."""


def all_settings() -> tuple:
    """Every setting of every section (config/fields.py `Setting`), in `--help` order."""
    return tuple(s for name, cls in SECTIONS.items() for s in section_settings(cls, name))


@dataclass
class LongStrawConfig:
    """The run's settings, a section per phase (module docstring)."""

    group: GroupSettings = dataclasses.field(default_factory=GroupSettings)
    loss: LossSettings = dataclasses.field(default_factory=LossSettings)
    capture: CaptureSettings = dataclasses.field(default_factory=CaptureSettings)
    replay: ReplaySettings = dataclasses.field(default_factory=ReplaySettings)
    reuse: ReuseSettings = dataclasses.field(default_factory=ReuseSettings)
    rollout: RolloutSettings = dataclasses.field(default_factory=RolloutSettings)
    environment: EnvironmentSettings = dataclasses.field(default_factory=EnvironmentSettings)
    guards: GuardSettings = dataclasses.field(default_factory=GuardSettings)
    run: RunSettings = dataclasses.field(default_factory=RunSettings)
    adapters: AdapterSettings = dataclasses.field(default_factory=AdapterSettings)

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"LongStrawConfig.{name} must be a {cls.__name__}, got "
                                f"{type(getattr(self, name)).__name__} (LongStrawConfig.of "
                                "takes the flat keys).")
        self._check_across_sections()

    def _check_across_sections(self) -> None:
        group, rollout, env = self.group, self.rollout, self.environment
        new = rollout.max_new_tokens or group.max_response_len
        if new > group.max_response_len:
            raise ValueError(f"longstraw max_new_tokens (--longstraw-max-new-tokens) {new} is more "
                             f"than max_response_len {group.max_response_len}: raise "
                             "--longstraw-max-response-len or generate fewer tokens.")
        if rollout.control != "none" and (rollout.mode != "online"
                                          or self.replay.prompt_grad is not PromptGrad.DETACHED):
            raise ValueError("longstraw control (--longstraw-control zeros) replaces the captured "
                             "prompt state in the online loop: it needs --longstraw-rollout online "
                             "and the detached prompt gradient.")
        if rollout.control == "blind" and env.env is None:
            raise ValueError("longstraw control blind (--longstraw-control blind) withholds the "
                             "environments' observations: it needs --longstraw-env.")
        if rollout.dynamic_sampling and rollout.mode != "online":
            raise ValueError("longstraw dynamic_sampling (--longstraw-dynamic-sampling) drops "
                             "generated groups without signal and generates more: it needs "
                             "--longstraw-rollout online (offline groups are given).")
        if env.env is not None and rollout.mode != "online":
            raise ValueError("longstraw env (--longstraw-env) answers the policy's tool calls while "
                             "it generates: it needs --longstraw-rollout online (offline "
                             "trajectories carry their own loss_masks).")
        if rollout.mode == "online" and group.reward is None and env.env is None:
            raise ValueError("--longstraw-rollout online rewards the generated responses: give a "
                             "reward function (--longstraw-reward module:function, YAML "
                             "longstraw.reward) or an environment that rewards them "
                             "(--longstraw-env).")
        reuse = self.reuse
        steps = self.steps_per_capture()
        if steps > 1 and self.replay.prompt_grad is PromptGrad.EXACT:
            raise ValueError("longstraw updates_per_capture (--longstraw-updates-per-capture) "
                             f"{reuse.updates_per_capture} x epochs (--longstraw-epochs) "
                             f"{reuse.epochs} with the exact prompt gradient: it needs the "
                             "prompt's state at the current weights, which a kept capture is not "
                             "after the first update. Use --longstraw-prompt-grad detached, or "
                             "one update per capture.")
        for name, value in (("drift_every", reuse.drift_every),
                            ("drift_first_last", reuse.drift_first_last)):
            if value and steps == 1:
                flag = "--longstraw-" + name.replace("_", "-")
                raise ValueError(f"longstraw {name} ({flag}) measures how stale a kept capture "
                                 "gets over its updates, but every step captures afresh "
                                 "(--longstraw-updates-per-capture 1, --longstraw-epochs 1): "
                                 "raise the updates per capture or drop it.")
        if reuse.drift_bound is not None and not (
                reuse.drift_bound > 0 and (reuse.drift_every or reuse.drift_first_last)):
            raise ValueError(f"longstraw drift_bound (--longstraw-drift-bound) "
                             f"{reuse.drift_bound!r}: a bound (> 0) on the measured mean |delta "
                             "log-prob| needs the drift measured (--longstraw-drift-every N or "
                             "--longstraw-drift-first-last).")
        self.loss_config()   # the loss's own checks (clip range, KL, eps)

    def loss_config(self) -> GRPOLossConfig:
        loss = self.loss
        return GRPOLossConfig(clip_eps_low=loss.clip_eps_low, clip_eps_high=loss.clip_eps_high,
                              kl_coef=loss.kl_coef, adv_eps=loss.adv_eps,
                              std_unbiased=loss.std_unbiased, aggregation=loss.loss_aggregation,
                              norm_constant=self.loss_norm_constant(),
                              dual_clip=loss.dual_clip, log_ratio_clamp=loss.log_ratio_clamp,
                              kl_clamp=loss.kl_clamp)

    def loss_norm_constant(self) -> int:
        """C of loss_aggregation "constant": `loss_constant`, else the longest response the run
        can have (`max_new_tokens`, else `max_response_len`)."""
        return (self.loss.loss_constant or self.rollout.max_new_tokens
                or self.group.max_response_len)

    def members_per_group(self) -> int:
        """G x K: the members each prompt gets (K updates per capture, G members each)."""
        return self.group.group_size * self.reuse.updates_per_capture

    def steps_per_capture(self) -> int:
        """E x K: the optimizer steps one capture serves (K mini-batches, E epochs over them)."""
        return self.reuse.updates_per_capture * self.reuse.epochs

    def max_new_tokens(self) -> int:
        """The most tokens a generated response has (`max_new_tokens`, else `max_response_len`)."""
        return self.rollout.max_new_tokens or self.group.max_response_len

    def flat(self) -> dict[str, object]:
        """Key -> value of every setting (the YAML `longstraw:` mapping this config reads as)."""
        return {s.key: getattr(getattr(self, s.section), s.name) for s in all_settings()}

    def replace(self, **values) -> "LongStrawConfig":
        """A copy with the settings named by their keys changed (checked like `of`)."""
        return LongStrawConfig.of(**{**self.flat(), **values})

    @classmethod
    def of(cls, **values) -> "LongStrawConfig":
        """The config of flat keys (the YAML `longstraw:` keys); the rest take their defaults."""
        return cls.from_dict(values)

    @classmethod
    def from_dict(cls, values: dict) -> "LongStrawConfig":
        by_key = {s.key: s for s in all_settings()}
        unknown = sorted(set(values) - set(by_key))
        if unknown:
            raise ValueError(f"Unknown longstraw settings {unknown}; known: {sorted(by_key)}.")
        sections: dict[str, dict] = {name: {} for name in SECTIONS}
        for key, value in values.items():
            sections[by_key[key].section][by_key[key].name] = value
        return cls(**{name: SECTIONS[name](**kwargs) for name, kwargs in sections.items()})

    @classmethod
    def from_yaml(cls, path: str | Path) -> "LongStrawConfig":
        """The settings of a YAML's `longstraw:` section (every key a setting's key)."""
        data = yaml.safe_load(Path(path).read_text()) or {}
        return cls.from_dict(data.get("longstraw", {}) or {})
