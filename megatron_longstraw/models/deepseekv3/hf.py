"""Hugging Face interop for DeepSeek-V3: `DeepseekV3Config` <-> `DeepseekV3Config` (ours), and state
dicts of transformers' `DeepseekV3ForCausalLM` <-> our Megatron `HybridModel` (see
`model.build_deepseekv3_model`). DeepSeek-V3, DeepSeek-R1 and Kimi-K2 (`kimi_k2`, the same
architecture) checkpoints convert.

Megatron layout: decoder layer i is HybridStack symbol 2i (attention: `input_layernorm`,
`self_attention.*`) and symbol 2i + 1 (FFN: `pre_mlp_layernorm`, `mlp.*`). Fused gated projections
keep rows `[gate; up]` on both sides (Megatron's GLU applies the activation to the first half of
`linear_fc1`'s output; transformers' experts do `gate, up = linear(x, gate_up_proj[e]).chunk(2)`).
Routed experts are one Megatron module each (`experts.local_experts.e`) and one slice of HF's
stacked `[E, ...]` tensors. Only expert-parallel size 1 is supported here (every rank holds all
experts; `parallel.load_full_state_dict` shards a full state dict over EP).

transformers builds `q_a_layernorm` / `kv_a_layernorm` with eps 1e-6 whatever `rms_norm_eps` is;
our spec builds the latent norms with `DeepseekV3Config.latent_norm_eps` (default 1e-6) to match.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import torch

from megatron_longstraw.models.deepseekv3.config import DeepseekV3Config
from megatron_longstraw.models.family import HFConversion

if TYPE_CHECKING:
    from transformers import DeepseekV3Config as HFDeepseekV3Config

_SAME_NAME_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size",
    "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
    "first_k_dense_replace", "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob",
    "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
)
_HF_LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default for q_a / kv_a_layernorm
_YARN_KEYS = ("original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim")


def _check_representable(cfg: DeepseekV3Config) -> None:
    """Raise if `cfg` uses a setting that transformers' DeepseekV3 cannot express."""
    problems = []
    if cfg.latent_norm_eps != _HF_LATENT_NORM_EPS:
        problems.append(f"latent_norm_eps={cfg.latent_norm_eps} (transformers uses 1e-6)")
    if not cfg.norm_topk_prob:
        problems.append("norm_topk_prob=False (Megatron's sigmoid router always normalises)")
    elif cfg.num_experts_per_tok == 1:
        problems.append("num_experts_per_tok=1 (transformers normalises the single weight to 1, "
                        "Megatron keeps the sigmoid score)")
    if cfg.n_group > 1 and cfg.num_experts_per_tok // cfg.topk_group != 2:
        problems.append("n_group > 1 with num_experts_per_tok // topk_group != 2 (transformers "
                        "scores a group by its top-2 experts, Megatron by its top-k/topk_group)")
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


@dataclass(frozen=True)
class _Entry:
    """One HF <-> Megatron correspondence. kind 'copy': meg[0] == hf[0]; 'cat': meg[0] ==
    cat(hf[0], hf[1]) on dim 0 (gate, up); 'stack': hf[0] == stack(meg) (routed experts)."""

    kind: str
    meg: tuple[str, ...]
    hf: tuple[str, ...]


def _mapping(cfg: DeepseekV3Config) -> list[_Entry]:
    """Every tensor correspondence of a DeepSeek-V3 model described by `cfg`."""
    copy = lambda meg, hf: _Entry("copy", (meg,), (hf,))  # noqa: E731
    entries = [copy("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
               copy("decoder.final_norm.weight", "model.norm.weight")]
    if not cfg.tie_word_embeddings:
        entries.append(copy("output_layer.weight", "lm_head.weight"))
    for i in range(cfg.num_hidden_layers):
        a, f, h = f"decoder.layers.{2 * i}", f"decoder.layers.{2 * i + 1}", f"model.layers.{i}"
        sa, attn = f"{a}.self_attention", f"{h}.self_attn"
        entries += [copy(f"{a}.input_layernorm.weight", f"{h}.input_layernorm.weight"),
                    copy(f"{f}.pre_mlp_layernorm.weight", f"{h}.post_attention_layernorm.weight")]
        for meg, hf in (("linear_q_down_proj", "q_a_proj"), ("q_layernorm", "q_a_layernorm"),
                        ("linear_q_up_proj", "q_b_proj"), ("linear_kv_down_proj", "kv_a_proj_with_mqa"),
                        ("kv_layernorm", "kv_a_layernorm"), ("linear_kv_up_proj", "kv_b_proj"),
                        ("linear_proj", "o_proj")):
            entries.append(copy(f"{sa}.{meg}.weight", f"{attn}.{hf}.weight"))
        mlp, hmlp = f"{f}.mlp", f"{h}.mlp"
        gated = lambda meg, hf: [  # noqa: E731
            _Entry("cat", (f"{meg}.linear_fc1.weight",), (f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight")),
            copy(f"{meg}.linear_fc2.weight", f"{hf}.down_proj.weight")]
        if not cfg.is_moe_layer(i):
            entries += gated(mlp, hmlp)
            continue
        experts = range(cfg.n_routed_experts)
        entries += [
            copy(f"{mlp}.router.weight", f"{hmlp}.gate.weight"),
            copy(f"{mlp}.router.expert_bias", f"{hmlp}.gate.e_score_correction_bias"),
            _Entry("stack", tuple(f"{mlp}.experts.local_experts.{e}.linear_fc1.weight" for e in experts),
                   (f"{hmlp}.experts.gate_up_proj",)),
            _Entry("stack", tuple(f"{mlp}.experts.local_experts.{e}.linear_fc2.weight" for e in experts),
                   (f"{hmlp}.experts.down_proj",)),
            *gated(f"{mlp}.shared_experts", f"{hmlp}.shared_experts"),
        ]
    return entries


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module  # DDP / Float16Module wrappers
    return model


def _megatron_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters plus the routers' `expert_bias` buffers (the other buffers are statistics)."""
    model = _unwrap(model)
    tensors = dict(model.named_parameters())
    tensors.update((name, buf) for name, buf in model.named_buffers()
                   if name.endswith("router.expert_bias"))
    return tensors


def _check_names(kind: str, expected: set[str], present: set[str]) -> None:
    missing, unexpected = sorted(expected - present), sorted(present - expected)
    if missing or unexpected:
        raise KeyError(f"{kind} names do not match the DeepSeek-V3 mapping: missing "
                       f"{len(missing)} {missing[:20]}; unexpected {len(unexpected)} "
                       f"{unexpected[:20]}.")


def to_hf_state_dict(model: torch.nn.Module, cfg: DeepseekV3Config) -> dict[str, torch.Tensor]:
    """transformers `DeepseekV3ForCausalLM` state dict of our model (no `lm_head.weight` when the
    embeddings are tied). 1:1 tensors are detached views sharing storage with the model."""
    meg = _megatron_tensors(model)
    entries = _mapping(cfg)
    _check_names("Megatron model", {n for e in entries for n in e.meg}, set(meg))
    out: dict[str, torch.Tensor] = {}
    for e in entries:
        tensors = [meg[n].detach() for n in e.meg]
        if e.kind == "copy":
            out[e.hf[0]] = tensors[0]
        elif e.kind == "cat":
            out[e.hf[0]], out[e.hf[1]] = tensors[0].chunk(2, dim=0)
        else:
            out[e.hf[0]] = torch.stack(tensors)
    return out


def from_hf_state_dict(hf_sd: Mapping[str, torch.Tensor], model: torch.nn.Module,
                       cfg: DeepseekV3Config) -> None:
    """Load a transformers `DeepseekV3ForCausalLM` state dict into our model in place (strict).

    Every Megatron parameter and router `expert_bias` must be covered and every HF key consumed
    (filter e.g. MTP layers `model.layers.{num_hidden_layers}.*` first); with tied embeddings an
    `lm_head.weight` equal to the embedding is accepted. Names and shapes are all checked before
    anything is written. Values are cast to each target tensor's dtype."""
    hf_sd = dict(hf_sd)
    entries = _mapping(cfg)
    if cfg.tie_word_embeddings and "lm_head.weight" in hf_sd:
        lm_head = hf_sd.pop("lm_head.weight")
        if not torch.equal(lm_head, hf_sd.get("model.embed_tokens.weight", lm_head)):
            raise ValueError("tie_word_embeddings=True but lm_head.weight differs from "
                             "model.embed_tokens.weight.")
    _check_names("HF state dict", {n for e in entries for n in e.hf}, set(hf_sd))
    meg = _megatron_tensors(model)
    _check_names("Megatron model", {n for e in entries for n in e.meg}, set(meg))
    writes: list[tuple[str, torch.Tensor]] = []
    for e in entries:
        src = [hf_sd[n] for n in e.hf]
        if e.kind == "copy":
            writes.append((e.meg[0], src[0]))
        elif e.kind == "cat":
            writes.append((e.meg[0], torch.cat(src, dim=0)))
        else:
            if src[0].shape[0] != len(e.meg):
                raise ValueError(f"{e.hf[0]} has {src[0].shape[0]} experts, the model {len(e.meg)}.")
            writes += list(zip(e.meg, src[0].unbind(0)))
    bad = [f"{name}: HF {tuple(v.shape)} vs Megatron {tuple(meg[name].shape)}"
           for name, v in writes if v.shape != meg[name].shape]
    if bad:
        raise ValueError(f"shape mismatch for {len(bad)} tensors: {bad[:20]}.")
    with torch.no_grad():
        for name, value in writes:
            meg[name].copy_(value)


# ---- by tensor name: tools/convert_hf.py --------------------------------------------------------
# On disk HF keeps routed experts as `mlp.experts.{e}.{gate,up,down}_proj.weight` (transformers
# stacks them into `gate_up_proj` / `down_proj` when loading); both layouts are read, the on-disk
# one is written. Multi-token-prediction layers (`model.layers.{num_hidden_layers}.*`, DeepSeek-V3's
# layer 61) are skipped.

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def expert_slot(stacked: str, expert: int) -> list[str]:
    """On-disk names of routed expert `expert` inside transformers' stacked tensor `stacked`
    (`...mlp.experts.gate_up_proj` [E, 2I, H] = [gate; up] per expert, `...down_proj` [E, H, I])."""
    prefix, kind = stacked.rsplit(".", 1)
    if kind == "gate_up_proj":
        return [f"{prefix}.{expert}.gate_proj.weight", f"{prefix}.{expert}.up_proj.weight"]
    return [f"{prefix}.{expert}.down_proj.weight"]


def _text_names(cfg: DeepseekV3Config, names) -> dict[str, str]:
    """{name in the mapping: on-disk name}, without the MTP layers (index >= num_hidden_layers)."""
    return {n: n for n in names
            if not ((m := _LAYER.match(n)) and int(m.group(1)) >= cfg.num_hidden_layers)}


def _to_ours(cfg: DeepseekV3Config, entry: _Entry, read, dtype: torch.dtype, available) -> list:
    if entry.kind == "copy":
        values = [read(entry.hf[0])]
    elif entry.kind == "cat":  # dense / shared-expert [gate; up]
        values = [torch.cat([read(n) for n in entry.hf])]
    elif entry.hf[0] in available:  # routed experts saved stacked (transformers' in-memory layout)
        values = list(read(entry.hf[0]).unbind(0))
    else:                           # routed experts one by one (the layout save_pretrained writes)
        values = [torch.cat([read(n) for n in expert_slot(entry.hf[0], e)])
                  for e in range(len(entry.meg))]
    return list(zip(entry.meg, values))


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _to_hf(cfg: DeepseekV3Config, entry: _Entry) -> list:
    first, second = (lambda t: t.chunk(2)[0]), (lambda t: t.chunk(2)[1])  # [gate; up] rows
    if entry.kind == "copy":
        return [(entry.hf[0], entry.meg[0], _identity)]
    if entry.kind == "cat":
        return [(entry.hf[0], entry.meg[0], first), (entry.hf[1], entry.meg[0], second)]
    plan = []
    for e, meg in enumerate(entry.meg):
        parts = expert_slot(entry.hf[0], e)
        rows = [first, second] if len(parts) == 2 else [_identity]
        plan += [(hf, meg, row) for hf, row in zip(parts, rows)]
    return plan


HF_CONVERSION = HFConversion(
    title="DeepSeek-V3 / R1, Kimi-K2 text model", model_types=("deepseek_v3", "kimi_k2"),
    hf_config_class="DeepseekV3Config", hf_model_class="DeepseekV3ForCausalLM",
    config_from_hf=deepseekv3_config_from_hf, hf_config=hf_config, mapping=_mapping,
    text_config=lambda hf_cfg: dict(hf_cfg), text_names=_text_names, to_ours=_to_ours,
    to_hf=_to_hf, expert_names=expert_slot,
    # Megatron keeps the routers' expert_bias in float32 whatever the parameter dtype.
    float32_names=("router.expert_bias", "e_score_correction_bias"))
