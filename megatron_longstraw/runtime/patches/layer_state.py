"""Release what a Megatron-Core layer keeps of its last call.

Megatron-Core 0.19.2 functions covered, and the attribute each sets on every call:
- `TransformerLayer._forward_pre_mlp_layernorm`: `self.mlp_norm_manager`, a
  `FineGrainedActivationOffloadingInterface` holding the MLP's input `hidden_states`;
- `MoEAlltoAllTokenDispatcher.dispatch_preprocess`: `self.probs` (the router's probabilities);
- `MoEAllGatherTokenDispatcher.dispatch_preprocess`: `self.local_probs`;
- `MoEFlexTokenDispatcher`'s managers (`_comm_manager`): `token_probs`, `dispatched_probs`.

Why: under autograd these tensors carry their graph, and they stay until the layer's next call.
Replay recomputes each decoder layer inside the backward (`torch.utils.checkpoint`,
non-reentrant), and that recomputed graph is never back-propagated itself: its saved tensors are
handed to the original graph's nodes, which free their references as they run. While a layer
attribute holds a tensor of the recomputed graph, that graph, and every tensor it saved, stays
alive: at the end of one member's backward every layer's recomputed working set was still there
(measured on the tiny GLM-5.2: replay's backward peak 1.59 MB instead of one layer's ~0.3 MB; on
the full model one sparse-attention gather per layer), freed only by the next member's forward.

Unchanged: each attribute is set at the start of the call that reads it and read only inside
that call (the dispatcher's combine step, the layer's own pre-MLP norm), so clearing it after the
call returns changes no result; the graph autograd needs is held by autograd itself.
"""

from __future__ import annotations

_LAYER_ATTRS = ("mlp_norm_manager",)
_DISPATCHER_ATTRS = ("probs", "local_probs", "token_probs")
_MANAGER_ATTRS = ("token_probs", "dispatched_probs")


def _clear(obj, names) -> None:
    for name in names:
        if getattr(obj, name, None) is not None:
            setattr(obj, name, None)


def release_call_state(layer) -> None:
    """Drop the tensors `layer` (a HybridStack layer) keeps from its last call (see the module)."""
    _clear(layer, _LAYER_ATTRS)
    dispatcher = getattr(getattr(layer, "mlp", None), "token_dispatcher", None)
    if dispatcher is not None:
        _clear(dispatcher, _DISPATCHER_ATTRS)
        manager = getattr(dispatcher, "_comm_manager", None)
        if manager is not None:
            _clear(manager, _MANAGER_ATTRS)
