"""The context-parallel pattern of the attention mixers (docs/design.md section 3), in one module.

Every rank holds its load-balanced shard of the prompt (`CPLayout.prompt_positions`) and, in branch
passes (score, replay), a contiguous share of the branch rows. Mixers compute on local tensors and
call these functions for everything that crosses ranks:

- Capture. A rank's queries need every earlier prompt key. `gather_prompt_keys` all-gathers one
  layer's key rows in position order (GLM-5.2's DSA: the global top-k scores every key);
  `ring_attention` broadcasts each rank's K/V shard in turn and merges the partial attention of
  this rank's queries by log-sum-exp, so no rank holds more than one shard of keys (Qwen3.6's
  gated attention).
- Branch passes. `attend_branch` gathers the branch's rows (queries, and the branch's own keys) to
  every rank, lets the mixer attend all branch queries over this rank's prompt shard plus the
  branch's own keys, and merges the partial outputs by log-sum-exp, reduce-scattered to the rows'
  owners (`parallel.merge_partials_by_lse`). The branch's own keys are on every rank, so every
  rank builds the same autograd graph (and the backward collectives line up), but only rank 0
  lets queries see them (`branch_keys_counted_here`, `branch_key_positions`): they count once.
  Backward mirrors the forward through the differentiable gather and reduce-scatter.

Gated DeltaNet's recurrence is sequential in tokens and independent across heads, so its CP is a
rows <-> heads exchange instead (`parallel.HeadParallel`, Megatron's own GDN CP scheme).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_longstraw import parallel
from megatron_longstraw.kernels.refs import merge_partial_attention
from megatron_longstraw.parallel import CPLayout
from megatron_longstraw.state import AttentionPass


def gather_prompt_keys(rows: torch.Tensor, state: AttentionPass) -> tuple[torch.Tensor, torch.Tensor]:
    """Capture: this rank's key rows [n_local, ...] -> (every rank's rows in position order
    [global_len, ...], their positions [global_len])."""
    total = state.cp.global_len
    gathered = parallel.gather_sequence(rows, state.positions, total, state.cp.layout)
    return gathered, torch.arange(total, device=rows.device)


def gather_prompt_keys_differentiable(rows: torch.Tensor, state: AttentionPass) -> torch.Tensor:
    """Prompt backward: `gather_prompt_keys`' rows under autograd (each key's cotangent, summed
    over the ranks whose queries read it, returns to its owner). -> [global_len, ...]"""
    return parallel.gather_sequence_differentiable(rows, state.positions, state.cp.global_len,
                                                   state.cp.layout)


def ring_attention(state: AttentionPass, keys: torch.Tensor, values: torch.Tensor,
                   attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple]) -> tuple:
    """Capture: this rank's queries over every rank's K/V shard, one shard at a time. `keys` /
    `values` [n_local, ...] are this rank's rows; `attend(k, v, k_positions)` returns this rank's
    queries' (out, lse) over the given keys. -> merged (out, lse)."""
    cp = state.cp
    shards = [CPLayout(None, cp.size, r).prompt_positions(cp.global_len, keys.device)
              for r in range(cp.size)]
    rows = max(p.numel() for p in shards)
    out = lse = None
    for src in range(cp.size):
        src_k = parallel.broadcast_rows(keys, src, rows, cp.layout)
        src_v = parallel.broadcast_rows(values, src, rows, cp.layout)
        # Padding rows get a position after every query: never visible.
        src_pos = parallel.broadcast_rows(state.positions, src, rows, cp.layout, fill=cp.global_len)
        part_out, part_lse = attend(src_k, src_v, src_pos)
        if out is None:
            out, lse = part_out, part_lse
        else:
            out, lse = merge_partial_attention([out, part_out], [lse, part_lse])
    return out, lse


def branch_keys_counted_here(state: AttentionPass) -> bool:
    """Whether this rank's partial attention includes the branch's own keys (rank 0 only)."""
    return state.cp.rank == 0


def branch_key_positions(state: AttentionPass) -> torch.Tensor:
    """Positions of the gathered branch keys as this rank's attention sees them: their own on
    rank 0, a position after every query elsewhere (never visible)."""
    positions = state.cp.branch_positions
    if branch_keys_counted_here(state):
        return positions
    return torch.full_like(positions, state.prefix_len + state.cp.branch_len)


def attend_branch(state: AttentionPass, rows: Sequence[torch.Tensor],
                  attend: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Branch pass under CP: `rows` are this rank's branch rows of the tensors the attention needs
    (queries first, then e.g. the branch's own keys); `attend(*gathered)` gets each of them for the
    whole padded branch and returns the partial (out [R_pad, h, d], lse [R_pad, h]) of all branch
    queries over this rank's keys. -> this rank's rows of the merged output [c, h, d]."""
    gathered = [parallel.gather_rows(t, state.cp.layout) for t in rows]
    out, lse = attend(*gathered)
    return parallel.merge_partials_by_lse(out, lse, state.cp.layout)


def merge_replicated(out: torch.Tensor, lse: torch.Tensor, state: AttentionPass) -> torch.Tensor:
    """Decode under CP: every rank holds the same query rows and its partial (out [s, h, d], lse
    [s, h]) over its own keys; all of them, merged by log-sum-exp in rank order (the same on
    every rank, so every rank gets the same output bit for bit). -> [s, h, d]"""
    layout = state.cp.layout
    outs = [torch.empty_like(out) for _ in range(layout.size)]
    lses = [torch.empty_like(lse) for _ in range(layout.size)]
    dist.all_gather(outs, out.contiguous(), group=layout.group)
    dist.all_gather(lses, lse.contiguous(), group=layout.group)
    merged, _ = merge_partial_attention(outs, lses)
    return merged.to(out.dtype)


def local_key_index(selection: torch.Tensor, prefix_positions: torch.Tensor, prefix_len: int,
                    branch_here: bool) -> torch.Tensor:
    """Global key positions [s, k] (-1 = none) -> indices into this rank's keys: its prompt shard
    (`prefix_positions`, ascending), then the branch's rows (positions prefix_len, prefix_len + 1,
    ...) when `branch_here`; -1 for a key held elsewhere. O(s x k): no table over the prompt."""
    chosen = selection.clamp(min=0)
    num_prefix = prefix_positions.numel()
    local = torch.full_like(selection, -1)
    if num_prefix:
        slot = torch.searchsorted(prefix_positions, chosen).clamp(max=num_prefix - 1)
        here = (selection >= 0) & (chosen < prefix_len) & (prefix_positions[slot] == chosen)
        local = torch.where(here, slot, local)
    if branch_here:
        local = torch.where(selection >= prefix_len, num_prefix + selection - prefix_len, local)
    return local
