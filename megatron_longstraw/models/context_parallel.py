"""The context-parallel pattern of the attention mixers (docs/design.md section 3), in one module.

Every rank holds its load-balanced shard of the prompt (`CPLayout.prompt_positions`) and, in branch
passes (score, replay), a contiguous share of the branch rows. Mixers compute on local tensors and
call these functions for everything that crosses ranks:

- Capture. A rank's queries need every earlier prompt key. Streamed (the default,
  `StreamedCapture`), each layer runs in three phases over this rank's token blocks: the blocks'
  key rows go to this rank's pages; every rank's rows of the layer are gathered into host memory
  in position order, one window on the device at a time; each block's queries then read them
  window by window (or, DSA, only the selected rows), as one process reads its pages. Whole-shard
  capture (the reference) all-gathers one layer's key rows on the device (`gather_prompt_keys`,
  GLM-5.2's DSA) or broadcasts each rank's K/V shard in turn and merges the partial attention by
  log-sum-exp (`ring_attention`, Qwen3.6's gated attention, DeepSeek-V3).
- Branch passes. `attend_branch` gathers the branch's rows (queries, and the branch's own keys) to
  every rank, lets the mixer attend all branch queries over this rank's prompt shard plus the
  branch's own keys, and merges the partial outputs by log-sum-exp, reduce-scattered to the rows'
  owners (`collectives.merge_partials_by_lse`). The branch's own keys are on every rank, so every
  rank builds the same autograd graph (and the backward collectives line up), but only rank 0
  lets queries see them (`branch_keys_counted_here`, `branch_key_positions`): they count once.
  Backward mirrors the forward through the differentiable gather and reduce-scatter.

Gated DeltaNet's recurrence is sequential in tokens and independent across heads, so its CP is a
rows <-> heads exchange instead (`collectives.HeadParallel`, Megatron's own GDN CP scheme).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_longstraw.distributed import collectives
from megatron_longstraw.kernels.refs import merge_partial_attention
from megatron_longstraw.runtime.memory import note_host
from megatron_longstraw.distributed.cp_layout import CPLayout
from megatron_longstraw.state.attention_pass import AttentionPass


class StreamedCapture:
    """Streamed capture under CP (capture.py): what crosses ranks, one layer at a time, through
    host memory. Every rank runs the same number of token blocks of its shard (`capture_blocks`),
    and per layer three phases:

    1. rows (mode `capture_rows`): each block's key rows go to this rank's pages (GDN: the block's
       mixer input goes to a host buffer, `buffer`); nothing is attended;
    2. exchange (the mixer's `capture_exchange`, collective): attention mixers gather every rank's
       rows of the layer into host memory in position order (`gather_keys`); GDN runs its
       recurrence one global token block at a time over this rank's heads and writes the mixer's
       output rows back into its host buffer;
    3. attend (mode `capture_block`): each block's queries read the gathered rows one key window
       or one selection at a time (`window`, `gather`: the reads of `pages.LayerRows`, by global
       position), then the block's FFN/MoE run.

    The device holds one window of `rows_per_copy` rows in phase 2 and one block's activations in
    1 and 3; the host holds the layer's rows of every rank (the planner's host line
    `capture_gathered_keys`)."""

    def __init__(self, layout: CPLayout, global_len: int, storage_device, pin_memory: bool,
                 rows_per_copy: int):
        self.layout, self.global_len = layout, global_len
        self.local_len = layout.shard_len(global_len)
        self.storage_device, self.pin_memory = torch.device(storage_device), pin_memory
        self.rows_per_copy = rows_per_copy
        self.keys: dict[str, torch.Tensor] = {}
        """The current layer's key rows by kind, [global_len, ...] in position order (host)."""
        self.bias = None
        """GDN: the output projection's bias (None, or the parameter Megatron adds after)."""
        self._buffers: dict[str, torch.Tensor] = {}
        self._windows: dict[str, torch.Tensor] = {}

    def buffer(self, name: str, shape: tuple[int, ...] | None = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """A host buffer by name (without a shape: the one made last), reused by every layer that
        asks for the same shape and dtype (named host storage for the live-bytes meter)."""
        buf = self._buffers.get(name)
        if shape is None:
            return buf
        if buf is None or tuple(buf.shape) != tuple(shape) or buf.dtype != dtype:
            self._buffers.pop(name, None)
            buf = note_host(torch.empty(shape, dtype=dtype, device=self.storage_device,
                                        pin_memory=self.pin_memory))
            self._buffers[name] = buf
        return buf

    @torch.no_grad()
    def gather_keys(self, pages, layer_idx: int, kinds, device) -> None:
        """Collective: every rank's rows of `kinds` of layer `layer_idx` (as its pages read them:
        fp8 pages dequantised) into `keys`, in global position order. Each rank's rows are
        broadcast by their owner in windows of `rows_per_copy` (one window on the device)."""
        layout, total = self.layout, self.global_len
        self.keys = {}
        for kind in kinds:
            empty = pages.window(layer_idx, kind, 0, 0, device)      # row shape and dtype
            row_shape = tuple(empty.shape[1:])
            out = self.buffer(f"keys:{kind}", (total,) + row_shape, empty.dtype)
            window = self._windows.get(kind)           # the one on the device, kept (gloo:
            if window is None or window.shape[1:] != empty.shape[1:]:   # module docstring)
                window = self._windows[kind] = empty.new_empty((self.rows_per_copy,) + row_shape)
            for src in range(layout.size):
                row = 0                                # the owner's local row of `a`
                for a, b in CPLayout(None, layout.size, src).shard_ranges(total):
                    for start in range(a, b, self.rows_per_copy):
                        end = min(start + self.rows_per_copy, b)
                        rows = window[:end - start]
                        if layout.rank == src:
                            rows.copy_(pages.window(layer_idx, kind, row + start - a,
                                                    row + end - a, device))
                        dist.broadcast(rows, src=dist.get_global_rank(layout.group, src),
                                       group=layout.group)
                        out[start:end].copy_(rows)
                    row += b - a
            self.keys[kind] = out

    def window(self, kind: str, start: int, end: int, device=None, dtype=None) -> torch.Tensor:
        """Rows at global positions [start, end) of the gathered `kind`, on `device`."""
        rows = self.keys[kind][start:end].to(device or self.storage_device,
                                             non_blocking=self.pin_memory)
        return rows if dtype is None else rows.to(dtype)

    def gather(self, kind: str, index: torch.Tensor, device=None, dtype=None) -> torch.Tensor:
        """Rows at global positions `index` (1-D) of the gathered `kind`, on `device`."""
        rows = self.keys[kind][index.to(self.storage_device)].to(device or self.storage_device,
                                                                 non_blocking=self.pin_memory)
        return rows if dtype is None else rows.to(dtype)


def capture_blocks(layout: CPLayout, global_len: int, token_block: int) -> list[tuple[int, int]]:
    """This rank's token blocks of capture, as local row ranges. One process: `token_block` rows
    each. Under CP every rank runs the same number (each MoE call is a collective): as many as
    the longest shard needs, near-equal (the chunks of `torch.tensor_split`)."""
    rows = layout.shard_len(global_len)
    if layout.size == 1:
        return [(s, min(s + token_block, rows)) for s in range(0, rows, token_block)]
    longest = max(layout.shard_len(global_len, r) for r in range(layout.size))
    count = -(-longest // token_block)
    size, extra = divmod(rows, count)
    bounds = [0]
    for i in range(count):
        bounds.append(bounds[-1] + size + (i < extra))
    return list(zip(bounds[:-1], bounds[1:]))


def gather_prompt_keys(rows: torch.Tensor, state: AttentionPass) -> tuple[torch.Tensor, torch.Tensor]:
    """Capture: this rank's key rows [n_local, ...] -> (every rank's rows in position order
    [global_len, ...], their positions [global_len])."""
    total = state.cp.global_len
    gathered = collectives.gather_sequence(rows, state.positions, total, state.cp.layout)
    return gathered, torch.arange(total, device=rows.device)


def gather_prompt_keys_differentiable(rows: torch.Tensor, state: AttentionPass) -> torch.Tensor:
    """Prompt backward: `gather_prompt_keys`' rows under autograd (each key's cotangent, summed
    over the ranks whose queries read it, returns to its owner). -> [global_len, ...]"""
    return collectives.gather_sequence_differentiable(rows, state.positions, state.cp.global_len,
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
        src_k = collectives.broadcast_rows(keys, src, rows, cp.layout)
        src_v = collectives.broadcast_rows(values, src, rows, cp.layout)
        # Padding rows get a position after every query: never visible.
        src_pos = collectives.broadcast_rows(state.positions, src, rows, cp.layout, fill=cp.global_len)
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
    return torch.full_like(positions, int(positions[-1]) + 1)


def attend_branch(state: AttentionPass, rows: Sequence[torch.Tensor],
                  attend: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Branch pass under CP: `rows` are this rank's branch rows of the tensors the attention needs
    (queries first, then e.g. the branch's own keys); `attend(*gathered)` gets each of them for the
    whole padded branch and returns the partial (out [R_pad, h, d], lse [R_pad, h]) of all branch
    queries over this rank's keys. -> this rank's rows of the merged output [c, h, d]."""
    gathered = [collectives.gather_rows(t, state.cp.layout) for t in rows]
    out, lse = attend(*gathered)
    return collectives.merge_partials_by_lse(out, lse, state.cp.layout)


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


def local_key_index(selection: torch.Tensor, held_positions: torch.Tensor, first: int,
                    branch_here: bool) -> torch.Tensor:
    """Global key positions [s, k] (-1 = none) -> indices into this rank's keys: the rows it holds
    before the current tokens (`held_positions`, ascending: its prompt shard, then its rows of a
    blockwise branch's earlier blocks), then the current tokens' rows (positions first, first +
    1, ...) when `branch_here`; -1 for a key held elsewhere. O(s x k): no table over the prompt."""
    chosen = selection.clamp(min=0)
    num_held = held_positions.numel()
    local = torch.full_like(selection, -1)
    if num_held:
        slot = torch.searchsorted(held_positions, chosen).clamp(max=num_held - 1)
        here = (selection >= 0) & (chosen < first) & (held_positions[slot] == chosen)
        local = torch.where(here, slot, local)
    if branch_here:
        local = torch.where(selection >= first, num_held + selection - first, local)
    return local
