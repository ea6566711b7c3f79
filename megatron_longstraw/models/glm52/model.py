"""Build a GLM-5.2 Megatron-Core `HybridModel` with LongStraw's state-aware attention."""

from __future__ import annotations

import torch
from megatron.core.models.hybrid.hybrid_model import HybridModel

from megatron_longstraw import parallel, platform
from megatron_longstraw.models.glm52.config import GLM52Config
from megatron_longstraw.models.glm52.spec import glm52_stack_spec


def build_glm52_model(cfg: GLM52Config, params_dtype: torch.dtype = torch.float32,
                      backend=None, **parallel_overrides) -> HybridModel:
    """A `HybridModel` with pattern `D-D-D-` + `DE` x (L - 3). Model-parallel state and RNG must be
    initialised (`parallel.initialize`); on CPU, `platform.apply()` runs first. `backend` is a
    Megatron spec provider for the dense modules (None: the local one; kernels.select's
    `dense_spec_provider()` gives TransformerEngine's when selected)."""
    platform.apply()
    if params_dtype == torch.float64:
        platform.enable_fp64_routing()
    tcfg = cfg.to_transformer_config(params_dtype=params_dtype, qk_layernorm=True,
                                     **{**parallel.current_sizes(), **parallel_overrides})
    model = HybridModel(
        config=tcfg,
        hybrid_stack_spec=glm52_stack_spec(backend=backend, latent_norm_eps=cfg.latent_norm_eps),
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        hybrid_layer_pattern=cfg.hybrid_layer_pattern(),
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        position_embedding_type="none",  # RoPE is applied inside the attention at true positions
    )
    # Megatron's local norms (WrappedTorchNorm) ignore params_dtype; one dtype for the whole model, as
    # Megatron's Float16Module does for bf16.
    model.to(dtype=params_dtype)
    model.longstraw_config = cfg
    return model
