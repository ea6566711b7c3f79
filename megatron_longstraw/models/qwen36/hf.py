"""Hugging Face interop for Qwen3.6: `Qwen3_5TextConfig` <-> `Qwen36Config`, and state dicts of
transformers' `Qwen3_5ForCausalLM` <-> our Megatron `HybridModel` (see `model.build_qwen36_model`).

Megatron layout: decoder layer i is HybridStack symbol 2i (mixer: `input_layernorm`,
`self_attention.*`) and symbol 2i + 1 (FFN: `pre_mlp_layernorm`, `mlp.*`). Correspondences that
are not plain copies:
- GDN `in_proj` rows are Megatron's sections [q; k; v; z; beta; alpha] = HF `in_proj_qkv`,
  `in_proj_z`, `in_proj_b`, `in_proj_a` concatenated (HF's qkv is already [q; k; v] flat).
- Gated attention `linear_qkv` rows are Megatron's per-K/V-group layout [q heads of the group;
  their gate heads; k; v] (`SelfAttention.get_query_key_value_tensors(output_gate=True)`); HF's
  `q_proj` interleaves per head [q_h; gate_h] and keeps k_proj / v_proj separate.
- GDN `out_norm`: Megatron builds every norm of this model zero-centred (`layernorm_zero_centered_
  gamma`, y * (1 + w)), but HF's gated norm (`linear_attn.norm`) has a plain gain (y * w), so
  w_megatron = w_hf - 1. The other norms (input, post-attention, q/k, final) are zero-centred on
  both sides and copy.
- The FFN's fused `linear_fc1` is [gate; up] (Megatron's GLU applies the activation to the first
  half), as for GLM-5.2.
The strict drivers and the plain kinds are `models/hf_common.py`'s; the gated qkv and the gated
norm are Qwen3.6's own kinds ('gated_qkv', 'minus_one'). Qwen3.5/3.6 checkpoints are
vision-language: `text_state_dict` keeps the text model's tensors (`model.language_model.*` ->
`model.*`) and drops `model.visual.*` and `mtp.*`.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, Mapping

import torch

from megatron_longstraw.models import hf_common
from megatron_longstraw.models.family import HFConversion
from megatron_longstraw.models.qwen36.config import Qwen36Config

if TYPE_CHECKING:
    from transformers import Qwen3_5TextConfig

_SAME_NAME_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim",
    "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "rms_norm_eps",
    "max_position_embeddings", "tie_word_embeddings",
)


def hf_config(cfg: Qwen36Config, attn_implementation: str = "eager") -> "Qwen3_5TextConfig":
    """transformers `Qwen3_5TextConfig` describing the same model as `cfg` (eager attention by
    default: it runs in float64 on CPU)."""
    from transformers import Qwen3_5TextConfig

    hf = Qwen3_5TextConfig(
        **{name: getattr(cfg, name) for name in _SAME_NAME_FIELDS},
        hidden_act="silu",
        attention_bias=False,
        initializer_range=cfg.init_std,
        layer_types=cfg.layer_types(),
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                         "partial_rotary_factor": cfg.partial_rotary_factor},
        attn_implementation=attn_implementation,
    )
    return hf


def qwen36_config_from_hf(hf_cfg: "Qwen3_5TextConfig | Mapping[str, Any]") -> Qwen36Config:
    """`Qwen36Config` from a transformers `Qwen3_5TextConfig` or a checkpoint's `config.json` dict
    (a vision-language config's `text_config` is used). Raises ValueError for settings our Megatron
    model does not implement."""
    from transformers import Qwen3_5TextConfig

    if isinstance(hf_cfg, Mapping):
        values = dict(hf_cfg.get("text_config") or hf_cfg)
        values.pop("model_type", None)
        hf_cfg = Qwen3_5TextConfig.from_dict(values)  # applies transformers' defaults/legacy keys
    get = lambda name, default=None: getattr(hf_cfg, name, default)  # noqa: E731
    rope = dict(get("rope_parameters") or {})
    layer_types = list(get("layer_types"))
    problems = []
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type={rope.get('rope_type')!r} (only 'default' RoPE)")
    for name, want in (("hidden_act", "silu"), ("attention_bias", False)):
        if get(name, want) != want:
            problems.append(f"{name}={get(name)!r} (need {want!r})")
    interval = layer_types.index("full_attention") + 1 if "full_attention" in layer_types else 0
    if not interval or layer_types != ["full_attention" if (i + 1) % interval == 0
                                       else "linear_attention" for i in range(len(layer_types))]:
        problems.append(f"layer_types {layer_types} is not every n-th layer full attention")
    if problems:
        raise ValueError("transformers Qwen3.5 config not supported: " + "; ".join(problems) + ".")
    return Qwen36Config(
        **{name: get(name) for name in _SAME_NAME_FIELDS},
        full_attention_interval=interval,
        partial_rotary_factor=float(rope.get("partial_rotary_factor", 0.25)),
        rope_theta=float(rope.get("rope_theta", Qwen36Config.rope_theta)),
        init_std=get("initializer_range", Qwen36Config.init_std),
    )


# ---- state dicts --------------------------------------------------------------------------------
# Entries (`hf_common.Entry`) of the shared kinds 'copy' and 'cat', and Qwen3.6's own: 'minus_one':
# meg[0] == hf[0] - 1 (plain gain -> zero-centred gain); 'gated_qkv': meg[0] is Megatron's grouped
# [q; gate; k; v] layout of (q_proj, k_proj, v_proj).


def _mapping(cfg: Qwen36Config) -> list[hf_common.Entry]:
    """Every tensor correspondence of a Qwen3.6 model described by `cfg`."""
    copy = hf_common.copy
    entries = hf_common.model_entries(cfg)
    for i in range(cfg.num_hidden_layers):
        a, f, h = hf_common.layer_prefixes(i)
        sa = f"{a}.self_attention"
        entries += hf_common.layer_norm_entries(a, f, h)
        entries += hf_common.gated_mlp_entries(f"{f}.mlp", f"{h}.mlp")
        if cfg.is_full_attention(i):
            attn = f"{h}.self_attn"
            entries += [hf_common.Entry("gated_qkv", (f"{sa}.linear_qkv.weight",),
                                        tuple(f"{attn}.{p}_proj.weight" for p in "qkv")),
                        copy(f"{sa}.q_layernorm.weight", f"{attn}.q_norm.weight"),
                        copy(f"{sa}.k_layernorm.weight", f"{attn}.k_norm.weight"),
                        copy(f"{sa}.linear_proj.weight", f"{attn}.o_proj.weight")]
        else:
            gdn = f"{h}.linear_attn"
            in_proj = tuple(f"{gdn}.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a"))
            entries += [hf_common.cat(f"{sa}.in_proj.weight", in_proj),
                        copy(f"{sa}.conv1d.weight", f"{gdn}.conv1d.weight"),
                        copy(f"{sa}.A_log", f"{gdn}.A_log"),
                        copy(f"{sa}.dt_bias", f"{gdn}.dt_bias"),
                        hf_common.Entry("minus_one", (f"{sa}.out_norm.weight",),
                                        (f"{gdn}.norm.weight",)),
                        copy(f"{sa}.out_proj.weight", f"{gdn}.out_proj.weight")]
    return entries


def _cat_sizes(cfg: Qwen36Config, entry: hf_common.Entry) -> list[int]:
    if entry.meg[0].endswith("in_proj.weight"):
        key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        return [2 * key_dim + value_dim, value_dim, cfg.linear_num_value_heads,
                cfg.linear_num_value_heads]
    return [cfg.intermediate_size, cfg.intermediate_size]  # linear_fc1: [gate; up]


def _qkv_to_megatron(cfg: Qwen36Config, q_proj, k_proj, v_proj) -> torch.Tensor:
    """HF q_proj [heads * 2 * d, h] (per head [q; gate]), k/v_proj [groups * d, h] -> Megatron
    linear_qkv [groups * (2 * heads_per_group + 2) * d, h]."""
    groups, d = cfg.num_key_value_heads, cfg.head_dim
    per_group = cfg.num_attention_heads // groups
    q_gate = q_proj.reshape(groups, per_group, 2, d, -1)
    hidden = q_gate.shape[-1]
    parts = [q_gate[:, :, 0].reshape(groups, per_group * d, hidden),
             q_gate[:, :, 1].reshape(groups, per_group * d, hidden),
             k_proj.reshape(groups, d, hidden), v_proj.reshape(groups, d, hidden)]
    return torch.cat(parts, dim=1).reshape(-1, hidden)


def _qkv_to_hf(cfg: Qwen36Config, linear_qkv) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, d = cfg.num_key_value_heads, cfg.head_dim
    per_group = cfg.num_attention_heads // groups
    hidden = linear_qkv.shape[-1]
    q, gate, k, v = linear_qkv.reshape(groups, -1, hidden).split(
        [per_group * d, per_group * d, d, d], dim=1)
    q_proj = torch.stack([q.reshape(groups, per_group, d, hidden),
                          gate.reshape(groups, per_group, d, hidden)], dim=2)
    return q_proj.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def text_state_dict(hf_sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The text model's tensors of a Qwen3.5/3.6 checkpoint in `Qwen3_5ForCausalLM` names:
    `model.language_model.*` -> `model.*`; `model.visual.*` and `mtp.*` (multi-token prediction)
    dropped; everything else kept as is."""
    out = {}
    for name, tensor in hf_sd.items():
        if name.startswith(("model.visual.", "mtp.")):
            continue
        out[name.replace("model.language_model.", "model.", 1)] = tensor
    return out


def _qkv_rows(cfg: Qwen36Config) -> tuple[int, int, int]:
    """Rows of HF's q_proj (per head [q; gate]), k_proj, v_proj."""
    return (2 * cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim,
            cfg.num_key_value_heads * cfg.head_dim)


def _special_to_hf(cfg: Qwen36Config, entry: hf_common.Entry, tensor: torch.Tensor):
    if entry.kind == "minus_one":
        return [tensor + 1]
    return _qkv_to_hf(cfg, tensor)  # gated_qkv


def _special_from_hf(cfg: Qwen36Config, entry: hf_common.Entry, src: list[torch.Tensor],
                     target: torch.Tensor) -> torch.Tensor:
    if entry.kind == "minus_one":
        return src[0].to(target.dtype) - 1
    hf_common.check_rows(entry.hf, src, _qkv_rows(cfg))  # gated_qkv
    return _qkv_to_megatron(cfg, *src)


def to_hf_state_dict(model: torch.nn.Module, cfg: Qwen36Config) -> dict[str, torch.Tensor]:
    """transformers `Qwen3_5ForCausalLM` state dict of our model (no `lm_head.weight` when the
    embeddings are tied). 1:1 tensors are detached views sharing storage with the model."""
    return hf_common.to_hf_state_dict(model, _mapping(cfg), Qwen36Config.FAMILY,
                                      split_sizes=partial(_cat_sizes, cfg),
                                      special=partial(_special_to_hf, cfg))


def from_hf_state_dict(hf_sd: Mapping[str, torch.Tensor], model: torch.nn.Module,
                       cfg: Qwen36Config) -> None:
    """Load a transformers `Qwen3_5ForCausalLM` state dict into our model in place (strict: every
    Megatron parameter covered and every HF key consumed; pass a checkpoint through
    `text_state_dict` first). With tied embeddings an `lm_head.weight` equal to the embedding is
    accepted. Names and shapes are all checked before anything is written; values are cast to each
    target tensor's dtype."""
    hf_common.from_hf_state_dict(hf_sd, model, _mapping(cfg), Qwen36Config.FAMILY,
                                 cfg.tie_word_embeddings, split_sizes=partial(_cat_sizes, cfg),
                                 special=partial(_special_from_hf, cfg))


# ---- by tensor name: checkpointing/hf.py (tools/convert_hf.py) ----------------------------------
# A vision-language checkpoint's text model is converted (`model.language_model.*`);
# `model.visual.*` and the MTP head `mtp.*` are skipped; --to-hf writes a text-only
# `Qwen3_5ForCausalLM`.


def _text_config(hf_cfg: dict) -> dict:
    """The text model's config.json values (a vision-language config keeps them in text_config)."""
    values = dict(hf_cfg.get("text_config") or hf_cfg)
    values.pop("model_type", None)
    return values


def _text_names(cfg: Qwen36Config, names) -> dict[str, str]:
    """{Qwen3_5ForCausalLM name: on-disk name}: text_state_dict's renaming and dropping (vision
    tower, MTP head), applied to the names (each maps to itself there)."""
    return text_state_dict({n: n for n in names})


def _to_ours(cfg: Qwen36Config, entry: hf_common.Entry, read, dtype: torch.dtype,
             available) -> list:
    if entry.kind == "minus_one":  # plain gain -> zero-centred, in the format's dtype
        return [(entry.meg[0], read(entry.hf[0]).to(dtype) - 1)]
    if entry.kind == "gated_qkv":
        return [(entry.meg[0], _qkv_to_megatron(cfg, *[read(n) for n in entry.hf]))]
    return hf_common.to_ours(cfg, entry, read, dtype, available)


def _to_hf(cfg: Qwen36Config, entry: hf_common.Entry) -> list:
    if entry.kind == "minus_one":
        return [(entry.hf[0], entry.meg[0], lambda t: t + 1)]
    if entry.kind == "gated_qkv":
        return [(hf, entry.meg[0], lambda t, j=j: _qkv_to_hf(cfg, t)[j])
                for j, hf in enumerate(entry.hf)]
    return hf_common.to_hf(cfg, entry, _cat_sizes(cfg, entry) if entry.kind == "cat" else None)


HF_CONVERSION = HFConversion(
    title="Qwen3.6 / Qwen3.5 Gated-DeltaNet hybrid", model_types=("qwen3_5_text", "qwen3_5"),
    hf_config_class="Qwen3_5TextConfig", hf_model_class="Qwen3_5ForCausalLM",
    config_from_hf=qwen36_config_from_hf, hf_config=hf_config, mapping=_mapping,
    text_config=_text_config, text_names=_text_names, to_ours=_to_ours, to_hf=_to_hf)
