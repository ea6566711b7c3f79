"""GLM-5.2's `Family` record (megatron_longstraw/models/registry.py collects it): MLA + DSA indexer
attention (`D`), dense (`-`) or MoE (`E`) FFN. The builder, the specs and the planner are imported
when called."""

from __future__ import annotations

import torch

from megatron_longstraw.models.family import (
    MLA_MOE_FP8_LINEARS, MLA_MOE_FROM_MEGATRON, MLA_MOE_LORA_TARGETS, Family, PlannerEntry, same,
    selected_kernels_build,
)
from megatron_longstraw.models.glm52.config import GLM52Config
from megatron_longstraw.models.glm52.hf import HF_CONVERSION

LORA_TARGETS = MLA_MOE_LORA_TARGETS
"""MLA's projections, the attention output and every FFN (dense, shared and routed experts)."""

FP8_LINEARS = MLA_MOE_FP8_LINEARS + ("linear_wq_b", "linear_wk")
"""The linears GLM-5.2's block-FP8 checkpoints hold in FP8: DeepSeek-V3's set plus the DSA
indexer's query and key projections (its head-weight projection `weights_proj`, like the router,
stays bf16, as in DeepSeek-V3.2's FP8 release)."""

FROM_MEGATRON = {
    **MLA_MOE_FROM_MEGATRON,
    "dsa_indexer_n_heads": ("index_n_heads", same),
    "dsa_indexer_head_dim": ("index_head_dim", same),
    "dsa_indexer_topk": ("index_topk", same),
    "dsa_indexer_topk_freq": ("index_topk_freq", same),
    "dsa_indexer_skip_topk_offset": ("index_skip_topk_offset", same),
}


def build_model(cfg: GLM52Config, params_dtype: torch.dtype = torch.float32, backend=None,
                **parallel_overrides):
    """model.build_glm52_model: the local spec unless `backend` is given, no kernel selection."""
    from megatron_longstraw.models.glm52.model import build_glm52_model

    return build_glm52_model(cfg, params_dtype=params_dtype, backend=backend, **parallel_overrides)


def describe(cfg: GLM52Config) -> str:
    return (f"{cfg.num_hidden_layers} layers, {cfg.num_full_indexer_layers()} full indexer layers, "
            f"{cfg.n_routed_experts} experts")


def footprint(spec, prompt_len: int):
    """planner.glm52 (imported here: the planner package reads the registry)."""
    from megatron_longstraw.models.glm52.planner import glm52

    return glm52(spec, prompt_len)


FAMILY = Family(
    name="glm52", config_class=GLM52Config, build=selected_kernels_build(build_model),
    build_model=build_model,
    from_megatron=FROM_MEGATRON,
    max_expert_parallel_size=None, lora_targets=LORA_TARGETS,
    num_routed_experts=lambda cfg: cfg.n_routed_experts, describe=describe, layer_symbols="D-E",
    tiny_config="examples/glm52/tiny.yaml", full_config="examples/glm52/full.yaml",
    hf=HF_CONVERSION,
    planner=PlannerEntry(footprint=footprint, index_key_width=lambda cfg: cfg.index_head_dim,
                         cp=32, ep=32),
    fp8_linears=FP8_LINEARS)
