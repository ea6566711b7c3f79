"""DeepEP for MoE token dispatch, through Megatron-Core's flex dispatcher (a config switch, no
wrapper of our own: Megatron calls DeepEP's `Buffer.dispatch/combine` in
`megatron/core/transformer/moe/fused_a2a.py`).

Megatron-Core 0.19.2 (`transformer_config.py`): `moe_token_dispatcher_type="flex"` selects
`MoEFlexTokenDispatcher` (`moe/token_dispatcher.py`), and `moe_flex_dispatcher_backend="deepep"`
its DeepEP manager (`_DeepepManager`; the older `moe_enable_deepep=True` is deprecated). The flex
dispatcher asserts TP x EP > 1 and refuses `moe_pad_expert_input_to_capacity` with DeepEP.
The reference for this part is Megatron's all-to-all dispatcher (GLM52Config's default): both route
the same tokens to the same experts with the same weights; only the transport differs.
"""

from __future__ import annotations

import logging

from megatron_longstraw.kernels import packages

logger = logging.getLogger(__name__)


def transformer_config_overrides(expert_parallel_size: int, tensor_parallel_size: int = 1) -> dict:
    """TransformerConfig fields that route MoE tokens through DeepEP (for `build_glm52_model(...,
    **overrides)` / `GLM52Config.to_transformer_config(**overrides)`).

    Raises `MissingKernelPackage` when DeepEP is not importable. With TP x EP == 1 there is no
    dispatch to accelerate (and Megatron's flex dispatcher rejects it): returns {} and logs it.
    """
    packages.require("deep_ep")
    if tensor_parallel_size * expert_parallel_size <= 1:
        logger.info("deepep: TP x EP = 1, nothing to dispatch; keeping Megatron's all-to-all "
                    "dispatcher.")
        return {}
    return {
        "moe_token_dispatcher_type": "flex",
        "moe_flex_dispatcher_backend": "deepep",
        "moe_pad_expert_input_to_capacity": False,
    }
