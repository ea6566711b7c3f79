"""DeepSeek-V3's `Family` record (megatron_longstraw/models/registry.py collects it): dense MLA attention
(`+`), dense (`-`) or MoE (`E`) FFN with group-limited sigmoid routing. The builder, the specs and
the planner are imported when called."""

from __future__ import annotations

import torch

from megatron_longstraw.models.deepseekv3.config import DeepseekV3Config
from megatron_longstraw.models.deepseekv3.hf import HF_CONVERSION
from megatron_longstraw.models.family import (
    MLA_MOE_FROM_MEGATRON, MLA_MOE_LORA_TARGETS, Family, PlannerEntry, same,
    selected_kernels_build,
)

LORA_TARGETS = MLA_MOE_LORA_TARGETS
"""MLA's projections, the attention output and every FFN (dense, shared and routed experts)."""


def _rope_type(value: str) -> str:
    """Megatron's `--rope-type rope|yarn` -> `rope_type` (`default` is plain RoPE)."""
    return "default" if value == "rope" else value


FROM_MEGATRON = {
    **MLA_MOE_FROM_MEGATRON,
    "moe_router_num_groups": ("n_group", same),
    "moe_router_group_topk": ("topk_group", same),
    "rope_type": ("rope_type", _rope_type),
    "rotary_scaling_factor": ("rope_factor", float),
    "mscale": ("mscale", float),
    "mscale_all_dim": ("mscale_all_dim", float),
    "yarn_original_max_position_embeddings": ("original_max_position_embeddings", same),
    "yarn_beta_fast": ("beta_fast", float),
    "yarn_beta_slow": ("beta_slow", float),
}


def build_model(cfg: DeepseekV3Config, params_dtype: torch.dtype = torch.float32, backend=None,
                **parallel_overrides):
    """model.build_deepseekv3_model: the local spec unless `backend` is given, no kernel
    selection."""
    from megatron_longstraw.models.deepseekv3.model import build_deepseekv3_model

    return build_deepseekv3_model(cfg, params_dtype=params_dtype, backend=backend,
                                  **parallel_overrides)


def describe(cfg: DeepseekV3Config) -> str:
    rope = (f"YaRN x{cfg.rope_factor:g} over {cfg.original_max_position_embeddings}"
            if cfg.rope_type == "yarn" else "RoPE")
    groups = f" in {cfg.n_group} groups (top-{cfg.topk_group})" if cfg.n_group > 1 else ""
    return (f"{cfg.num_hidden_layers} layers: dense MLA, {cfg.first_k_dense_replace} dense FFN + "
            f"{cfg.num_hidden_layers - cfg.first_k_dense_replace} MoE, {cfg.n_routed_experts} "
            f"experts top-{cfg.num_experts_per_tok}{groups}, {rope}")


def footprint(spec, prompt_len: int):
    """deepseekv3/planner.py (imported here: the planner package reads the registry)."""
    from megatron_longstraw.models.deepseekv3.planner import deepseekv3

    return deepseekv3(spec, prompt_len)


FAMILY = Family(
    name="deepseekv3", config_class=DeepseekV3Config, build=selected_kernels_build(build_model),
    build_model=build_model,
    from_megatron=FROM_MEGATRON,
    max_expert_parallel_size=None, lora_targets=LORA_TARGETS,
    num_routed_experts=lambda cfg: cfg.n_routed_experts, describe=describe, layer_symbols="+-E",
    tiny_config="examples/deepseekv3/tiny.yaml", full_config="examples/deepseekv3/full.yaml",
    hf=HF_CONVERSION,
    # No index keys: the width is unused (128 keeps the fp8 figure defined).
    planner=PlannerEntry(footprint=footprint, index_key_width=lambda cfg: 128, cp=32, ep=32))
