"""The mixer protocol: what every state-aware token mixer shares, written once.

A mixer is the module of a decoder layer that reads other tokens: GLM-5.2's MLA + DSA, Qwen3.6's
gated attention and Gated DeltaNet. Each is Megatron-Core's own module (same submodules, same
parameter names, built from the same spec) with `StateAwareMixer` placed first in its bases:

    class LongStrawGatedDeltaNet(StateAwareMixer, GatedDeltaNet): ...

Megatron calls `self_attention(hidden_states, attention_mask=..., ...)`, and the pass travels as
that `attention_mask` (`state/attention_pass.py`): what this pass's queries attend to. Megatron
hands the argument unchanged from `HybridModel.forward` down to every layer's `self_attention`,
so the pass needs no new Megatron argument and no module-level state. `StateAwareMixer.forward`

1. checks the input: one sequence ([s, 1, hidden]), tensor-parallel size 1;
2. takes the pass: `attention_mask` when it is an `AttentionPass`; when it is None, a plain
   full-sequence pass from position 0 (`plain_pass`), so the model is still an ordinary Megatron
   model; anything else (a tensor mask) is refused: these mixers build their own causal structure
   from the pass's positions, and a mask would be silently ignored;
3. refuses a pass whose context-parallel size is not the one the model was built for (a plain
   forward of a CP model would treat each rank's shard as a whole sequence);
4. dispatches, once, on the mode to the family's method `forward_<mode>(hidden_states, state)`:
   `forward_full`, `forward_capture` (the whole-shard reference), `forward_capture_block`
   (streamed capture; under CP with `forward_capture_rows` first and `capture_exchange` between),
   `forward_score` (default: `forward_replay`, which scoring runs without autograd),
   `forward_replay`, `forward_prompt_backward` (the exact prompt gradient: the prompt under
   autograd, handing its page state to `emit`) and `forward_decode`.
   When the prompt is sharded over CP, `forward_<mode>_sharded` is called instead where the family
   has one (the attention mixers' `models/context_parallel.py` pattern); a mixer without one
   handles CP in `forward_<mode>` (GDN's rows <-> heads exchange).

Page reads and writes go through `read_page`, `write_rows`, `write_state`, so the choice between a
constant prompt state and a differentiable one (`PageStore.leaf`, the exact prompt-gradient hook)
is made here, once, and so is `causal_in_order`, the no-autograd token-block loop of the attention
mixers whose pages are per-token key rows (capture, and a full forward under no_grad). A family's
mixer keeps only its math; the context-parallel exchanges it needs are functions of
`models/context_parallel.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from megatron_longstraw.models import partials
from megatron_longstraw.state.pages import LayerRows
from megatron_longstraw.config.choices import PromptGrad
from megatron_longstraw.state.attention_pass import AttentionPass


class StateAwareMixer:
    """Mode dispatch, input checks and page access for a Megatron mixer module (module docstring).
    Subclasses set `layer_idx` (0-based decoder layer: the pages' layer key) and implement the
    `forward_<mode>` methods of the modes they support."""

    layer_idx: int

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **unused_kwargs):
        """hidden_states: [s, 1, hidden] (input-layernormed); attention_mask: the `AttentionPass`,
        or None for a plain full-sequence forward. Returns (output [s, 1, hidden], bias)."""
        name = type(self).__name__
        if hidden_states.dim() != 3 or hidden_states.shape[1] != 1:
            raise ValueError(f"{name} processes one sequence at a time ([s, 1, hidden], batch 1); "
                             f"got shape {tuple(hidden_states.shape)}.")
        if self.config.tensor_model_parallel_size > 1:
            raise ValueError(f"{name} runs with tensor parallel size 1 (LongStraw folds CP and EP; "
                             "set --tensor-model-parallel-size 1).")
        if attention_mask is None:
            state = self.plain_pass(hidden_states)
        elif isinstance(attention_mask, AttentionPass):
            state = attention_mask
        else:
            raise ValueError(
                f"{name} takes an AttentionPass (or None: a plain full-sequence forward) as "
                f"attention_mask, not {type(attention_mask).__name__}: it builds its own causal "
                "structure from the pass's positions and would ignore a mask.")
        built = self.config.context_parallel_size
        if state.cp.size != built:
            raise ValueError(
                f"A {state.mode!r} pass with context parallel size {state.cp.size} reached "
                f"{name} of decoder layer {self.layer_idx}, built for context parallel size "
                f"{built}. A plain forward of this model has no context-parallel layout (each "
                "rank would treat its shard as a whole sequence): run it through LongStraw "
                "capture and replay (schedule.forward_backward_longstraw / replay.score_member), "
                "or build it with CP 1.")
        return self._handler(state)(hidden_states, state)

    def _handler(self, state: AttentionPass):
        """`forward_<mode>_sharded` when the prompt is sharded over CP and the family has one,
        else `forward_<mode>` (a mixer whose CP is not the attention pattern, e.g. GDN's
        rows <-> heads exchange, handles it there); `score` falls back to `replay`."""
        modes = (state.mode, "replay") if state.mode == "score" else (state.mode,)
        for mode in modes:
            for name in ((f"forward_{mode}_sharded",) if state.cp.size > 1 else ()) + (
                    f"forward_{mode}",):
                handler = getattr(self, name, None)
                if handler is not None:
                    return handler
        raise ValueError(f"{type(self).__name__} has no {state.mode!r} mode.")

    def plain_pass(self, hidden_states: torch.Tensor) -> AttentionPass:
        """The pass of a plain Megatron forward: the current tokens are one sequence from 0."""
        positions = torch.arange(hidden_states.shape[0], device=hidden_states.device)
        return AttentionPass(mode="full", positions=positions)

    # ---- pages ------------------------------------------------------------------------------

    def read_page(self, state: AttentionPass, kind: str, device, dtype: torch.dtype | None = None,
                  differentiable: bool = True) -> torch.Tensor:
        """This layer's captured `kind` on `device` (as `dtype`). With the pass's `prompt_grad`
        `PromptGrad.EXACT` and `differentiable`, its cotangent is added to the page's buffer
        (`PageStore.differentiable`: the whole tensor, for fixed-size state; key rows go through
        `page_rows` / `page_keys`, which never form a gradient of the page's size); otherwise a
        constant."""
        page = state.pages.fetch(self.layer_idx, kind, device)
        page = page if dtype is None else page.to(dtype)
        if differentiable and self._exact_grad_to_page(state, kind):
            return state.pages.differentiable(page, self.layer_idx, kind)
        return page

    def page_rows(self, state: AttentionPass, kind: str, device, dtype) -> partials.PageRows:
        """This layer's captured rows of `kind` as a sparse attention part (`partials.PageRows`:
        with the exact prompt gradient, the selected rows' cotangents go to the page's buffer)."""
        rows = self.read_page(state, kind, device, dtype, differentiable=False)
        store = state.pages if self._exact_grad_to_page(state, kind) else None
        return partials.PageRows(rows, store, self.layer_idx, kind)

    def key_grads(self, state: AttentionPass, kind: str) -> Callable | None:
        """`(start, end, grad)` -> added to rows [start, end) of the page buffer of `kind` (the
        sink of a `partials.PageKeys` part), or None when this pass keeps no prompt gradient."""
        if not self._exact_grad_to_page(state, kind):
            return None
        return lambda start, end, grad: state.pages.add_grad(self.layer_idx, kind, grad,
                                                             slice(start, end))

    def decode_rows(self, state: AttentionPass, segment: int, new_rows: dict[str, torch.Tensor],
                    branch_here: bool = True):
        """`decode`: append segment `segment`'s new rows ({kind: [n, ...]}, its rows of the
        step) to its member's branch pages -> this layer's keys for its queries
        (`decode.DecodeKeys`: the prompt's pages, then, with `branch_here`, the member's rows,
        on one row axis; each query sees those up to its position), read a key window or a
        selection at a time, so that no device tensor grows with the tokens generated."""
        for kind, rows in new_rows.items():
            state.decode.append(segment, self.layer_idx, kind, rows)
        return state.decode.keys(segment, self.layer_idx, state, branch_here)

    def earlier_pass(self, state: AttentionPass) -> AttentionPass | None:
        """A blockwise branch pass (`state.branch`): the member's earlier blocks as a pass whose
        pages they are, so they are read with the prompt's readers (`read_page`, `page_rows`, a
        family's page keys); reads send their cotangents to the blocks' buffers whenever those
        keep some (the reverse walk of replay.py: earlier rows are functions of the parameters,
        in the detached mode too). None for a whole branch or the first block (nothing earlier:
        under CP the same on every rank)."""
        branch = state.branch
        if branch is None or branch.num_rows == 0:
            return None
        return replace(state, pages=branch.pages, prompt_grad=PromptGrad.EXACT, branch=None)

    def emit_branch(self, state: AttentionPass, kind: str, tensor: torch.Tensor | None) -> None:
        """A blockwise branch pass: hand the block's `kind` state (this rank's key rows, or the
        carried state at the block's end) to `state.branch.emitted` (replay.py keeps it for the
        later blocks, or seeds its cotangent). Nothing for a whole branch. The first emission
        is kept: an activation checkpoint's recompute in backward emits again, and holding the
        recomputed tensor would hold its layer's recomputed graph until the block ends. A view
        into a larger buffer (V of the fused QKV output, the conv tail of [tail; block]) is
        copied: every layer's emission lives until the block ends, and the view would keep the
        whole buffer."""
        if state.branch is None or tensor is None or (self.layer_idx, kind) in state.branch.emitted:
            return
        if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
            tensor = tensor.clone()
        state.branch.emitted[(self.layer_idx, kind)] = tensor

    def _exact_grad_to_page(self, state: AttentionPass, kind: str) -> bool:
        """The pass is `PromptGrad.EXACT` and the pages keep a cotangent buffer for this layer's
        `kind` (capture's `PageStore.keep_grads`: not for index keys)."""
        return (state.prompt_grad is PromptGrad.EXACT
                and state.pages.has_grad(self.layer_idx, kind))

    def capture_keys(self, state: AttentionPass):
        """Streamed capture: where this layer's key rows are read by global position, a window
        or a selection at a time: its pages on one process (`pages.LayerRows`), every rank's
        rows gathered in host memory under CP (`context_parallel.StreamedCapture`)."""
        return state.streamed if state.cp.size > 1 else LayerRows(state.pages, self.layer_idx)

    def capture_exchange(self, state: AttentionPass) -> None:
        """Streamed capture under CP, between a layer's rows and attend phases (collective):
        every rank's key rows of this layer gathered in host memory. A mixer whose CP is
        another exchange (GDN's rows <-> heads) overrides it."""
        state.streamed.gather_keys(state.pages, self.layer_idx, state.pages.kinds(self.layer_idx),
                                   state.positions.device)

    def write_rows(self, state: AttentionPass, kind: str, rows: torch.Tensor) -> None:
        """Append per-token rows [n, ...] of `kind` (capture, in position order of this rank)."""
        state.pages.append(self.layer_idx, kind, rows)

    def write_state(self, state: AttentionPass, kind: str, tensor: torch.Tensor) -> None:
        """Store fixed-size state of `kind` (e.g. a recurrent state after the prefix)."""
        state.pages.put(self.layer_idx, kind, tensor)

    def emit(self, state: AttentionPass, kind: str, tensor: torch.Tensor) -> None:
        """`prompt_backward`: hand this layer's differentiable `kind` state (what capture wrote
        with `write_rows` / `write_state`, as a function of the layer's input) to the driver."""
        state.emitted[(self.layer_idx, kind)] = tensor

    # ---- the in-order causal loop -----------------------------------------------------------

    def causal_in_order(self, x: torch.Tensor, state: AttentionPass, kinds: Sequence[str],
                        write_pages: bool, rows: Callable, attend: Callable):
        """No autograd: token blocks in order; a block's queries attend over the key rows written
        so far (one preallocated buffer per page kind), so nothing is O(P^2). `rows(x_block,
        positions)` -> (one row tensor per kind of `kinds`, what `attend` needs of the block);
        `attend(that, buffers up to the block's end, positions, key positions)` -> the block's
        output [b, 1, hidden]. With `write_pages` (capture) each block's rows are appended to the
        pages. -> (output [s, 1, hidden], None)"""
        num_tokens = x.shape[0]
        buffers = None
        outputs = []
        for start in range(0, num_tokens, state.token_block):
            end = min(start + state.token_block, num_tokens)
            positions = state.positions[start:end]
            block_rows, block = rows(x[start:end], positions)
            if write_pages:
                for kind, r in zip(kinds, block_rows):
                    self.write_rows(state, kind, r)
            if buffers is None:
                buffers = [r.new_empty((num_tokens,) + r.shape[1:]) for r in block_rows]
            for buffer, r in zip(buffers, block_rows):
                buffer[start:end] = r
            outputs.append(attend(block, [buffer[:end] for buffer in buffers], positions,
                                  state.positions[:end])[0])
        return torch.cat(outputs), None
