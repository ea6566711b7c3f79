"""The exact prompt gradient (`ReplaySettings.prompt_grad` `PromptGrad.EXACT`, docs/design.md
section 2).

Detached replay computes d loss / d theta at fixed prompt state z_P. The exact gradient adds
(d loss / d z_P)(d z_P / d theta), and this module computes it:

1. Capture keeps every decoder layer's input over the prompt rows, every top-k it computed, a
   buffer for the running cotangent and, on one process, the carried state (GDN) at each token
   block's start (`capture.PromptBackwardInputs`, host memory), and gives every page a cotangent
   buffer of its shape (`PageStore.keep_grads`).
2. Replay reads the pages as differentiable inputs (`AttentionPass.prompt_grad`): after all
   G members, each page's buffer holds d loss / d state summed over the members (MLA latent rows,
   K/V rows, GDN state and conv tail). Only selected rows (sparse attention) or one key window at
   a time (dense attention, `refs.streamed_attention`) ever have a gradient on the way. Index
   keys get none: the top-k is discrete, and the selection stays as in the forward.
3. `prompt_backward` runs the decoder layers in reverse, each one token block at a time (one
   process; `_blockwise`):
   - queries: block b's input (kept) is run through the layer under autograd, its queries
     attending over the layer's pages with capture's selections; one backward takes the running
     cotangent of the block's output rows and sends the key rows' cotangents to the page buffers
     (they are constants here). A mixer that carries state (GDN) restarts the block from the
     state capture kept at its start and also gives its end state the cotangent that the next
     block (or, for the last block, replay) left; blocks go last to first, so that cotangent is
     complete when its block is reached.
   - rows: once every block's queries are done, each page row's cotangent is complete (replay's
     plus every prompt query's), and block b's key rows, recomputed from its input under
     autograd (mode `prompt_rows`), take it.
   The input cotangent overwrites the block's rows of the running buffer (the next, lower
   layer's output cotangent). The top layer's prompt outputs feed nothing (the loss reads
   response rows only), so the running cotangent starts at zero; after layer 0 it goes into the
   embedding, block by block. Nothing allocated here is larger than a block's graph or one
   window of keys: the prompt-sized buffers were allocated by capture.

MoE routing is recomputed as in the forward (same input, same experts; aux-loss-free routing:
the per-block recompute computes the same routing as capture's chunks). Under context
parallelism (`_whole_shard`) each rank recomputes its prompt shard at once: the attention gathers
the whole prompt's key rows under autograd, so each key's cotangent, summed over the ranks whose
queries read it, returns to its owner (`collectives.gather_sequence_differentiable`); GDN exchanges
rows and heads as in capture (differentiable both ways); each rank's pages, and so their
cotangents, are its own. That path's memory is one layer's graph over the shard, O(P / CP) (a
ring of key blocks, as capture's streaming needs, would bound it by a block too). Parameter
gradients are partial per rank, summed by finalize.py like replay's.
"""

from __future__ import annotations

import torch

from megatron_longstraw.context.capture import CapturedPrompt
from megatron_longstraw.config.settings import CaptureSettings
from megatron_longstraw.config.choices import PromptGrad
from megatron_longstraw.models.common import (
    decoder_groups,
    embed,
    is_mixer,
    mixer_of,
    run_group,
    run_layer,
)
from megatron_longstraw.state.attention_pass import AttentionPass, CPPass


def prompt_backward(model, captured: CapturedPrompt, capture: CaptureSettings) -> None:
    """Back-propagate the pages' accumulated cotangents through the prompt (module docstring);
    parameter gradients accumulate into `.grad`. Frees the kept inputs and the page buffers at
    the end (freeing them as it descends would not lower the host peak, which is at the start,
    and would hide the phase's own working set from the live-bytes meter)."""
    kept = captured.backward
    if kept is None or captured.prefix_len == 0:
        return
    groups = decoder_groups(model)
    device = next(model.parameters()).device
    descend = _blockwise if captured.layout.size == 1 else _whole_shard
    grad = descend(groups, captured, capture, device)
    kept.layer_inputs.clear()
    for start in range(0, grad.shape[0], capture.token_block):
        end = min(start + capture.token_block, grad.shape[0])
        with torch.enable_grad():
            hidden = embed(model, kept.token_ids[start:end].to(device))
        if hidden.requires_grad:       # a frozen embedding (adapters) takes nothing
            hidden.backward(grad[start:end].to(device, hidden.dtype))
    kept.cotangent = None
    captured.pages.drop_grads()


def _blockwise(groups, captured: CapturedPrompt, capture: CaptureSettings, device) -> torch.Tensor:
    """One process: every layer, top to bottom, one token block at a time (module docstring).
    -> d loss / d (layer 0's input) over the prompt rows (the running buffer)."""
    kept, pages = captured.backward, captured.pages
    grad = kept.cotangent
    num_rows = grad.shape[0]
    blocks = [(s, min(s + capture.token_block, num_rows)) for s in range(0, num_rows, capture.token_block)]
    for layer_idx in reversed(range(len(groups))):
        group, inputs = groups[layer_idx], kept.layer_inputs[layer_idx]
        mixer = mixer_of(group)
        carried_kinds = getattr(mixer, "carried_kinds", ())
        # d loss / d (carried state at the current block's end): replay's, for the last block.
        carry = {kind: pages.grad(layer_idx, kind) for kind in carried_kinds}
        boundaries = (kept.boundaries or {}).get(layer_idx)
        top = layer_idx == len(groups) - 1
        for index in reversed(range(len(blocks)) if carried_kinds or not top else ()):
            start, end = blocks[index]
            carried = None
            if carried_kinds:
                # A copy (as on a device): the kept boundary itself must not collect a gradient.
                carried = {kind: None if t is None else t.to(device, copy=True).requires_grad_()
                           for kind, t in boundaries[index].items()}
            state = _block_pass(captured, capture, "prompt_backward", start, end, device, carried)
            x = inputs[start:end].to(device, copy=True).requires_grad_()
            with torch.enable_grad():
                out = run_group(group, x, state)
            outputs, cotangents = [out], [grad[start:end].to(device, out.dtype)]
            for (_, kind), tensor in state.emitted.items():
                if carry.get(kind) is not None:
                    outputs.append(tensor)
                    cotangents.append(carry[kind].to(device, tensor.dtype).reshape(tensor.shape))
            torch.autograd.backward(outputs, cotangents)
            grad[start:end] = x.grad
            if carried is not None:
                carry = {kind: None if t is None else t.grad for kind, t in carried.items()}
        if hasattr(mixer, "forward_prompt_rows"):
            layer = next(layer for layer in group if is_mixer(layer))
            for start, end in blocks:
                state = _block_pass(captured, capture, "prompt_rows", start, end, device)
                x = inputs[start:end].to(device, copy=True).requires_grad_()
                with torch.enable_grad():
                    run_layer(layer, x, state)
                outputs, cotangents = [], []
                for (layer_key, kind), tensor in state.emitted.items():
                    buffer = pages.grad(layer_key, kind)
                    if buffer is not None:
                        outputs.append(tensor)
                        cotangents.append(buffer[start:end].to(device, tensor.dtype)
                                          .reshape(tensor.shape))
                if outputs:
                    torch.autograd.backward(outputs, cotangents)
                    if x.grad is not None:
                        grad[start:end] += x.grad.to(grad.device)
    return grad


def _block_pass(captured: CapturedPrompt, capture: CaptureSettings, mode: str, start: int, end: int,
                device, carried=None) -> AttentionPass:
    """The pass of prompt rows [start, end) on one process: its positions and capture's
    selections for them; the page rows' positions (`cp.prefix_positions`) for dense attention."""
    kept = captured.backward
    return AttentionPass(
        mode=mode, positions=captured.positions[start:end].to(device), pages=captured.pages,
        prefix_len=captured.prefix_len,
        cp=CPPass(layout=captured.layout, global_len=captured.prefix_len,
                  prefix_positions=captured.positions.to(device)),
        selections={layer: sel[start:end].to(device, torch.long)
                    for layer, sel in kept.selections.items()},
        reuse_selections=True, prompt_grad=PromptGrad.EXACT, query_block=capture.query_block,
        key_block=capture.key_block, token_block=capture.token_block, emitted={}, carried=carried)


def _whole_shard(groups, captured: CapturedPrompt, capture: CaptureSettings, device) -> torch.Tensor:
    """Context parallelism: every layer over this rank's whole shard at once (module docstring).
    -> d loss / d (layer 0's input) over this rank's prompt rows."""
    kept, pages = captured.backward, captured.pages
    grad = None                         # d loss / d (layer output) over the prompt rows
    for layer_idx in reversed(range(len(groups))):
        # A copy (as on a device): the kept input itself must not collect a gradient.
        x = kept.layer_inputs[layer_idx].to(device, copy=True).requires_grad_()
        state = AttentionPass(
            mode="prompt_backward", positions=captured.positions.to(device), pages=pages,
            cp=CPPass.for_capture(captured.layout, captured.prefix_len),
            selections={layer: sel.to(device, torch.long) for layer, sel in kept.selections.items()},
            reuse_selections=True, query_block=capture.query_block, key_block=capture.key_block,
            token_block=capture.token_block, emitted={})
        with torch.enable_grad():
            out = run_group(groups[layer_idx], x, state)
        outputs, cotangents = [], []
        if grad is not None:
            outputs.append(out)
            cotangents.append(grad)
        for (layer, kind), tensor in state.emitted.items():
            cotangent = pages.grad(layer, kind)
            if cotangent is not None:
                outputs.append(tensor)
                cotangents.append(cotangent.to(tensor.device, tensor.dtype).reshape(tensor.shape))
        if outputs:
            torch.autograd.backward(outputs, cotangents)
        grad = x.grad
        del x, out, outputs, cotangents, state
    return grad if grad is not None else torch.zeros_like(kept.cotangent)
