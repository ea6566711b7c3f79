"""GLM-5.2's `Family` record (megatron_longstraw/families.py collects it): MLA + DSA indexer
attention (`D`), dense (`-`) or MoE (`E`) FFN. The builder, the specs and the planner are imported
when called."""

from __future__ import annotations

import torch

from megatron_longstraw.models.family import COMMON_FROM_MEGATRON, Family, PlannerEntry, same
from megatron_longstraw.models.glm52.config import GLM52Config
from megatron_longstraw.models.glm52.hf import HF_CONVERSION

LORA_TARGETS = ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                "linear_kv_up_proj", "linear_proj", "linear_fc1", "linear_fc2")
"""MLA's projections, the attention output and every FFN (dense, shared and routed experts)."""

FROM_MEGATRON = {
    **COMMON_FROM_MEGATRON,
    "q_lora_rank": ("q_lora_rank", same),
    "kv_lora_rank": ("kv_lora_rank", same),
    "qk_head_dim": ("qk_nope_head_dim", same),
    "qk_pos_emb_head_dim": ("qk_rope_head_dim", same),
    "v_head_dim": ("v_head_dim", same),
    "num_experts": ("n_routed_experts", same),
    "moe_router_topk": ("num_experts_per_tok", same),
    "moe_ffn_hidden_size": ("moe_intermediate_size", same),
    "moe_router_topk_scaling_factor": ("routed_scaling_factor", same),
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


def build(cfg: GLM52Config, params_dtype: torch.dtype, expert_parallel_size: int = 1):
    """The launcher's build: the selected dense backend and MoE dispatcher (kernels/select.py)."""
    from megatron_longstraw.kernels import select

    return build_model(cfg, params_dtype, backend=select.dense_spec_provider(),
                       **select.moe_config_overrides(expert_parallel_size))


def describe(cfg: GLM52Config) -> str:
    return (f"{cfg.num_hidden_layers} layers, {cfg.num_full_indexer_layers()} full indexer layers, "
            f"{cfg.n_routed_experts} experts")


def footprint(spec, prompt_len: int):
    """planner.glm52 (imported here: the planner package reads the registry)."""
    from megatron_longstraw.planner.glm52 import glm52

    return glm52(spec, prompt_len)


FAMILY = Family(
    name="glm52", config_class=GLM52Config, build=build, build_model=build_model,
    from_megatron=FROM_MEGATRON,
    max_expert_parallel_size=None, lora_targets=LORA_TARGETS,
    num_routed_experts=lambda cfg: cfg.n_routed_experts, describe=describe, layer_symbols="D-E",
    tiny_config="examples/glm52/tiny.yaml", full_config="examples/glm52/full.yaml",
    hf=HF_CONVERSION,
    planner=PlannerEntry(footprint=footprint, index_key_width=lambda cfg: cfg.index_head_dim,
                         cp=32, ep=32))
