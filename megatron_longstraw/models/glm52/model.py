"""Build a GLM-5.2 Megatron-Core `HybridModel` with LongStraw's state-aware attention."""

from __future__ import annotations

import torch
from megatron.core.models.hybrid.hybrid_model import HybridModel

from megatron_longstraw.distributed import parallel
from megatron_longstraw.runtime import precision
from megatron_longstraw.models.common import build_hybrid_model
from megatron_longstraw.models.glm52.config import GLM52Config
from megatron_longstraw.models.glm52.spec import glm52_stack_spec


def build_glm52_model(cfg: GLM52Config, params_dtype: torch.dtype = torch.float32,
                      backend=None, **parallel_overrides) -> HybridModel:
    """A `HybridModel` with pattern `D-D-D-` + `DE` x (L - 3). Model-parallel state and RNG must be
    initialised (`parallel.initialize`, which also applies platform.py); a float64 model needs
    `precision.use_dtype(torch.float64)` first (the caller's choice; checked here). `backend` is a
    Megatron spec provider for the dense modules (None: the local one; kernels.select's
    `dense_spec_provider()` gives TransformerEngine's when selected)."""
    precision.check_dtype(params_dtype)
    tcfg = cfg.to_transformer_config(params_dtype=params_dtype, qk_layernorm=True,
                                     **{**parallel.current_sizes(), **parallel_overrides})
    spec = glm52_stack_spec(backend=backend, latent_norm_eps=cfg.latent_norm_eps)
    return build_hybrid_model(cfg, tcfg, spec, params_dtype)
