"""The LongStraw GRPO step (docs/design.md section 2), in Megatron's forward-backward-function style.

    capture(prompt)                         no autograd; pages hold what responses read
    for i in 1..G: score(i)                 logp_old (and logp_ref), DSA selections recorded
                                            (or the engine's: routing replay);
                                            with the engine's log-probs: importance weights
                                            and mismatch figures (offpolicy.py)
    for i in 1..G: replay(i); backward      one member's graph alive at a time; its loss and
                                            statistics computed once, there (with a loss mask,
                                            member_loss gets the mask of each block's tokens)
    (the above for each group of the step)  micro-batches: gradients accumulate
    finalize grads; optimizer.step()        once (train_step)

`forward_backward_longstraw` does everything up to the gradients (like Megatron's
`forward_backward_no_pipelining`); `train_step` adds finalisation and the optimizer step;
`train_on_capture` takes K optimizer steps over one capture (each group G x K members: every
member scored once before the first update, update k replays members [kG, (k+1)G) over the kept
capture).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_longstraw.adapters.lora import lora_modules
from megatron_longstraw.context.capture import capture_prompt
from megatron_longstraw.config.settings import LongStrawConfig
from megatron_longstraw.config.choices import PromptGrad
from megatron_longstraw.data.group import GRPOGroup
from megatron_longstraw.data.routing import FIELDS as ROUTING_FIELDS
from megatron_longstraw.grpo.loss import group_advantages, member_loss, validate_group
from megatron_longstraw.runtime import memory
from megatron_longstraw.grpo import offpolicy
from megatron_longstraw.step import routing_replay
from megatron_longstraw.kernels import select
from megatron_longstraw.distributed.agreement import any_rank, check_agreement, fail_together
from megatron_longstraw.distributed.cp_layout import CPLayout
from megatron_longstraw.context.prompt_backward import prompt_backward
from megatron_longstraw.step.replay import replay_member, score_member
from megatron_longstraw.step.staleness import measure_drift


@dataclass
class StepResult:
    loss: float
    """Total GRPO loss of the group (sum of member shares)."""
    stats: dict[str, float]
    """Mean reward, its within-group spread (`reward_group_std`: the population std of one
    group's G rewards; merged: its mean over the groups), advantages, `zero_advantage_frac` (1 for a group
    whose rewards are all equal; merged: the fraction of such groups), ratio and clip
    statistics, KL, `entropy` (the policy's mean next-token entropy over the trained tokens, in
    nats; replayed steps only); with the engine's log-probs also the mismatch figures
    (offpolicy.mismatch_stats: mismatch_abs_mean / _max, mismatch_kl, tis_frac)."""
    logps: list[torch.Tensor]
    """Per-member per-token log-probs from replay (current parameters)."""
    logps_old: list[torch.Tensor]
    """Per-member per-token log-probs from pre-step scoring (the PPO ratio's denominator)."""
    token_weights: list[torch.Tensor] | None = None
    """Per member: the engine-trainer importance weights [R_i] of the policy term (offpolicy.py),
    None when the group carries no engine log-probs."""
    phase_seconds: dict[str, float] = field(default_factory=dict)
    """Wall time of capture, scoring, replay (prompt_backward in exact mode; train_step adds
    optimizer: finalisation, clipping and the step; the online launcher adds rollout)."""
    page_bytes: int = 0
    """Bytes of captured prompt state (all pages, this rank)."""
    page_bytes_by_kind: dict[str, int] = field(default_factory=dict)
    """`page_bytes` per page kind (`latent`, `index_key`; `gdn_state`, `conv_tail`, `key`,
    `value`), summed over layers (and the reference policy's capture)."""
    fixed_page_kinds: list[str] = field(default_factory=list)
    """The kinds of `page_bytes_by_kind` whose size does not grow with the prompt (recurrent
    state); every other kind holds rows per prompt token."""
    selections: list[dict[int, torch.Tensor]] = field(default_factory=list)
    """Per member: each full indexer layer's top-k (global key positions) from scoring, this
    rank's rows of the branch (`replay.gather_selections` gives the whole member's)."""
    skipped: bool = False
    """train_step: the loss or the gradient was NaN / inf on some rank, so the optimizer did not
    step (gradients dropped, weights and optimizer state untouched)."""
    nonfinite_loss_ranks: list[int] = field(default_factory=list)
    """When skipped: the ranks whose group's loss was not finite (empty: only the gradient)."""
    nonfinite_groups: list[int] = field(default_factory=list)
    """train_step: the positions, among this rank's groups, of those whose loss was not finite."""
    seconds: float = 0.0
    """train_on_capture with K > 1: the update's wall time (the first's with the capture and
    scoring)."""


def validate_inputs(model, group: GRPOGroup, cfg: LongStrawConfig, updates: int = 1) -> None:
    """Reject bad input with a clear message before any work starts (`updates`: K, the
    optimizer steps the group's capture serves: G x K members)."""
    vocab = model.vocab_size
    if group.prompt_ids.dim() != 1 or group.prompt_ids.numel() == 0:
        raise ValueError("The prompt must be a non-empty 1-D tensor of token ids, got shape "
                         f"{tuple(group.prompt_ids.shape)}.")
    responses = [torch.as_tensor(r) for r in group.response_ids]
    validate_group([int(r.numel()) for r in responses], group.rewards, cfg.group.max_response_len)
    size = cfg.group.group_size
    if len(responses) != size * updates:
        per = (f"; one capture serves {updates} updates of G = {size}, so a group has "
               f"{size * updates} members" if updates > 1 else "")
        raise ValueError(f"Got a group of {len(responses)} responses but --longstraw-group-size is "
                         f"{size}{per}; pass every member of the group or change the flag.")
    longest = group.prompt_ids.numel() + max(r.numel() for r in responses)
    if longest >= 2**31:  # positions (and the int32 DSA selections kept between phases)
        raise ValueError(f"prompt + response is {longest} tokens; LongStraw positions must stay "
                         "below 2^31.")
    for name, ids in [("prompt", group.prompt_ids)] + [(f"response {i}", r) for i, r in enumerate(responses)]:
        if ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: token ids must be int32/int64, got {ids.dtype}.")
        bad = ((ids < 0) | (ids >= vocab)).nonzero().flatten()
        if bad.numel():
            pos = int(bad[0])
            raise ValueError(f"{name}: token id {int(ids[pos])} at position {pos} is outside the "
                             f"vocabulary [0, {vocab}); check the tokenizer matches the model.")
    masks = _loss_masks(group)
    if group.logps_old is not None:
        for i, (lp, r) in enumerate(zip(group.logps_old, responses)):
            # an untrained token's engine log-prob may be absent (NaN): nothing reads it
            trained = torch.ones_like(r, dtype=torch.bool) if masks[i] is None else masks[i]
            if lp.shape != r.shape or not torch.isfinite(lp[trained.to(lp.device)]).all():
                raise ValueError(f"response {i}: old log-probs must be finite at the trained "
                                 f"tokens with shape {tuple(r.shape)}, got shape "
                                 f"{tuple(lp.shape)}.")
    routing_replay.validate_group(model, group)   # the engine's routed_experts / dsa_topk


def _loss_masks(group: GRPOGroup) -> list[torch.Tensor | None]:
    """Per member the bool loss mask [R_i] (True: trained), None where every token is trained
    (no mask, or one of all ones); ValueError for a mask of the wrong shape or training
    nothing."""
    if group.loss_masks is None:
        return [None] * len(group.response_ids)
    if len(group.loss_masks) != len(group.response_ids):
        raise ValueError(f"{len(group.loss_masks)} loss masks for {len(group.response_ids)} "
                         "responses; give one mask per response (or none).")
    masks = []
    for i, (mask, r) in enumerate(zip(group.loss_masks, group.response_ids)):
        mask = torch.as_tensor(mask).bool()
        if mask.shape != torch.as_tensor(r).shape or not bool(mask.any()):
            raise ValueError(f"response {i}: the loss mask must have shape "
                             f"{tuple(torch.as_tensor(r).shape)} and train at least one token, "
                             f"got shape {tuple(mask.shape)} with {int(mask.sum())} trained.")
        masks.append(None if bool(mask.all()) else mask)
    return masks


def forward_backward_longstraw(model, group: GRPOGroup, cfg: LongStrawConfig, ref_model=None,
                               forward_only: bool = False, loss_scale: float = 1.0,
                               progress=None, captured=None) -> StepResult:
    """Capture, score and replay one GRPO group; gradients accumulate into `model`'s parameters.
    `captured`: the group's prompt already captured under the current weights (the online loop
    generated from it: rollout.py), used instead of a new capture (exact prompt gradient: captured
    with `prompt_grad=PromptGrad.EXACT`).

    `ref_model` is the frozen reference policy for the KL term (it gets its own capture, since its
    prompt state differs); required when cfg.loss.kl_coef > 0. `loss_scale` is 1/N when the optimizer
    step averages N groups (across data-parallel replicas and/or several calls); gradients are
    plain sums otherwise. Under context parallelism every rank of the CP group passes the same
    group; each holds a partial gradient (finalize.py sums them). `progress(done, total)` reports
    capture progress per decoder layer.

    Kernels: the step runs on `cfg.run.kernels`'s selection. Set-up chooses it once (the launcher:
    `select.use` in `start_process_groups`, before the model is built); here the step only adopts
    it (`select.adopt`: nothing to do when it is the active selection; a library caller who never
    called `select.use` gets it on the first step).
    """
    _agree_on_inputs(model, group, cfg, ref_model, captured, forward_only)
    with fail_together():
        return _step(model, group, cfg, ref_model, forward_only, loss_scale, progress, captured)


def _agree_on_inputs(model, group: GRPOGroup, cfg: LongStrawConfig, ref_model, captured,
                     forward_only: bool, updates: int = 1) -> None:
    """Check the group (G x `updates` members), the reference policy and a given capture on every
    rank, fail together with the first rank's message, and adopt the config's kernels."""
    try:
        validate_inputs(model, group, cfg, updates)
        if cfg.loss.kl_coef > 0 and ref_model is None:
            raise ValueError("kl_coef > 0 needs a reference policy: pass ref_model (or set "
                             "--longstraw-kl-coef 0).")
        local_error = None
        if captured is not None:
            _check_captured(captured, group, cfg, forward_only)
        if not forward_only:
            _check_unmerged(model)
    except ValueError as exc:
        local_error = str(exc)
    check_agreement(local_error, _fingerprint(group), CPLayout.current())
    select.adopt(cfg.run.kernels)


def _check_unmerged(model) -> None:
    """Training needs the adapters apart from the base: a merged adapter's update was folded into
    the base weight when it was merged, and the forward skips the adapter, so the optimizer's
    steps would never reach the weights the model computes with."""
    merged = [name for name, module in lora_modules(model) if module.merged]
    if merged:
        raise ValueError(f"{len(merged)} LoRA adapters are merged into their base weights (e.g. "
                         f"{merged[0]}): a training step would update adapters the forward no "
                         "longer reads. Call adapters.lora.unmerge_adapters(model) before "
                         "training (merge only to export).")


def _check_captured(captured, group: GRPOGroup, cfg: LongStrawConfig, forward_only: bool) -> None:
    """A given capture must be of this group's prompt (length and last token) and, for the exact
    gradient, keep what the prompt backward needs."""
    if (captured.prefix_len != group.prompt_ids.numel() - 1
            or captured.last_token != int(group.prompt_ids[-1])):
        raise ValueError(f"The given capture holds a prompt of {captured.prefix_len + 1} tokens "
                         f"ending in {captured.last_token}, not this group's ("
                         f"{group.prompt_ids.numel()} tokens ending in "
                         f"{int(group.prompt_ids[-1])}): capture the group's own prompt.")
    if (cfg.replay.prompt_grad is PromptGrad.EXACT and not forward_only and captured.prefix_len
            and captured.backward is None):
        raise ValueError("The exact prompt gradient needs a capture made with "
                         "prompt_grad=PromptGrad.EXACT.")


def _fingerprint(group: GRPOGroup) -> dict:
    """What every rank of a CP group must agree on (cheap to exchange)."""
    try:
        return _fingerprint_of(group)
    except Exception:  # noqa: BLE001 - malformed input: validation reports it
        return {"malformed": True}


def _fingerprint_of(group: GRPOGroup) -> dict:
    prompt = group.prompt_ids.long().reshape(-1)
    weights = torch.arange(1, prompt.numel() + 1, dtype=torch.long) % 1009
    return {
        "prompt_len": int(prompt.numel()),
        "prompt_checksum": int((prompt * weights).sum()),
        "group_size": len(group.response_ids),
        "response_lens": [int(torch.as_tensor(r).numel()) for r in group.response_ids],
        "rewards": [float(r) for r in group.rewards],
        "trained_tokens": (None if group.loss_masks is None
                           else [int(torch.as_tensor(m).sum()) for m in group.loss_masks]),
        "routing_replay": [getattr(group, f, None) is not None for f in ROUTING_FIELDS],
    }


@dataclass
class _Scored:
    """One group's capture and its scoring before any update: what every update over this
    capture replays against."""

    group: GRPOGroup
    captured: object
    ref_captured: object | None
    engine: list
    """Per member: routing replay's (selections, routed experts), or (None, None)."""
    scored: list
    """Per member: score_member's (logp, selections, pages) at the current weights."""
    logps_ref: list | None
    logps_old: list[torch.Tensor]
    """The PPO ratio's denominator: the log-probs scored at capture time, before any update."""
    masks: list
    weights: list | None
    mismatch: dict
    timings: dict[str, float]
    keep_pages: bool


def _capture_and_score(model, group, cfg, ref_model, forward_only, progress, captured,
                       prompt_grad, keep_upto: int | None = None) -> _Scored:
    """Capture the group's prompt (unless `captured` is given) and score every member: the PPO
    denominators. With reuse_branch_pages the members below `keep_upto` (all when None) keep
    their blockwise pages for replay; the others are scored again before their replay
    (train_on_capture's later updates), so none of theirs waits in host memory."""
    timings: dict[str, float] = {}
    with memory.phase("capture"):
        if captured is None:
            captured = capture_prompt(model, group.prompt_ids, cfg.capture, progress=progress,
                                      prompt_grad=prompt_grad)
        ref_captured = (capture_prompt(ref_model, group.prompt_ids, cfg.capture)
                        if cfg.loss.kl_coef > 0 else None)
    timings["capture"] = captured.seconds + (ref_captured.seconds if ref_captured else 0.0)

    start = time.perf_counter()
    with memory.phase("scoring"):
        # Routing replay: the engine's DSA selections / MoE routing, when the group has them.
        engine = [routing_replay.member_inputs(model, group, i, captured.prefix_len,
                                               captured.layout, cfg.replay.response_block)
                  for i in range(len(group.response_ids))]
        # With reuse_branch_pages scoring keeps each blockwise member's pages for its replay.
        keep = cfg.replay.reuse_branch_pages and not forward_only
        upto = len(group.response_ids) if keep_upto is None else keep_upto
        scored = [score_member(model, captured, r, cfg, *engine[i], keep_pages=keep and i < upto)
                  for i, r in enumerate(group.response_ids)]
        logps_ref = ([score_member(ref_model, ref_captured, r, cfg)[0] for r in group.response_ids]
                     if ref_captured is not None else None)
    # The PPO ratio's denominator is the trainer's own pre-step log-prob, never the engine's: a
    # kernel or precision difference between the two would bias every ratio and clip decision.
    # The engine's log-probs give per-token importance weights pi_old / pi_engine instead.
    logps_old = [s[0] for s in scored]
    masks = _loss_masks(group)
    weights, mismatch = _engine_correction(logps_old, group.logps_old, cfg, masks)
    timings["scoring"] = time.perf_counter() - start
    return _Scored(group, captured, ref_captured, engine, scored, logps_ref, logps_old, masks,
                   weights, mismatch, timings, keep)


def _rescore(model, work: _Scored, members: list[int], cfg) -> float:
    """Score `members` again at the current weights over the same (now older) capture: the
    selections (and, with reuse_branch_pages, the pages) replay then uses are those of the
    current weights, as a plain forward over the kept state would pick. The log-probs are not
    the ratio's denominator (that stays `logps_old`). -> seconds."""
    start = time.perf_counter()
    with memory.phase("scoring"):
        for i in members:
            work.scored[i] = score_member(model, work.captured, work.group.response_ids[i], cfg,
                                          *work.engine[i], keep_pages=work.keep_pages)
    return time.perf_counter() - start


def _replay_members(model, work: _Scored, members: list[int], advantages: torch.Tensor, cfg,
                    forward_only: bool, loss_scale: float) -> StepResult:
    """The loss of `members` (positions in the group; `advantages` [len(members)]) over the
    group's capture, backpropagated member by member (replay); G of the loss is len(members)."""
    group, masks, scored = work.group, work.masks, work.scored
    loss_cfg = cfg.loss_config()
    num_members = len(members)
    # R_i and T count trained tokens (all of them without loss masks); known before replay
    trained = [int(group.response_ids[i].numel()) if masks[i] is None else int(masks[i].sum())
               for i in members]
    group_tokens = sum(trained)
    start = time.perf_counter()
    total, logps, member_stats = 0.0, [], []
    entropy_sum, entropy_tokens = 0.0, 0   # replay's entropy, summed as members go (no [R] kept)
    with memory.phase("replay"):
        for j, i in enumerate(members):
            response = group.response_ids[i]
            # member_loss divides by G (num_members) and by R_i (num_tokens: the whole member's,
            # also under CP; or by the group's T = group_tokens, or G*C: loss_cfg.aggregation)
            # and multiplies by loss_scale (1/N groups per step); nothing divides again (losses
            # and gradients are plain sums over members and groups).
            args = dict(advantage=advantages[j], num_members=num_members, cfg=loss_cfg,
                        num_tokens=trained[j], loss_scale=loss_scale,
                        group_tokens=group_tokens)
            ref = work.logps_ref[i] if work.logps_ref else None
            weight = work.weights[i] if work.weights else None
            mask = masks[i]
            old = work.logps_old[i]

            def loss_of(logp, tokens=slice(None), args=args, ref=ref, weight=weight,
                        mask=mask, old=old):
                """Member i's (loss, stats) from the log-probs of its tokens `tokens`; with a
                loss mask, `loss_mask` is the mask of those tokens (bool, logp's shape and
                device; True: trained)."""
                masked = {} if mask is None else {"loss_mask": mask[tokens].to(logp.device)}
                return member_loss(logp, old[tokens].to(logp.dtype),
                                   logp_ref=None if ref is None else ref[tokens].to(logp.dtype),
                                   token_weight=None if weight is None else weight[tokens],
                                   **masked, **args)

            if forward_only:     # no backward: the loss of scoring's log-probs
                logp = scored[i][0]
                loss, stats = loss_of(logp)
            else:                # replay calls loss_of once, under autograd, and backpropagates
                pages = scored[i][2] if work.keep_pages else None
                logp, loss, stats, entropy = replay_member(
                    model, work.captured, response, scored[i][1], cfg, loss_of,
                    routed_experts=work.engine[i][1], pages=pages)
                if work.keep_pages:           # consumed: freed with the member
                    scored[i] = (scored[i][0], scored[i][1], None)
                entropy_sum += float(entropy.double().sum())
                entropy_tokens += entropy.numel()
                del entropy
            total += float(loss)
            logps.append(logp)
            member_stats.append(stats)
    seconds = time.perf_counter() - start
    rewards = group.rewards[members] if len(members) < len(group.response_ids) else group.rewards
    stats = _summarise(rewards, advantages, member_stats, trained)
    if entropy_tokens:   # replayed: the policy's entropy, the mean over the group's trained tokens
        stats["entropy"] = entropy_sum / entropy_tokens
    stats.update(work.mismatch)
    stores = [work.captured.pages] + ([work.ref_captured.pages] if work.ref_captured else [])
    by_kind: dict[str, int] = {}
    for store in stores:
        for kind, nbytes in store.bytes_by_kind().items():
            by_kind[kind] = by_kind.get(kind, 0) + nbytes
    fixed = [k for k in by_kind if any(k in store.fixed_kinds() for store in stores)]
    return StepResult(loss=total, stats=stats, logps=logps,
                      logps_old=[work.logps_old[i] for i in members],
                      token_weights=[work.weights[i] for i in members] if work.weights else None,
                      phase_seconds={"replay": seconds}, page_bytes=sum(s.nbytes() for s in stores),
                      page_bytes_by_kind=by_kind, fixed_page_kinds=fixed,
                      selections=[scored[i][1] for i in members])


def _step(model, group, cfg, ref_model, forward_only, loss_scale, progress,
          captured=None) -> StepResult:
    prompt_grad = PromptGrad.DETACHED if forward_only else cfg.replay.prompt_grad  # nothing to backprop
    work = _capture_and_score(model, group, cfg, ref_model, forward_only, progress, captured,
                              prompt_grad)
    loss_cfg = cfg.loss_config()
    advantages = group_advantages(group.rewards.to(torch.float64), eps=loss_cfg.adv_eps,
                                  std_unbiased=loss_cfg.std_unbiased)
    result = _replay_members(model, work, list(range(len(group.response_ids))), advantages, cfg,
                             forward_only, loss_scale)
    result.phase_seconds = {**work.timings, **result.phase_seconds}
    if prompt_grad is PromptGrad.EXACT:
        start = time.perf_counter()
        with memory.phase("prompt_backward"):
            prompt_backward(model, work.captured, cfg.capture)
        result.phase_seconds["prompt_backward"] = time.perf_counter() - start
    return result


def _engine_correction(logps_old, logps_engine, cfg, masks=None
                       ) -> tuple[list[torch.Tensor] | None, dict]:
    """(per-member importance weights or None, mismatch figures) from the trainer's pre-step
    log-probs and the engine's (offpolicy.py; nothing without the engine's). With loss masks
    (`masks`: per member bool [R_i] or None) only the trained tokens count: an untrained token
    has no loss term, so its weight is 1 (its engine log-prob, possibly absent (NaN), is
    replaced by the trainer's) and the mismatch figures are over the trained tokens."""
    if logps_engine is None:
        return None, {}
    masks = [None] * len(logps_old) if masks is None else masks

    def trained(x, m):   # the trained tokens of x
        return x if m is None else x[m.to(x.device)]
    logps_engine = [engine if m is None else   # float64, as importance_weights computes
                    torch.where(m.to(old.device), engine.to(old.device).double(),
                                old.detach().double())
                    for old, engine, m in zip(logps_old, logps_engine, masks)]
    pairs = [offpolicy.importance_weights(old, engine, cfg.loss.tis, cfg.loss.tis_cap)
             for old, engine in zip(logps_old, logps_engine)]
    mismatch = offpolicy.mismatch_stats(
        [trained(old, m) for old, m in zip(logps_old, masks)],
        [trained(engine, m) for engine, m in zip(logps_engine, masks)],
        None if cfg.loss.tis == "off" else [trained(c, m) for (_, c), m in zip(pairs, masks)])
    return (None if cfg.loss.tis == "off" else [w for w, _ in pairs]), mismatch


def merge_stats(stats: list[dict[str, float]]) -> dict[str, float]:
    """Statistics of several groups (or replicas) as one: means over those that report a key
    (the mismatch figures come only from groups with engine log-probs), max / min for the
    extremes."""
    keys = list(dict.fromkeys(k for s in stats for k in s))
    merged = {}
    for key in keys:
        values = [s[key] for s in stats if key in s]
        merged[key] = (max(values) if key.endswith("_max") else min(values)
                       if key.endswith("_min") else sum(values) / len(values))
    return merged


def _summarise(rewards, advantages, member_stats, lengths) -> dict[str, float]:
    """Token-weighted means of the per-member statistics plus group-level reward figures."""
    total = float(sum(lengths))
    def mean(key):
        return sum(float(s[key]) * n for s, n in zip(member_stats, lengths)) / total
    r = rewards.double()
    return {
        "reward_mean": float(r.mean()),
        # the spread of the G rewards within this group (merged: its mean over the groups), not
        # a spread over steps or groups
        "reward_group_std": float(r.std(unbiased=False)),
        # 1 when every member's reward is the same: all advantages are zero (no signal); merged
        # over the step's groups (merge_stats: the mean) it is the fraction of such groups
        "zero_advantage_frac": float(bool(torch.all(r == r[0]))),
        "advantage_abs_mean": float(advantages.abs().mean()),
        "clip_frac": mean("clip_frac"),
        "ratio_mean": mean("ratio_mean"),
        "ratio_max": max(float(s["ratio_max"]) for s in member_stats),
        "ratio_min": min(float(s["ratio_min"]) for s in member_stats),
        "kl": mean("kl"),
    }


def merge_results(results: list[StepResult]) -> StepResult:
    """One StepResult for the groups of one optimizer step on this rank (micro-batches): losses
    and phase times add up, statistics are means over the groups (ratio extremes: max / min),
    per-member lists concatenate, page bytes are the largest group's (pages are freed between
    groups)."""
    if len(results) == 1:
        return results[0]
    stats = merge_stats([r.stats for r in results])
    weights = [r.token_weights or [None] * len(r.logps) for r in results]
    largest = max(results, key=lambda r: r.page_bytes)
    return StepResult(
        loss=sum(r.loss for r in results), stats=stats,
        logps=[lp for r in results for lp in r.logps],
        logps_old=[lp for r in results for lp in r.logps_old],
        token_weights=([w for ws in weights for w in ws]
                       if any(r.token_weights for r in results) else None),
        phase_seconds={k: sum(r.phase_seconds.get(k, 0.0) for r in results)
                       for k in results[0].phase_seconds},
        page_bytes=largest.page_bytes, page_bytes_by_kind=dict(largest.page_bytes_by_kind),
        fixed_page_kinds=list(largest.fixed_page_kinds),
        selections=[sel for r in results for sel in r.selections])


def train_step(model, optimizer, groups: GRPOGroup | list[GRPOGroup], cfg: LongStrawConfig,
               ref_model=None, max_grad_norm: float | None = None, loss_scale: float = 1.0,
               progress=None, captures=None) -> StepResult:
    """One GRPO update: zero grads, forward_backward_longstraw for each of this rank's `groups`
    (micro-batches: gradients accumulate, each group's loss times `loss_scale`), the corrected
    finalisation (finalize.py: sums over CP/DP, experts on their owners), clipping, one optimizer
    step; or no step when a loss or the gradient is not finite on some rank (`result.skipped`:
    the caller stops or counts it, --check-for-nan-in-loss-and-grad). The result merges the
    groups (`merge_results`); `nonfinite_groups` names the local ones whose loss was not
    finite. `captures`: one capture per group, made under the current weights (the online
    loop's: `forward_backward_longstraw(captured=)`), or None."""
    groups = [groups] if isinstance(groups, GRPOGroup) else list(groups)
    if not groups:
        raise ValueError("train_step needs at least one group.")
    optimizer.zero_grad(set_to_none=True)
    captures = [None] * len(groups) if captures is None else list(captures)
    results = [forward_backward_longstraw(model, group, cfg, ref_model=ref_model,
                                          loss_scale=loss_scale, progress=progress,
                                          captured=captured)
               for group, captured in zip(groups, captures, strict=True)]
    return _apply_update(model, optimizer, results, max_grad_norm)


def _apply_update(model, optimizer, results: list[StepResult],
                  max_grad_norm: float | None) -> StepResult:
    """Finalize the accumulated gradients, clip, and step (or skip: a NaN / inf anywhere never
    reaches the weights); the groups' results merged."""
    from megatron_longstraw.distributed.finalize import clip_grads, finalize_longstraw_grads, grad_norm

    result = merge_results(results)
    start = time.perf_counter()
    finalize_longstraw_grads(model)
    result.stats["grad_norm"] = (clip_grads(model, max_grad_norm) if max_grad_norm
                                 else grad_norm(model))
    # A NaN / inf anywhere never reaches the weights: every rank agrees and none steps.
    result.nonfinite_groups = [i for i, r in enumerate(results) if not math.isfinite(r.loss)]
    loss_bad = bool(result.nonfinite_groups)
    any_loss_bad, grad_bad = any_rank([loss_bad, not math.isfinite(result.stats["grad_norm"])])
    if any_loss_bad or grad_bad:
        optimizer.zero_grad(set_to_none=True)
        result.skipped = True
        result.phase_seconds["optimizer"] = time.perf_counter() - start
        if any_loss_bad and dist.is_initialized() and dist.get_world_size() > 1:
            flags = [None] * dist.get_world_size()
            dist.all_gather_object(flags, loss_bad)
            result.nonfinite_loss_ranks = [r for r, bad in enumerate(flags) if bad]
        elif any_loss_bad:
            result.nonfinite_loss_ranks = [0]
        return result
    optimizer.step()
    result.phase_seconds["optimizer"] = time.perf_counter() - start   # finalize, clip, step
    return result


ADVANTAGE_SCOPES = ("capture", "update")
"""Over which members a group's advantages are computed when one capture serves K updates:
"capture" (all G x K members of the prompt: one baseline for the capture) or "update" (each
update's G members, as K separate steps would)."""


def drift_updates(updates: int, every: int = 0, first_last: bool = False) -> set[int]:
    """The updates of a capture before which the drift is measured: N, 2N, ... below `updates`
    (`every` N; 0: none), and with `first_last` update 1 (one optimizer step after the capture)
    and update K - 1 (the stalest). Update 0 runs at the capture's own weights: never."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(f"drift_every={every!r}: measure the drift before every N-th update (an "
                         "integer >= 1), or 0 for never.")
    chosen = set(range(every, updates, every)) if every else set()
    if first_last and updates > 1:
        chosen |= {1, updates - 1}
    return chosen


def train_on_capture(model, optimizer, groups: GRPOGroup | list[GRPOGroup], cfg: LongStrawConfig,
                     updates: int | None = None, advantage_scope: str | None = None,
                     ref_model=None, max_grad_norm: float | None = None, loss_scale: float = 1.0,
                     progress=None, captures=None, drift_every: int | None = None,
                     drift_bound: float | None = None, after_update=None,
                     drift_first_last: bool | None = None, epochs: int | None = None
                     ) -> list[StepResult]:
    """`updates` (K) optimizer steps over one capture per group (docs/design.md, "Several
    updates per capture"). Each group carries G x K members (G = cfg.group.group_size). Its
    prompt is captured once (or `captures` given) and every member scored once, before any
    update: those log-probs are every update's PPO denominator. Update k trains members
    [k G, (k + 1) G) of every group: they are scored again at the current weights over the kept
    (now older) capture, for the selections replay uses (only when the model selects: DSA; or
    keeps branch pages), then replayed with the loss (G of the loss is G), and the optimizer
    steps (`train_step`'s finalisation, clipping and NaN skip).
    Advantages: `advantage_scope` ("capture": over the prompt's G x K members; "update": over
    each update's G). K = 1 is `train_step`. The exact prompt gradient needs the prompt at the
    current weights, which a kept capture is not: refused for K > 1.

    `epochs` E (PPO's epochs): the K mini-batches are trained E times in order, E x K optimizer
    steps in all (update n trains mini-batch n mod K); E = K = 1 is `train_step`.

    Staleness (staleness.py): with `drift_every` N > 0, before updates N, 2N, ..., and with
    `drift_first_last` before update 1 and the last (`drift_updates`, counting all E x K), the
    prompt is captured again at the current weights and the update's members scored and
    replayed over both states; the figures go into that update's statistics (`drift/*`, and `drift/recaptured`). When
    `drift_bound` is given and the mean |delta log-prob| is past it, the fresh capture replaces
    the kept one for the remaining updates (the PPO denominator stays the capture-time
    log-probs). `updates`, `epochs`, `advantage_scope`, `drift_every`, `drift_first_last` and
    `drift_bound` default to `cfg.reuse`'s. `after_update(n, result)` is called after each
    update, before the next (the launcher steps its learning-rate schedule there, logs, and may
    stop the run by raising). -> E x K results, one per update."""
    reuse = cfg.reuse
    updates = reuse.updates_per_capture if updates is None else updates
    advantage_scope = reuse.advantage_scope if advantage_scope is None else advantage_scope
    drift_every = reuse.drift_every if drift_every is None else drift_every
    drift_bound = reuse.drift_bound if drift_bound is None else drift_bound
    drift_first_last = reuse.drift_first_last if drift_first_last is None else drift_first_last
    epochs = reuse.epochs if epochs is None else epochs
    for name, value in (("updates", updates), ("epochs", epochs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: give the number of mini-batches per capture "
                             "(updates) and of passes over them (epochs), integers >= 1.")
    steps = updates * epochs
    measured_at = drift_updates(steps, drift_every, drift_first_last)
    if drift_bound is not None and not (drift_bound > 0 and (drift_every or drift_first_last)):
        raise ValueError(f"drift_bound={drift_bound!r}: a bound on the measured mean |delta "
                         "log-prob| (> 0) needs the drift measured (drift_every >= 1 or "
                         "drift_first_last).")
    if advantage_scope not in ADVANTAGE_SCOPES:
        raise ValueError(f"advantage_scope={advantage_scope!r}: choose one of "
                         f"{list(ADVANTAGE_SCOPES)}.")
    groups = [groups] if isinstance(groups, GRPOGroup) else list(groups)
    start = time.perf_counter()
    if steps == 1:
        result = train_step(model, optimizer, groups, cfg, ref_model=ref_model,
                            max_grad_norm=max_grad_norm, loss_scale=loss_scale,
                            progress=progress, captures=captures)
        result.seconds = time.perf_counter() - start
        if after_update is not None:
            after_update(0, result)
        return [result]
    if not groups:
        raise ValueError("train_on_capture needs at least one group.")
    if cfg.replay.prompt_grad is PromptGrad.EXACT:
        raise ValueError("The exact prompt gradient needs the prompt's state at the current "
                         f"weights; a capture kept for {steps} updates is older after the "
                         "first. Use --longstraw-prompt-grad detached with several updates per "
                         "capture, or one update per capture.")
    size = cfg.group.group_size
    captures = [None] * len(groups) if captures is None else list(captures)
    work = []
    for group, captured in zip(groups, captures, strict=True):
        _agree_on_inputs(model, group, cfg, ref_model, captured, False, updates)
        with fail_together():
            work.append(_capture_and_score(model, group, cfg, ref_model, False, progress,
                                           captured, PromptGrad.DETACHED, keep_upto=size))
    loss_cfg = cfg.loss_config()

    def advantages_of(rewards):
        return group_advantages(rewards.to(torch.float64), eps=loss_cfg.adv_eps,
                                std_unbiased=loss_cfg.std_unbiased)

    whole = [advantages_of(w.group.rewards) for w in work]
    results = []
    for n in range(steps):
        k = n % updates            # the mini-batch of update n (epoch n // updates)
        members = list(range(k * size, (k + 1) * size))
        scopes = [adv[members] if advantage_scope == "capture" else
                  advantages_of(w.group.rewards[members]) for w, adv in zip(work, whole)]
        optimizer.zero_grad(set_to_none=True)
        # The drift of every group's kept capture, before any of this update's gradients exist
        # (measure_drift leaves none behind).
        drifts, measured = [], time.perf_counter()
        if n in measured_at:
            for w, scope in zip(work, scopes):
                with fail_together():
                    drift, fresh = measure_drift(model, w, members, scope, cfg, _rescore,
                                                 _replay_members)
                recapture = drift_bound is not None and drift.logp_abs_mean > drift_bound
                if recapture:
                    w.captured = fresh
                drifts.append({**drift.stats(), "drift/recaptured": float(recapture)})
                del fresh
        measured = (time.perf_counter() - measured) / len(work)
        done = []
        for w, scope in zip(work, scopes):
            with fail_together():
                # Only what the weights chose or wrote needs scoring again: DSA selections, and
                # blockwise branch pages kept for replay. A model without either (Qwen3.6,
                # DeepSeek-V3) replays against the capture as scored.
                stale = w.keep_pages or any(w.scored[i][1] for i in members)
                rescored = _rescore(model, w, members, cfg) if n and stale else 0.0
                r = _replay_members(model, w, members, scope, cfg, False, loss_scale)
            r.phase_seconds = {"capture": w.timings["capture"] if n == 0 else 0.0,
                               "scoring": w.timings["scoring"] if n == 0 else rescored,
                               **r.phase_seconds, **({"drift": measured} if drifts else {})}
            done.append(r)
        result = _apply_update(model, optimizer, done, max_grad_norm)
        result.stats["update_in_capture"] = float(n)
        if epochs > 1:
            result.stats["epoch"] = float(n // updates)
        if drifts:
            result.stats.update(merge_stats(drifts))
        result.seconds = time.perf_counter() - start
        results.append(result)
        if after_update is not None:
            after_update(n, result)
        start = time.perf_counter()
    return results
