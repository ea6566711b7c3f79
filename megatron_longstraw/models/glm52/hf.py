"""Hugging Face interop for GLM-5.2: `GlmMoeDsaConfig` <-> `GLM52Config`, and state dicts of
transformers' `GlmMoeDsaForCausalLM` <-> our Megatron `HybridModel` (see `model.build_glm52_model`).

The tensor correspondences are the MLA + MoE mapping GLM-5.2 shares with DeepSeek-V3
(`models/hf_common.py`: layout, fused `[gate; up]` rows, routed experts, the strict drivers)
plus what is GLM-5.2's own: each full indexer layer's DSA indexer
(`self_attention.core_attention.indexer` <-> `self_attn.indexer`; IndexShare layers have none),
and the IndexShare schedule in the config.
Only expert-parallel size 1 is supported (every rank must hold all experts).

transformers builds `q_a_layernorm` / `kv_a_layernorm` with eps 1e-6 whatever `rms_norm_eps` is;
our spec builds the latent norms with `GLM52Config.latent_norm_eps` (default 1e-6) to match.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, Mapping

import torch

from megatron_longstraw.models import hf_common
from megatron_longstraw.models.family import HFConversion
from megatron_longstraw.models.glm52.config import GLM52Config, has_own_indexer

if TYPE_CHECKING:
    from transformers import GlmMoeDsaConfig

_SAME_NAME_FIELDS = hf_common.MLA_MOE_SAME_NAME_FIELDS + (
    "index_n_heads", "index_head_dim", "index_topk")
_HF_INDEXER_NORM_EPS = 1e-6  # transformers' GlmMoeDsaIndexer.k_norm (hard-coded)


def _check_representable(cfg: GLM52Config) -> None:
    """Raise if `cfg` uses a switch that transformers' GLM-MoE-DSA cannot express."""
    problems = []
    if not cfg.indexer_score_relu:
        problems.append("indexer_score_relu=False (transformers always applies ReLU)")
    if not cfg.indexer_rope_interleaved:
        problems.append("indexer_rope_interleaved=False (transformers' indexer RoPE is interleaved)")
    if cfg.indexer_norm_eps != _HF_INDEXER_NORM_EPS:
        problems.append(f"indexer_norm_eps={cfg.indexer_norm_eps} (transformers uses 1e-6)")
    if cfg.latent_norm_eps != _HF_INDEXER_NORM_EPS:
        problems.append(f"latent_norm_eps={cfg.latent_norm_eps} (transformers uses 1e-6)")
    problems += hf_common.sigmoid_router_problems(cfg)
    if problems:
        raise ValueError("GLM52Config has no transformers equivalent: " + "; ".join(problems) + ".")


def hf_config(cfg: GLM52Config, attn_implementation: str = "eager",
              experts_implementation: str = "eager") -> "GlmMoeDsaConfig":
    """transformers `GlmMoeDsaConfig` describing the same model as `cfg`. The defaults pick the
    plain-PyTorch attention and expert loops (they run in float64 on CPU; `grouped_mm` does not)."""
    from transformers import GlmMoeDsaConfig

    _check_representable(cfg)
    hf = GlmMoeDsaConfig(
        **{name: getattr(cfg, name) for name in _SAME_NAME_FIELDS},
        num_key_value_heads=cfg.num_attention_heads,
        hidden_act="silu",
        attention_bias=False,
        initializer_range=cfg.init_std,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        index_topk_freq=cfg.index_topk_freq,
        index_skip_topk_offset=cfg.index_skip_topk_offset,
        attn_implementation=attn_implementation,
        experts_implementation=experts_implementation,
    )
    if list(hf.indexer_types) != cfg.indexer_types():
        raise AssertionError(f"transformers' indexer_types {hf.indexer_types} differ from "
                             f"GLM52Config.indexer_types() {cfg.indexer_types()}.")
    return hf


def _freq_offset_for(indexer_types: list[str]) -> tuple[int, int]:
    """(index_topk_freq, index_skip_topk_offset) whose IndexShare rule reproduces `indexer_types`."""
    n = len(indexer_types)
    for freq in range(1, n + 1):
        for offset in range(0, n + 1):
            if all((kind == "full") == has_own_indexer(i, freq, offset)
                   for i, kind in enumerate(indexer_types)):
                return freq, offset
    raise ValueError(f"indexer_types {indexer_types} is not an IndexShare pattern "
                     "('full' iff max(i - offset + 1, 0) % freq == 0) for any freq/offset; "
                     "GLM52Config cannot represent it.")


def glm52_config_from_hf(hf_cfg: "GlmMoeDsaConfig | Mapping[str, Any]") -> GLM52Config:
    """`GLM52Config` from a transformers `GlmMoeDsaConfig` or a checkpoint's `config.json` dict.

    The IndexShare schedule comes from `index_topk_freq`/`index_skip_topk_offset` when present,
    otherwise it is derived from `indexer_types` (ValueError if no freq/offset reproduces it).
    Raises ValueError for settings our Megatron model does not implement."""
    from transformers import GlmMoeDsaConfig

    if isinstance(hf_cfg, Mapping):
        hf_cfg = GlmMoeDsaConfig.from_dict(dict(hf_cfg))  # applies transformers' defaults/legacy keys
    get = lambda name, default=None: getattr(hf_cfg, name, default)  # noqa: E731
    problems = []
    rope = dict(get("rope_parameters") or {})
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type={rope.get('rope_type')!r} (only 'default' RoPE)")
    for name, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                       ("num_key_value_heads", get("num_attention_heads")),
                       ("scoring_func", "sigmoid"), ("indexer_rope_interleave", True)):
        value = get(name, want)
        if value != want:
            problems.append(f"{name}={value!r} (need {want!r})")
    if get("q_lora_rank") is None:
        problems.append("q_lora_rank=None (the query down-projection is required)")
    layers = get("num_hidden_layers")
    first_dense = get("first_k_dense_replace")
    mlp_types = list(get("mlp_layer_types") or [])
    if mlp_types and mlp_types != ["dense"] * first_dense + ["sparse"] * (layers - first_dense):
        problems.append(f"mlp_layer_types {mlp_types} is not first_k_dense_replace={first_dense} "
                        "dense layers followed by MoE layers")
    if problems:
        raise ValueError("transformers GLM-MoE-DSA config not supported: " + "; ".join(problems) + ".")

    indexer_types = list(get("indexer_types"))
    freq, offset = get("index_topk_freq"), get("index_skip_topk_offset")
    if freq is None or offset is None:
        freq, offset = _freq_offset_for(indexer_types)
    cfg = GLM52Config(
        **{name: get(name) for name in _SAME_NAME_FIELDS},
        index_topk_freq=freq,
        index_skip_topk_offset=offset,
        rope_theta=float(rope.get("rope_theta", GLM52Config.rope_theta)),
        init_std=get("initializer_range", GLM52Config.init_std),
        indexer_norm_eps=_HF_INDEXER_NORM_EPS,
    )
    if cfg.indexer_types() != indexer_types:
        raise ValueError(f"index_topk_freq={freq}, index_skip_topk_offset={offset} give "
                         f"{cfg.indexer_types()}, but the config's indexer_types is {indexer_types}.")
    return cfg


# ---- state dicts --------------------------------------------------------------------------------


def _indexer_entries(cfg: GLM52Config, i: int, sa: str, attn: str) -> list[hf_common.Entry]:
    """Layer i's DSA indexer (IndexShare layers have none)."""
    if not cfg.has_own_indexer(i):
        return []
    ix, hix = f"{sa}.core_attention.indexer", f"{attn}.indexer"
    return [hf_common.copy(f"{ix}.{meg}", f"{hix}.{hf}")
            for meg, hf in (("linear_wq_b.weight", "wq_b.weight"),
                            ("linear_wk.weight", "wk.weight"),
                            ("k_norm.weight", "k_norm.weight"), ("k_norm.bias", "k_norm.bias"),
                            ("linear_weights_proj.weight", "weights_proj.weight"))]


def _mapping(cfg: GLM52Config) -> list[hf_common.Entry]:
    """Every tensor correspondence of a GLM-5.2 model described by `cfg`: the shared MLA + MoE
    mapping plus each full layer's indexer."""
    return hf_common.mla_moe_mapping(cfg, partial(_indexer_entries, cfg))


def to_hf_state_dict(model: torch.nn.Module, cfg: GLM52Config) -> dict[str, torch.Tensor]:
    """transformers `GlmMoeDsaForCausalLM` state dict of our model (`hf_common.to_hf_state_dict`)."""
    return hf_common.to_hf_state_dict(model, _mapping(cfg), GLM52Config.FAMILY)


def from_hf_state_dict(hf_sd: Mapping[str, torch.Tensor], model: torch.nn.Module,
                       cfg: GLM52Config) -> None:
    """Load a transformers `GlmMoeDsaForCausalLM` state dict into our model in place
    (`hf_common.from_hf_state_dict`, strict: filter the MTP layers
    `model.layers.{num_hidden_layers}.*` first)."""
    hf_common.from_hf_state_dict(hf_sd, model, _mapping(cfg), GLM52Config.FAMILY,
                                 cfg.tie_word_embeddings)


# ---- by tensor name: checkpointing/hf.py (tools/convert_hf.py) ----------------------------------
# Both on-disk expert layouts are read, the one save_pretrained writes is written
# (`hf_common.expert_slot`); multi-token-prediction layers (`model.layers.{num_hidden_layers}.*`)
# are skipped.

HF_CONVERSION = HFConversion(
    title="GLM-5.2 text model", model_types=("glm_moe_dsa",), hf_config_class="GlmMoeDsaConfig",
    hf_model_class="GlmMoeDsaForCausalLM", config_from_hf=glm52_config_from_hf,
    hf_config=hf_config, mapping=_mapping, text_config=hf_common.text_config,
    text_names=hf_common.text_names_without_mtp, to_ours=hf_common.to_ours,
    to_hf=hf_common.to_hf, expert_names=hf_common.expert_slot,
    float32_names=hf_common.ROUTER_FLOAT32_NAMES, fp8_checkpoints=True)
