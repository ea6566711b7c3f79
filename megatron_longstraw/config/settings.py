"""LongStrawConfig: the settings of the LongStraw step (the `--longstraw-*` flags, or a YAML
`longstraw:` section)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from megatron_longstraw.config.loss import GRPOLossConfig, check_loss_options, check_tis
from megatron_longstraw.config.sampling import CONTROLS, SamplingParams
from megatron_longstraw.state.attention_pass import PromptGrad
from megatron_longstraw.state.pages import PAGE_FORMATS


@dataclass
class LongStrawConfig:
    group_size: int = 4
    """G: responses per prompt (>= 2; GRPO compares members of a group)."""
    max_response_len: int = 4096
    """Longest response accepted (tokens); longer ones are rejected before any work."""
    clip_eps_low: float = 0.2
    """PPO clip: ratios below 1 - clip_eps_low are clipped."""
    clip_eps_high: float = 0.2
    """PPO clip: ratios above 1 + clip_eps_high are clipped."""
    kl_coef: float = 0.0
    """beta of the k3 KL penalty to the reference policy (0 disables reference scoring)."""
    adv_eps: float = 1e-6
    """Added to the group's reward std in the advantage denominator, A_i = (r_i - mean) / (std +
    adv_eps) (> 0)."""
    std_unbiased: bool = False
    """Advantage std: False = population std (divide by G), True = sample std (divide by G - 1)."""
    loss_aggregation: str = "sequence_mean"
    """How the loss aggregates token terms (grpo/loss.py states each formula): "sequence_mean"
    (each member's token mean, then the mean over the G members; the default), "token_mean" (DAPO:
    the mean over the group's sum_i R_i tokens, so a long response weighs more) or "constant"
    (Dr. GRPO: each member's token sum divided by the constant `loss_constant`, then the mean over
    members)."""
    loss_constant: int | None = None
    """C of loss_aggregation "constant" (tokens); None: the longest response the run can have,
    `max_new_tokens` if set, else `max_response_len`."""
    dual_clip: float | None = None
    """c > 1 of the dual clip for negative advantages (None: off; the flag alone gives 3): for
    A_i < 0 a token's policy loss is at most c |A_i|."""
    log_ratio_clamp: float | None = None
    """d > 0: the PPO ratio is exp(clamp(logp - logp_old, -d, d)) (None: off)."""
    kl_clamp: float | None = None
    """k > 0: each token's k3 KL estimate is capped at k (None: off)."""
    entropy_floor: float = 0.01
    """The launcher warns (once) when the policy's mean entropy over a step's trained tokens falls
    below this many nats (entropy collapse; training/guards.py); 0: no warning."""
    stop_after_no_signal: int = 0
    """The launcher stops after this many consecutive steps in which every group's rewards were
    all equal (zero advantage: no learning signal); 0: never (training/guards.py)."""
    page_tokens: int = 65536
    """Rows per page of captured state."""
    offload_pages: bool = True
    """Keep captured pages in host memory (pinned with CUDA) and stream them layer by layer."""
    index_key_pages: str = "model"
    """Storage of DSA index-key pages (GLM-5.2; families without index keys ignore it): "model"
    (the model's dtype) or "fp8" (e4m3 + one fp32 scale per token: d + 4 bytes a row, 132 B at
    index_head_dim 128, DeepGEMM's layout; pages.py). fp8 only changes which keys the top-k
    selects (index keys get no gradient), and nothing under DeepGEMM's indexer, which casts the
    keys the same way. "model" is the default: the CPU parity tests compare with transformers at
    fp64 and need exact selections. Capture builds its `PageStore` with `page_formats()`."""
    kernels: str = "auto"
    """Kernel backend: auto | ref | a backend name | per-part spec such as
    "auto,indexer=ref" or "sparse_mla=flashmla,sparse_mla_grad=triton" (kernels/select.py)."""
    checkpoint_layers: bool = True
    """Whole-decoder-layer activation checkpointing during replay."""
    prompt_grad: PromptGrad = PromptGrad.DETACHED
    """The prompt state's gradient (`PromptGrad`; given as "detached" or "exact", converted in
    `__post_init__`): DETACHED (d loss / d theta at fixed prompt state, the paper's) or EXACT
    (replay accumulates d loss / d state into the pages' cotangents, then a prompt backward runs
    the prompt's layers in reverse: the update of standard GRPO; prompt_backward.py)."""
    token_block: int = 8192
    """Tokens per chunk for token-wise work in capture (projections, FFN, MoE); the token block
    of streamed capture."""
    response_block: int = 8192
    """Tokens per block of a response branch in scoring and replay (training/replay.py): a longer
    branch runs block by block, its earlier blocks' state kept in host pages like the prompt's,
    and replay walks the blocks in reverse, so device memory is bounded by one block, not by the
    response. Under CP a block is rounded up to a multiple of the CP size (every rank holds a
    share of each block). The update is the same (blockwise equals whole-branch)."""
    reuse_branch_pages: bool = False
    """Blockwise branches: scoring keeps every member's blocks' state (host pages) for replay,
    which then skips its own forward of the blocks (the same weights and selections write the
    same pages): one forward of the branch less per member, for G members' branch pages in host
    memory instead of one's (the planner's `branch pages` line, times G)."""
    capture: str = "streamed"
    """"streamed" (layer by layer, token block by token block, the residual stream in host memory,
    under CP the layer's rows of every rank exchanged through host memory: nothing of the
    prompt's size on the device; capture.py) or "whole" (each layer over this rank's whole shard
    on the device: the earlier schedule, kept as the reference streamed capture is tested
    against)."""
    query_block: int = 1024
    """Queries per sparse-attention block."""
    key_block: int = 4096
    """Keys per indexer-score block (running top-k)."""
    seed: int = 1234
    """Random seed (initialisation and synthetic data)."""
    tis: str = "truncate"
    """Off-policy correction with the engine's log-probs (the data's `logprobs_old`; nothing to
    correct without them): "truncate" weights token t's policy term by min(pi_old / pi_engine, C),
    "mask" by pi_old / pi_engine inside [1/C, C] and 0 outside, "off" by 1 (the mismatch is
    still logged). The PPO ratio's denominator is always the trainer's own pi_old
    (offpolicy.py)."""
    tis_cap: float = 2.0
    """C of `tis`: the largest importance weight (truncate), the mask's bounds [1/C, C] (>= 1)."""
    reward: str | None = None
    """Reward function `module:function` or `longstraw:<built-in>` (rewards.py), called for the
    members of a record that carries no `rewards`; None: every record must carry them."""

    rollout: str = "offline"
    """"offline": the groups of --longstraw-data, responses and rewards given (or rewards from
    `reward`); "online": --longstraw-data holds prompts, and every step generates `group_size`
    responses per prompt from the step's own capture and rewards them with `reward`
    (rollout.py)."""
    max_new_tokens: int | None = None
    """Online: the most tokens a generated response has (default: `max_response_len`)."""
    temperature: float = 1.0
    """Online sampling temperature (0: greedy)."""
    top_p: float = 1.0
    """Online nucleus sampling mass (1: off)."""
    top_k: int = 0
    """Online top-k sampling (0: off)."""
    stop_ids: tuple[int, ...] = ()
    """Online: token ids that end a response (kept in it)."""
    control: str = "none"
    """Online: "zeros" replaces the captured prompt state by zeros (a control run that cannot
    see the prompt; rollout.py)."""
    dynamic_sampling: bool = False
    """Online (DAPO's dynamic sampling; rollout/online.py): drop the groups whose rewards are all
    equal (zero advantage) and generate more from the next prompts, so the step trains on
    groups with signal."""
    dynamic_sampling_rounds: int = 4
    """The most extra generation rounds of a dynamic-sampling step, each over the next global
    batch of prompts (a step generates at most (1 + rounds) x --global-batch-size groups); when
    they do not fill the batch, the remaining slots take dropped groups (counted as short)."""
    env: str | None = None
    """Online: an environment factory `module:factory` (rollout/env.py; the built-in example
    `megatron_longstraw.rollout.example_env:lookup`): multi-turn trajectories, each env call's
    observation prefilled into the member's state and masked out of the loss."""
    env_max_turns: int = 8
    """Online with `env`: environment calls per member."""
    env_turn_tokens: int = 0
    """Online with `env`: a turn also ends after this many policy tokens (0: only at the env's
    stop ids)."""
    env_timeout: float = 30.0
    """Online with `env`: seconds one environment call may take (past it the member ends)."""

    def __post_init__(self) -> None:
        for name in ("group_size", "max_response_len", "page_tokens", "token_block",
                     "response_block", "query_block", "key_block", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"longstraw {name} must be an integer, got {value!r}.")
        for name in ("offload_pages", "checkpoint_layers", "std_unbiased", "reuse_branch_pages",
                     "dynamic_sampling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"longstraw {name} must be true or false, got "
                                 f"{getattr(self, name)!r}.")
        if self.group_size < 2:
            raise ValueError(f"longstraw group_size must be >= 2 (GRPO needs a group), got "
                             f"{self.group_size}.")
        for name in ("max_response_len", "page_tokens", "token_block", "response_block",
                     "query_block", "key_block"):
            if getattr(self, name) <= 0:
                raise ValueError(f"longstraw {name} must be positive, got {getattr(self, name)}.")
        for name in ("clip_eps_low", "clip_eps_high", "kl_coef", "adv_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                hint = (" (YAML reads a number without a dot, like 1e-6, as text: write 1.0e-6)"
                        if isinstance(value, str) else "")
                raise ValueError(f"longstraw {name} must be a number, got {value!r}{hint}.")
        if (isinstance(self.entropy_floor, bool) or not isinstance(self.entropy_floor, (int, float))
                or not 0 <= self.entropy_floor < float("inf")):
            raise ValueError(f"longstraw entropy_floor (--longstraw-entropy-floor) must be a "
                             f"number >= 0 (nats; 0: off), got {self.entropy_floor!r}.")
        if (isinstance(self.stop_after_no_signal, bool)
                or not isinstance(self.stop_after_no_signal, int) or self.stop_after_no_signal < 0):
            raise ValueError(f"longstraw stop_after_no_signal (--longstraw-stop-after-no-signal) "
                             f"must be an integer >= 0 (steps; 0: never), got "
                             f"{self.stop_after_no_signal!r}.")
        if self.index_key_pages not in PAGE_FORMATS:
            raise ValueError(f"longstraw index_key_pages (--longstraw-index-key-pages) must be one "
                             f"of {list(PAGE_FORMATS)}, got {self.index_key_pages!r}.")
        if self.capture not in ("streamed", "whole"):
            raise ValueError(f"longstraw capture must be 'streamed' or 'whole', got "
                             f"{self.capture!r}.")
        if self.prompt_grad not in list(PromptGrad):
            raise ValueError(f"longstraw prompt_grad must be one of "
                             f"{[g.value for g in PromptGrad]}, got {self.prompt_grad!r}.")
        self.prompt_grad = PromptGrad(self.prompt_grad)
        check_loss_options(self.loss_aggregation, self.loss_constant, self.dual_clip,
                           self.log_ratio_clamp, self.kl_clamp)
        check_tis(self.tis, self.tis_cap)
        self._check_rollout()
        self.loss_config()  # validates the clip, KL and advantage settings (C: after max_new_tokens)
        if self.reward is not None and (not isinstance(self.reward, str)
                                        or ":" not in self.reward):
            raise ValueError(f"longstraw reward (--longstraw-reward) must be 'module:function' "
                             f"or 'longstraw:<name>', got {self.reward!r}.")

    def _check_rollout(self) -> None:
        if self.rollout not in ("offline", "online"):
            raise ValueError(f"longstraw rollout (--longstraw-rollout) must be 'offline' or "
                             f"'online', got {self.rollout!r}.")
        self.stop_ids = tuple(int(i) for i in self.stop_ids)
        new = self.max_new_tokens or self.max_response_len
        if new > self.max_response_len:
            raise ValueError(f"longstraw max_new_tokens (--longstraw-max-new-tokens) {new} is more "
                             f"than max_response_len {self.max_response_len}: raise "
                             "--longstraw-max-response-len or generate fewer tokens.")
        SamplingParams(max_new_tokens=new, temperature=self.temperature, top_p=self.top_p,
                       top_k=self.top_k)   # its checks name the bad value
        if self.control not in CONTROLS:
            raise ValueError(f"longstraw control (--longstraw-control) must be one of "
                             f"{list(CONTROLS)}, got {self.control!r}.")
        if self.control != "none" and (self.rollout != "online"
                                       or self.prompt_grad is not PromptGrad.DETACHED):
            raise ValueError("longstraw control (--longstraw-control zeros) replaces the captured "
                             "prompt state in the online loop: it needs --longstraw-rollout online "
                             "and the detached prompt gradient.")
        rounds = self.dynamic_sampling_rounds
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
            raise ValueError(f"longstraw dynamic_sampling_rounds (--longstraw-dynamic-sampling-"
                             f"rounds) must be an integer >= 0, got {rounds!r}.")
        if self.dynamic_sampling and self.rollout != "online":
            raise ValueError("longstraw dynamic_sampling (--longstraw-dynamic-sampling) drops "
                             "generated groups without signal and generates more: it needs "
                             "--longstraw-rollout online (offline groups are given).")
        self._check_env()
        if self.rollout == "online" and self.reward is None and self.env is None:
            raise ValueError("--longstraw-rollout online rewards the generated responses: give a "
                             "reward function (--longstraw-reward module:function, YAML "
                             "longstraw.reward) or an environment that rewards them "
                             "(--longstraw-env).")

    def _check_env(self) -> None:
        if self.env is None:
            return
        if not isinstance(self.env, str) or ":" not in self.env:
            raise ValueError(f"longstraw env (--longstraw-env) must be 'module:factory', got "
                             f"{self.env!r}.")
        if self.rollout != "online":
            raise ValueError("longstraw env (--longstraw-env) answers the policy's tool calls while "
                             "it generates: it needs --longstraw-rollout online (offline "
                             "trajectories carry their own loss_masks).")
        for name, low in (("env_max_turns", 1), ("env_turn_tokens", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                flag = "--longstraw-" + name.replace("_", "-")
                raise ValueError(f"longstraw {name} ({flag}) must be an integer >= {low}, got "
                                 f"{value!r}.")
        if isinstance(self.env_timeout, bool) or not isinstance(self.env_timeout, (int, float)) \
                or not 0 < self.env_timeout < float("inf"):
            raise ValueError(f"longstraw env_timeout (--longstraw-env-timeout) must be a positive "
                             f"number of seconds, got {self.env_timeout!r}.")

    def page_formats(self) -> dict[str, str]:
        """Page kind -> storage format for the capture's `PageStore` (`formats`): "index_key" is
        the GLM-5.2 mixer's kind (models/glm52/attention.py INDEX_KEY)."""
        return {"index_key": self.index_key_pages} if self.index_key_pages != "model" else {}

    def loss_config(self) -> GRPOLossConfig:
        return GRPOLossConfig(clip_eps_low=self.clip_eps_low, clip_eps_high=self.clip_eps_high,
                              kl_coef=self.kl_coef, adv_eps=self.adv_eps,
                              std_unbiased=self.std_unbiased, aggregation=self.loss_aggregation,
                              norm_constant=self.loss_norm_constant(),
                              dual_clip=self.dual_clip, log_ratio_clamp=self.log_ratio_clamp,
                              kl_clamp=self.kl_clamp)

    def loss_norm_constant(self) -> int:
        """C of loss_aggregation "constant": `loss_constant`, else the longest response the run
        can have (`max_new_tokens`, else `max_response_len`)."""
        return self.loss_constant or self.max_new_tokens or self.max_response_len

    @classmethod
    def from_dict(cls, values: dict) -> "LongStrawConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"Unknown longstraw settings {unknown}; known: {sorted(known)}.")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "LongStrawConfig":
        """The step settings of a YAML's `longstraw:` section; its adapter keys (`ADAPTER_KEYS`, the
        launcher's LoRA / QLoRA request, arguments.py) are not step settings and are skipped."""
        data = yaml.safe_load(Path(path).read_text()) or {}
        section = data.get("longstraw", {}) or {}
        return cls.from_dict({k: v for k, v in section.items() if k not in ADAPTER_KEYS})


ADAPTER_KEYS = ("lora", "qlora", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets",
                "lora_exclude", "fp8_base")
"""YAML `longstraw:` keys that configure adapters (arguments.LORA_DEFAULTS), not the step."""
