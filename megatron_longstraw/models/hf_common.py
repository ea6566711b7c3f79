"""What the families' Hugging Face interop (`models/<family>/hf.py`) shares: the tensor
correspondences (`Entry`), the strict state-dict drivers over them, and their by-name halves for
checkpointing/hf.py (tools/convert_hf.py); plus the mapping of the MLA + MoE decoder that GLM-5.2 and DeepSeek-V3 share.

Megatron layout of every family: decoder layer i is HybridStack symbol 2i (the mixer:
`input_layernorm`, `self_attention.*`) and symbol 2i + 1 (the FFN: `pre_mlp_layernorm`, `mlp.*`).
Fused gated projections keep rows `[gate; up]` on both sides (Megatron's GLU applies the
activation to the first half of `linear_fc1`'s output; transformers' experts do
`gate, up = linear(x, gate_up_proj[e]).chunk(2)`). Routed experts are one Megatron module each
(`experts.local_experts.e`) and one slice of HF's stacked `[E, ...]` tensors.

Entry kinds handled here: 'copy', 'cat', 'stack'. A family with other kinds (Qwen3.6's
'minus_one', 'gated_qkv') passes its own `special_*` transform for them, and `split_sizes` where
its 'cat' parts are not equal.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Entry:
    """One HF <-> Megatron correspondence. kind 'copy': meg[0] == hf[0]; 'cat': meg[0] ==
    cat(hf) on dim 0 (e.g. gate, up); 'stack': hf[0] == stack(meg) (routed experts); other kinds
    are a family's own."""

    kind: str
    meg: tuple[str, ...]
    hf: tuple[str, ...]


def copy(meg: str, hf: str) -> Entry:
    return Entry("copy", (meg,), (hf,))


def cat(meg: str, hf: Sequence[str]) -> Entry:
    return Entry("cat", (meg,), tuple(hf))


# ---- config ------------------------------------------------------------------------------------


MLA_MOE_SAME_NAME_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size",
    "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
    "first_k_dense_replace", "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob",
    "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
)
"""Config fields an MLA + MoE family's config and transformers' (GLM-5.2, DeepSeek-V3) name the
same way."""


def sigmoid_router_problems(cfg) -> list[str]:
    """What transformers' DeepSeek-V3-style sigmoid router (GLM-5.2, DeepSeek-V3) computes
    differently from Megatron's for `cfg` (HF field names): one message per setting."""
    problems = []
    if not cfg.norm_topk_prob:
        problems.append("norm_topk_prob=False (Megatron's sigmoid router always normalises)")
    elif cfg.num_experts_per_tok == 1:
        problems.append("num_experts_per_tok=1 (transformers normalises the single weight to 1, "
                        "Megatron keeps the sigmoid score)")
    if cfg.n_group > 1 and cfg.num_experts_per_tok // cfg.topk_group != 2:
        problems.append("n_group > 1 with num_experts_per_tok // topk_group != 2 (transformers "
                        "scores a group by its top-2 experts, Megatron by its top-k/topk_group)")
    return problems


# ---- the mapping's pieces -----------------------------------------------------------------------


def model_entries(cfg) -> list[Entry]:
    """Embedding, final norm and (untied) output layer."""
    entries = [copy("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
               copy("decoder.final_norm.weight", "model.norm.weight")]
    if not cfg.tie_word_embeddings:
        entries.append(copy("output_layer.weight", "lm_head.weight"))
    return entries


def layer_prefixes(i: int) -> tuple[str, str, str]:
    """Decoder layer i: (its Megatron mixer symbol, its Megatron FFN symbol, its HF layer)."""
    return f"decoder.layers.{2 * i}", f"decoder.layers.{2 * i + 1}", f"model.layers.{i}"


def layer_norm_entries(mixer: str, ffn: str, hf: str) -> list[Entry]:
    """The two residual-stream norms of a decoder layer (see `layer_prefixes`)."""
    return [copy(f"{mixer}.input_layernorm.weight", f"{hf}.input_layernorm.weight"),
            copy(f"{ffn}.pre_mlp_layernorm.weight", f"{hf}.post_attention_layernorm.weight")]


def gated_mlp_entries(meg: str, hf: str) -> list[Entry]:
    """A gated MLP: Megatron `linear_fc1` = [gate_proj; up_proj], `linear_fc2` = `down_proj`."""
    return [cat(f"{meg}.linear_fc1.weight", (f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight")),
            copy(f"{meg}.linear_fc2.weight", f"{hf}.down_proj.weight")]


_MLA_PROJECTIONS = (
    ("linear_q_down_proj", "q_a_proj"), ("q_layernorm", "q_a_layernorm"),
    ("linear_q_up_proj", "q_b_proj"), ("linear_kv_down_proj", "kv_a_proj_with_mqa"),
    ("kv_layernorm", "kv_a_layernorm"), ("linear_kv_up_proj", "kv_b_proj"),
    ("linear_proj", "o_proj"))
"""`MLASelfAttention` submodule -> transformers' DeepSeek-V3-style attention module."""


def mla_moe_mapping(cfg, attention_extra: Callable[[int, str, str], list[Entry]] | None = None
                    ) -> list[Entry]:
    """Every tensor correspondence of an MLA + MoE model (`cfg`: HF field names; GLM-5.2,
    DeepSeek-V3): per decoder layer the norms, MLA's projections, `attention_extra(i, Megatron
    self_attention prefix, HF self_attn prefix)` (GLM-5.2's DSA indexer), then the dense MLP
    (`cfg.is_moe_layer(i)` false) or the MoE: router weight and `expert_bias`
    (`e_score_correction_bias`), routed experts stacked, shared experts."""
    entries = model_entries(cfg)
    for i in range(cfg.num_hidden_layers):
        a, f, h = layer_prefixes(i)
        sa, attn = f"{a}.self_attention", f"{h}.self_attn"
        entries += layer_norm_entries(a, f, h)
        entries += [copy(f"{sa}.{meg}.weight", f"{attn}.{hf}.weight")
                    for meg, hf in _MLA_PROJECTIONS]
        if attention_extra is not None:
            entries += attention_extra(i, sa, attn)
        mlp, hmlp = f"{f}.mlp", f"{h}.mlp"
        if not cfg.is_moe_layer(i):
            entries += gated_mlp_entries(mlp, hmlp)
            continue
        experts = [f"{mlp}.experts.local_experts.{e}" for e in range(cfg.n_routed_experts)]
        entries += [
            copy(f"{mlp}.router.weight", f"{hmlp}.gate.weight"),
            copy(f"{mlp}.router.expert_bias", f"{hmlp}.gate.e_score_correction_bias"),
            Entry("stack", tuple(f"{e}.linear_fc1.weight" for e in experts),
                  (f"{hmlp}.experts.gate_up_proj",)),
            Entry("stack", tuple(f"{e}.linear_fc2.weight" for e in experts),
                  (f"{hmlp}.experts.down_proj",)),
            *gated_mlp_entries(f"{mlp}.shared_experts", f"{hmlp}.shared_experts"),
        ]
    return entries


ROUTER_FLOAT32_NAMES = ("router.expert_bias", "e_score_correction_bias")
"""`HFConversion.float32_names` of a model with routers: Megatron keeps the routers' expert_bias in
float32 whatever the parameter dtype."""


# ---- state dicts --------------------------------------------------------------------------------


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module  # DDP / Float16Module wrappers
    return model


def megatron_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters plus the routers' `expert_bias` buffers (the other buffers are statistics)."""
    model = unwrap(model)
    tensors = dict(model.named_parameters())
    tensors.update((name, buf) for name, buf in model.named_buffers()
                   if name.endswith("router.expert_bias"))
    return tensors


def check_names(family: str, kind: str, expected: set[str], present: set[str]) -> None:
    """KeyError naming what `present` (the `kind` side) lacks and has beyond `family`'s mapping."""
    missing, unexpected = sorted(expected - present), sorted(present - expected)
    if missing or unexpected:
        raise KeyError(f"{kind} names do not match the {family} mapping: missing {len(missing)} "
                       f"{missing[:20]}; unexpected {len(unexpected)} {unexpected[:20]}.")


def to_hf_state_dict(model: torch.nn.Module, entries: Sequence[Entry], family: str,
                     split_sizes: Callable[[Entry], list[int]] | None = None,
                     special: Callable[[Entry, torch.Tensor], Sequence[torch.Tensor]] | None = None
                     ) -> dict[str, torch.Tensor]:
    """HF state dict of our model over `entries`, without `lm_head.weight` when the embeddings
    are tied (a 'cat' is split into equal parts unless `split_sizes(entry)` says otherwise;
    `special(entry, tensor)` gives the HF tensors of the family's own kinds). 1:1 tensors are
    detached views sharing storage with the model."""
    meg = megatron_tensors(model)
    check_names(family, "Megatron model", {n for e in entries for n in e.meg}, set(meg))
    out: dict[str, torch.Tensor] = {}
    for e in entries:
        tensors = [meg[n].detach() for n in e.meg]
        if e.kind == "copy":
            out[e.hf[0]] = tensors[0]
        elif e.kind == "cat":
            parts = (tensors[0].chunk(len(e.hf), dim=0) if split_sizes is None
                     else tensors[0].split(split_sizes(e), dim=0))
            out.update(zip(e.hf, parts))
        elif e.kind == "stack":
            out[e.hf[0]] = torch.stack(tensors)
        else:
            out.update(zip(e.hf, special(e, tensors[0])))
    return out


def from_hf_state_dict(hf_sd: Mapping[str, torch.Tensor], model: torch.nn.Module,
                       entries: Sequence[Entry], family: str, tie_word_embeddings: bool,
                       split_sizes: Callable[[Entry], list[int]] | None = None,
                       special: Callable[[Entry, list[torch.Tensor], torch.Tensor], torch.Tensor]
                       | None = None) -> None:
    """Load an HF state dict into our model in place over `entries`, strictly: every Megatron
    parameter and router `expert_bias` must be covered and every HF key consumed (filter e.g.
    multi-token-prediction layers first); with tied embeddings an `lm_head.weight` equal to the
    embedding is accepted. With `split_sizes` each 'cat' part is checked to be 2-D with its rows;
    `special(entry, HF tensors, target)` gives the value of a family's own kind. Names and shapes
    are all checked before anything is written; values are cast to each target tensor's dtype."""
    hf_sd = dict(hf_sd)
    if tie_word_embeddings and "lm_head.weight" in hf_sd:
        lm_head = hf_sd.pop("lm_head.weight")
        if not torch.equal(lm_head, hf_sd.get("model.embed_tokens.weight", lm_head)):
            raise ValueError("tie_word_embeddings=True but lm_head.weight differs from "
                             "model.embed_tokens.weight.")
    check_names(family, "HF state dict", {n for e in entries for n in e.hf}, set(hf_sd))
    meg = megatron_tensors(model)
    check_names(family, "Megatron model", {n for e in entries for n in e.meg}, set(meg))
    writes: list[tuple[str, torch.Tensor]] = []
    for e in entries:
        src = [hf_sd[n] for n in e.hf]
        if e.kind == "copy":
            writes.append((e.meg[0], src[0]))
        elif e.kind == "cat":
            if split_sizes is not None:
                check_rows(e.hf, src, split_sizes(e))
            writes.append((e.meg[0], torch.cat(src, dim=0)))
        elif e.kind == "stack":
            if src[0].shape[0] != len(e.meg):
                raise ValueError(f"{e.hf[0]} has {src[0].shape[0]} experts, the model "
                                 f"{len(e.meg)}.")
            writes += list(zip(e.meg, src[0].unbind(0)))
        else:
            writes.append((e.meg[0], special(e, src, meg[e.meg[0]])))
    bad = [f"{name}: HF {tuple(v.shape)} vs Megatron {tuple(meg[name].shape)}"
           for name, v in writes if v.shape != meg[name].shape]
    if bad:
        raise ValueError(f"shape mismatch for {len(bad)} tensors: {bad[:20]}.")
    with torch.no_grad():
        for name, value in writes:
            meg[name].copy_(value)


def check_rows(names: Iterable[str], tensors: Iterable[torch.Tensor], rows: Iterable[int]) -> None:
    """ValueError unless each tensor is 2-D with its number of rows."""
    bad = [f"{n}: {tuple(t.shape)}" for n, t, size in zip(names, tensors, rows)
           if t.dim() != 2 or t.shape[0] != size]
    if bad:
        raise ValueError(f"shape mismatch for {bad}.")


# ---- by tensor name: checkpointing/hf.py (tools/convert_hf.py) ----------------------------------
# On disk HF keeps routed experts as `mlp.experts.{e}.{gate,up,down}_proj.weight` (transformers
# stacks them into `gate_up_proj` / `down_proj` when loading); both layouts are read, the on-disk
# one is written.

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def expert_slot(stacked: str, expert: int) -> list[str]:
    """On-disk names of routed expert `expert` inside transformers' stacked tensor `stacked`
    (`...mlp.experts.gate_up_proj` [E, 2I, H] = [gate; up] per expert, `...down_proj` [E, H, I])."""
    prefix, kind = stacked.rsplit(".", 1)
    if kind == "gate_up_proj":
        return [f"{prefix}.{expert}.gate_proj.weight", f"{prefix}.{expert}.up_proj.weight"]
    return [f"{prefix}.{expert}.down_proj.weight"]


def text_config(hf_cfg: dict) -> dict:
    """`HFConversion.text_config` of a text-only checkpoint: its config.json values as they are."""
    return dict(hf_cfg)


def text_names_without_mtp(cfg, names) -> dict[str, str]:
    """{name in the mapping: on-disk name}, without the multi-token-prediction layers
    (`model.layers.{i}.*` with i >= num_hidden_layers)."""
    return {n: n for n in names
            if not ((m := _LAYER.match(n)) and int(m.group(1)) >= cfg.num_hidden_layers)}


def to_ours(cfg, entry: Entry, read, dtype: torch.dtype, available) -> list:
    """`HFConversion.to_ours` of the 'copy', 'cat' and 'stack' kinds."""
    if entry.kind == "copy":
        values = [read(entry.hf[0])]
    elif entry.kind == "cat":  # e.g. dense / shared-expert [gate; up]
        values = [torch.cat([read(n) for n in entry.hf])]
    elif entry.hf[0] in available:  # routed experts saved stacked (transformers' in-memory layout)
        values = list(read(entry.hf[0]).unbind(0))
    else:                           # routed experts one by one (the layout save_pretrained writes)
        values = [torch.cat([read(n) for n in expert_slot(entry.hf[0], e)])
                  for e in range(len(entry.meg))]
    return list(zip(entry.meg, values))


def identity(t: torch.Tensor) -> torch.Tensor:
    return t


def to_hf(cfg, entry: Entry, split_sizes: list[int] | None = None) -> list:
    """`HFConversion.to_hf` of the 'copy', 'cat' (equal parts unless `split_sizes`) and 'stack'
    kinds."""
    if entry.kind == "copy":
        return [(entry.hf[0], entry.meg[0], identity)]
    if entry.kind == "cat":
        if split_sizes is None:
            parts = len(entry.hf)
            return [(hf, entry.meg[0], lambda t, j=j: t.chunk(parts)[j])
                    for j, hf in enumerate(entry.hf)]
        return [(hf, entry.meg[0], lambda t, j=j: t.split(split_sizes)[j])
                for j, hf in enumerate(entry.hf)]
    first, second = (lambda t: t.chunk(2)[0]), (lambda t: t.chunk(2)[1])  # [gate; up] rows
    plan = []
    for e, meg in enumerate(entry.meg):
        parts = expert_slot(entry.hf[0], e)
        rows = [first, second] if len(parts) == 2 else [identity]
        plan += [(hf, meg, row) for hf, row in zip(parts, rows)]
    return plan
