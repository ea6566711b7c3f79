"""Attention over keys held in parts: the captured prompt pages and the branch's own rows.

Replay's keys are the prompt's pages ([P, ...], constant in the detached mode) and the branch's own
rows ([R, ...], differentiable). Concatenating them and attending once would make the backward form
a gradient of the whole concatenation (the `latents[indices]` gather, a blockwise kernel's `grad_k`
/ `grad_v`) of which only the last R rows are used: a [P + R, d] buffer per layer and query block.
Instead each part is attended on its own, and the partial results merge by log-sum-exp
(`kernels/refs.merge_partial_attention`, differentiable), which is exact: softmax over a union of
disjoint key sets. A constant part then gets no gradient buffer at all, and a differentiable one a
buffer of its own size (docs/design.md section 7).

With the exact prompt gradient the prompt's rows need cotangents too, and they go to the pages'
buffers (`PageStore.keep_grads`) without a buffer of the prompt's size on the way: a `PageRows`
part (sparse attention) sends each query block's row cotangents to the buffer from the reference's
backward (`refs.sparse_mla_attention_to_sink`; a GPU backend gets only the rows its selection
reads, as one gathered differentiable tensor), and a `PageKeys` part
(dense attention) is attended by `refs.streamed_attention`, whose backward adds each key window's
cotangents to the buffers as it goes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megatron_longstraw.kernels import refs, select


@dataclass
class PageRows:
    """A sparse attention part of captured latent rows `rows` [t, d_qk] (this layer's page
    window). With `store` (the exact prompt gradient) the rows a query block selects are handed
    to autograd as one gathered tensor whose cotangent goes to the page's buffer at those rows
    (`PageStore.differentiable`); without, the rows are a constant."""

    rows: torch.Tensor
    store: object = None
    layer: int = -1
    kind: str = ""

    def selected(self, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows the kernel reads, `local` [s, k] indices into them)."""
        if self.store is None:
            return self.rows, local
        used, remapped = compact_selection(local)
        if used is None:                                              # nothing selected here
            return self.rows[:1], local
        return self.store.differentiable(self.rows[used], self.layer, self.kind, rows=used), remapped

    def add_grads(self, row_idx: torch.Tensor, grad_rows: torch.Tensor) -> None:
        """Cotangents of rows `row_idx` [n] (repeats add up) into the page's buffer."""
        self.store.add_grad(self.layer, self.kind, grad_rows, rows=row_idx)

    def grad_sink(self):
        """`add_grads` as a function that holds the store, layer and kind only, not `rows`: the
        reference's autograd node keeps its sink until backward, and under whole-layer
        checkpointing a sink holding the part would keep every layer's page window (its device
        copy) alive through the forward (O(layers x rows), not one layer's)."""
        store, layer, kind = self.store, self.layer, self.kind
        return lambda row_idx, grad_rows: store.add_grad(layer, kind, grad_rows, rows=row_idx)

    def streams_grads(self, query: torch.Tensor) -> bool:
        """Whether this part's cotangents go straight to the page's buffer from the reference's
        backward (`refs.sparse_mla_attention_to_sink`): the exact prompt gradient, a recorded call
        on the reference `sparse_mla_grad` backend. There the selected rows are neither gathered
        into a tensor of their own nor kept for backward (the backward gathers each query
        block's rows again); other backends take `selected`'s compact rows."""
        return (self.store is not None and torch.is_grad_enabled() and query.requires_grad
                and select.kernels().choices.get("sparse_mla_grad", "ref") == "ref")


def compact_selection(selection: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """A selection [s, k] of row indices (-1 = none) -> (the distinct rows it reads, sorted, or
    None when it reads none; the selection as indices into them, -1 kept)."""
    valid = selection >= 0
    used, inverse = selection[valid].unique(return_inverse=True)
    if used.numel() == 0:
        return None, selection
    local = torch.full_like(selection, -1)
    local[valid] = inverse
    return used, local


@dataclass
class PageKeys:
    """A dense attention part of captured key rows: keys [t, g, d], values [t, g, d_v], key
    positions [t] (this layer's page window). With `key_grads(start, end, grad_k, grad_v)` (the
    exact prompt gradient) it is attended by `refs.streamed_attention` (the source protocol), and
    each key window's cotangents go to `key_grads`; without, it is a constant part like a tuple."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    key_grads: Callable | None = None

    @property
    def groups(self) -> int:
        return self.keys.shape[1]

    @property
    def value_dim(self) -> int:
        return self.values.shape[-1]

    def __call__(self, start: int, end: int):
        return self.keys[start:end], self.values[start:end], self.positions[start:end]

    def blocks(self, q_pos: torch.Tensor, key_block: int):
        return refs._visible_key_blocks(q_pos, self.positions, key_block)


@dataclass
class PageWindows:
    """A dense attention part read from a layer's pages one key window at a time (streamed
    capture, decode): key rows [0, num_keys), `read(start, end)` -> (keys [t, g, d], values [t,
    g, d_v]) on the compute device. Row i is at position i (one process), or where `rows` says:
    an object with `positions(index)` (rows -> global positions, ascending) and `visible(last)`
    (how many rows are at positions <= last), e.g. `decode.DecodeKeys` (a CP shard, then a
    member's rows). Attended by `refs.streamed_attention` (no gradient): one window of keys on
    the device at a time, and the same windows, so the same result, as over the rows held in
    one tensor."""

    read: Callable
    num_keys: int
    groups: int
    value_dim: int
    key_grads: Callable | None = None
    rows: object | None = None

    def __call__(self, start: int, end: int):
        keys, values = self.read(start, end)
        index = torch.arange(start, end, device=keys.device)
        return keys, values, index if self.rows is None else self.rows.positions(index)

    def blocks(self, q_pos: torch.Tensor, key_block: int):
        last = int(q_pos.max())
        seen = last + 1 if self.rows is None else self.rows.visible(last)
        for start in range(0, min(self.num_keys, seen), key_block):
            yield start, min(start + key_block, self.num_keys)


def prompt_key_positions(prefix_len: int, device) -> torch.Tensor:
    """Key positions of the captured prompt's rows for a branch pass's causal mask: every prompt
    key precedes every branch query, so one position (0) stands for all of them, expanded to
    [prefix_len] without memory (the rows carry their RoPE already; the mask is all a position
    does here). Not a table of P positions per layer."""
    return torch.zeros(1, dtype=torch.long, device=device).expand(prefix_len)


class _MergeByLSE(torch.autograd.Function):
    """`refs.merge_partial_attention` with a backward of its own, so that what it saves is stated:
    the partial outputs and log-sum-exps, the merged output and log-sum-exp (planner: the
    families' replay lines). With w_i = exp(lse_i - lse), out = sum_i w_i out_i:
    d out_i = w_i g,  d lse_i = w_i (g . (out_i - out) + g_lse)."""

    @staticmethod
    def forward(ctx, num_parts: int, *tensors):
        outs, lses = tensors[:num_parts], tensors[num_parts:]
        out, lse = refs.merge_partial_attention(list(outs), list(lses))
        out = out.to(outs[0].dtype)
        ctx.num_parts = num_parts
        ctx.save_for_backward(out, lse, *outs, *lses)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        out, lse, *parts = ctx.saved_tensors
        outs, lses = parts[:ctx.num_parts], parts[ctx.num_parts:]
        acc = lse.dtype
        grad = torch.zeros(out.shape, dtype=acc, device=out.device) if grad_out is None \
            else grad_out.to(acc)
        extra = 0.0 if grad_lse is None else grad_lse.to(acc).nan_to_num(0.0)
        grads_out, grads_lse = [], []
        for part_out, part_lse in zip(outs, lses):
            weight = refs.lse_merge_weights(part_lse.to(acc), lse)
            grads_out.append((weight[..., None] * grad).to(part_out.dtype))
            moved = (grad * (part_out.to(acc) - out.to(acc))).sum(-1)
            grads_lse.append((weight * (moved + extra)).to(part_lse.dtype))
        return (None, *grads_out, *grads_lse)


def merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One partial as it is; several merged by log-sum-exp. -> (out, lse)"""
    if len(outs) == 1:
        return outs[0], lses[0]
    return _MergeByLSE.apply(len(outs), *outs, *lses)


def sparse_mla(query: torch.Tensor, parts: Sequence[torch.Tensor], indices: torch.Tensor,
               scale: float, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel selector's `sparse_mla_attention` over latent rows held in `parts` ([n_i, d_qk]
    each, or a `PageRows`); `indices` [s, k] index their concatenation (-1 = skip).
    -> (out [s, h, v_dim], lse)"""
    outs, lses, first = [], [], 0
    for part in parts:
        held = part.rows if isinstance(part, PageRows) else part
        local = indices - first
        local = torch.where((indices >= first) & (local < held.shape[0]), local, -1)
        first += held.shape[0]
        if isinstance(part, PageRows) and part.streams_grads(query):
            out, lse = refs.sparse_mla_attention_to_sink(query, held, local, scale, v_dim,
                                                         part.grad_sink())
            outs.append(out)
            lses.append(lse)
            continue
        rows, local = part.selected(local) if isinstance(part, PageRows) else (part, local)
        if rows.shape[0] < local.shape[1]:
            # A part of fewer rows than the selection is wide (the branch's own rows): at most
            # that many selected keys are in it, so keep those columns (attention over a set:
            # the order of the indices does not matter; -1 sorts last).
            local = local.sort(dim=1, descending=True).values[:, :rows.shape[0]]
        out, lse = select.kernels().sparse_mla_attention(query, rows, local, scale, v_dim)
        outs.append(out)
        lses.append(lse)
    return merge(outs, lses)


def blockwise(q: torch.Tensor, parts: Sequence, q_pos: torch.Tensor, scale: float,
              key_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel selector's `blockwise_attention` of queries [s, heads, d] over key parts
    (keys [t_i, groups, d], values [t_i, groups, d_v], key positions [t_i]; or a `PageKeys`, or
    a `PageWindows`),
    causal by position. -> (out [s, heads, d_v], lse [s, heads])"""
    outs, lses = [], []
    for part in parts:
        if isinstance(part, PageWindows) or (isinstance(part, PageKeys)
                                             and part.key_grads is not None):
            out, lse = refs.streamed_attention(q, part, q_pos, scale, key_block)
        else:
            keys, values, key_pos = ((part.keys, part.values, part.positions)
                                     if isinstance(part, PageKeys) else part)
            out, lse = select.kernels().blockwise_attention(q, keys, values, q_pos, key_pos,
                                                            scale, key_block)
        outs.append(out)
        lses.append(lse)
    return merge(outs, lses)
