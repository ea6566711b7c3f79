"""The planner's vocabulary: the request (`PlanSpec`), what a family contributes (`Footprint` of
parameter groups, page kinds and per-phase items) and the helpers every family shares."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_longstraw.config.choices import PromptGrad

GiB = 1024 ** 3
MiB = 1024 ** 2

GPU_BYTES = {  # total device memory as nvidia-smi reports it (MiB), per GPU kind
    "H20": 97871 * MiB,
    "H100": 81559 * MiB,
    "H200": 143771 * MiB,
}

DTYPE_BYTES = {"fp64": 8.0, "fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0,
               # NF4 with double quantisation (adapters.nf4_nbytes): 4 bits, an 8-bit absmax per
               # 64 values, an fp32 scale per 256 absmax values
               "nf4": 0.5 + 1 / 64 + 4 / (64 * 256)}


@dataclass
class PlanSpec:
    """What the plan is for. Bytes per element are floats (fp8 rows carry a scale)."""

    family: str
    model: object
    """The family's architecture config (GLM52Config, Qwen36Arch)."""
    prompt_len: int
    group_size: int
    response_len: int
    """Longest response R (the replayed branch is R tokens: the prompt's last token + R - 1)."""
    cp: int = 1
    ep: int = 1
    weight_bytes: float = 2.0
    fp8_base: bool = False
    """`--longstraw-fp8-base` (`--weight-dtype fp8`): the groups' fp8_shapes in FP8 with an fp32
    scale per 128 x 128 block (fp8.nbytes), every other parameter in `act_bytes`;
    `weight_bytes` is then unused."""
    act_bytes: float = 2.0
    """Activations (the model's compute dtype)."""
    latent_bytes: float = 2.0
    """Per element of a latent / K/V page row."""
    index_key_bytes: float = 1 + 4 / 128
    """Per element of an index-key page row (fp8 + one fp32 scale per 128-value row)."""
    trainable: str = "all"
    """all | non_expert | attention | head | lora | none (see `trainable_count`)."""
    lora_rank: int = 64
    """adapters.LoRAConfig.rank; adapters are fp32 (adapters.py's default for 16-bit bases)."""
    lora_experts: bool = False
    """Adapters on the routed experts' linear_fc1/fc2 too (GLM-5.2's Family.lora_targets match them
    unless `exclude=("*.experts.*",)`); off: attention, dense MLP and shared-expert linears."""
    trainable_params: int | None = None
    """Override the trainable-parameter count (e.g. a published adapter size)."""
    shard_optimizer: bool = False
    """Megatron's distributed optimizer: fp32 master + Adam moments sharded over DP x CP."""
    kl: bool = False
    """A reference capture for the KL term doubles the pages."""
    page_tokens: int = 65536
    response_block: int = 8192
    """`ReplaySettings.response_block`: a branch longer than this is scored and replayed block by
    block (step/replay.py, `branch_blocks`); device lines of scoring and replay are one
    block's, the earlier blocks' rows live in host pages (`branch_blocks_rows`)."""
    reuse_branch_pages: bool = False
    """`ReplaySettings.reuse_branch_pages`: scoring keeps every member's branch pages for its
    replay (the host lines of the branch's pages and carried state, times G)."""
    token_block: int = 16384
    query_block: int = 256
    key_block: int = 16384
    gpu_bytes: int = GPU_BYTES["H20"]
    device_reserve: int = 4 * GiB
    """CUDA context, NCCL buffers, allocator slack (assumed)."""
    host_bytes: int = 1024 * GiB
    """Host memory per node."""
    ranks_per_node: int = 8
    host_reserve_per_rank: int = 4 * GiB
    """Python, torch, CUDA host state per process (assumed)."""
    prompt_grad: PromptGrad = PromptGrad.DETACHED
    """`PromptGrad.EXACT` (or "exact"): the exact prompt gradient (prompt_backward.py):
    `prompt_backward_items`."""
    moe_imbalance: float = 1.0
    """Tokens an EP rank receives / the balanced share (1: perfectly balanced routing)."""
    updates_per_capture: int = 1
    """`ReuseSettings.updates_per_capture` (K): each prompt has G x K members, scored before the
    capture's first update; their capture-time tables and DSA selections are held through the K
    updates (`Plan`'s host lines). The device bound is one block's, whatever K."""
    drift: bool = False
    """`--longstraw-drift-every` / `--longstraw-drift-first-last` with K > 1: a measurement
    captures the prompt afresh beside the kept capture (one more copy of the pages on the
    host while it runs)."""
    gdn_kernels: str = "fla"
    """Qwen3.6's delta rule in capture and replay's recompute: "fla" (the GPU's FLA kernels,
    analytic) or "torch" (Megatron-Core's torch chunked rule, what the CPU runs: the plan the CPU
    tests check)."""

    def __post_init__(self) -> None:
        for name in ("prompt_len", "group_size", "response_len", "cp", "ep", "page_tokens",
                     "response_block", "token_block", "query_block", "key_block", "ranks_per_node",
                     "updates_per_capture"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}.")
        if self.gdn_kernels not in ("fla", "torch"):
            raise ValueError(f"gdn_kernels must be 'fla' or 'torch', got {self.gdn_kernels!r}.")
        if self.trainable not in TRAINABLE:
            raise ValueError(f"trainable must be one of {sorted(TRAINABLE)}, got {self.trainable!r}.")
        if self.prompt_grad not in list(PromptGrad):
            raise ValueError(f"prompt_grad must be one of {[g.value for g in PromptGrad]}, got "
                             f"{self.prompt_grad!r}.")
        self.prompt_grad = PromptGrad(self.prompt_grad)


TRAINABLE = {"all", "non_expert", "attention", "head", "lora", "none"}


@dataclass
class ParamGroup:
    name: str
    count: int
    """Parameters in the whole model (all experts)."""
    expert: bool = False
    """Routed-expert weights: split over EP."""
    kind: str = "other"
    """attention | indexer | mlp | experts | embedding | head | other"""
    lora_shapes: list[tuple[int, int]] = field(default_factory=list)
    """(in, out) of each linear a LoRA adapter attaches to (the family's Family.lora_targets)."""
    fp8_shapes: list[tuple[int, int, int]] = field(default_factory=list)
    """(in, out, row parts) of each linear the family's block-FP8 checkpoints hold in FP8
    (Family.fp8_linears; row parts: fp8.row_parts, 2 for a gated linear_fc1)."""


@dataclass
class PageKind:
    name: str
    row_bytes: float
    """Bytes per token row (sequence kinds) or the whole state (fixed kinds)."""
    num_layers: int
    sequence: bool = True


@dataclass
class Item:
    name: str
    bytes: float
    measured: bool = False
    """True where tests/test_planner.py checks the formula against a measurement."""
    group: str = ""
    """Items of one non-empty group are never alive together: the largest one counts."""


def phase_bytes(items: list[Item]) -> float:
    """Bytes at a phase's peak: every ungrouped item plus the largest item of each group."""
    groups: dict[str, float] = {}
    for i in items:
        if i.group:
            groups[i.group] = max(groups.get(i.group, 0.0), i.bytes)
    return sum(i.bytes for i in items if not i.group) + sum(groups.values())


@dataclass
class Footprint:
    """What a family contributes for one prompt length."""

    params: list[ParamGroup]
    pages: list[PageKind]
    phases: dict[str, list[Item]]
    """Phase -> the transient items alive at that phase's peak (on top of the static state)."""
    replay_saved: dict[str, float]
    """SavedTensorMeter-convention bytes of replay (see glm52_replay_saved)."""
    notes: list[str] = field(default_factory=list)
    host: list[Item] = field(default_factory=list)
    """Host bytes per rank beside the pages (held from scoring to replay)."""


# ---- shared helpers -----------------------------------------------------------------------------


def prompt_backward_inputs_bytes(cfg, rows: int, act_bytes: float, prompt_len: int) -> float:
    """What capture keeps for the exact prompt gradient (capture.PromptBackwardInputs) on a rank
    with `rows` captured rows: every decoder layer's input [rows, hidden] in the activation dtype,
    the token ids (int64) and, for DSA, every full indexer layer's selection [rows, k] (int32,
    k = min(top-k, P - 1)). Checked against a capture on CPU (tests/test_planner.py)."""
    total = cfg.num_hidden_layers * rows * cfg.hidden_size * act_bytes + rows * 8
    if hasattr(cfg, "num_full_indexer_layers"):
        k = min(cfg.index_topk, max(prompt_len - 1, 0))
        total += cfg.num_full_indexer_layers() * rows * k * 4
    return total


def streamed_capture_host(cfg, n: int, b: float, selection_width: int = 0, total: int = 0,
                          gathered_values: int = 0, staged: bool = False) -> list[Item]:
    """Streamed capture's host buffers beside the pages (capture.py): the residual stream [P/CP,
    h] and, for DSA, the latest full indexer layer's selection [P/CP, k] int32 (what IndexShare
    reads); under CP (`context_parallel.StreamedCapture`, `total` > 0) also every rank's key rows
    of a layer, `gathered_values` per token in the activation dtype (one buffer per page kind,
    reused by every layer), and with `staged` GDN's exchange buffer [P/CP, h]. Freed when capture
    returns; their peak is capture's last layer, with the pages nearly whole, so they count with
    the pages. Checked on CPU (tests/test_planner.py, tests/test_capture_streamed_cp.py: the
    live-bytes meter's host peak of a capture is the pages plus these, exactly)."""
    items = [Item("capture residual stream [P/CP, h] (host; streamed capture)",
                  n * cfg.hidden_size * b, measured=True)]
    if selection_width:
        items.append(Item("capture selection [P/CP, topk] int32, latest full indexer layer (host)",
                          n * selection_width * 4, measured=True))
    if total and gathered_values:
        items.append(Item("capture gathered key rows of one layer [P, row] per kind (host; CP "
                          "exchange)", total * gathered_values * b, measured=True))
    if total and staged:
        items.append(Item("capture GDN exchange buffer [P/CP, h] (host; CP)",
                          n * cfg.hidden_size * b, measured=True))
    return items


def streamed_capture_device(cfg, n: int, tb: int, b: float, cp: int = 1,
                            window_values: int = 0) -> list[Item]:
    """What every streamed capture layer holds on the device besides its own scratch: the one
    prompt-sized table, the captured rows' positions [P/CP] int64 (checked on CPU: the device
    peak grows by exactly this from P to 4P, CP 1 and 2), one token block's input, normed input
    and output, and under CP the exchange's key windows [token_block, row] (one per page kind,
    `window_values` in all, kept from layer to layer)."""
    items = [Item("capture positions [P/CP] int64 (the only prompt-sized device tensor)", 8 * n,
                  measured=True),
             Item("capture token block [token_block, h] x3 (input, normed input, output)",
                  3 * tb * cfg.hidden_size * b)]
    if cp > 1 and window_values:
        items.append(Item("capture exchange windows [token_block, row] per key kind (CP)",
                          tb * window_values * b))
    return items


def local_prompt_rows(prompt_len: int, cp: int) -> int:
    """Captured rows on the busiest rank: the prefix `prompt[:-1]` in Megatron's load-balanced
    2*CP-chunk order (cp_layout.CPLayout.prompt_positions)."""
    captured = max(prompt_len - 1, 0)
    if cp == 1:
        return captured
    bounds = [round(captured * i / (2 * cp)) for i in range(2 * cp + 1)]
    return max(bounds[r + 1] - bounds[r] + bounds[2 * cp - r] - bounds[2 * cp - r - 1]
               for r in range(cp))


def page_bytes(pages: list[PageKind], rows: int, page_tokens: int) -> tuple[float, float]:
    """(logical, allocated) bytes of one rank's pages (pages.PageStore.nbytes)."""
    logical = allocated = 0.0
    for kind in pages:
        if kind.sequence:
            logical += kind.num_layers * rows * kind.row_bytes
            allocated += kind.num_layers * math.ceil(rows / page_tokens) * page_tokens * kind.row_bytes
        else:
            logical += kind.num_layers * kind.row_bytes
            allocated += kind.num_layers * kind.row_bytes
    return logical, allocated


def lse_merge_saved(queries: int, rows: int, heads: int, width: int, acc: float) -> float:
    """collectives.merge_partials_by_lse under autograd on one rank: its partial [queries, heads,
    width] over its keys is weighted by exp(lse - max) and [weight * out; weight] is
    reduce-scattered, leaving its own `rows` merged rows. Saved: the weight (and its [..., None]
    view, by the product), the partial in `acc`; numerator / clamp_min(denominator) (both, and
    clamp's input); torch.where's condition (bool)."""
    return (2 * queries * heads * acc + queries * heads * width * acc
            + rows * heads * (width + 2) * acc + rows * heads)


def rank_rows(prompt_len: int, cp: int, response_len: int) -> tuple[int, int, int, int]:
    """(n: captured prompt rows on the busiest rank, total: captured prompt rows P - 1 of all
    ranks, rows: this rank's branch rows ceil(R / CP), r_pad: the padded branch rows * CP)."""
    rows = -(-response_len // cp)
    return local_prompt_rows(prompt_len, cp), max(prompt_len - 1, 0), rows, rows * cp


@dataclass(frozen=True)
class BranchBlocks:
    """A member's branch as step/replay.py walks it (`branch_blocks`: blocks of
    `response_block` rows rounded up to a multiple of CP, each split into CP equal contiguous
    shares), seen from one rank."""

    num_blocks: int
    block: int
    """Padded rows of the largest block, all ranks (the rows attention gathers under CP)."""
    rows: int
    """This rank's rows of that block (block / CP): what token-wise work holds."""
    earlier: int
    """This rank's rows of the earlier blocks when the last block runs (what the earlier blocks'
    host pages hold at most; 0 for a branch of one block)."""


def branch_blocks_rows(response_len: int, response_block: int, cp: int) -> BranchBlocks:
    """`BranchBlocks` of a branch of `response_len` rows (replay.branch_blocks: one block, the
    whole branch padded to a multiple of CP, when it fits in one)."""
    block = -(-response_block // cp) * cp
    r_pad = -(-response_len // cp) * cp
    num = -(-response_len // block)
    if num <= 1:
        return BranchBlocks(1, r_pad, r_pad // cp, 0)
    return BranchBlocks(num, block, block // cp, (num - 1) * block // cp)


def branch_members(spec: PlanSpec) -> int:
    """Members whose branch pages are held at once: G with `reuse_branch_pages`, else 1."""
    return spec.group_size if spec.reuse_branch_pages else 1


def branch_host_pages(kinds: list[PageKind], blocks: BranchBlocks, page_tokens: int,
                      grad_bytes, members: int = 1) -> list[Item]:
    """Host bytes of one member's blockwise branch on one rank (replay.py `_Blocks`): the earlier
    blocks' key rows of every layer (`kinds`: sequence kinds, one row each, in the model's dtype)
    in pages of `page_tokens` rows; the carried state (fixed kinds) put once per layer and kept at
    every later block's start; and, in replay's reverse walk, a cotangent buffer beside every
    kind but the index keys (`grad_bytes(kind)`: bytes per row of it, at least fp32). Freed
    after the member. `members`: G when scoring keeps every member's pages and carried state for
    replay (`reuse_branch_pages`). Nothing for a branch of one block."""
    if blocks.num_blocks == 1:
        return []
    pages = -(-blocks.earlier // page_tokens) * page_tokens
    seq = [k for k in kinds if k.sequence and k.num_layers]
    fixed = [k for k in kinds if not k.sequence and k.num_layers]
    kept = "" if members == 1 else f" x G = {members} (kept from scoring for replay)"
    items = [Item("branch pages: the earlier blocks' key rows of every layer [R/CP, row] (host, "
                  f"model dtype, whole pages){kept}",
                  members * sum(k.num_layers * pages * k.row_bytes for k in seq), measured=True)]
    if fixed:
        items.append(Item("branch carried state (GDN state + conv tail) per layer, put + kept at "
                          f"each later block's start (host){kept}",
                          members * sum(k.num_layers * k.row_bytes for k in fixed)
                          * blocks.num_blocks, measured=True))
    items.append(Item("branch cotangent buffers beside the kept rows and carried state (host, "
                      ">= fp32, every kind but index keys; replay)",
                      sum(k.num_layers * (blocks.earlier if k.sequence else 1) * grad_bytes(k)
                          for k in seq + fixed if k.name != "index_key"), measured=True))
    return items


def block_state_items(kinds: list[PageKind], blocks: BranchBlocks, grad_bytes) -> list[Item]:
    """Device bytes of a blockwise branch's current block on one rank (replay.py `_Blocks`): in
    scoring and replay's forward, every layer's emitted rows of the block [block/CP, row] and end
    state (the model's dtype), held until the block ends and `keep` moves them to the host pages;
    in the reverse walk, the cotangent seeds of the block's own rows and of its end state, every
    kind but the index keys, brought to the device for the block's one backward (`rewind`,
    `carried_grads`; `grad_bytes(kind)` per row). Nothing for a branch of one block."""
    if blocks.num_blocks == 1:
        return []
    rows = lambda kind: blocks.rows if kind.sequence else 1
    live = [k for k in kinds if k.num_layers]
    return [Item("the block's emitted rows and end state, every layer [block/CP, row] (until the "
                 "block joins the host pages)",
                 sum(k.num_layers * rows(k) * k.row_bytes for k in live), measured=True),
            Item("the block's cotangent seeds, every layer [block/CP, row] >= fp32 (replay's "
                 "backward of the block)",
                 sum(k.num_layers * rows(k) * grad_bytes(k) for k in live
                     if k.name != "index_key"), measured=True)]


def rms_norm_saved(rows: int, width: int, b: float) -> float:
    """torch RMSNorm under autograd on [rows, width]: input, rstd x2, two products."""
    return (3 * rows * width + 2 * rows) * b


def outside_layers_saved(cfg, rows: int, b: float, acc: float,
                         final_norm: float) -> tuple[float, float, float, float]:
    """What replay saves outside the decoder layers for `rows` branch rows: (token ids, the
    checkpoint inputs [rows, h] of every decoder layer, the LM head, the loss: grpo.member_loss's
    ratio, clip, min and scalars). The LM head (models/common.head_logprobs) is a non-reentrant
    checkpoint per chunk of rows: it saves each chunk's input rows [chunk, h] (views of the last
    hidden states) and targets [chunk] int64, nothing of the vocabulary (its logits are recomputed
    in backward: `head_chunk_bytes`). `final_norm` is unused: the norm runs inside the chunks."""
    h = cfg.hidden_size
    embed = 8 * rows
    inputs = cfg.num_hidden_layers * rows * h * b
    head = rows * h * b + 8 * rows
    loss = 4 * rows * acc + 2 * acc
    return embed, inputs, head, loss


def head_chunk_bytes(cfg, rows: int, acc: float, tensors: int) -> float:
    """`tensors` fp32-or-wider [chunk, vocab] tensors of the chunked LM head
    (models/common.head_logprobs, chunk = min(rows, HEAD_CHUNK_ROWS)): scoring holds the logits and
    their log-softmax (2); replay's backward of a chunk the recomputed logits, log-softmax and its
    gradient (3)."""
    from megatron_longstraw.models.common import HEAD_CHUNK_ROWS

    return tensors * min(rows, HEAD_CHUNK_ROWS) * cfg.vocab_size * acc
