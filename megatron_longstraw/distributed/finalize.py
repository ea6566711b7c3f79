"""Corrected gradient finalisation for the LongStraw schedule (docs/design.md section 4).

What Megatron-Core 0.19.2's stock `finalize_model_grads` gets wrong here. It finishes the gradient
sync of `DistributedDataParallel`, which, by default, scales every gradient by 1 / (DP x CP) and
sums it over DP x CP (non-expert) or expert-DP (experts): an average that assumes each rank computed
a full loss on its own micro-batch. In its `calculate_per_token_loss` mode it sums, then divides
every gradient by the global token count its schedule passes. Under LongStraw:

- each CP rank holds a *partial sum* of the group's gradient (its prompt shard's attention
  contributions and its rows of each response), and the loss already carries every divisor
  (1 / (N_groups G R_i), grpo.py). The correct reduction is a plain SUM over DP x CP; the stock
  average makes every gradient CP times too small (experts included), and the per-token variant
  divides again by a token count the loss already used (measured on CP2/EP2 in
  tests/test_distributed.py: ratios 1/2 and 1/num_response_tokens);
- with EP folded on the CP ranks an expert's gradient is complete on its owner (all tokens routed
  to it, from every CP rank, were dispatched there). Replicas of an expert across expert-DP hold
  disjoint token sets, so they are SUMMED, never averaged; with expert-DP = 1 nothing is reduced;
- the gradient norm for clipping must count each parameter once: non-expert parameters are
  identical on every rank after the sum; experts are distinct across EP ranks and replicated
  across expert-DP.

After `finalize_longstraw_grads` every replica of a parameter holds the same gradient, and the
update equals the one a single process running the whole step would make (tests/test_distributed.py
shows both, and the stock function's CP-fold error).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_longstraw.distributed.collectives import all_reduce_sum
from megatron_longstraw.distributed.parallel import gradient_groups


def is_expert_param(param: torch.nn.Parameter) -> bool:
    """Megatron marks expert parameters (reduced over expert-DP, not DP) with allreduce=False."""
    return not getattr(param, "allreduce", True)


def finalize_longstraw_grads(model: torch.nn.Module) -> None:
    """Sum partial gradients: non-expert over DP x CP, experts over expert-DP (no averaging)."""
    dp_cp, expert_dp, _ = gradient_groups()
    params = [p for p in model.parameters() if p.requires_grad]
    sum_grads([p for p in params if not is_expert_param(p)], dp_cp)
    sum_grads([p for p in params if is_expert_param(p)], expert_dp)


def grad_norm(model: torch.nn.Module) -> float:
    """L2 norm of the finalized gradient, each parameter counted once across CP, DP and EP."""
    _, _, expert_mp = gradient_groups()
    dense_sq = torch.zeros((), dtype=torch.float64)
    expert_sq = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is None:
            continue
        sq = p.grad.detach().double().pow(2).sum().cpu()
        if is_expert_param(p):
            expert_sq += sq
        else:
            dense_sq += sq
    all_reduce_sum(expert_sq, expert_mp)   # distinct experts on each EP rank
    return math.sqrt(float(dense_sq + expert_sq))


def clip_grads(model: torch.nn.Module, max_norm: float) -> float:
    """Scale gradients so that the global norm is at most `max_norm`; returns the norm before."""
    norm = grad_norm(model)
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


def sum_grads(params: list[torch.nn.Parameter], group) -> None:
    """SUM-all-reduce the gradients of `params` over `group`, one flat buffer per dtype (no-op
    without a group or on a group of one)."""
    if group is None or dist.get_world_size(group) == 1:
        return
    # A parameter no rank used (the DSA indexer: it only selects) keeps grad None, as it would in
    # one process; one used elsewhere but not here joins the sum with zeros.
    used = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
    dist.all_reduce(used, op=dist.ReduceOp.MAX, group=group)
    params = [p for p, u in zip(params, used.tolist()) if u]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for same in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in same])
        dist.all_reduce(flat, group=group)
        offset = 0
        for p in same:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n
