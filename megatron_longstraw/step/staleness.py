"""How stale a kept capture is (docs/design.md, "Several updates per capture"): the prompt captured
again under the current weights, and the same members scored and replayed over both states.

    fresh = capture(prompt) at the current weights
    for i in members: logp_stale_i, logp_fresh_i     per-token log-probs over each state
    grad_stale, grad_fresh                            the GRPO loss's finalized gradient over each

Reported (`Drift`): the per-token |logp_stale - logp_fresh| (mean over the members' tokens, max),
a KL estimate between the two (k3 over the members' tokens: exp(d) - d - 1 with d = logp_fresh -
logp_stale; the tokens were sampled from neither state's policy, so it is an estimate of the
gap, not an exact divergence), and the cosine and relative norm |g_stale - g_fresh| / |g_fresh|
of the two gradients (dense parameters counted once, experts summed over their owners, as
finalize.grad_norm). The model's gradients are left as they were found (None)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_longstraw.context.capture import capture_prompt
from megatron_longstraw.distributed.collectives import all_reduce_sum
from megatron_longstraw.distributed.finalize import finalize_longstraw_grads, is_expert_param
from megatron_longstraw.distributed.parallel import gradient_groups


@dataclass(frozen=True)
class Drift:
    """The gap between a kept capture and a fresh one, over the same members (module docstring)."""

    logp_abs_mean: float
    logp_abs_max: float
    kl: float
    """k3 estimate, mean over the members' tokens."""
    grad_cosine: float
    grad_rel_norm: float
    """|g_stale - g_fresh| / |g_fresh| (inf when the fresh gradient is 0 and the stale one not)."""
    capture_seconds: float
    """The fresh capture's time: what measuring costs, beside the replays."""

    def stats(self) -> dict[str, float]:
        return {"drift/logp_abs_mean": self.logp_abs_mean, "drift/logp_abs_max": self.logp_abs_max,
                "drift/kl": self.kl, "drift/grad_cosine": self.grad_cosine,
                "drift/grad_rel_norm": self.grad_rel_norm}


def _finalized_grads(model) -> dict[str, torch.Tensor]:
    finalize_longstraw_grads(model)
    out = {n: p.grad.detach().double().clone() for n, p in model.named_parameters()
           if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _dot(model, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """<a, b> over the model's finalized gradients, each parameter counted once (grad_norm's
    rule: dense parameters are whole on every rank, experts distinct per EP rank)."""
    _, _, expert_mp = gradient_groups()
    dense = torch.zeros((), dtype=torch.float64)
    expert = torch.zeros((), dtype=torch.float64)
    for name, param in model.named_parameters():
        if name not in a or name not in b:
            continue
        value = (a[name] * b[name]).sum().cpu()
        if is_expert_param(param):
            expert += value
        else:
            dense += value
    all_reduce_sum(expert, expert_mp)
    return float(dense + expert)


def measure_drift(model, work, members: list[int], advantages: torch.Tensor, cfg, rescore,
                  replay):
    """The drift of `work`'s kept capture (schedule._Scored: the group, its capture and
    capture-time log-probs) over `members` at the current weights (module docstring). Collective
    under CP / EP: every rank calls it with the same members. -> (Drift, the fresh capture: the
    caller may keep it, to recapture when the drift is past its bound). `rescore(model, work,
    members, cfg)` and `replay(model, work, members, advantages, cfg, forward_only, loss_scale)`
    are the step's own phases (schedule.py), which score the members at the current weights over
    `work.captured` and replay them with the loss."""

    if any(p.grad is not None for p in model.parameters()):
        raise ValueError("measure_drift runs between updates: the model holds gradients "
                         "(call it before backward or after optimizer.zero_grad).")
    stale_scores = list(work.scored)
    rescore(model, work, members, cfg)
    stale = replay(model, work, members, advantages, cfg, False, 1.0)
    g_stale = _finalized_grads(model)

    fresh_capture = capture_prompt(model, work.group.prompt_ids, cfg.capture)
    kept = work.captured
    work.captured = fresh_capture
    try:
        rescore(model, work, members, cfg)
        fresh = replay(model, work, members, advantages, cfg, False, 1.0)
        g_fresh = _finalized_grads(model)
    finally:
        work.captured = kept
        work.scored = stale_scores
    gaps = [(f.double() - s.double()) for f, s in zip(fresh.logps, stale.logps)]
    flat = torch.cat([g.reshape(-1) for g in gaps])
    k3 = torch.exp(flat) - flat - 1.0
    ss, ff, sf = _dot(model, g_stale, g_stale), _dot(model, g_fresh, g_fresh), \
        _dot(model, g_stale, g_fresh)
    diff = math.sqrt(max(ss + ff - 2 * sf, 0.0))
    cosine = sf / math.sqrt(ss * ff) if ss > 0 and ff > 0 else float("nan")
    rel = diff / math.sqrt(ff) if ff > 0 else (0.0 if diff == 0 else float("inf"))
    return Drift(logp_abs_mean=float(flat.abs().mean()), logp_abs_max=float(flat.abs().max()),
                 kl=float(k3.mean()), grad_cosine=cosine, grad_rel_norm=rel,
                 capture_seconds=fresh_capture.seconds), fresh_capture
