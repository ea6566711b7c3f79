"""The exact prompt gradient (`LongStrawConfig.prompt_grad = "exact"`, docs/design.md section 2).

Detached replay computes d loss / d theta at fixed prompt state z_P. The exact gradient adds
(d loss / d z_P)(d z_P / d theta), and this module computes it:

1. Capture keeps every decoder layer's input over the prompt rows and every top-k it computed
   (`capture.PromptBackwardInputs`, host memory).
2. Replay reads the pages as leaves (`AttentionPass.prompt_state_grad`, `PageStore.leaf`): after
   all G members, each page holds d loss / d state summed over the members (MLA latent rows, K/V
   rows, GDN state and conv tail). Index keys get none: the top-k is discrete, and the selection
   stays as in the forward.
3. `prompt_backward` runs the decoder layers in reverse. Layer l's prompt forward is recomputed
   under autograd from its kept input (mode `prompt_backward`: each mixer attends as capture did,
   with capture's selections, and emits the state it wrote), and one backward takes the running
   cotangent of the layer's output together with the pages' cotangents of its state; it yields
   the cotangent of the layer's input (the next, lower layer's output) and accumulates parameter
   gradients. The top layer's prompt outputs feed nothing (the loss reads response rows only), so
   the running cotangent starts at zero; after layer 0 it goes into the embedding.

MoE routing is recomputed as in the forward (same input, same experts; under EP the same
dispatch collectives on every rank). Under context parallelism each rank recomputes its prompt
shard: the attention gathers the whole prompt's key rows under autograd, so each key's cotangent,
summed over the ranks whose queries read it, returns to its owner
(`parallel.gather_sequence_differentiable`); GDN exchanges rows and heads as in capture
(differentiable both ways); each rank's pages, and so their cotangents, are its own. Parameter
gradients are partial per rank, summed by finalize.py like replay's. The recompute is one layer
over the whole prompt (shard) at a time: memory O(P) for that layer's graph (a block-wise prompt
backward is the next step; the planner does not count this mode yet).
"""

from __future__ import annotations

import torch

from megatron_longstraw.capture import CapturedPrompt
from megatron_longstraw.config import LongStrawConfig
from megatron_longstraw.models.common import decoder_groups, embed, run_group
from megatron_longstraw.state import AttentionPass, CPPass, attention_pass


def prompt_backward(model, captured: CapturedPrompt, cfg: LongStrawConfig) -> None:
    """Back-propagate the pages' accumulated cotangents through the prompt (module docstring);
    parameter gradients accumulate into `.grad`. Frees the kept inputs and the page leaves as it
    descends."""
    kept = captured.backward
    if kept is None or captured.prefix_len == 0:
        return
    pages = captured.pages
    groups = decoder_groups(model)
    device = next(model.parameters()).device
    grad = None                         # d loss / d (layer output) over the prompt rows
    for layer_idx in reversed(range(len(groups))):
        x = kept.layer_inputs[layer_idx].to(device).requires_grad_()
        state = AttentionPass(
            mode="prompt_backward", positions=captured.positions.to(device), pages=pages,
            cp=CPPass.for_capture(captured.layout, captured.prefix_len),
            selections={layer: sel.to(device, torch.long) for layer, sel in kept.selections.items()},
            reuse_selections=True, query_block=cfg.query_block, key_block=cfg.key_block,
            token_block=cfg.token_block, emitted={})
        with torch.enable_grad(), attention_pass(state):
            out = run_group(groups[layer_idx], x)
        outputs, cotangents = [], []
        if grad is not None:
            outputs.append(out)
            cotangents.append(grad)
        for (layer, kind), tensor in state.emitted.items():
            cotangent = pages.pop_grad(layer, kind)
            if cotangent is not None:
                outputs.append(tensor)
                cotangents.append(cotangent.to(tensor.device, tensor.dtype).reshape(tensor.shape))
        if outputs:
            torch.autograd.backward(outputs, cotangents)
        grad = x.grad
        kept.layer_inputs[layer_idx] = None   # host memory back as the backward descends
        del x, out, outputs, cotangents, state
    if grad is not None:
        with torch.enable_grad():
            hidden = embed(model, kept.token_ids.to(device))
        if hidden.requires_grad:       # a frozen embedding (adapters) takes nothing
            hidden.backward(grad)
