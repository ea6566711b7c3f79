"""The collectives of the schedule (docs/design.md section 3): row gathers (differentiable where
replay needs them), the global top-k merge, the LSE merge of partial attention with its
reduce-scatter back to the owners, and the rows <-> heads exchange of head-parallel mixers."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_longstraw.distributed.cp_layout import CPLayout
from megatron_longstraw.kernels.refs import lse_merge_weights


class _GatherRows(torch.autograd.Function):
    """all_gather of equal-size row blocks along dim 0; backward sums the gradient over ranks and
    returns this rank's block (reduce-scatter; all-reduce + slice where the backend has none)."""

    @staticmethod
    def forward(ctx, x, group, size, rank):
        ctx.group, ctx.size, ctx.rank, ctx.rows = group, size, rank, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "nccl":
            out = torch.empty((ctx.rows,) + grad.shape[1:], dtype=grad.dtype, device=grad.device)
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
            return out, None, None, None
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows].clone(), None, None, None


def gather_rows(x: torch.Tensor, layout: CPLayout) -> torch.Tensor:
    """[n, ...] per rank -> [size * n, ...] in rank order, differentiable."""
    if layout.size == 1:
        return x
    return _GatherRows.apply(x, layout.group, layout.size, layout.rank)


@torch.no_grad()
def gather_sequence(rows: torch.Tensor, positions: torch.Tensor, total: int,
                    layout: CPLayout) -> torch.Tensor:
    """Assemble a sequence sharded by `positions` (no autograd): [n_local, ...] -> [total, ...] in
    global position order, on every rank."""
    if layout.size == 1:
        return rows
    counts = [torch.zeros(1, dtype=torch.long, device=rows.device) for _ in range(layout.size)]
    dist.all_gather(counts, torch.tensor([rows.shape[0]], device=rows.device), group=layout.group)
    longest = int(max(c.item() for c in counts))
    padded = rows.new_zeros((longest,) + rows.shape[1:])
    padded[:rows.shape[0]] = rows
    pos = positions.new_full((longest,), -1)
    pos[:positions.shape[0]] = positions
    all_rows = [torch.empty_like(padded) for _ in range(layout.size)]
    all_pos = [torch.empty_like(pos) for _ in range(layout.size)]
    dist.all_gather(all_rows, padded, group=layout.group)
    dist.all_gather(all_pos, pos, group=layout.group)
    out = rows.new_empty((total,) + rows.shape[1:])
    for r, p in zip(all_rows, all_pos):
        valid = p >= 0
        out[p[valid]] = r[valid]
    return out


class _GatherSequence(torch.autograd.Function):
    """`gather_sequence` with a backward: the gradient of the whole sequence is summed over the
    ranks (each rank's attention read every row) and each rank keeps its own positions' rows."""

    @staticmethod
    def forward(ctx, rows, positions, total, layout):
        ctx.positions, ctx.layout = positions, layout
        return gather_sequence(rows.detach(), positions, total, layout)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.layout.group)
        return grad[ctx.positions], None, None, None


def gather_sequence_differentiable(rows: torch.Tensor, positions: torch.Tensor, total: int,
                                   layout: CPLayout) -> torch.Tensor:
    """`gather_sequence` under autograd: the cotangents of every rank's reads of the gathered
    rows reach the rows' owner (all-reduce, then each rank's own rows)."""
    if layout.size == 1:
        return rows
    return _GatherSequence.apply(rows, positions, total, layout)


@torch.no_grad()
def merge_topk_candidates(scores: torch.Tensor, positions: torch.Tensor, k: int,
                          layout: CPLayout) -> torch.Tensor:
    """Global top-k from per-rank candidates. scores/positions: [s, c] (global key positions, -1 =
    none) -> [s, k] global positions, ascending, -1 where fewer than k keys exist.

    Each rank's candidates are its shard's top-k, so their union contains the global top-k; the
    merge keeps the same order a single process uses (score, then lower position first).
    """
    from megatron_longstraw.kernels.refs import _top_k_stable

    if layout.size > 1:
        parts_s = [torch.empty_like(scores) for _ in range(layout.size)]
        parts_p = [torch.empty_like(positions) for _ in range(layout.size)]
        dist.all_gather(parts_s, scores.contiguous(), group=layout.group)
        dist.all_gather(parts_p, positions.contiguous(), group=layout.group)
        scores, positions = torch.cat(parts_s, 1), torch.cat(parts_p, 1)
    scores = scores.masked_fill(positions < 0, float("-inf"))
    order_key = torch.where(positions < 0, torch.iinfo(torch.long).max, positions)
    order = order_key.sort(dim=1).indices                     # ascending global position
    scores, positions = scores.gather(1, order), positions.gather(1, order)
    if scores.shape[1] > k:
        scores, positions = _top_k_stable(scores, positions, k)
    return positions.masked_fill(torch.isneginf(scores), -1)


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """In-place SUM all-reduce over `group` (no-op without one)."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


class _ReduceScatterRows(torch.autograd.Function):
    """Sum over ranks of [size * n, ...], this rank's block [n, ...] (reduce-scatter; all-reduce +
    slice where the backend has none); backward all-gathers the gradient (the transpose of
    `_GatherRows`)."""

    @staticmethod
    def forward(ctx, x, group, size, rank):
        ctx.group, ctx.size = group, size
        rows = x.shape[0] // size
        x = x.contiguous()
        if dist.get_backend(group) == "nccl":
            out = torch.empty((rows,) + x.shape[1:], dtype=x.dtype, device=x.device)
            dist.reduce_scatter_tensor(out, x, group=group)
            return out
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x[rank * rows:(rank + 1) * rows].clone()

    @staticmethod
    def backward(ctx, grad):
        parts = [torch.empty_like(grad) for _ in range(ctx.size)]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts), None, None, None


def merge_partials_by_lse(out: torch.Tensor, lse: torch.Tensor, layout: CPLayout) -> torch.Tensor:
    """Merge every rank's partial attention of the same queries over disjoint keys, and keep this
    rank's rows: out [s, h, d], lse [s, h] on each rank (s = size * c) -> this rank's merged rows
    [c, h, d] (c = s / size), differentiable in out and lse.

    With m the row maximum of lse over ranks (a constant: the result does not depend on it),
    merged = sum_r exp(lse_r - m) out_r / sum_r exp(lse_r - m); numerator and denominator are
    reduce-scattered together, so a rank holds its own partial plus 1 / size of the sums, never
    every rank's partials. The weights are `kernels.refs.lse_merge_weights`, the one merge rule
    (`merge_partial_attention` is its single-process form)."""
    if layout.size == 1:
        return out
    with torch.no_grad():
        shift = lse.detach().clone()
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=layout.group)
        shift = shift.nan_to_num(neginf=0.0)                  # rows no rank sees anything of
    acc = torch.promote_types(out.dtype, torch.float32)      # sums in float32 or wider
    weight = lse_merge_weights(lse.to(acc), shift.to(acc))[..., None]  # [s, h, 1], 0 where -inf
    packed = torch.cat([weight * out.to(acc), weight], -1)    # [s, h, d + 1]
    mine = _ReduceScatterRows.apply(packed, layout.group, layout.size, layout.rank)
    numerator, denominator = mine[..., :-1], mine[..., -1:]
    merged = torch.where(denominator > 0, numerator / denominator.clamp_min(1e-300), 0.0)
    return merged.to(out.dtype)


class HeadParallel:
    """Rows sharded by position across the CP group <-> the whole sequence in position order with the
    last dim cut into CP column blocks (this rank's heads): Megatron-Core's context-parallel to
    head-parallel all-to-all (`all_to_all_sp2hp` / `all_to_all_hp2sp`, as its Gated DeltaNet uses
    under CP), for shards of unequal length. Both directions are differentiable (the backward of an
    all-to-all is the reverse all-to-all).

    shard_positions: each rank's positions (rank order), together a permutation of 0 .. total - 1.
    """

    def __init__(self, layout: CPLayout, shard_positions: list[torch.Tensor]):
        self.layout = layout
        self.rows = max(int(p.numel()) for p in shard_positions)       # every shard padded to this
        self.local_rows = int(shard_positions[layout.rank].numel())
        total = sum(int(p.numel()) for p in shard_positions)
        device = shard_positions[0].device
        self.index = torch.empty(total, dtype=torch.long, device=device)  # position -> exchanged row
        for rank, positions in enumerate(shard_positions):
            self.index[positions] = rank * self.rows + torch.arange(positions.numel(), device=device)

    @classmethod
    def for_prompt(cls, layout: CPLayout, length: int, device=None) -> "HeadParallel":
        """The load-balanced prompt shards of `CPLayout.prompt_positions`: the one global block
        [0, length) of `for_prompt_block`."""
        return cls.for_prompt_block(layout, length, 0, length, device)

    @classmethod
    def for_prompt_block(cls, layout: CPLayout, length: int, start: int, end: int,
                         device=None) -> "HeadParallel":
        """The rows of the load-balanced prompt shards at positions [start, end) (positions
        relative to `start`; a rank may hold none): one global token block of streamed capture."""
        shards = []
        for rank in range(layout.size):
            ranges = CPLayout(None, layout.size, rank).shard_ranges(length)
            spans = [(max(a, start), min(b, end)) for a, b in ranges]
            shards.append(torch.cat([torch.arange(lo - start, max(lo, hi) - start, device=device)
                                     for lo, hi in spans]))
        return cls(layout, shards)

    @classmethod
    def for_branch(cls, layout: CPLayout, padded_length: int, device=None) -> "HeadParallel":
        """The contiguous, equal branch rows of `CPLayout.branch_rows` (positions relative)."""
        per_rank = padded_length // layout.size
        return cls(layout, [torch.arange(r * per_rank, (r + 1) * per_rank, device=device)
                            for r in range(layout.size)])

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[n_local, d] (this rank's rows) -> [total, d / size] (all rows, this rank's columns)."""
        from megatron.core.tensor_parallel.mappings import all_to_all_sp2hp

        if x.shape[-1] % self.layout.size:
            raise ValueError(f"{x.shape[-1]} columns do not split over CP {self.layout.size}.")
        padded = torch.cat([x, x.new_zeros((self.rows - x.shape[0],) + x.shape[1:])])
        return all_to_all_sp2hp(padded, group=self.layout.group)[self.index]

    def to_rows(self, y: torch.Tensor) -> torch.Tensor:
        """[total, d / size] -> [n_local, d]: the inverse of `to_heads`."""
        from megatron.core.tensor_parallel.mappings import all_to_all_hp2sp

        padded = y.new_zeros((self.layout.size * self.rows,) + y.shape[1:]).index_copy(
            0, self.index, y)
        return all_to_all_hp2sp(padded, group=self.layout.group)[:self.local_rows]


def broadcast_rows(x: torch.Tensor, src: int, rows: int, layout: CPLayout,
                   fill: float | int = 0) -> torch.Tensor:
    """CP rank `src`'s `x` [n, ...] (n <= rows), padded to `rows` with `fill`, on every rank of the
    group (no autograd). Every rank passes a tensor of the same trailing shape and dtype."""
    out = x.new_full((rows,) + x.shape[1:], fill)
    if layout.rank == src:
        out[:x.shape[0]] = x
    if layout.size > 1:
        dist.broadcast(out, src=dist.get_global_rank(layout.group, src), group=layout.group)
    return out


@torch.no_grad()
def gather_tensor(x: torch.Tensor, layout: CPLayout) -> torch.Tensor:
    """Non-differentiable all_gather of equal-size blocks along dim 0."""
    if layout.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(layout.size)]
    dist.all_gather(parts, x.contiguous(), group=layout.group)
    return torch.cat(parts)
