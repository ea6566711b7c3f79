"""The per-pass state that state-aware attention layers read: which mode, at which positions, over
which pages, with which top-k selections.

A pass is handed explicitly, as Megatron's `attention_mask` argument: it says what this pass's
queries attend to, which is what a mask says. Megatron-Core 0.19.2 hands `attention_mask`
unchanged from `HybridModel.forward(input_ids, position_ids, attention_mask, ...)` through
`HybridStack.forward` and `TransformerLayer.forward` to `self_attention(hidden_states,
attention_mask=..., ...)`, and MLP / MoE layers ignore it, so no Megatron signature changes and
nothing is kept in module state. Capture, replay, the prompt backward and decode call the layers
with `models/common.run_layer(layer, hidden, state)` / `run_group(group, hidden, state)` (also
inside activation checkpointing, which gets the pass as an argument); a full-model forward is
`model(input_ids, position_ids, attention_mask=state)`. With `attention_mask=None` the mixers run
the plain full-sequence forward from position 0, so the model is still an ordinary Megatron model
(`models/mixer.py`).

A pass is immutable (a frozen dataclass): what layers fill during a pass (`selections` of the full
indexer layers, `emitted`, `boundaries`, `used_selections`, the decode caches) lives in containers
the caller hands in and reads afterwards; a pass that differs is a copy (`dataclasses.replace`,
e.g. `member_pass`, or capture's per-block passes).

Modes (`models/mixer.py` dispatches on them, once, for every mixer):
- `full`:    the current tokens are the whole sequence; keys are the current tokens (the reference).
- `capture`: the current tokens are the prompt (this rank's whole shard); their state is written
             to `pages` (no autograd). The whole-shard reference (`--longstraw-capture whole`).
- `capture_block`: streamed capture (capture.py): the current tokens are one token block of the
             prompt, this rank's rows [block_start, block_start + s). One process: earlier
             blocks' state is in `pages` already: attention reads its key rows window by window
             from the pages, GDN continues from the state stored there; the block's own state is
             appended (no autograd). Under CP (`forward_capture_block_sharded`) the layer's rows
             are written already (`capture_rows`) and exchanged (`streamed`): attention reads
             every rank's rows window by window from host memory, GDN hands over its output
             rows. Nothing on the device is of the prompt's size.
- `capture_rows`: streamed capture under CP, a layer's first phase: the block's key rows are
             appended to the pages (GDN: its input kept for the exchange); nothing attended.
- `score`:   the current tokens are one response, keys the prompt pages plus the current tokens,
             without autograd (pre-step scoring: logp_old, logp_ref, the DSA selections replay
             reuses).
- `replay`:  the same pass under autograd (one member's training graph).
- `prompt_backward`: the prompt again, under autograd, one decoder layer at a time (exact prompt
             gradient, prompt_backward.py). On one process, one token block at a time: the block's
             queries attend over the layer's pages (key cotangents to the page buffers), and a
             mixer that carries state (GDN) starts from `carried` and hands the state at the
             block's end to `emitted`. Under CP (`forward_prompt_backward_sharded`), this rank's
             whole shard: each mixer attends as in capture, with capture's selections, and hands
             the differentiable state it would write to `emitted`. Run for `PromptGrad.EXACT`
             only: it is the prompt's backward of that gradient.
- `prompt_rows`: the prompt block's key rows (what capture wrote for it) as functions of its
             input, handed to `emitted`; nothing is attended (the second half of a block of the
             blockwise prompt backward).
- Blockwise branches (`branch`, replay.py): with `branch` set, a `score` / `replay` pass's
             current tokens are one token block of a member's branch; its keys are the prompt's
             pages, the branch's earlier blocks (`branch.pages`, this rank's rows of them, and the
             carried state at the block's start) and the block's own rows. Each mixer hands the
             block's state (its key rows, the carried state at its end) to `branch.emitted`;
             replay.py appends it to `branch.pages` (forward, no autograd) or gives it the
             cotangents later blocks left there (the reverse walk).
- `decode`: the current tokens are the members' rows of a decode step (decode.py), in segments
             of one member each: its newest token, or a block of an observation's ids. Each
             mixer appends a segment's state to its member's branch pages and attends its queries
             over the prompt's pages plus the member's rows up to each query's position, a key
             window or a selection at a time (no autograd).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, Optional

import torch

from megatron_longstraw.config.choices import PromptGrad
from megatron_longstraw.state.pages import PageStore
from megatron_longstraw.distributed.cp_layout import CPLayout

Mode = Literal["full", "capture", "capture_block", "capture_rows", "score", "replay",
               "prompt_backward", "prompt_rows", "decode"]
BRANCH_MODES = ("score", "replay")
"""Modes whose current tokens are a response branch over captured pages."""


@dataclass(frozen=True)
class CPPass:
    """The context-parallel part of a pass, fixed when the pass is made (`for_capture`,
    `for_branch`); size 1 (the default) is one process holding everything."""

    layout: CPLayout = field(default_factory=CPLayout)
    """The CP group, size and this rank."""
    global_len: int = 0
    """Capture: tokens in the whole captured prefix (all ranks)."""
    prefix_positions: Optional[torch.Tensor] = None
    """Branch passes: global positions of this rank's captured rows (its pages, in order)."""
    branch_positions: Optional[torch.Tensor] = None
    """Branch passes: global positions of the whole (padded) branch, or of the current block of a
    blockwise one, the same on every rank."""
    branch_len: int = 0
    """Branch passes: rows of the padded branch, or of the current block (CP * rows per rank)."""

    @classmethod
    def for_capture(cls, layout: CPLayout, global_len: int) -> "CPPass":
        return cls(layout=layout, global_len=global_len)

    @classmethod
    def for_branch(cls, layout: CPLayout, prefix_positions: torch.Tensor, prefix_len: int,
                   padded_len: int, start: int = 0) -> "CPPass":
        """A branch pass over rows [start, start + padded_len) of the (padded) branch: the whole
        branch, or one block of a blockwise one (replay.py)."""
        if layout.size == 1:
            return cls(layout=layout)
        first = prefix_len + start
        branch = torch.arange(first, first + padded_len, device=prefix_positions.device)
        return cls(layout=layout, prefix_positions=prefix_positions, branch_positions=branch,
                   branch_len=padded_len)

    @property
    def size(self) -> int:
        return self.layout.size

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def group(self):
        return self.layout.group


@dataclass(frozen=True)
class AttentionPass:
    """One pass of the state-aware mixers (module docstring); frozen: the containers it holds are
    filled by the layers, its fields are never reassigned."""

    mode: Mode
    """What the attention layers do with their keys (see the module docstring)."""
    positions: torch.Tensor
    """[s] global positions of the current tokens (the prompt starts at 0, a response at P)."""
    pages: Optional[PageStore] = None
    """Captured prompt state: written in `capture`, read in `replay`."""
    prefix_len: int = 0
    """Number of captured prompt tokens that precede the current tokens (replay: P)."""
    selections: dict[int, torch.Tensor] = field(default_factory=dict)
    """DSA top-k per decoder layer: `[s, k]` int64 indices into `[prefix; current]` keys.
    Filled by the layers that compute a selection; IndexShare layers read their source layer's.
    `capture_block`: global key positions `[rows, k]` int32 in the pages' storage, of the latest
    full indexer layer only (what IndexShare reads), filled block by block."""
    reuse_selections: bool = False
    """Use `selections` as given for full indexer layers (indexer replay) instead of recomputing."""
    prompt_grad: PromptGrad = PromptGrad.DETACHED
    """`EXACT`: prompt pages read in this pass send their cotangents to the pages' buffers
    (`PageStore.keep_grads`); `DETACHED`: they are constants."""
    emitted: Optional[dict[tuple[int, str], torch.Tensor]] = None
    """`prompt_backward` / `prompt_rows`: each mixer's differentiable state by (layer, kind) (key
    rows, or the carried state at the block's end), to be given their cotangents."""
    carried: Optional[dict[str, Optional[torch.Tensor]]] = None
    """Blockwise `prompt_backward`: the carried state by kind at the block's start (kept by
    capture in `boundaries`; None: the zero start state), for a mixer that carries one (GDN)."""
    decode: Optional[object] = None
    """`decode`: the members' branch caches (`decode.DecodeCache`); its `segments` say which rows
    of the current tokens are whose."""
    member_selections: Optional[list[dict]] = None
    """`decode`: per segment, its member's DSA selections of this step (`member_pass`)."""
    boundaries: Optional[dict[int, list]] = None
    """`capture` for the exact gradient on one process: per layer, the carried state (by kind) at
    the start of each token block, appended by mixers that carry one."""
    used_selections: Optional[dict[int, torch.Tensor]] = None
    """When a dict, every layer records the top-k it attended with (tests, diagnostics)."""
    query_block: int = 1024
    """Queries per attention block (bounds the gathered `[block, k, d]` rows)."""
    key_block: int = 4096
    """Keys per indexer-score block (bounds the `[block_q, h_i, block_k]` scores)."""
    token_block: int = 8192
    """Tokens per chunk for token-wise work in capture (projections, FFN, MoE)."""
    block_start: int = 0
    """`capture_block` / `capture_rows`: this block's first row among this rank's captured rows
    (its pages)."""
    streamed: Optional[object] = None
    """Streamed capture under CP: the layer's exchange through host memory
    (`context_parallel.StreamedCapture`)."""
    cp: CPPass = field(default_factory=CPPass)
    """Context-parallel part (size 1: everything on this process); frozen."""
    branch: Optional[EarlierBlocks] = None
    """Blockwise branch passes (`score` / `replay`): the member's earlier blocks (module
    docstring); None: the current tokens are the whole branch."""


@dataclass(frozen=True)
class EarlierBlocks:
    """A blockwise branch pass's view of the member's earlier blocks (replay.py): their state on
    this rank, read like the prompt's pages (`StateAwareMixer.earlier_pass`)."""

    pages: PageStore
    """This rank's rows of the earlier blocks by (layer, kind), in position order, and the
    carried state (GDN) at the current block's start as fixed kinds. In the reverse walk it keeps
    cotangent buffers (`PageStore.keep_grads`): what this block's queries read of them adds to
    the rows' cotangents."""
    positions: torch.Tensor
    """[n] global positions of those rows (ascending; n = 0 for the first block)."""
    emitted: dict[tuple[int, str], torch.Tensor | None] = field(default_factory=dict)
    """Filled by the mixers: the current block's state by (layer, kind) (this rank's key rows;
    the carried state at the block's end)."""

    @property
    def num_rows(self) -> int:
        return int(self.positions.numel())


def member_pass(state: AttentionPass, segment: int) -> AttentionPass:
    """`decode`: the pass seen by the queries of segment `segment` of a decode step (one
    member's rows, `decode.DecodeCache.segments`): their positions, the member's own top-k
    selections of this step (IndexShare layers read their source layer's for the same member)."""
    rows = state.decode.rows(segment)
    return replace(state, positions=state.positions[rows],
                   selections=state.member_selections[segment], member_selections=None)
