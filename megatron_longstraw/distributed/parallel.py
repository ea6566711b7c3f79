"""Process groups for LongStraw: TP = PP = 1, context parallel (CP) and expert parallel (EP) folded
on the same ranks (docs/design.md section 3), and the collectives the schedule needs."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from megatron_longstraw.runtime import platform
from megatron_longstraw.runtime.errors import ConfigError
from megatron_longstraw.kernels.refs import lse_merge_weights


def initialize(context_parallel_size: int = 1, expert_parallel_size: int = 1, seed: int = 1234,
               timeout_s: float = 600.0, init_method: str | None = None) -> None:
    """Start torch.distributed (env:// rendezvous as torchrun sets it up, `init_method` when given,
    or a one-process group when no launcher set one up) and Megatron's model-parallel state with CP
    and EP folded on the same ranks. `timeout_s` bounds every collective: a rank whose peer died
    fails within it instead of hanging."""
    from megatron.core import parallel_state as ps

    platform.apply()
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        if platform.has_cuda():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        kwargs = {}
        if init_method is not None:
            kwargs = dict(init_method=init_method, rank=int(os.environ["RANK"]),
                          world_size=int(os.environ["WORLD_SIZE"]))
        dist.init_process_group(platform.dist_backend(),
                                timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    world = dist.get_world_size()
    if world % context_parallel_size or world % expert_parallel_size:
        raise ConfigError(f"world size {world} must be divisible by the context-parallel size "
                          f"(--context-parallel-size {context_parallel_size}) and the "
                          f"expert-parallel size (--expert-model-parallel-size "
                          f"{expert_parallel_size}).")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_parallel_size,
    )
    platform.manual_seed(seed)


SUPPORTED_LAYOUT = (
    "LongStraw runs tensor- and pipeline-parallel size 1: it splits a long prompt with context "
    "parallelism (--context-parallel-size), shards experts with expert parallelism folded on the "
    "same ranks (--expert-model-parallel-size dividing the world size, at most the family's "
    "expert limit), and gives the remaining ranks to data parallelism (world size / CP replicas)")


def check_model_parallel_sizes(tensor_parallel_size: int | None = 1,
                               pipeline_parallel_size: int | None = 1,
                               expert_tensor_parallel_size: int | None = None) -> None:
    """Refuse, before any process group starts, the Megatron parallel sizes LongStraw does not
    run (`initialize` builds TP = PP = 1; extra ranks would silently become data-parallel)."""
    for flag, size in (("--tensor-model-parallel-size", tensor_parallel_size),
                       ("--pipeline-model-parallel-size", pipeline_parallel_size),
                       ("--expert-tensor-parallel-size", expert_tensor_parallel_size)):
        if size is not None and size > 1:
            raise ConfigError(f"{flag} {size} is not supported. {SUPPORTED_LAYOUT}. Set {flag} 1 "
                              "and give those ranks to --context-parallel-size.")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- layout -------------------------------------------------------------------------------------


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


# ---- collectives --------------------------------------------------------------------------------


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


# ---- expert-parallel naming ---------------------------------------------------------------------

_LOCAL_EXPERT = "mlp.experts.local_experts."


def _expert_offset() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1
    return ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()


def global_name(name: str, num_experts: int) -> str:
    """Name of a local parameter in the single-process (EP = 1) model: local expert j on EP rank e
    is global expert e * (num_experts / EP) + j (Megatron's contiguous expert placement)."""
    if _LOCAL_EXPERT not in name:
        return name
    ep_rank, ep_size = _expert_offset()
    head, tail = name.split(_LOCAL_EXPERT)
    local, rest = tail.split(".", 1)
    return f"{head}{_LOCAL_EXPERT}{ep_rank * (num_experts // ep_size) + int(local)}.{rest}"


def load_full_state_dict(model: torch.nn.Module, full: dict[str, torch.Tensor],
                         num_experts: int) -> None:
    """Load a single-process state dict into an expert-parallel model (this rank's experts)."""
    own = model.state_dict()
    missing = [n for n in own if global_name(n, num_experts) not in full
               and not n.endswith("_extra_state")]
    if missing:
        raise KeyError(f"state dict lacks {len(missing)} entries, e.g. {missing[:3]}")
    wrong = [(n, tuple(full[global_name(n, num_experts)].shape), tuple(t.shape))
             for n, t in own.items() if not n.endswith("_extra_state")
             and full[global_name(n, num_experts)].shape != t.shape]
    if wrong:  # checked before anything is written: copy_ would broadcast silently
        raise ValueError(f"state dict shapes differ from the model for {len(wrong)} entries, "
                         f"e.g. {wrong[:3]} (saved, model).")
    with torch.no_grad():
        for name, tensor in own.items():
            if name.endswith("_extra_state"):
                continue
            tensor.copy_(full[global_name(name, num_experts)])


def current_sizes() -> dict:
    """The parallel sizes of the initialised Megatron state, as TransformerConfig fields (layers
    read them from the config: e.g. expert parameters are marked for expert-DP reduction only when
    `expert_model_parallel_size` > 1)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return {}
    return {"context_parallel_size": ps.get_context_parallel_world_size(),
            "expert_model_parallel_size": ps.get_expert_model_parallel_world_size()}


# ---- Gradient collectives (finalize.py) ----------------------------------------------------------

def gradient_groups():
    """(DP x CP group, expert-DP group, expert-model-parallel group) of the initialised Megatron
    state, or (None, None, None) without a process group: the groups a gradient is summed over
    (non-expert, expert) and the one whose ranks hold distinct experts (for norms and counts)."""
    from megatron.core import parallel_state as ps

    if not (dist.is_initialized() and ps.model_parallel_is_initialized()):
        return None, None, None
    return (ps.get_data_parallel_group(with_context_parallel=True),
            ps.get_expert_data_parallel_group(),
            ps.get_expert_model_parallel_group())


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
