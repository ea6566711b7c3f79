"""The online loop's rollout (`--longstraw-rollout online`, docs/design.md section 2): per group of
the step, the prompt is captured once under the current policy, G responses are generated from
that capture (decode.py), the reward function scores them (rewards.py), and the training step
scores, replays and back-propagates over the same capture; nothing of the prompt is computed
twice. With one update per capture (the default) the state is captured again every step, so it
is never stale; with K updates per capture (`--longstraw-updates-per-capture`) G x K responses
are generated and the capture serves K updates (step/schedule.py `train_on_capture`; its
staleness measured with `--longstraw-drift-every` / `--longstraw-drift-first-last`).

    for each of this replica's prompts (dataset.py order, global sample g):
        captured  = capture_prompt(policy, prompt)            (+ backward inputs in exact mode)
        responses = generate(policy, captured, G, seed + g)   (decode.py)
        rewards   = reward_fn(prompt, response, text, meta)   (rewards.py; a failure stops the
                                                              step before any update)
    train_step(policy, groups, captures)                      (schedule.py: scoring, replay, ...;
                                                              K > 1: train_on_capture)

The engine log-probs of the generated responses (the group's `logps_old`) are the sampling
distribution's (decode.Generation.sample_logprobs): with temperature 1 and no truncation they
are the policy's, and the mismatch figures show decode against the trainer's scoring (~1e-15);
otherwise the importance weight pi_old / pi_sample corrects for the sampling distribution
(offpolicy.py, --longstraw-tis).

`control="zeros"` (the demo's control run) replaces the captured prompt state with zeros before
generation and training: the policy then sees nothing of the prompt but its last token.

Dynamic sampling (DAPO; `--longstraw-dynamic-sampling`, `dynamic_sampling_batch`): a group whose
rewards are all equal has zero advantages and no policy gradient, so it is dropped (its capture
freed) and the step generates more: each extra round takes the next batch of prompts of the data
order, at most `dynamic_sampling_rounds` extra rounds a step; the first groups with signal fill
the step's batch. When the limit is reached first, the remaining slots take dropped groups (no
policy gradient: the step keeps its batch size, and every replica its group count) and are
counted as short.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_longstraw.config.sampling import SamplingParams
from megatron_longstraw.config.settings import EnvironmentSettings, LongStrawConfig
from megatron_longstraw.context.capture import CapturedPrompt, capture_prompt
from megatron_longstraw.data.group import GRPOGroup
from megatron_longstraw.rollout.decode import generate
from megatron_longstraw.rollout.env import BlindEnvs, EnvLimits, EnvSetupError
from megatron_longstraw.rollout.env_workers import WorkerEnvs
from megatron_longstraw.rollout.rewards import compute_rewards
from megatron_longstraw.runtime.errors import ConfigError


@dataclass
class Rollout:
    """One group generated online, with the capture it came from."""

    group: GRPOGroup
    captured: CapturedPrompt
    seconds: float
    """Wall time of generation and rewards (capture: `captured.seconds`)."""
    trajectories: list[dict] | None = None
    """With an environment, per member: {"turns": [{"policy_tokens", "observation_tokens",
    "reward"}, ..], "end": why it ended, "reward": the member's reward and where it came from
    ("env" or "reward function"; "none": 0, neither gave one)}."""
    meta: object = None
    """The prompt line's `meta` (what the environment and the reward function read)."""


def sampling_params(cfg: LongStrawConfig, seed: int) -> SamplingParams:
    rollout = cfg.rollout
    return SamplingParams(max_new_tokens=cfg.max_new_tokens(), temperature=rollout.temperature,
                          top_p=rollout.top_p, top_k=rollout.top_k,
                          stop_ids=tuple(rollout.stop_ids), seed=seed)


def rollout_group(model, record, cfg: LongStrawConfig, reward_fn, seed: int, tokenizer=None,
                  control: str = "none") -> Rollout:
    """Capture `record`'s prompt (data.GroupRecord of a prompt line), generate
    `cfg.members_per_group()` responses from it (G x K with K updates per capture) with `seed`,
    reward them (module docstring)."""
    prompt = record.group.prompt_ids
    captured = capture_prompt(model, prompt, cfg.capture, prompt_grad=cfg.replay.prompt_grad)
    if control == "zeros":
        captured.pages.zero_()
    start = time.perf_counter()
    source = getattr(record.group, "source", None) or f"line {record.line}"
    name = source + (f" (id {record.id!r})" if record.id != record.line else "")
    members = cfg.members_per_group()   # G, or G x K with K updates per capture
    envs = (make_envs(cfg.environment, record, prompt, tokenizer, name, members)
            if cfg.environment.env else None)
    if envs is not None and control == "blind":
        envs = BlindEnvs(envs)
    try:
        generations = generate(model, captured, members, sampling_params(cfg, seed),
                               cfg.capture, envs=envs,
                               env_limits=env_limits(cfg.environment) if envs else None,
                               tokenizer=tokenizer)
    except EnvSetupError as exc:   # the factory failed on this record: the run's data or code
        raise ConfigError(f"{name}: {exc}") from exc
    responses = [g.token_ids for g in generations]
    trajectories = None
    if envs is None:
        rewards = compute_rewards(reward_fn, prompt, responses, record.meta, None, tokenizer,
                                  record=name)
    else:
        rewards, trajectories = env_rewards(generations, reward_fn, prompt, record, tokenizer,
                                             name)
    group = GRPOGroup(prompt_ids=prompt, response_ids=responses, rewards=rewards,
                      logps_old=[g.sample_logprobs for g in generations],
                      loss_masks=[g.loss_mask for g in generations] if envs else None)
    group.source = source
    return Rollout(group, captured, time.perf_counter() - start, trajectories, record.meta)


def env_limits(environment: EnvironmentSettings) -> EnvLimits:
    return EnvLimits(max_turns=environment.env_max_turns, turn_tokens=environment.env_turn_tokens,
                     timeout_s=environment.env_timeout,
                     max_concurrency=environment.env_max_concurrency,
                     prefill_block=environment.env_prefill_block)


def make_envs(environment: EnvironmentSettings, record, prompt, tokenizer, name: str,
              count: int) -> WorkerEnvs:
    """`count` environments, one per member, from the record (`factory(meta, prompt_ids,
    tokenizer)`), each made in a worker process of its own when generation starts
    (env_workers.py; under CP on CP rank 0 only). A factory that fails is the run's
    configuration or data, not one member's: it stops the step with the record named
    (`rollout_group`; `name` is kept for callers that report it themselves)."""
    del name
    return WorkerEnvs(environment.env, record.meta, prompt, tokenizer, count)


def env_rewards(generations, reward_fn, prompt, record, tokenizer, name: str):
    """Each member's reward: the environment's final one when it gave one, else the reward
    function's (over the whole trajectory), else 0 (a member the environment ended without one,
    e.g. an error, and no reward function) -> (rewards [G], trajectory records)."""
    from_env = [g.env_reward for g in generations]
    missing = [i for i, r in enumerate(from_env) if r is None]
    computed = None
    if missing and reward_fn is not None:
        computed = compute_rewards(reward_fn, prompt, [g.token_ids for g in generations],
                                   record.meta, None, tokenizer, record=name)
    rewards, records = [], []
    for i, g in enumerate(generations):
        if from_env[i] is not None:
            reward, origin = from_env[i], "env"
        elif computed is not None:
            reward, origin = float(computed[i]), "reward function"
        else:
            reward, origin = 0.0, "none"
        rewards.append(reward)
        records.append({"turns": g.turns, "end": g.end_reason, "reward": reward,
                        "reward_from": origin, "tokens": int(g.token_ids.numel()),
                        "trained_tokens": int(g.loss_mask.sum())})
    return torch.tensor(rewards, dtype=torch.float64), records


def has_signal(group: GRPOGroup) -> bool:
    """True when the group's rewards are not all equal (some advantage is not zero)."""
    rewards = group.rewards
    return bool((rewards != rewards[0]).any())


@dataclass
class DynamicBatch:
    """What `dynamic_sampling_batch` gives a step: its rollouts and the counts the history keeps."""

    rollouts: list[Rollout]
    """The step's groups: `need` of them, those with signal first."""
    generated: int
    """Groups generated this step (every round)."""
    dropped: int
    """Groups filtered out: rewards all equal (zero variance)."""
    resampled: int
    """Groups generated in the extra rounds."""
    extra_rounds: int
    """Extra generation rounds this step (agreed by every rank)."""
    short: int
    """Slots filled with dropped groups because the round limit was reached."""
    reward_sum: float = 0.0
    """Sum of the rewards of every member of every group generated this step (kept or dropped):
    with `reward_count`, the policy's mean reward on fresh prompts, which the trained groups'
    mean overstates or understates once the all-equal groups are filtered out."""
    reward_count: int = 0
    """Members generated this step (every round)."""


def dynamic_sampling_batch(generate_round: Callable[[int], list[Rollout]], need: int,
                           max_extra_rounds: int,
                           agree_short: Callable[[bool], bool] = lambda short: short,
                           ) -> DynamicBatch:
    """Round 0 generates the step's own prompts (`generate_round(0)`), round r >= 1 the next
    batch of prompts; groups with signal (`has_signal`) are kept up to `need`, the others
    dropped. Another round runs while some rank is short of `need` (`agree_short(local_short)`:
    every rank of the world must run the same rounds; a rank that is not short calls no
    `generate_round`) and fewer than `max_extra_rounds` extra ones ran. A short batch is filled
    with dropped groups (module docstring); captures of the groups not used are freed as soon
    as they are dropped."""
    kept: list[Rollout] = []
    fallback: list[Rollout] = []     # dropped groups kept for a short batch, at most what it lacks
    generated = dropped = resampled = reward_count = 0
    reward_sum = 0.0
    round_idx = 0
    while True:
        rollouts = generate_round(round_idx) if len(kept) < need else []
        generated += len(rollouts)
        resampled += len(rollouts) if round_idx else 0
        for rollout in rollouts:
            reward_sum += float(rollout.group.rewards.sum())
            reward_count += int(rollout.group.rewards.numel())
            if has_signal(rollout.group):
                if len(kept) < need:
                    kept.append(rollout)
            else:
                dropped += 1
                fallback.append(rollout)
            del fallback[max(0, need - len(kept)):]
        if not agree_short(len(kept) < need) or round_idx >= max_extra_rounds:
            break
        round_idx += 1
    return DynamicBatch(kept + fallback, generated, dropped, resampled, round_idx, len(fallback),
                        reward_sum, reward_count)
