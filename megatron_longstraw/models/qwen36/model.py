"""Build a Qwen3.6 Megatron-Core `HybridModel` with LongStraw's state-aware GDN and attention."""

from __future__ import annotations

import torch
from megatron.core.models.hybrid.hybrid_model import HybridModel

from megatron_longstraw import parallel, platform
from megatron_longstraw.models.common import build_hybrid_model
from megatron_longstraw.models.qwen36.config import Qwen36Config
from megatron_longstraw.models.qwen36.spec import qwen36_stack_spec


def build_qwen36_model(cfg: Qwen36Config, params_dtype: torch.dtype = torch.float32,
                       backend=None, **parallel_overrides) -> HybridModel:
    """A `HybridModel` with pattern `G-G-G-*-` x (L / 4). Model-parallel state and RNG must be
    initialised (`parallel.initialize`); on CPU, `platform.apply()` runs first. `backend` is a
    Megatron spec provider for the linear layers (None: the local one; kernels.select's
    `dense_spec_provider()` gives TransformerEngine's when selected)."""
    platform.apply()
    if params_dtype == torch.float64:
        platform.enable_fp64_gdn()
    sizes = {**parallel.current_sizes(), **parallel_overrides}
    if sizes.get("context_parallel_size", 1) > 1 or sizes.get("tensor_model_parallel_size", 1) > 1:
        raise ValueError("Qwen3.6 runs with context and tensor parallel size 1 in this version "
                         f"(got CP={sizes.get('context_parallel_size', 1)}, TP="
                         f"{sizes.get('tensor_model_parallel_size', 1)}); GLM-5.2 supports CP/EP.")
    tcfg = cfg.to_transformer_config(params_dtype=params_dtype, **sizes)
    spec = qwen36_stack_spec(tcfg, rotary_base=cfg.rope_theta,
                             rotary_percent=cfg.partial_rotary_factor, backend=backend)
    return build_hybrid_model(cfg, tcfg, spec, params_dtype)
