"""Pre-step scoring and serial replay (docs/design.md section 2, steps 2 and 3).

A member's branch is `[x_P, y_1 .. y_{R-1}]` at positions `P-1 .. P+R-2` over the captured prefix;
its outputs score `y_1 .. y_R`. Scoring runs the branch without autograd and records each full DSA
indexer layer's top-k ("indexer replay"); replay runs it again under autograd with those selections,
every decoder layer wrapped in activation checkpointing, computes the member's loss and its
statistics (once) and backpropagates the loss before the next member starts. Live autograd memory
is one branch, whatever P and G. When the group carries the engine's DSA selections or MoE routing
(routing replay, routing_replay.py), scoring uses them and replay reuses them.

Under context parallelism each rank owns a contiguous share of the branch rows (padded to equal
shares) for token-wise work and the loss; attention exchanges queries and partial outputs
(`models/context_parallel.py`); the shares' losses and statistics are combined after backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from megatron_longstraw.distributed import collectives
from megatron_longstraw.state.attention_pass import AttentionPass, CPPass, PromptGrad
from megatron_longstraw.config.settings import LongStrawConfig
from megatron_longstraw.models.common import decoder_groups, embed, head_logprobs, run_group
from megatron_longstraw.context.capture import CapturedPrompt
from megatron_longstraw.grpo.loss import combine_shares
from megatron_longstraw.training import routing_replay


@dataclass
class Branch:
    """This rank's rows of one member's branch."""

    input_ids: torch.Tensor   # [c] token ids (padding: 0)
    targets: torch.Tensor     # [c] next tokens (padding: 0)
    positions: torch.Tensor   # [c] global positions
    valid: torch.Tensor       # [c] bool, False on padding
    rows: slice               # this rank's rows within the (padded) branch
    length: int               # R (unpadded)
    padded_length: int        # R padded to the CP size


def make_branch(captured: CapturedPrompt, response_ids: torch.Tensor) -> Branch:
    layout = captured.layout
    length = int(response_ids.numel())
    start, end, padded = layout.branch_rows(length)
    device = response_ids.device
    first = torch.tensor([captured.last_token], dtype=response_ids.dtype, device=device)
    pad = torch.zeros(padded - length, dtype=response_ids.dtype, device=device)
    input_ids = torch.cat([first, response_ids[:-1], pad])
    targets = torch.cat([response_ids, pad])
    positions = torch.arange(captured.prefix_len, captured.prefix_len + padded, device=device)
    valid = torch.arange(padded, device=device) < length
    rows = slice(start, end)
    return Branch(input_ids[rows], targets[rows], positions[rows], valid[rows], rows, length, padded)


def _pass(captured: CapturedPrompt, branch: Branch, cfg: LongStrawConfig,
          selections: dict | None, mode: str = "replay",
          prompt_grad: PromptGrad = PromptGrad.DETACHED) -> AttentionPass:
    cp = CPPass.for_branch(captured.layout, captured.positions, captured.prefix_len,
                           branch.padded_length)
    return AttentionPass(mode=mode, positions=branch.positions, pages=captured.pages,
                         prefix_len=captured.prefix_len, selections=dict(selections or {}),
                         reuse_selections=selections is not None, query_block=cfg.query_block,
                         key_block=cfg.key_block, token_block=cfg.token_block, cp=cp,
                         prompt_grad=prompt_grad)


def _run_branch(model, captured: CapturedPrompt, branch: Branch, state: AttentionPass,
                checkpoint_layers: bool):
    """Log-probs [c] of this rank's branch rows in the pass `state`. A checkpointed layer gets the
    pass as an argument, so its recompute in backward runs in the same pass."""
    hidden = embed(model, branch.input_ids)                           # [c, 1, h]
    groups = decoder_groups(model)
    for layer_idx, group in enumerate(groups):
        if captured.prefix_len and layer_idx + 1 < len(groups):
            captured.pages.prefetch(layer_idx + 1, hidden.device)    # one layer ahead
        if checkpoint_layers and torch.is_grad_enabled():
            hidden = checkpoint(run_group, group, hidden, state, use_reentrant=False)
        else:
            hidden = run_group(group, hidden, state)
        captured.pages.release(layer_idx)
    return head_logprobs(model, hidden, branch.targets)


def gather_member(values: torch.Tensor, branch: Branch, captured: CapturedPrompt) -> torch.Tensor:
    """This rank's rows [c] -> the whole member [R] on every rank (no autograd)."""
    return collectives.gather_tensor(values.detach(), captured.layout)[:branch.length]


def score_member(model, captured: CapturedPrompt, response_ids: torch.Tensor,
                 cfg: LongStrawConfig, selections: dict[int, torch.Tensor] | None = None,
                 routed_experts: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Per-token log-probs [R] of one response (no autograd; whole member on every rank) and the DSA
    selections it used (global key positions, int32, kept in host memory when pages are offloaded:
    all G members' selections wait for replay, [R, top-k] per full indexer layer each).

    Routing replay (routing_replay.py): `selections` (the engine's, {full indexer layer: [R
    padded, k]}) are used instead of computed ones, and returned; `routed_experts` [R, L, k]
    route this rank's rows in every MoE layer."""
    branch = make_branch(captured, response_ids)
    state = _pass(captured, branch, cfg, selections=selections, mode="score")
    with (torch.no_grad(),
          routing_replay.replay_routing(model, routed_experts, branch.rows, branch.length)):
        logp = _run_branch(model, captured, branch, state, checkpoint_layers=False)
    keep = "cpu" if cfg.offload_pages else None
    selections = {layer: sel.to(device=keep, dtype=torch.int32)
                  for layer, sel in state.selections.items()}
    return gather_member(logp, branch, captured), selections


class ReplayedMember(NamedTuple):
    """What `replay_member` returns: the whole member on every rank, nothing holding a graph."""

    logp: torch.Tensor
    """[R] the member's log-probs under the current parameters."""
    loss: torch.Tensor
    """0-d, detached: the member's loss (grpo.loss.member_loss: its 1/(G R_i) share included),
    the sum of the CP ranks' shares."""
    stats: dict[str, torch.Tensor]
    """member_loss's statistics of the whole member (ratio, clip fraction, KL)."""


def replay_member(model, captured: CapturedPrompt, response_ids: torch.Tensor,
                  selections: dict[int, torch.Tensor] | None, cfg: LongStrawConfig,
                  loss_fn: Callable[[torch.Tensor, slice], tuple[torch.Tensor, dict]],
                  routed_experts: torch.Tensor | None = None) -> ReplayedMember:
    """Rebuild one member's graph, compute its loss once, backpropagate, free the graph.

    `loss_fn(logp, tokens)` -> (loss, stats): grpo.loss.member_loss (as the schedule binds it)
    of this rank's share of the member, from the log-probs of its tokens `tokens` (a slice of
    the member's R tokens; padding excluded; may be empty). It is called once, under autograd;
    the loss is backpropagated, then (context parallelism) the ranks' shares are combined into
    the member's loss and statistics, the same on every rank (`_whole_member`). Every rank calls
    backward (the exchanges in attention are collectives), even with an empty share. Gradients
    accumulate into `.grad` (plain sums across members: the loss carries the 1/(G R_i) share).
    `routed_experts` [R, L, k]: the engine's routing, kept through backward (the checkpoint
    recompute routes the same way; routing_replay.py).
    """
    branch = make_branch(captured, response_ids)
    # Exact prompt gradient: pages as leaves, their cotangents summed over the members.
    state = _pass(captured, branch, cfg, selections=selections, mode="replay",
                  prompt_grad=cfg.prompt_grad)
    # Backward recomputes checkpointed layers (in `state`, their argument): keep the routing.
    with routing_replay.replay_routing(model, routed_experts, branch.rows, branch.length):
        logp = _run_branch(model, captured, branch, state, cfg.checkpoint_layers)
        num_valid = int(branch.valid.sum())
        loss, stats = loss_fn(logp[:num_valid],
                              slice(branch.rows.start, branch.rows.start + num_valid))
        loss.backward()
    loss, stats = _whole_member(loss.detach(), stats, num_valid, captured.layout)
    return ReplayedMember(gather_member(logp, branch, captured), loss, stats)


def _whole_member(loss: torch.Tensor, stats: dict[str, torch.Tensor], num_rows: int,
                  layout) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This rank's share of the member's (loss, stats), over `num_rows` of its tokens -> the
    member's, on every rank: under CP one all-gather of each rank's few numbers, then
    `grpo.loss.combine_shares` (no divisor applied again)."""
    if layout.size == 1:
        return loss, stats
    keys = sorted(stats)
    # float64 holds the fp32 / fp64 figures and the row count exactly
    mine = torch.stack([loss, *(stats[k] for k in keys)]).to(torch.float64)
    mine = torch.cat([mine, mine.new_tensor([num_rows])])
    shares = [(row[0].to(loss.dtype), {k: row[1 + j].to(loss.dtype) for j, k in enumerate(keys)},
               int(row[-1]))
              for row in collectives.gather_tensor(mine[None], layout)]     # [CP, 2 + stats]
    return combine_shares(shares)
