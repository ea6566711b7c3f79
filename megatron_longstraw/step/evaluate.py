"""Held-out scoring (`--longstraw-eval-data`, Megatron's `--eval-interval` / `--eval-iters`): the
current policy's log-probabilities of the supplied responses of held-out groups.

The metric is not the mean of the supplied rewards (those do not depend on the policy): it is how
likely the policy finds the held-out responses, per token and per sequence, and, when the file
carries the engine's `logprobs_old`, how far the policy has moved from the one that generated them
(k3 KL estimate and mean |logp - logp_old|, per token). With loss masks (multi-turn members)
every figure is over the trained tokens only (the policy's; tool observations are context, and
their engine log-probs may be absent). Each group runs capture and scoring only
(schedule.forward_backward_longstraw with forward_only=True: no replay, no gradient).

The same `n` groups are scored every time (the first ones of the file, so successive evaluations
are comparable), `n` = min(--eval-iters, groups in the file) rounded down to a multiple of the
data-parallel size; replica r scores groups r, r + DP, ... and the sums are reduced over the
data-parallel group.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def eval_group_count(eval_iters: int, num_groups: int, dp_size: int) -> int:
    """How many held-out groups one evaluation scores (module docstring); ValueError when none."""
    n = min(eval_iters, num_groups) // dp_size * dp_size
    if n == 0:
        raise ValueError(f"--eval-iters {eval_iters} with {num_groups} held-out groups scores "
                         f"fewer groups than the {dp_size} data-parallel replicas (each replica "
                         f"scores the same number); give at least {dp_size} groups and "
                         f"--eval-iters >= {dp_size}.")
    return n


@torch.no_grad()
def evaluate(model, dataset, cfg, count: int, dp_rank: int, dp_size: int,
             dp_group=None) -> dict[str, float]:
    """Scores of `count` held-out groups of `dataset` (module docstring), the same on every rank.
    Collective over the model-parallel and data-parallel groups."""
    from megatron_longstraw.step.schedule import forward_backward_longstraw

    # [sum of logp, tokens, sequences, sum of k3, sum of |diff|, tokens with logprobs_old]
    sums = torch.zeros(6, dtype=torch.float64)
    for index in range(dp_rank, count, dp_size):
        group = dataset[index]
        result = forward_backward_longstraw(model, group, cfg, forward_only=True)
        for i, logp in enumerate(result.logps):
            logp = logp.detach().double()
            trained = (torch.ones_like(logp, dtype=torch.bool) if group.loss_masks is None
                       else torch.as_tensor(group.loss_masks[i]).bool().to(logp.device))
            logp = logp[trained]
            sums[0] += logp.sum()
            sums[1] += logp.numel()
            sums[2] += 1
            if group.logps_old is not None:
                old = group.logps_old[i].double().to(trained.device)[trained]
                diff = old - logp   # log(pi_old / pi)
                sums[3] += (diff.exp() - 1 - diff).sum()    # k3 estimate of KL(pi || pi_old)
                sums[4] += diff.abs().sum()
                sums[5] += diff.numel()
    if dist.is_initialized() and dp_size > 1:
        dist.all_reduce(sums, group=dp_group)
    token_mean = float(sums[0] / sums[1])
    out = {"eval/groups": float(count), "eval/logprob_token_mean": token_mean,
           "eval/perplexity": math.exp(-token_mean),
           "eval/logprob_seq_mean": float(sums[0] / sums[2])}
    if sums[5] > 0:
        out["eval/kl_to_old"] = float(sums[3] / sums[5])
        out["eval/logprob_abs_diff_to_old"] = float(sums[4] / sums[5])
    return out
