"""`CPLayout`: a rank's place in the context-parallel group and Megatron's load-balanced 2 x CP
chunk order of a sequence (docs/design.md section 3)."""

from __future__ import annotations


import torch
import torch.distributed as dist


class CPLayout:
    """Where tokens live across the context-parallel group.

    Prompt: Megatron's load-balanced order, the sequence cut into 2 * CP chunks and rank r holding
    chunks r and 2 * CP - 1 - r (chunk sizes differ by at most one when the length does not divide).
    Response branches: contiguous rows, padded at the end to CP * ceil(R / CP) so every rank owns
    the same number of rows (padding tokens come last: causal masking hides them from real tokens,
    and the loss ignores them).
    """

    def __init__(self, group=None, size: int = 1, rank: int = 0):
        self.group, self.size, self.rank = group, size, rank

    @classmethod
    def current(cls) -> "CPLayout":
        from megatron.core import parallel_state as ps

        if not (dist.is_initialized() and ps.model_parallel_is_initialized()):
            return cls()
        size = ps.get_context_parallel_world_size()
        return cls(ps.get_context_parallel_group() if size > 1 else None, size,
                   ps.get_context_parallel_rank())

    def prompt_positions(self, length: int, device=None) -> torch.Tensor:
        """Global positions [n_local] of this rank's prompt shard, ascending."""
        ranges = self.shard_ranges(length)
        out = torch.empty(sum(b - a for a, b in ranges), dtype=torch.long, device=device)
        row = 0
        for a, b in ranges:   # written in place: the table is the only prompt-sized allocation
            torch.arange(a, b, out=out[row:row + b - a])
            row += b - a
        return out

    def shard_ranges(self, length: int) -> list[tuple[int, int]]:
        """This rank's prompt shard as global position ranges [start, end), ascending (one range
        on one process, two under CP): `prompt_positions` without a tensor."""
        if self.size == 1:
            return [(0, length)]
        bounds = torch.linspace(0, length, 2 * self.size + 1).round().long().tolist()
        chunks = (self.rank, 2 * self.size - 1 - self.rank)
        return [(bounds[c], bounds[c + 1]) for c in chunks]

    def shard_len(self, length: int, rank: int | None = None) -> int:
        """Rows of rank `rank`'s prompt shard (default: this rank's)."""
        layout = self if rank is None else CPLayout(None, self.size, rank)
        return sum(b - a for a, b in layout.shard_ranges(length))

    def shard_rows_within(self, length: int, start: int, end: int,
                          rank: int | None = None) -> tuple[int, int]:
        """Local rows [lo, hi) of rank `rank`'s shard (default: this rank's) whose global
        positions lie in [start, end) (one range: the shard's positions ascend)."""
        layout = self if rank is None else CPLayout(None, self.size, rank)
        ranges = layout.shard_ranges(length)
        below = lambda x: sum(min(max(x - a, 0), b - a) for a, b in ranges)
        return below(start), below(end)

    def branch_rows(self, length: int) -> tuple[int, int, int]:
        """(start, end, padded_length) of this rank's rows of a response branch."""
        per_rank = -(-length // self.size)
        return self.rank * per_rank, (self.rank + 1) * per_rank, per_rank * self.size

    def branch_blocks(self, length: int, block: int) -> list[tuple[int, int]]:
        """(first row, padded end) of each block of a branch of `length` rows: `block` rows each
        (rounded up to a multiple of the CP size: every rank holds a share of every block), the
        last one padded to a multiple of the CP size. One block (the whole padded branch, as
        `branch_rows` pads it) when the branch fits in one. Rank r holds the r-th of CP equal
        contiguous shares of each block (step/replay.py)."""
        block = -(-block // self.size) * self.size
        return [(start, start + -(-min(block, length - start) // self.size) * self.size)
                for start in range(0, length, block)]

    def own_branch_rows(self, length: int, block: int) -> torch.Tensor:
        """This rank's rows of a blockwise branch (`branch_blocks`), in order: its share of each
        block. -> [R_pad / CP] int64"""
        shares = []
        for start, end in self.branch_blocks(length, block):
            per_rank = (end - start) // self.size
            first = start + self.rank * per_rank
            shares.append(torch.arange(first, first + per_rank))
        return torch.cat(shares)
