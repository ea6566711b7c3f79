"""A LoRA / QLoRA training checkpoint as a PEFT LoRA adapter for the Hugging Face base model
(`tools/convert_hf.py --to-peft`): `adapter_config.json` + `adapter_model.safetensors`, what
`peft.PeftModel.from_pretrained(base, DIR)` loads (PEFT's format, which serving engines' LoRA
loaders take; not tested here). No model and no process group are built; only the adapters are
read (any CP/EP layout: `model.safetensors` and every `experts_ep<e>.safetensors`, reassembled by
name as export.py does).

A Megatron linear's adapter `W + s B A` (`B: [out, r]`, `A: [r, in]`, `s = alpha / r`) becomes
the adapters of the HF modules its weight maps to, exactly: the family's hf.py gives each HF
weight as a transform of the Megatron weight (`HFConversion.to_hf`). When that transform only
selects rows and columns, `W_hf = W[rows][:, cols]`, then
`(W + s B A)[rows][:, cols] = W_hf + s B[rows] A[:, cols]`: the HF module's `lora_B` is
`B[rows]` and its `lora_A` is `A[:, cols]` (the whole `A` when no input is fused), same `r` and
`alpha`. A fused output (`linear_fc1` = [gate; up], MLA's `linear_q_down_proj`, Qwen3.6's
per-group `linear_qkv` interleaving, GDN's `in_proj` = [qkv; z; b; a]) therefore splits and
permutes `B`'s rows exactly as the weight's rows move, with `A` shared. The selection is read off
the transform itself (`_selection`: applied to an index grid, and to an affine image of it to
rule out value changes), so a family's new correspondence is covered without a table here, and
one that changes values (Qwen3.6's gated-norm `w + 1`) is refused.

Refused, with the module named and the merged export (`--to-hf`) as the way out, never a partial
adapter: a trained module whose HF weight is not a row/column selection of its weight, or whose HF
counterpart is not an `nn.Linear` in transformers' model (routed experts: transformers stacks
them into `experts.gate_up_proj` / `down_proj` parameters, which PEFT's LoRA layers do not wrap).

Loading with peft: peft 0.21 on transformers 5 rewrites the targets of MoE model types whose
experts transformers v5 stacks (`glm_moe_dsa`, `deepseek_v3`): every target named `gate_proj`,
`up_proj` or `down_proj` is taken for a routed expert and moved to the stacked
`experts.gate_up_proj` / `down_proj` parameters (its v4 -> v5 conversion,
`peft.utils.transformers_weight_conversion._convert_peft_config_moe`), so stock
`PeftModel.from_pretrained` silently drops the adapters of the dense FFN layers and the shared
experts. Such an adapter is refused by default (`peft_remapped_leaves` reads which model types and
leaf names the installed peft remaps, so the check follows the pinned peft; without peft,
`PEFT_REMAPPED` records what peft 0.21.2 does): export merged, train without the FFN adapters, or
pass `keep_ffn` (`--peft-keep-ffn`) to write them for loaders that map modules by name.

What the adapter sits on: the HF base the run started from. For QLoRA that is the original
(unquantised) base, while training saw its NF4 round trip: the adapter on the original base is
the trained policy up to NF4's error (the merged export is the trained policy exactly). For LoRA
on the FP8 base (`--longstraw-fp8-base`) it is the dequantised base: load the FP8 checkpoint
dequantised (or export the base with `--to-hf --fp8 dequantize`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from megatron_longstraw.checkpointing import checkpoint, export, model_format
from megatron_longstraw.checkpointing.hf import ConversionError, staged_dir
from megatron_longstraw.models.registry import FAMILIES, Family
from megatron_longstraw.runtime.errors import CheckpointError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""PEFT's saved names: `base_model.model.<HF module>.lora_{A,B}.weight`."""


PEFT_REMAPPED = {"glm_moe_dsa": ("down_proj", "gate", "gate_proj", "up_proj"),
                 "deepseek_v3": ("down_proj", "gate", "gate_proj", "up_proj")}
"""{HF model_type: target leaf names} that peft 0.21.2 on transformers 5 moves to stacked expert
parameters (its `_MODEL_TO_CONVERSION_PATTERN` maps both types to `qwen2_moe`, whose
`_MOE_TARGET_MODULE_MAPPING` is these names); used only when peft is not installed
(`peft_remapped_leaves`; tests/test_peft_export.py checks it against the pinned peft)."""


def peft_remapped_leaves(model_type: str) -> tuple[str, ...]:
    """Target leaf names that `peft.PeftModel.from_pretrained` on a `model_type` base moves away
    from their `nn.Linear` modules to stacked expert parameters, read from the installed peft
    (its v4 -> v5 conversion `_convert_peft_config_moe` applies exactly when the model type has a
    transformers checkpoint conversion, a `_MODEL_TO_CONVERSION_PATTERN` entry whose
    `_MOE_TARGET_MODULE_MAPPING` and `_MOE_FUSED_TARGETS` are non-empty); `PEFT_REMAPPED` when
    peft (or that module of it) is not installed."""
    try:
        from peft.utils import transformers_weight_conversion as conversion
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return PEFT_REMAPPED.get(model_type, ())
    if get_checkpoint_conversion_mapping(model_type) is None:
        return ()
    pattern = conversion._MODEL_TO_CONVERSION_PATTERN.get(model_type)
    mapping = conversion._MOE_TARGET_MODULE_MAPPING.get(pattern) or {}
    if not conversion._MOE_FUSED_TARGETS.get(pattern):
        return ()
    return tuple(sorted(mapping))


def _model_type(family: Family, cfg, meta: dict) -> str:
    """The HF base's model_type: its config.json's when the run's base was converted from a
    readable HF directory, else the one the family's config writes."""
    source = _base_model(meta)
    if source:
        try:
            return json.loads((Path(source) / "config.json").read_text())["model_type"]
        except (OSError, KeyError, ValueError):
            pass
    return family.hf.hf_config(cfg).model_type


def _selection(transform, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, cols) with `transform(W) == W[rows][:, cols]` for every W of `shape`, or None when
    `transform` is not such a selection. The grid `g[i, j] = i * in + j` (exact in float64 below
    2^53) decodes into a row and a column per output element; the decoding must be separable and
    in range, and an affine image of the grid (`3 g + 1`) must come out as the same image of the
    output, which a value-changing transform (`w + 1`, a scale) fails."""
    out_dim, in_dim = shape
    if out_dim * in_dim >= 2 ** 53:
        return None
    grid = (torch.arange(out_dim, dtype=torch.float64)[:, None] * in_dim
            + torch.arange(in_dim, dtype=torch.float64)[None, :])
    picked = transform(grid)
    if picked.dim() != 2 or picked.numel() == 0 or not torch.equal(picked, picked.round()):
        return None
    if not torch.equal(transform(3 * grid + 1), 3 * picked + 1):
        return None
    flat = picked.to(torch.int64)
    rows, cols = flat // in_dim, flat % in_dim
    if bool((flat < 0).any()) or bool((rows >= out_dim).any()):
        return None
    if not (bool((rows == rows[:, :1]).all()) and bool((cols == cols[:1, :]).all())):
        return None
    return rows[:, 0].clone(), cols[0, :].clone()


def _adapters(found: Path, meta: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{Megatron module (single-process name): (A [r, in], B [out, r])} of every shard."""
    saved = model_format.SafetensorsReader(export._shard_files(found, meta))
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name in saved:
        for kind in ("lora_A", "lora_B"):
            if name.endswith("." + kind):
                modules.setdefault(name[:-len(kind) - 1], {})[kind] = saved[name]
    broken = sorted(m for m, parts in modules.items() if len(parts) != 2)
    if broken or not modules:
        raise CheckpointError(f"{found}: {'no LoRA adapters' if not modules else 'adapters without '
                              f'both lora_A and lora_B: {broken[:5]}'}; it was not written by a "
                              "LoRA run of the launcher.")
    return {m: (parts["lora_A"], parts["lora_B"]) for m, parts in sorted(modules.items())}


def _hf_linears(family: Family, cfg) -> dict[str, tuple[int, int]]:
    """{HF module name: (out, in)} of every `nn.Linear` in transformers' model (meta device)."""
    import transformers

    config = family.hf.hf_config(cfg)
    with torch.device("meta"):
        model = getattr(transformers, family.hf.hf_model_class)(config)
    return {n: (m.out_features, m.in_features) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)}


def _base_model(meta: dict) -> str | None:
    """The HF directory the run's base was converted from (its model-format `source`), if any."""
    source = (meta.get("lora") or {}).get("base", {}).get("source") or meta.get("initial_weights")
    if not source or not model_format.is_model_format(source):
        return None
    base = model_format.read_meta(Path(source) / model_format.MODEL_META, model_format.MODEL_FORMAT)
    return base.get("source")


def _short_targets(modules: list[str], linears: dict) -> list[str]:
    """PEFT `target_modules`: the modules' last names when those select exactly `modules` among
    the HF model's linears (PEFT matches a name or a `.name` suffix), else the full names."""
    short = sorted({m.rsplit(".", 1)[-1] for m in modules})
    selected = {n for n in linears if n.rsplit(".", 1)[-1] in short}
    return short if selected == set(modules) else sorted(modules)


def peft_adapter(family: Family | None, ckpt: Path, dtype: torch.dtype = torch.float32,
                 keep_ffn: bool = False) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """(adapter_config.json dict, {PEFT name: tensor}, meta) of the LoRA training checkpoint
    `ckpt` (a step_N folder or a --save folder: its latest). Raises ConversionError naming a
    trained module PEFT cannot express, or (unless `keep_ffn`) modules whose adapters stock peft
    would not apply on this base (`peft_remapped_leaves`)."""
    found = export.resolve_training_checkpoint(ckpt)
    if found is None:
        raise ConversionError(f"{ckpt} is not a training checkpoint (a step_N folder with "
                              f"{checkpoint.TRAIN_META}, or a --save folder holding one); "
                              "--to-peft exports the adapters of a LoRA / QLoRA run.")
    meta = checkpoint.read_checkpoint_meta(found)
    record = meta.get("lora")
    if not record:
        raise ConversionError(f"{found} is a full-parameter checkpoint: it has no adapters to "
                              "export; use --to-hf.")
    if family is None:
        family = FAMILIES.get(meta.get("family"))
        if family is None:
            raise ConversionError(f"{found} holds a {meta.get('family')!r} model; families: "
                                  f"{', '.join(sorted(FAMILIES))}.")
    if meta.get("family") != family.name:
        raise ConversionError(f"{found} holds a {meta.get('family')!r} model, not {family.name}.")
    cfg = family.config_class.from_dict(meta["model"])
    adapters = _adapters(found, meta)
    plan: dict[str, list] = {}
    for entry in family.hf.mapping(cfg):
        for hf_name, meg, transform in family.hf.to_hf(cfg, entry):
            plan.setdefault(meg, []).append((hf_name, transform))
    linears = _hf_linears(family, cfg)
    merged_hint = ("export the merged model instead: tools/convert_hf.py --to-hf --hf-dir OUT "
                   f"--out {ckpt}")
    tensors: dict[str, torch.Tensor] = {}
    modules: list[str] = []
    cache: dict = {}   # every layer's transform of one kind and shape selects the same rows
    for module, (lora_a, lora_b) in adapters.items():
        weight = f"{module}.weight"
        shape = (lora_b.shape[0], lora_a.shape[1])
        if weight not in plan:
            raise ConversionError(f"{found}: the trained module {module} has no Hugging Face "
                                  f"weight in the {family.name} mapping; {merged_hint}.")
        for hf_name, transform in plan[weight]:
            hf_module = hf_name.removesuffix(".weight")
            if hf_module not in linears:
                raise ConversionError(
                    f"{found}: the trained module {module} maps to {hf_name}, which is no "
                    "nn.Linear in transformers' model (routed experts are stacked into "
                    "experts.gate_up_proj / down_proj parameters) and cannot carry a PEFT LoRA "
                    f"adapter; {merged_hint} (or train with --longstraw-lora-exclude "
                    "'*.experts.*').")
            key = (re.sub(r"\.\d+\.", ".N.", weight), shape, hf_name.rsplit(".", 2)[-2])
            if key not in cache:
                cache[key] = _selection(transform, shape)
            picked = cache[key]
            if picked is None:
                raise ConversionError(
                    f"{found}: the trained module {module} maps to {hf_name} by a transform "
                    "that is not a selection of rows and columns, so its adapter has no exact "
                    f"PEFT LoRA form; {merged_hint}.")
            rows, cols = picked
            if (len(rows), len(cols)) != linears[hf_module]:
                raise ConversionError(f"{found}: {module} gives {hf_module} the shape "
                                      f"{(len(rows), len(cols))}, transformers' model has "
                                      f"{linears[hf_module]}.")
            name = f"{PEFT_PREFIX}{hf_module}"
            tensors[f"{name}.lora_A.weight"] = lora_a[:, cols].to(dtype).contiguous()
            tensors[f"{name}.lora_B.weight"] = lora_b[rows].to(dtype).contiguous()
            modules.append(hf_module)
    model_type = _model_type(family, cfg, meta)
    remapped = peft_remapped_leaves(model_type)
    dropped = [m for m in modules if m.rsplit(".", 1)[-1] in remapped]
    if dropped and not keep_ffn:
        names = sorted({m.rsplit(".", 1)[-1] for m in dropped})
        raise ConversionError(
            f"{found}: stock peft.PeftModel.from_pretrained would silently drop the adapters of "
            f"{len(dropped)} dense-layer / shared-expert FFN modules ({', '.join(dropped[:3])}"
            f"{', ...' if len(dropped) > 3 else ''}): on this {model_type} "
            f"base peft takes every {' / '.join(names)} target for the stacked routed experts "
            "(peft.utils.transformers_weight_conversion); export merged (--to-hf), or train "
            "without FFN adapters (--longstraw-lora-targets with the attention modules only, "
            "e.g. linear_q_down_proj linear_q_up_proj linear_kv_down_proj linear_kv_up_proj "
            "linear_proj, or --longstraw-lora-exclude linear_fc1 linear_fc2), or pass "
            "--peft-keep-ffn to write them anyway for a loader that maps modules by name "
            "(stock peft drops them).")
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "auto_mapping": None,
        "base_model_name_or_path": _base_model(meta), "revision": None,
        "r": int(record["rank"]), "lora_alpha": float(record["alpha"]), "lora_dropout": 0.0,
        "target_modules": _short_targets(modules, linears), "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
        "alpha_pattern": {},
    }
    return config, tensors, {"found": found, "meta": meta, "family": family,
                             "peft_drops": dropped}


def longstraw_to_peft(family: Family | None, ckpt: Path, out: Path,
                      dtype: torch.dtype = torch.float32, base_model: str | None = None,
                      keep_ffn: bool = False) -> dict:
    """Write `peft_adapter(...)` into `out` (new or empty): adapter_config.json (its
    `base_model_name_or_path` is `base_model`, default the HF directory the run's base was
    converted from) and adapter_model.safetensors. Nothing is written when it raises (a
    temporary folder renamed at the end). Returns a summary."""
    config, tensors, info = peft_adapter(family, ckpt, dtype, keep_ffn)
    if base_model is not None:
        config["base_model_name_or_path"] = base_model
    with staged_dir(out, "--to-peft never overwrites an adapter") as tmp:
        model_format.write_safetensors(tmp / ADAPTER_WEIGHTS, tensors, metadata={"format": "pt"})
        model_format.write_text_atomic(tmp / ADAPTER_CONFIG,
                                       json.dumps(config, indent=2, sort_keys=True) + "\n")
    note = {"note": f"--peft-keep-ffn: {len(info['peft_drops'])} FFN modules written that "
                    "stock peft.PeftModel.from_pretrained drops on this base"
            } if info["peft_drops"] else {}
    return {"family": info["family"].name, "modules": len(tensors) // 2, "rank": config["r"],
            "alpha": config["lora_alpha"], "dtype": model_format.DTYPE_NAMES[dtype],
            "base": config["base_model_name_or_path"],
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values()), **note}


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PEFT_REMAPPED", "longstraw_to_peft",
           "peft_adapter", "peft_remapped_leaves"]
