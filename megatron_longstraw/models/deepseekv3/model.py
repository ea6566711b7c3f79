"""Build a DeepSeek-V3 Megatron-Core `HybridModel` with LongStraw's state-aware dense MLA."""

from __future__ import annotations

import torch
from megatron.core.models.hybrid.hybrid_model import HybridModel

from megatron_longstraw.distributed import parallel
from megatron_longstraw.runtime import precision
from megatron_longstraw.models.common import build_hybrid_model
from megatron_longstraw.models.deepseekv3.config import DeepseekV3Config
from megatron_longstraw.models.deepseekv3.spec import deepseekv3_stack_spec


def build_deepseekv3_model(cfg: DeepseekV3Config, params_dtype: torch.dtype = torch.float32,
                           backend=None, **parallel_overrides) -> HybridModel:
    """A `HybridModel` with pattern `+-` x first_k_dense_replace + `+E` x the rest. Model-parallel
    state and RNG must be initialised (`parallel.initialize`, which also applies platform.py); a
    float64 model needs `precision.use_dtype(torch.float64)` first (the caller's choice; checked
    here). `backend` is a Megatron spec provider for the dense modules (None: the local one;
    kernels.select's `dense_spec_provider()` gives TransformerEngine's when selected)."""
    precision.check_dtype(params_dtype)
    sizes = {**parallel.current_sizes(), **parallel_overrides}
    ep = sizes.get("expert_model_parallel_size", 1)
    if cfg.n_routed_experts % ep:
        raise ValueError(f"expert parallel size {ep} does not divide the {cfg.n_routed_experts} "
                         "routed experts of each MoE layer.")
    tcfg = cfg.to_transformer_config(params_dtype=params_dtype, qk_layernorm=True, **sizes)
    spec = deepseekv3_stack_spec(backend=backend, latent_norm_eps=cfg.latent_norm_eps,
                                 yarn=cfg.rope_type == "yarn")
    return build_hybrid_model(cfg, tcfg, spec, params_dtype)
