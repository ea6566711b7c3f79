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
Qwen3.5/3.6 checkpoints are vision-language: `text_state_dict` keeps the text model's tensors
(`model.language_model.*` -> `model.*`) and drops `model.visual.*` and `mtp.*`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import torch

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


@dataclass(frozen=True)
class _Entry:
    """One HF <-> Megatron correspondence. kind 'copy': meg == hf[0]; 'cat': meg == cat(hf) on
    dim 0; 'minus_one': meg == hf[0] - 1 (plain gain -> zero-centred gain); 'gated_qkv': meg is
    Megatron's grouped [q; gate; k; v] layout of (q_proj, k_proj, v_proj)."""

    kind: str
    meg: str
    hf: tuple[str, ...]


def _mapping(cfg: Qwen36Config) -> list[_Entry]:
    """Every tensor correspondence of a Qwen3.6 model described by `cfg`."""
    copy = lambda meg, hf: _Entry("copy", meg, (hf,))  # noqa: E731
    entries = [copy("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
               copy("decoder.final_norm.weight", "model.norm.weight")]
    if not cfg.tie_word_embeddings:
        entries.append(copy("output_layer.weight", "lm_head.weight"))
    for i in range(cfg.num_hidden_layers):
        a, f, h = f"decoder.layers.{2 * i}", f"decoder.layers.{2 * i + 1}", f"model.layers.{i}"
        sa = f"{a}.self_attention"
        entries += [copy(f"{a}.input_layernorm.weight", f"{h}.input_layernorm.weight"),
                    copy(f"{f}.pre_mlp_layernorm.weight", f"{h}.post_attention_layernorm.weight"),
                    _Entry("cat", f"{f}.mlp.linear_fc1.weight",
                           (f"{h}.mlp.gate_proj.weight", f"{h}.mlp.up_proj.weight")),
                    copy(f"{f}.mlp.linear_fc2.weight", f"{h}.mlp.down_proj.weight")]
        if cfg.is_full_attention(i):
            attn = f"{h}.self_attn"
            entries += [_Entry("gated_qkv", f"{sa}.linear_qkv.weight",
                               tuple(f"{attn}.{p}_proj.weight" for p in "qkv")),
                        copy(f"{sa}.q_layernorm.weight", f"{attn}.q_norm.weight"),
                        copy(f"{sa}.k_layernorm.weight", f"{attn}.k_norm.weight"),
                        copy(f"{sa}.linear_proj.weight", f"{attn}.o_proj.weight")]
        else:
            gdn = f"{h}.linear_attn"
            entries += [_Entry("cat", f"{sa}.in_proj.weight",
                               tuple(f"{gdn}.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a"))),
                        copy(f"{sa}.conv1d.weight", f"{gdn}.conv1d.weight"),
                        copy(f"{sa}.A_log", f"{gdn}.A_log"),
                        copy(f"{sa}.dt_bias", f"{gdn}.dt_bias"),
                        _Entry("minus_one", f"{sa}.out_norm.weight", (f"{gdn}.norm.weight",)),
                        copy(f"{sa}.out_proj.weight", f"{gdn}.out_proj.weight")]
    return entries


def _cat_sizes(cfg: Qwen36Config, entry: _Entry) -> list[int]:
    if entry.meg.endswith("in_proj.weight"):
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


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module  # DDP / Float16Module wrappers
    return model


def _check_names(kind: str, expected: set[str], present: set[str]) -> None:
    missing, unexpected = sorted(expected - present), sorted(present - expected)
    if missing or unexpected:
        raise KeyError(f"{kind} names do not match the Qwen3.6 mapping: missing {len(missing)} "
                       f"{missing[:20]}; unexpected {len(unexpected)} {unexpected[:20]}.")


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


def to_hf_state_dict(model: torch.nn.Module, cfg: Qwen36Config) -> dict[str, torch.Tensor]:
    """transformers `Qwen3_5ForCausalLM` state dict of our model (no `lm_head.weight` when the
    embeddings are tied). 1:1 tensors are detached views sharing storage with the model."""
    meg = dict(_unwrap(model).named_parameters())
    entries = _mapping(cfg)
    _check_names("Megatron model", {e.meg for e in entries}, set(meg))
    out: dict[str, torch.Tensor] = {}
    for e in entries:
        tensor = meg[e.meg].detach()
        if e.kind == "copy":
            out[e.hf[0]] = tensor
        elif e.kind == "minus_one":
            out[e.hf[0]] = tensor + 1
        elif e.kind == "cat":
            out.update(zip(e.hf, tensor.split(_cat_sizes(cfg, e), dim=0)))
        else:
            out.update(zip(e.hf, _qkv_to_hf(cfg, tensor)))
    return out


def from_hf_state_dict(hf_sd: Mapping[str, torch.Tensor], model: torch.nn.Module,
                       cfg: Qwen36Config) -> None:
    """Load a transformers `Qwen3_5ForCausalLM` state dict into our model in place (strict: every
    Megatron parameter covered and every HF key consumed; pass a checkpoint through
    `text_state_dict` first). With tied embeddings an `lm_head.weight` equal to the embedding is
    accepted. Names and shapes are all checked before anything is written; values are cast to each
    target tensor's dtype."""
    hf_sd = dict(hf_sd)
    entries = _mapping(cfg)
    if cfg.tie_word_embeddings and "lm_head.weight" in hf_sd:
        lm_head = hf_sd.pop("lm_head.weight")
        if not torch.equal(lm_head, hf_sd.get("model.embed_tokens.weight", lm_head)):
            raise ValueError("tie_word_embeddings=True but lm_head.weight differs from "
                             "model.embed_tokens.weight.")
    _check_names("HF state dict", {n for e in entries for n in e.hf}, set(hf_sd))
    meg = dict(_unwrap(model).named_parameters())
    _check_names("Megatron model", {e.meg for e in entries}, set(meg))
    writes: list[tuple[str, torch.Tensor]] = []
    for e in entries:
        src = [hf_sd[n] for n in e.hf]
        if e.kind == "copy":
            writes.append((e.meg, src[0]))
        elif e.kind == "minus_one":
            writes.append((e.meg, src[0].to(meg[e.meg].dtype) - 1))
        elif e.kind == "cat":
            bad = [f"{n}: {tuple(t.shape)}" for n, t, size in zip(e.hf, src, _cat_sizes(cfg, e))
                   if t.dim() != 2 or t.shape[0] != size]
            if bad:
                raise ValueError(f"shape mismatch for {bad}.")
            writes.append((e.meg, torch.cat(src, dim=0)))
        else:
            rows = (2 * cfg.num_attention_heads * cfg.head_dim,
                    cfg.num_key_value_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim)
            bad = [f"{n}: {tuple(t.shape)}" for n, t, size in zip(e.hf, src, rows)
                   if t.dim() != 2 or t.shape[0] != size]
            if bad:
                raise ValueError(f"shape mismatch for {bad}.")
            writes.append((e.meg, _qkv_to_megatron(cfg, *src)))
    bad = [f"{name}: HF {tuple(v.shape)} vs Megatron {tuple(meg[name].shape)}"
           for name, v in writes if v.shape != meg[name].shape]
    if bad:
        raise ValueError(f"shape mismatch for {len(bad)} tensors: {bad[:20]}.")
    with torch.no_grad():
        for name, value in writes:
            meg[name].copy_(value)


# ---- by tensor name: tools/convert_hf.py --------------------------------------------------------
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


def _to_ours(cfg: Qwen36Config, entry: _Entry, read, dtype: torch.dtype, available) -> list:
    values = [read(n) for n in entry.hf]
    if entry.kind == "copy":
        return [(entry.meg, values[0])]
    if entry.kind == "minus_one":  # plain gain -> zero-centred, in the format's dtype
        return [(entry.meg, values[0].to(dtype) - 1)]
    if entry.kind == "cat":
        return [(entry.meg, torch.cat(values))]
    return [(entry.meg, _qkv_to_megatron(cfg, *values))]  # gated_qkv


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _to_hf(cfg: Qwen36Config, entry: _Entry) -> list:
    if entry.kind == "copy":
        return [(entry.hf[0], entry.meg, _identity)]
    if entry.kind == "minus_one":
        return [(entry.hf[0], entry.meg, lambda t: t + 1)]
    if entry.kind == "cat":
        sizes = _cat_sizes(cfg, entry)
        return [(hf, entry.meg, lambda t, j=j: t.split(sizes)[j]) for j, hf in enumerate(entry.hf)]
    return [(hf, entry.meg, lambda t, j=j: _qkv_to_hf(cfg, t)[j])  # gated_qkv
            for j, hf in enumerate(entry.hf)]


HF_CONVERSION = HFConversion(
    title="Qwen3.6 / Qwen3.5 Gated-DeltaNet hybrid", model_types=("qwen3_5_text", "qwen3_5"),
    hf_config_class="Qwen3_5TextConfig", hf_model_class="Qwen3_5ForCausalLM",
    config_from_hf=qwen36_config_from_hf, hf_config=hf_config, mapping=_mapping,
    text_config=_text_config, text_names=_text_names, to_ours=_to_ours, to_hf=_to_hf)
