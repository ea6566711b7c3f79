"""Build a Qwen3.6 Megatron-Core `HybridModel` with LongStraw's state-aware GDN and attention."""

from __future__ import annotations

import torch
from megatron.core.models.hybrid.hybrid_model import HybridModel

from megatron_longstraw.distributed import parallel
from megatron_longstraw.runtime import precision
from megatron_longstraw.models.common import build_hybrid_model
from megatron_longstraw.models.qwen36.config import Qwen36Config
from megatron_longstraw.models.qwen36.spec import qwen36_stack_spec


def build_qwen36_model(cfg: Qwen36Config, params_dtype: torch.dtype = torch.float32,
                       backend=None, **parallel_overrides) -> HybridModel:
    """A `HybridModel` with pattern `G-G-G-*-` x (L / 4). Model-parallel state and RNG must be
    initialised (`parallel.initialize`; context parallel sizes that divide the GDN heads, no TP or
    EP), which also applies platform.py; a float64 model needs `precision.use_dtype(torch.float64)`
    first (the caller's choice; checked here). `backend` is a Megatron spec provider for the linear
    layers (None: the local one; kernels.select's `dense_spec_provider()` gives TransformerEngine's
    when selected)."""
    precision.check_dtype(params_dtype)
    sizes = {**parallel.current_sizes(), **parallel_overrides}
    cp = sizes.get("context_parallel_size", 1)
    if sizes.get("tensor_model_parallel_size", 1) > 1:
        raise ValueError("Qwen3.6 runs with tensor parallel size 1 (LongStraw parallelises a long "
                         "prompt with context parallelism); got TP="
                         f"{sizes['tensor_model_parallel_size']}.")
    if sizes.get("expert_model_parallel_size", 1) > 1:
        raise ValueError("Qwen3.6 has no experts: run it with expert parallel size 1, got "
                         f"{sizes['expert_model_parallel_size']}.")
    if cfg.linear_num_key_heads % cp or cfg.linear_num_value_heads % cp:
        raise ValueError(
            f"Context parallel size {cp} must divide the GDN heads ({cfg.linear_num_key_heads} "
            f"query/key, {cfg.linear_num_value_heads} value): under CP each rank runs the "
            "recurrence of whole heads over the whole sequence (Megatron's GDN scheme). Use a CP "
            "size that divides both (full-size Qwen3.6: 1, 2, 4, 8 or 16).")
    tcfg = cfg.to_transformer_config(params_dtype=params_dtype, **sizes)
    spec = qwen36_stack_spec(tcfg, rotary_base=cfg.rope_theta,
                             rotary_percent=cfg.partial_rotary_factor, backend=backend)
    return build_hybrid_model(cfg, tcfg, spec, params_dtype)
