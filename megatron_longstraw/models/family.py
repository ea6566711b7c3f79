"""What a model family is, for every entry point: the `Family` record each `models/<family>/`
exports as `FAMILY`, and its two parts for tools (`HFConversion`, `PlannerEntry`).

`megatron_longstraw/models/registry.py` collects the records; the launcher, `tools/*.py` and the planner
read them. Nothing here imports a model: a family's record module imports its builder, its
Megatron-Core specs and its planner functions inside functions, so the registry stays cheap to
import and free of cycles (the planner imports the registry).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class HFConversion:
    """One family's Hugging Face <-> model-format conversion, by tensor name (checkpointing/hf.py
    holds the shared reading, checking and writing, tools/convert_hf.py the command line; no model
    is built)."""

    title: str
    """What the family is on the HF side, for messages."""
    model_types: tuple[str, ...]
    """config.json `model_type` values that convert."""
    hf_config_class: str
    """transformers config class of the text model (for --to-hf and the expected shapes)."""
    hf_model_class: str
    """transformers model class; the `architectures` entry --to-hf writes."""
    config_from_hf: Callable
    """config.json dict -> our config (ValueError for unsupported settings)."""
    hf_config: Callable
    """our config -> transformers config (when the stored config.json does not describe it)."""
    mapping: Callable
    """our config -> hf.py's correspondences (entries)."""
    text_config: Callable[[dict], dict]
    """config.json dict -> the text model's config values."""
    text_names: Callable
    """(our config, on-disk names) -> {name in the mapping: on-disk name}; names left out are
    deliberately skipped (MTP layers, a vision tower)."""
    to_ours: Callable
    """(our config, entry, read, dtype, names available) -> [(model-format name, tensor)]."""
    to_hf: Callable
    """(our config, entry) -> [(HF name, model-format name, transform of that tensor)]."""
    expert_names: Callable[[str, int], list[str]] | None = None
    """(transformers' stacked expert tensor `...experts.gate_up_proj` / `...down_proj`, expert)
    -> that expert's on-disk names (None: the family has no routed experts)."""
    float32_names: tuple[str, ...] = ()
    """Name suffixes (either side) kept in float32 whatever --dtype says."""
    fp8_checkpoints: bool = False
    """Block-FP8 checkpoints (`weight` float8_e4m3fn + `weight_scale_inv`, 128 x 128 blocks)
    convert with their FP8 bytes and scales kept (the mapping's 'copy', 'cat' and 'stack' kinds
    only move whole tensors and rows; megatron_longstraw/kernels/fp8.py)."""


@dataclass(frozen=True)
class PlannerEntry:
    """One family in the memory planner (megatron_longstraw/planner, tools/plan_memory.py)."""

    footprint: Callable
    """(PlanSpec, prompt_len) -> planner.Footprint: the family's planner function."""
    index_key_width: Callable[..., int]
    """config -> values per index-key row (the fp8 index keys carry one fp32 scale per row; a
    family without index keys returns any positive width: it is unused)."""
    cp: int
    """--cp of the full-size plan (tools/plan_memory.py's default)."""
    ep: int
    """--ep of the full-size plan."""


@dataclass(frozen=True)
class Family:
    """What an entry point needs to know about one model family."""

    name: str
    """`--longstraw-family` / `--family` value; also the `family` recorded in checkpoints, the model
    format and receipts."""
    config_class: type
    """The family's config dataclass (`from_dict`, `from_yaml`, `to_dict`; `FAMILY`: its title)."""
    build: Callable
    """(config, params_dtype, expert_parallel_size) -> model, with the selected kernel backends
    (the launcher's; checkpointing/model_source.py's, for tools/score.py and tools/generate.py).
    Model-parallel state must be initialised."""
    build_model: Callable
    """(config, params_dtype, backend=None, **parallel_overrides) -> model: the family's model
    builder itself (models/<family>/model.py), the local spec unless `backend` is given and no
    kernel selection (CPU tools, device checks)."""
    from_megatron: dict[str, tuple[str, Callable]]
    """Megatron flag dest -> (config field, conversion of the flag's value)."""
    max_expert_parallel_size: int | None
    """The largest `--expert-model-parallel-size` the model can use (None: any that divides its
    experts; 1: the model has no experts)."""
    lora_targets: tuple[str, ...]
    """The linears `--longstraw-lora` wraps when `--longstraw-lora-targets` is not given."""
    num_routed_experts: Callable[..., int]
    """config -> routed experts per MoE layer (1: no experts), for loading an EP shard."""
    describe: Callable[..., str]
    """config -> one line for the run summary."""
    layer_symbols: str
    """The `HybridModel` `hybrid_layer_pattern` symbols the family's stack uses."""
    tiny_config: str
    """The tiny example YAML (repository-relative): tests, CPU tools, error messages."""
    full_config: str
    """The full-size example YAML (repository-relative): the planner's default."""
    hf: HFConversion
    """Hugging Face conversion (checkpointing/hf.py, tools/convert_hf.py)."""
    planner: PlannerEntry
    """Memory planner entry (megatron_longstraw/planner)."""
    fp8_linears: tuple[str, ...] = ()
    """Linears the family's block-FP8 checkpoints hold in FP8 (name patterns as `lora_targets`):
    `--longstraw-fp8-base` quantises these at load when the base has no FP8 weights, and the
    planner's `--weight-dtype fp8` counts them in FP8 (empty: the family has no FP8 base)."""


# ---- Megatron flags shared by the families ------------------------------------------------------


def same(value):
    return value


def untied(value: bool) -> bool:
    return not value


COMMON_FROM_MEGATRON: dict[str, tuple[str, Callable]] = {
    "num_layers": ("num_hidden_layers", same),
    "hidden_size": ("hidden_size", same),
    "num_attention_heads": ("num_attention_heads", same),
    "ffn_hidden_size": ("intermediate_size", same),
    "rotary_base": ("rope_theta", float),
    "layernorm_epsilon": ("rms_norm_eps", same),
    "max_position_embeddings": ("max_position_embeddings", same),
    "vocab_size": ("vocab_size", same),
    "untie_embeddings_and_output_weights": ("tie_word_embeddings", untied),
    "init_method_std": ("init_std", same),
}
"""Megatron flag -> (config field, conversion) for the settings every family's config names the
same way (a family's `from_megatron` extends it)."""


MLA_MOE_FROM_MEGATRON: dict[str, tuple[str, Callable]] = {
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
}
"""`COMMON_FROM_MEGATRON` plus the MLA and MoE flags of the MLA + MoE families (GLM-5.2,
DeepSeek-V3), whose configs name them the HF way."""

MLA_MOE_LORA_TARGETS = ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                        "linear_kv_up_proj", "linear_proj", "linear_fc1", "linear_fc2")
"""MLA's projections, the attention output and every FFN (dense, shared and routed experts)."""

MLA_MOE_FP8_LINEARS = MLA_MOE_LORA_TARGETS
"""The linears of DeepSeek-V3's block-FP8 release: MLA's projections, the attention output, every
FFN; the embedding, output layer, norms and router stay bf16."""


# ---- the launcher's build -----------------------------------------------------------------------


def selected_kernels_build(build_model: Callable, routed_experts: bool = True) -> Callable:
    """A family's `Family.build` over its `build_model`: the selected dense backend and, for a
    model with routed experts, the selected MoE dispatcher (kernels/select.py, imported when
    called)."""

    def build(cfg, params_dtype, expert_parallel_size: int = 1):
        from megatron_longstraw.kernels import select

        backend = select.dense_spec_provider()
        overrides = select.moe_config_overrides(expert_parallel_size) if routed_experts else {}
        return build_model(cfg, params_dtype, backend=backend, **overrides)

    return build
