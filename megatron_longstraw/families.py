"""The model families an entry point can build (`--longstraw-family`), in one table.

GLM-5.2 and Qwen3.6 differ, for the launcher, only in what this table holds: the config class, the
model builder, which Megatron model flags set which config field, how many expert-parallel ranks the
model can use, the linears LoRA wraps by default, and a one-line description for the run summary. Everything after the build
(capture, replay, finalisation, checkpoints, receipts) is family-independent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_longstraw.adapters import GLM52_TARGETS, QWEN36_TARGETS
from megatron_longstraw.models.glm52.config import GLM52Config
from megatron_longstraw.models.qwen36.config import Qwen36Config


def _same(value):
    return value


def _untied(value: bool) -> bool:
    return not value


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


# Megatron flag -> (config field, conversion), applied when the flag was typed on the command line.
_COMMON_FROM_MEGATRON = {
    "num_layers": ("num_hidden_layers", _same),
    "hidden_size": ("hidden_size", _same),
    "num_attention_heads": ("num_attention_heads", _same),
    "ffn_hidden_size": ("intermediate_size", _same),
    "rotary_base": ("rope_theta", float),
    "layernorm_epsilon": ("rms_norm_eps", _same),
    "max_position_embeddings": ("max_position_embeddings", _same),
    "vocab_size": ("vocab_size", _same),
    "untie_embeddings_and_output_weights": ("tie_word_embeddings", _untied),
    "init_method_std": ("init_std", _same),
}
GLM52_FROM_MEGATRON = {
    **_COMMON_FROM_MEGATRON,
    "q_lora_rank": ("q_lora_rank", _same),
    "kv_lora_rank": ("kv_lora_rank", _same),
    "qk_head_dim": ("qk_nope_head_dim", _same),
    "qk_pos_emb_head_dim": ("qk_rope_head_dim", _same),
    "v_head_dim": ("v_head_dim", _same),
    "num_experts": ("n_routed_experts", _same),
    "moe_router_topk": ("num_experts_per_tok", _same),
    "moe_ffn_hidden_size": ("moe_intermediate_size", _same),
    "moe_router_topk_scaling_factor": ("routed_scaling_factor", _same),
    "dsa_indexer_n_heads": ("index_n_heads", _same),
    "dsa_indexer_head_dim": ("index_head_dim", _same),
    "dsa_indexer_topk": ("index_topk", _same),
    "dsa_indexer_topk_freq": ("index_topk_freq", _same),
    "dsa_indexer_skip_topk_offset": ("index_skip_topk_offset", _same),
}
QWEN36_FROM_MEGATRON = {
    **_COMMON_FROM_MEGATRON,
    "num_query_groups": ("num_key_value_heads", _same),
    "kv_channels": ("head_dim", _same),
    "rotary_percent": ("partial_rotary_factor", float),
    "linear_conv_kernel_dim": ("linear_conv_kernel_dim", _same),
    "linear_key_head_dim": ("linear_key_head_dim", _same),
    "linear_value_head_dim": ("linear_value_head_dim", _same),
    "linear_num_key_heads": ("linear_num_key_heads", _same),
    "linear_num_value_heads": ("linear_num_value_heads", _same),
    "linear_attention_freq": ("full_attention_interval", _attention_interval),
}


def _build_glm52(cfg: GLM52Config, params_dtype: torch.dtype, expert_parallel_size: int):
    from megatron_longstraw.kernels import select
    from megatron_longstraw.models.glm52.model import build_glm52_model

    return build_glm52_model(cfg, params_dtype=params_dtype, backend=select.dense_spec_provider(),
                             **select.moe_config_overrides(expert_parallel_size))


def _build_qwen36(cfg: Qwen36Config, params_dtype: torch.dtype, expert_parallel_size: int):
    from megatron_longstraw.kernels import select
    from megatron_longstraw.models.qwen36.model import build_qwen36_model

    return build_qwen36_model(cfg, params_dtype=params_dtype, backend=select.dense_spec_provider())


def _describe_glm52(cfg: GLM52Config) -> str:
    return (f"{cfg.num_hidden_layers} layers, {cfg.num_full_indexer_layers()} full indexer layers, "
            f"{cfg.n_routed_experts} experts")


def _describe_qwen36(cfg: Qwen36Config) -> str:
    full = cfg.num_full_attention_layers()
    return (f"{cfg.num_hidden_layers} layers: {cfg.num_hidden_layers - full} Gated DeltaNet + "
            f"{full} full attention, dense FFN")


@dataclass(frozen=True)
class Family:
    """What an entry point needs to know about one model family."""

    name: str
    """`--longstraw-family` value; also the `family` recorded in checkpoints and receipts."""
    config_class: type
    """The family's config dataclass (`from_dict`, `from_yaml`, `to_dict`)."""
    tiny_config: str
    """The tiny example YAML (repository-relative), named in error messages."""
    from_megatron: dict[str, tuple[str, Callable]]
    """Megatron flag dest -> (config field, conversion of the flag's value)."""
    build: Callable[..., torch.nn.Module]
    """(config, params_dtype, expert_parallel_size) -> model, with the selected kernel backends;
    model-parallel state must be initialised."""
    describe: Callable[..., str]
    """config -> one line for the run summary."""
    max_expert_parallel_size: int | None
    """The largest `--expert-model-parallel-size` the model can use (None: any that divides its
    experts; 1: the model has no experts)."""
    lora_targets: tuple[str, ...] = ()
    """The linears `--longstraw-lora` wraps when `--longstraw-lora-targets` is not given
    (adapters.py's per-family defaults)."""


FAMILIES: dict[str, Family] = {
    "glm52": Family("glm52", GLM52Config, "examples/glm52/tiny.yaml", GLM52_FROM_MEGATRON,
                    _build_glm52, _describe_glm52, max_expert_parallel_size=None,
                    lora_targets=GLM52_TARGETS),
    "qwen36": Family("qwen36", Qwen36Config, "examples/qwen36/tiny.yaml", QWEN36_FROM_MEGATRON,
                     _build_qwen36, _describe_qwen36, max_expert_parallel_size=1,
                     lora_targets=QWEN36_TARGETS),
}


def get_family(name: str) -> Family:
    """The table entry of `name` (ValueError naming the known families otherwise)."""
    if name not in FAMILIES:
        raise ValueError(f"Unknown model family {name!r}; known: {sorted(FAMILIES)}.")
    return FAMILIES[name]


def check_parallel_sizes(family: Family, expert_parallel_size: int) -> None:
    """Reject an expert-parallel size the family's model cannot use, before any process group
    starts."""
    limit = family.max_expert_parallel_size
    if limit is None or expert_parallel_size <= limit:
        return
    why = (" has no MoE layers (its FFN is dense), so there are no experts to shard" if limit == 1
           else f" uses at most {limit} expert-parallel ranks")
    raise ValueError(f"--expert-model-parallel-size {expert_parallel_size}: "
                     f"{family.config_class.FAMILY}{why}; use --expert-model-parallel-size "
                     f"{limit} and give the ranks to --context-parallel-size.")
