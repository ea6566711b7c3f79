"""Hugging Face interop for DeepSeek-V3: `DeepseekV3Config` <-> `DeepseekV3Config` (ours), and state
dicts of transformers' `DeepseekV3ForCausalLM` <-> our Megatron `HybridModel` (see
`model.build_deepseekv3_model`). DeepSeek-V3, DeepSeek-R1 and Kimi-K2 (`kimi_k2`, the same
architecture) checkpoints convert.

The tensor correspondences are exactly the MLA + MoE mapping shared with GLM-5.2
(`models/hf_common.py`: layout, fused `[gate; up]` rows, routed experts, the strict drivers); what
is DeepSeek-V3's own is the config: YaRN RoPE (`rope_parameters` <-> the flat `rope_*` fields),
`rope_interleave`, `topk_method="noaux_tc"` and group-limited routing. Only expert-parallel size 1
is supported here (every rank holds all experts; `expert_names.load_full_state_dict` shards a full
state dict over EP).

transformers builds `q_a_layernorm` / `kv_a_layernorm` with eps 1e-6 whatever `rms_norm_eps` is;
our spec builds the latent norms with `DeepseekV3Config.latent_norm_eps` (default 1e-6) to match.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import torch

from megatron_longstraw.models import hf_common
from megatron_longstraw.models.deepseekv3.config import DeepseekV3Config
from megatron_longstraw.models.family import HFConversion

if TYPE_CHECKING:
    from transformers import DeepseekV3Config as HFDeepseekV3Config

_SAME_NAME_FIELDS = hf_common.MLA_MOE_SAME_NAME_FIELDS
_HF_LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default for q_a / kv_a_layernorm
_YARN_KEYS = ("original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim")


def _check_representable(cfg: DeepseekV3Config) -> None:
    """Raise if `cfg` uses a setting that transformers' DeepseekV3 cannot express."""
    problems = []
    if cfg.latent_norm_eps != _HF_LATENT_NORM_EPS:
        problems.append(f"latent_norm_eps={cfg.latent_norm_eps} (transformers uses 1e-6)")
    problems += hf_common.sigmoid_router_problems(cfg)
    if problems:
        raise ValueError("DeepseekV3Config has no transformers equivalent: " + "; ".join(problems)
                         + ".")


def rope_parameters(cfg: DeepseekV3Config) -> dict:
    """transformers' `rope_parameters` of `cfg`."""
    if cfg.rope_type == "default":
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor,
            **{key: getattr(cfg, key) for key in _YARN_KEYS}}


def hf_config(cfg: DeepseekV3Config, attn_implementation: str = "eager",
              experts_implementation: str = "eager") -> "HFDeepseekV3Config":
    """transformers `DeepseekV3Config` describing the same model as `cfg` (no MTP layers). The
    defaults pick the plain-PyTorch attention and expert loops (they run in float64 on CPU;
    `grouped_mm` does not)."""
    from transformers import DeepseekV3Config as HFConfig

    _check_representable(cfg)
    return HFConfig(
        **{name: getattr(cfg, name) for name in _SAME_NAME_FIELDS},
        num_key_value_heads=cfg.num_attention_heads,
        hidden_act="silu",
        attention_bias=False,
        rope_interleave=True,
        initializer_range=cfg.init_std,
        rope_parameters=rope_parameters(cfg),
        num_mtp_layers=0,
        attn_implementation=attn_implementation,
        experts_implementation=experts_implementation,
    )


def deepseekv3_config_from_hf(hf_cfg: "HFDeepseekV3Config | Mapping[str, Any]") -> DeepseekV3Config:
    """Our `DeepseekV3Config` from a transformers `DeepseekV3Config` or a checkpoint's `config.json`
    dict (legacy `rope_scaling` included). Raises ValueError for settings our Megatron model does
    not implement."""
    from transformers import DeepseekV3Config as HFConfig

    if isinstance(hf_cfg, Mapping):
        hf_cfg = HFConfig.from_dict(dict(hf_cfg))  # applies transformers' defaults/legacy keys
    get = lambda name, default=None: getattr(hf_cfg, name, default)  # noqa: E731
    problems = []
    rope = dict(get("rope_parameters") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        problems.append(f"rope_type={rope_type!r} (only 'default' and 'yarn' RoPE)")
    if rope_type == "yarn":
        if rope.get("factor") is None:
            problems.append("YaRN without 'factor'")
        if rope.get("attention_factor") is not None:
            problems.append("an explicit YaRN 'attention_factor' (derived from mscale here)")
        if not rope.get("truncate", True):
            problems.append("YaRN truncate=False (the correction range is rounded here)")
    for name, want in (("hidden_act", "silu"), ("attention_bias", False),
                       ("num_key_value_heads", get("num_attention_heads")),
                       ("rope_interleave", True), ("scoring_func", "sigmoid"),
                       ("topk_method", "noaux_tc")):
        value = get(name, want)
        if value != want:
            problems.append(f"{name}={value!r} (need {want!r})")
    if get("q_lora_rank") is None:
        problems.append("q_lora_rank=None (the query down-projection is required)")
    if problems:
        raise ValueError("transformers DeepSeek-V3 config not supported: " + "; ".join(problems)
                         + ".")
    yarn = {}
    if rope_type == "yarn":
        yarn = {"rope_factor": float(rope["factor"]),
                "original_max_position_embeddings": int(rope.get(
                    "original_max_position_embeddings", get("max_position_embeddings"))),
                # transformers: `beta_fast or 32`, `beta_slow or 1`; unset mscales are 0 here.
                "beta_fast": float(rope.get("beta_fast") or 32),
                "beta_slow": float(rope.get("beta_slow") or 1),
                "mscale": float(rope.get("mscale") or 0.0),
                "mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0)}
    return DeepseekV3Config(
        **{name: get(name) for name in _SAME_NAME_FIELDS},
        rope_theta=float(rope.get("rope_theta", DeepseekV3Config.rope_theta)),
        rope_type=rope_type,
        init_std=get("initializer_range", DeepseekV3Config.init_std),
        **yarn,
    )


# ---- state dicts --------------------------------------------------------------------------------


def _mapping(cfg: DeepseekV3Config) -> list[hf_common.Entry]:
    """Every tensor correspondence of a DeepSeek-V3 model described by `cfg` (the shared MLA + MoE
    mapping, nothing else)."""
    return hf_common.mla_moe_mapping(cfg)


def to_hf_state_dict(model: torch.nn.Module, cfg: DeepseekV3Config) -> dict[str, torch.Tensor]:
    """transformers `DeepseekV3ForCausalLM` state dict of our model
    (`hf_common.to_hf_state_dict`)."""
    return hf_common.to_hf_state_dict(model, _mapping(cfg), DeepseekV3Config.FAMILY)


def from_hf_state_dict(hf_sd: Mapping[str, torch.Tensor], model: torch.nn.Module,
                       cfg: DeepseekV3Config) -> None:
    """Load a transformers `DeepseekV3ForCausalLM` state dict into our model in place
    (`hf_common.from_hf_state_dict`, strict: filter the MTP layers
    `model.layers.{num_hidden_layers}.*`, DeepSeek-V3's layer 61, first)."""
    hf_common.from_hf_state_dict(hf_sd, model, _mapping(cfg), DeepseekV3Config.FAMILY,
                                 cfg.tie_word_embeddings)


# ---- by tensor name: checkpointing/hf.py (tools/convert_hf.py) ----------------------------------
# Both on-disk expert layouts are read, the one save_pretrained writes is written
# (`hf_common.expert_slot`); multi-token-prediction layers (`model.layers.{num_hidden_layers}.*`,
# DeepSeek-V3's layer 61) are skipped.

HF_CONVERSION = HFConversion(
    title="DeepSeek-V3 / R1, Kimi-K2 text model", model_types=("deepseek_v3", "kimi_k2"),
    hf_config_class="DeepseekV3Config", hf_model_class="DeepseekV3ForCausalLM",
    config_from_hf=deepseekv3_config_from_hf, hf_config=hf_config, mapping=_mapping,
    text_config=hf_common.text_config, text_names=hf_common.text_names_without_mtp,
    to_ours=hf_common.to_ours, to_hf=hf_common.to_hf, expert_names=hf_common.expert_slot,
    float32_names=hf_common.ROUTER_FLOAT32_NAMES)
