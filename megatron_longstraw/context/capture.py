"""Prompt capture (docs/design.md section 2, step 1): run the shared prompt once through every layer without
autograd and keep only the state that response tokens read, in a `PageStore`.

The captured prefix is `prompt[:-1]`. The last prompt token is replayed with every member instead:
its output scores the first response token, so replaying it keeps that token's own computation in
the member's autograd graph (only the state of the tokens before it is a constant).

Capture is streamed (`capture_block`): layer by layer, token block by token block. The residual
stream lives in a host buffer of this rank's rows `[n_local, 1, h]` (the pages' storage); each
block is copied to the device, run through the decoder layer and its output overwrites the block's
rows of the buffer (a block's input is not read again: later blocks read the layer's pages). On
one process the mixer appends the block's rows to the pages and reads earlier rows from them one
key window at a time, or continues the GDN state stored there. Under context parallelism each
layer runs in three phases (`context_parallel.StreamedCapture`): the blocks' key rows to the pages
(`capture_rows`), an exchange through host memory (every rank's rows gathered in position order;
GDN: its recurrence per global token block over this rank's heads), then the blocks' queries and
FFN/MoE (every rank the same number of blocks: each MoE call is a collective). DSA selections are
int32 in host memory, the latest full indexer layer's only (what IndexShare reads). Device memory
is then one block's activations, one key window or one query block's selected rows, and one
layer's weights: nothing of the prompt's size but the rows' position table.

`--longstraw-capture whole` keeps the earlier schedule as the reference: each rank runs its whole
shard per layer (`capture`: the mixers gather or ring the shard's keys; the residual stream on the
device). Nothing is O(P^2) either way: FFN/MoE intermediates live for one token chunk, indexer
scores for one (query block, key block) pair.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from megatron_longstraw.config.settings import CaptureSettings, LongStrawConfig, capture_section
from megatron_longstraw.config.choices import PromptGrad
from megatron_longstraw.runtime.memory import note_host
from megatron_longstraw.models.common import (decoder_groups, embed, is_mixer, mixer_of, run_group,
                                               run_layer, selection_kinds)
from megatron_longstraw.models.context_parallel import StreamedCapture, capture_blocks
from megatron_longstraw.state.pages import PageStore
from megatron_longstraw.distributed.cp_layout import CPLayout
from megatron_longstraw.state.attention_pass import AttentionPass, CPPass


@dataclass
class CapturedPrompt:
    pages: PageStore
    """Per-layer state of the captured prefix (host memory)."""
    prefix_len: int
    """Tokens captured: P - 1."""
    last_token: int
    """The prompt's last token id; it opens every replayed branch."""
    layout: CPLayout
    """Context-parallel layout of the capture (size 1: the whole prefix is here)."""
    positions: torch.Tensor
    """Global positions of the rows this rank captured (its pages, in order)."""
    seconds: float
    """Wall time of the capture."""
    backward: PromptBackwardInputs | None = None
    """With `prompt_grad=PromptGrad.EXACT`: what the prompt backward needs."""


@dataclass
class PromptBackwardInputs:
    """What capture keeps for the exact prompt gradient (prompt_backward.py), in the pages'
    storage (host memory when they are offloaded): every decoder layer's input over the captured
    rows, each DSA source layer's selection, the captured token ids, the running cotangent's
    buffer and (one process) the carried state at each token block's start. Capture also gives
    the pages their cotangent buffers (`PageStore.keep_grads`). All of it is allocated here, so
    replay and the prompt backward add nothing of the prompt's size (the planner's host line
    `prompt_backward_inputs_bytes`)."""

    layer_inputs: list[torch.Tensor]
    """[n_local, 1, hidden] per decoder layer (the input of its mixer's layer)."""
    selections: dict[int, torch.Tensor]
    """Global key positions [n_local, k] (int32) of every layer that computed a top-k."""
    token_ids: torch.Tensor
    """The captured rows' token ids [n_local]."""
    cotangent: torch.Tensor | None = None
    """[n_local, 1, hidden]: d loss / d (a layer's output) over the prompt rows, overwritten block
    by block as the prompt backward descends (zero above the top layer: nothing reads the top
    layer's prompt outputs)."""
    boundaries: dict[int, list] | None = None
    """One process: per layer of a mixer that carries state (GDN), the state by kind at the start
    of each token block (`AttentionPass.boundaries`)."""


def capture_prompt(model, prompt_ids: torch.Tensor, settings: CaptureSettings | LongStrawConfig,
                   pages: PageStore | None = None,
                   progress: Callable[[int, int], None] | None = None,
                   prompt_grad: PromptGrad = PromptGrad.DETACHED) -> CapturedPrompt:
    """Capture `prompt_ids` [P] (P >= 1, the whole prompt on every rank) into `pages` (a new store by
    default). Under context parallelism each rank captures its load-balanced shard. `progress(done,
    total)` is called after each decoder layer (a progress bar on rank 0). `PromptGrad.EXACT`:
    also keep each layer's input and every top-k (`PromptBackwardInputs`: L x [P, hidden] more
    host memory) for the exact prompt gradient. `settings`: the capture section (a whole
    `LongStrawConfig` gives its `capture`)."""
    start = time.perf_counter()
    capture = capture_section(settings)
    layout = CPLayout.current()
    prefix = prompt_ids[:-1]
    num_captured = int(prefix.numel())
    if layout.size > 1 and num_captured < 2 * layout.size:
        raise ValueError(f"A prompt of {prompt_ids.numel()} tokens is too short for context "
                         f"parallelism {layout.size}: it needs at least {2 * layout.size + 1}.")
    positions = layout.prompt_positions(num_captured, device=prefix.device)
    if pages is None:  # host pages streamed per layer, or (no offload) pages kept on the device
        pages = PageStore(page_tokens=capture.page_tokens, formats=capture.page_formats(),
                          storage_device="cpu" if capture.offload_pages else prompt_ids.device)
    exact = prompt_grad is PromptGrad.EXACT
    backward = None
    if num_captured > 0:
        if exact:
            backward = PromptBackwardInputs([], {}, note_host(prefix[positions].to(
                pages.storage_device, copy=True)))
        streamed = capture.mode == "streamed"
        state = AttentionPass(mode="capture_block" if streamed else "capture", pages=pages,
                              positions=positions, cp=CPPass.for_capture(layout, num_captured),
                              query_block=capture.query_block, key_block=capture.key_block,
                              token_block=capture.token_block,
                              boundaries={} if exact and layout.size == 1 else None)
        run = _run_streamed if streamed else _run_whole
        with torch.no_grad():
            run(model, prefix, state, capture, backward, progress)
        if backward is not None:
            backward.cotangent = note_host(torch.zeros_like(backward.layer_inputs[-1]))
            backward.boundaries = state.boundaries
            pages.keep_grads([kind for kind in pages.bytes_by_kind()
                              if kind not in selection_kinds(model)])
        state.selections.clear()
    return CapturedPrompt(pages=pages, prefix_len=num_captured, last_token=int(prompt_ids[-1]),
                          layout=layout, positions=positions,
                          seconds=time.perf_counter() - start, backward=backward)


def _keep_selections(state: AttentionPass, backward: PromptBackwardInputs | None) -> None:
    """The exact gradient needs every full indexer layer's top-k (capture keeps the latest)."""
    if backward is None:
        return
    for layer, selection in state.selections.items():
        if layer not in backward.selections:
            backward.selections[layer] = note_host(
                selection.to(state.pages.storage_device, torch.int32, copy=True))


def _run_whole(model, prefix, state: AttentionPass, capture: CaptureSettings, backward, progress):
    """Every layer over this rank's whole shard (the residual stream on the device)."""
    storage = state.pages.storage_device
    blocks = capture_blocks(state.cp.layout, state.cp.global_len, capture.token_block)
    hidden = embed(model, prefix[state.positions])                  # [n_local, 1, h]
    groups = decoder_groups(model)
    for layer_idx, group in enumerate(groups):
        if backward is not None:
            backward.layer_inputs.append(note_host(hidden.to(storage, copy=True)))
        # FFN/MoE in streamed capture's token blocks (under CP as many on every rank).
        hidden = run_group(group, hidden, state, chunk_sizes=[end - start for start, end in blocks])
        _keep_selections(state, backward)
        if progress is not None:
            progress(layer_idx + 1, len(groups))


def _run_streamed(model, prefix, state: AttentionPass, capture: CaptureSettings, backward, progress):
    """Streamed capture: the residual stream in a host buffer, every layer run one token block at
    a time (`capture_block`; under CP after the rows and exchange phases; module docstring). Each
    block runs in its own copy of `state` (its mode, positions and first row; the same pages,
    selections and boundaries)."""
    positions, storage, layout = state.positions, state.pages.storage_device, state.cp.layout
    device = prefix.device
    blocks = capture_blocks(layout, state.cp.global_len, capture.token_block)
    if layout.size > 1:
        state = replace(state, streamed=StreamedCapture(layout, state.cp.global_len, storage,
                                                        state.pages.pin_memory, capture.token_block))
    residual = None
    for start, end in blocks:
        hidden = embed(model, prefix[positions[start:end]])         # [b, 1, h]
        if residual is None:
            residual = note_host(torch.empty((positions.numel(),) + tuple(hidden.shape[1:]),
                                             dtype=hidden.dtype, device=storage,
                                             pin_memory=state.pages.pin_memory))
        residual[start:end].copy_(hidden)
    del hidden
    groups = decoder_groups(model)
    for layer_idx, group in enumerate(groups):
        if backward is not None:
            backward.layer_inputs.append(note_host(residual.clone()))
        if state.streamed is not None and is_mixer(group[0]):
            for start, end in blocks:            # the blocks' key rows (or GDN inputs) first
                block = replace(state, mode="capture_rows", positions=positions[start:end],
                                block_start=start)
                run_layer(group[0], residual[start:end].to(device, non_blocking=True), block)
            mixer_of(group).capture_exchange(state)
        for start, end in blocks:
            block = replace(state, positions=positions[start:end], block_start=start)
            out = run_group(group, residual[start:end].to(device, non_blocking=True), block)
            residual[start:end].copy_(out)   # (synchronous: the block's rows are read next layer)
        del out
        _keep_selections(state, backward)
        if progress is not None:
            progress(layer_idx + 1, len(groups))
