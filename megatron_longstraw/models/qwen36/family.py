"""Qwen3.6's `Family` record (megatron_longstraw/models/registry.py collects it): Gated DeltaNet (`G`) and
gated full attention (`*`) mixers, dense FFN (`-`), no experts. Builder, specs and planner are
imported when called."""

from __future__ import annotations

import torch

from megatron_longstraw.models.family import (
    COMMON_FROM_MEGATRON, Family, PlannerEntry, same, selected_kernels_build,
)
from megatron_longstraw.models.qwen36.config import Qwen36Config
from megatron_longstraw.models.qwen36.hf import HF_CONVERSION

LORA_TARGETS = ("linear_qkv", "linear_proj", "in_proj", "out_proj", "linear_fc1", "linear_fc2")
"""Gated attention (linear_qkv, linear_proj), GDN (in_proj, out_proj) and the FFN: Megatron-Core's
own names, which are also `adapters.LoRAConfig`'s default targets."""


def _attention_interval(value) -> int:
    """Megatron's `--linear-attention-freq` (an int N: N - 1 linear-attention layers per full
    attention layer, or a 0/1 list with 0 = full attention) -> `full_attention_interval`."""
    if isinstance(value, int):
        return value
    pattern = list(value)
    interval = pattern.index(0) + 1 if 0 in pattern else 0
    if not interval or pattern != [0 if (i + 1) % interval == 0 else 1 for i in range(len(pattern))]:
        raise ValueError(f"--linear-attention-freq {pattern}: Qwen3.6 needs every n-th layer full "
                         "attention (pass an integer n).")
    return interval


FROM_MEGATRON = {
    **COMMON_FROM_MEGATRON,
    "num_query_groups": ("num_key_value_heads", same),
    "kv_channels": ("head_dim", same),
    "rotary_percent": ("partial_rotary_factor", float),
    "linear_conv_kernel_dim": ("linear_conv_kernel_dim", same),
    "linear_key_head_dim": ("linear_key_head_dim", same),
    "linear_value_head_dim": ("linear_value_head_dim", same),
    "linear_num_key_heads": ("linear_num_key_heads", same),
    "linear_num_value_heads": ("linear_num_value_heads", same),
    "linear_attention_freq": ("full_attention_interval", _attention_interval),
}


def build_model(cfg: Qwen36Config, params_dtype: torch.dtype = torch.float32, backend=None,
                **parallel_overrides):
    """model.build_qwen36_model: the local spec unless `backend` is given, no kernel selection."""
    from megatron_longstraw.models.qwen36.model import build_qwen36_model

    return build_qwen36_model(cfg, params_dtype=params_dtype, backend=backend, **parallel_overrides)


def describe(cfg: Qwen36Config) -> str:
    full = cfg.num_full_attention_layers()
    return (f"{cfg.num_hidden_layers} layers: {cfg.num_hidden_layers - full} Gated DeltaNet + "
            f"{full} full attention, dense FFN")


def footprint(spec, prompt_len: int):
    """planner.qwen36 (imported here: the planner package reads the registry)."""
    from megatron_longstraw.models.qwen36.planner import qwen36

    return qwen36(spec, prompt_len)


FAMILY = Family(
    name="qwen36", config_class=Qwen36Config,
    # the selected dense backend; no experts, so no MoE dispatcher
    build=selected_kernels_build(build_model, routed_experts=False), build_model=build_model,
    from_megatron=FROM_MEGATRON,
    max_expert_parallel_size=1, lora_targets=LORA_TARGETS, num_routed_experts=lambda cfg: 1,
    describe=describe, layer_symbols="G*-",
    tiny_config="examples/qwen36/tiny.yaml", full_config="examples/qwen36/full.yaml",
    hf=HF_CONVERSION,
    # No index keys: the width is unused (128 keeps the fp8 figure defined).
    planner=PlannerEntry(footprint=footprint, index_key_width=lambda cfg: 128, cp=8, ep=1))
