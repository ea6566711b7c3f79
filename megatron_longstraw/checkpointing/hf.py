"""Hugging Face <-> the plugin's model format (model_format.py), by tensor name: no model and no
process group are built (tools/convert_hf.py is the command line; its docstring describes the
conversion, block-FP8 checkpoints and each family's particulars).

`hf_to_longstraw` reads a Hugging Face directory (config.json + *.safetensors, sharded with
model.safetensors.index.json or not; `hf_weight_files`) lazily, one tensor at a time, and writes
the model format; `longstraw_to_hf` writes it back shard by shard, from the model format or from
a training checkpoint (export.py reads either). The tensor mapping is the
family's hf.py (its record's `hf`, `HFConversion` in models/family.py, collected by
models/registry.py); the reading, checking and writing are shared here. A checkpoint that cannot be
converted raises `ConversionError` (a ValueError) saying why and what to do.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_longstraw.checkpointing import model_format
from megatron_longstraw.kernels import fp8
from megatron_longstraw.models.registry import FAMILIES, Family

Transform = Callable[[torch.Tensor], torch.Tensor]


class ConversionError(ValueError):
    """A checkpoint that cannot be converted; the message says why and what to do."""


# ---- Hugging Face side --------------------------------------------------------------------------


def hf_weight_files(hf_dir: Path) -> list[Path]:
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [hf_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ConversionError(f"{hf_dir} has no *.safetensors files (PyTorch .bin checkpoints are "
                              "not read: re-save them with save_pretrained(safe_serialization=True)).")
    return files


def _expected_hf_shapes(family: Family, text_config: dict) -> dict[str, tuple[int, ...]]:
    """Tensor shapes the config implies, transformers' in-memory names plus on-disk expert names
    (a meta-device model: no memory, no weights)."""
    import transformers

    config = getattr(transformers, family.hf.hf_config_class).from_dict(dict(text_config))
    with torch.device("meta"):
        model = getattr(transformers, family.hf.hf_model_class)(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    expert_names = family.hf.expert_names
    for name, shape in list(shapes.items()) if expert_names else ():
        if name.endswith("experts.gate_up_proj"):
            for e in range(shape[0]):
                for part in expert_names(name, e):
                    shapes[part] = (shape[1] // 2, shape[2])
        elif name.endswith("experts.down_proj"):
            for e in range(shape[0]):
                shapes[expert_names(name, e)[0]] = shape[1:]
    return shapes


def _declared_dtype(hf_cfg: dict) -> str | None:
    for values in (hf_cfg, hf_cfg.get("text_config") or {}):
        declared = values.get("dtype") or values.get("torch_dtype")
        if declared:
            return declared
    return None


def _check_model_type(family: Family, hf_cfg: dict, config_path: Path) -> None:
    model_type = hf_cfg.get("model_type")
    if model_type in family.hf.model_types:
        return
    other = [f.name for f in FAMILIES.values() if model_type in f.hf.model_types]
    hint = f" (that is --family {other[0]})" if other else ""
    raise ConversionError(f"{config_path}: model_type {model_type!r}{hint} is not "
                          f"{' or '.join(map(repr, family.hf.model_types))} ({family.hf.title}); "
                          f"nothing else converts to --family {family.name}.")


def family_of_hf_config(hf_cfg: dict, config_path: Path) -> Family:
    """The family whose conversion reads `hf_cfg`'s model_type (the default of convert_hf.py's
    --family)."""
    model_type = hf_cfg.get("model_type")
    found = [f for f in FAMILIES.values() if model_type in f.hf.model_types]
    if not found:
        known = ", ".join(f"{t!r} ({f.name})" for f in FAMILIES.values() for t in f.hf.model_types)
        raise ConversionError(f"{config_path}: model_type {model_type!r} is none that converts; "
                              f"known: {known}.")
    return found[0]


def _check_fp8_config(family: Family, hf_cfg: dict, where: Path, found: str) -> None:
    """Refuse FP8 tensors the family's conversion cannot keep, or another block layout."""
    if not family.hf.fp8_checkpoints:
        allowed = sorted(f.name for f in FAMILIES.values() if f.hf.fp8_checkpoints)
        raise ConversionError(f"{where} is FP8 block-quantised ({found}); FP8 checkpoints convert "
                              f"as they ship for --family {', '.join(allowed)} only: dequantise "
                              "this one to bf16 first.")
    quant = hf_cfg.get("quantization_config") or {}
    block = quant.get("weight_block_size")
    if block is not None and list(block) != [fp8.BLOCK, fp8.BLOCK]:
        raise ConversionError(f"{where / 'config.json'}: quantization_config.weight_block_size "
                              f"{block}; only [128, 128] blocks are read: dequantise it first.")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ConversionError(f"{where / 'config.json'}: quantization_config.fmt "
                              f"{quant.get('fmt')!r}; only e4m3 FP8 is read.")


def hf_to_longstraw(family: Family | None, hf_dir: Path, out: Path,
                    dtype: torch.dtype | None) -> dict:
    """Hugging Face directory of `family` (None: the family of its config's model_type) -> model
    format. Returns a summary."""
    config_path = hf_dir / "config.json"
    if not config_path.exists():
        raise ConversionError(f"{hf_dir} has no config.json.")
    hf_cfg = json.loads(config_path.read_text())
    if family is None:
        family = family_of_hf_config(hf_cfg, config_path)
    _check_model_type(family, hf_cfg, config_path)
    cfg = family.hf.config_from_hf(hf_cfg)
    if dtype is None:
        declared = _declared_dtype(hf_cfg)
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32,
                 "float64": torch.float64}.get(declared)
        if dtype is None:
            raise ConversionError(f"{config_path} declares dtype {declared!r}; pass --dtype "
                                  "bf16|fp32|fp64.")
    hf = model_format.SafetensorsReader(hf_weight_files(hf_dir))
    pairs = fp8.find_pairs(hf, hf.dtype_name, hf.shape, str(hf_dir))  # {FP8 weight: its scale}
    if pairs:
        _check_fp8_config(family, hf_cfg, hf_dir, f"{len(pairs)} FP8 weights such as "
                                                  f"{next(iter(pairs))}")
    expected = _expected_hf_shapes(family, family.hf.text_config(hf_cfg))
    scales = set(pairs.values())
    on_disk = family.hf.text_names(cfg, [n for n in hf if n not in scales])  # {mapping: on disk}
    used: set[str] = set()
    kinds: set[bool] = set()   # FP8 or not, of the tensors one correspondence reads

    def read(name: str) -> torch.Tensor:
        if name not in on_disk:
            raise ConversionError(f"{hf_dir} lacks tensor {name}.")
        disk = on_disk[name]
        if name in expected and hf.shape(disk) != expected[name]:
            raise ConversionError(f"{hf_dir}: {disk} has shape {hf.shape(disk)}, but config.json "
                                  f"implies {expected[name]}.")
        used.add(name)
        kinds.add(disk in pairs)
        return hf[disk]

    def read_scale(name: str) -> torch.Tensor:
        return hf[pairs[on_disk[name]]]

    tensors: dict[str, torch.Tensor] = {}
    for entry in family.hf.mapping(cfg):
        kinds.clear()
        converted = family.hf.to_ours(cfg, entry, read, dtype, on_disk)
        if True in kinds:
            if False in kinds or entry.kind not in ("copy", "cat", "stack"):
                raise ConversionError(
                    f"{hf_dir}: {', '.join(entry.hf)} -> {', '.join(entry.meg[:2])}"
                    f"{', ...' if len(entry.meg) > 2 else ''}: FP8 weights in a '{entry.kind}' "
                    f"correspondence{' mixed with unquantised ones' if False in kinds else ''} "
                    "cannot keep their FP8 bytes; dequantise the checkpoint to bf16 first.")
            # The same rearrangement (whole tensors, row blocks) applied to the scales.
            converted_scales = dict(family.hf.to_ours(cfg, entry, read_scale, dtype, on_disk))
        for name, value in converted:
            if value.dtype == fp8.FP8_DTYPE:   # kept as stored, with its stacked scale grids
                scale = converted_scales[name].contiguous()
                fp8.check_pair(name, value, scale, fp8.row_parts(name))
                tensors[name], tensors[fp8.scale_name(name)] = value.contiguous(), scale
                continue
            target = torch.float32 if name.endswith(family.hf.float32_names) else dtype
            tensors[name] = value.to(target).contiguous()
    if cfg.tie_word_embeddings and "lm_head.weight" in on_disk:
        if not torch.equal(read("lm_head.weight"), read("model.embed_tokens.weight")):
            raise ConversionError("tie_word_embeddings is true but lm_head.weight differs from "
                                  "model.embed_tokens.weight.")
    unknown = sorted(set(on_disk) - used)
    if unknown:
        raise ConversionError(f"{hf_dir} has {len(unknown)} tensors with no place in the model, "
                              f"e.g. {[on_disk[n] for n in unknown[:5]]}.")
    fp8_meta = {"fp8": {"format": "float8_e4m3fn", "weight_block_size": [fp8.BLOCK, fp8.BLOCK],
                        "num_weights": len(pairs)}} if pairs else {}
    model_format.write_model(out, tensors, family.name, cfg.to_dict(), dtype,
                           layout={"world_size": 1, "context_parallel_size": 1,
                                   "expert_parallel_size": 1, "data_parallel_size": 1},
                           source=str(hf_dir.resolve()),
                           # --to-hf restores what the model config does not carry (token ids).
                           extra_meta={"hf_config": hf_cfg, **fp8_meta})
    return {"family": family.name, "tensors": len(tensors),
            "skipped": len(hf) - len(scales) - len(on_disk),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


# ---- back to Hugging Face -----------------------------------------------------------------------


def longstraw_to_hf(family: Family | None, model_dir: Path, hf_dir: Path,
                    dtype: torch.dtype | None, max_shard_bytes: int,
                    fp8_mode: str = "keep") -> dict:
    """Model format, or a training checkpoint (full parameters at any CP/EP layout, or LoRA
    adapters, merged; export.py), -> Hugging Face directory of `family` (None: the family the
    source records) (config.json +
    safetensors shards). `fp8_mode`: "keep" writes the source's block-FP8 weights in FP8,
    "dequantize" in `dtype` (export.fp8_layout)."""
    import transformers

    from megatron_longstraw.checkpointing import export

    meta, tensors = export.read_weights(model_dir)
    tensors = export.fp8_layout(meta, tensors, fp8_mode)
    if family is None:
        if meta["family"] not in FAMILIES:
            raise ConversionError(f"{model_dir} holds a {meta['family']!r} model; families: "
                                  f"{', '.join(sorted(FAMILIES))}.")
        family = FAMILIES[meta["family"]]
    if meta["family"] != family.name:
        raise ConversionError(f"{model_dir} holds a {meta['family']!r} model, not {family.name}.")
    cfg = family.config_class.from_dict(meta["model"])
    dtype = dtype or {v: k for k, v in model_format.DTYPE_NAMES.items()}[meta["dtype"]]
    stored = meta.get("hf_config")
    text = family.hf.text_config(stored) if stored is not None else None
    if text is not None and family.hf.config_from_hf(text) == cfg:
        config = getattr(transformers, family.hf.hf_config_class).from_dict(text)
    else:
        config = family.hf.hf_config(cfg)
    config.architectures = [family.hf.hf_model_class]
    config.dtype = dtype
    pairs = fp8.find_pairs(tensors, tensors.dtype_name, tensors.shape, str(model_dir),
                           fp8.row_parts)   # {FP8 weight: its scale}
    if pairs:
        _check_fp8_config(family, stored or {}, model_dir, f"{len(pairs)} FP8 weights such as "
                                                           f"{next(iter(pairs))}")
        if getattr(config, "quantization_config", None) is None:
            config.quantization_config = dict(fp8.QUANTIZATION_CONFIG)
    elif getattr(config, "quantization_config", None) is not None:   # --fp8 dequantize
        del config.quantization_config
    expected = _expected_hf_shapes(family, config.to_dict())

    # (hf name, model-format name, transform of the model-format tensor); an FP8 weight's scale
    # grid follows it through the same transform (whole tensors, equal row parts).
    plan = [item for entry in family.hf.mapping(cfg) for item in family.hf.to_hf(cfg, entry)]
    plan += [(fp8.scale_name(hf_name), pairs[meg], transform)
             for hf_name, meg, transform in plan if meg in pairs]
    missing = sorted({meg for _, meg, _ in plan} - set(tensors))
    if missing:
        raise ConversionError(f"{model_dir} lacks {len(missing)} tensors, e.g. {missing[:5]}.")
    scales = {fp8.scale_name(hf_name) for hf_name, meg, _ in plan if meg in pairs}
    for name in scales:
        expected[name] = fp8.scale_shape(*expected[name[:-len(fp8.SCALE_SUFFIX)]])

    def out_dtype(hf_name: str, meg: str) -> torch.dtype:
        if meg in pairs:
            return fp8.FP8_DTYPE
        if hf_name in scales or hf_name.endswith(family.hf.float32_names):
            return torch.float32
        return dtype

    def nbytes(hf_name: str, meg: str) -> int:
        return (int(torch.Size(expected[hf_name]).numel())
                * torch.empty((), dtype=out_dtype(hf_name, meg)).element_size())

    shards: list[list[tuple[str, str, Transform]]] = [[]]
    size = 0
    for item in plan:
        n = nbytes(item[0], item[1])
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += n
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])

    with staged_dir(hf_dir, "--to-hf never overwrites a checkpoint") as tmp:
        weight_map, total = {}, 0
        for file_name, shard in zip(names, shards):
            out = {}
            for hf_name, meg, transform in shard:  # one shard in memory at a time
                value = transform(tensors[meg]).to(out_dtype(hf_name, meg))
                if tuple(value.shape) != expected[hf_name]:
                    raise ConversionError(f"{model_dir}: {meg} gives {hf_name} of shape "
                                          f"{tuple(value.shape)}, but the config implies "
                                          f"{expected[hf_name]}.")
                out[hf_name] = value
                weight_map[hf_name] = file_name
                total += out[hf_name].numel() * out[hf_name].element_size()
            model_format.write_safetensors(tmp / file_name, out)
            del out
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            model_format.write_text_atomic(tmp / "model.safetensors.index.json",
                                         json.dumps(index, indent=2, sort_keys=True) + "\n")
        config.save_pretrained(str(tmp))
    return {"family": family.name, "tensors": len(plan), "shards": len(shards), "bytes": total}


@contextlib.contextmanager
def staged_dir(out: Path, never: str):
    """A new output directory written whole or not at all: refused when `out` holds anything
    (`never` says why, e.g. "--to-hf never overwrites a checkpoint"); the caller writes into the
    yielded temporary folder beside it, renamed to `out` at the end; removed if the body raises."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConversionError(f"{out} exists and is not empty; {never}: choose a new --hf-dir.")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_random_hf(family: Family, config, out: Path, seed: int = 0) -> dict:
    """A Hugging Face checkpoint of `family` with random weights (transformers' own initialisation,
    seeded), written by `save_pretrained` into `out` (which must not exist or be empty): what
    tools/tiny_hf.py gives the README's walkthrough in place of a download. `config` is the
    family's model config (object or dict). Returns a summary for the tool's line."""
    import transformers

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConversionError(f"{out} exists and is not empty; choose a new directory.")
    if isinstance(config, dict):
        config = family.config_class.from_dict(config)
    torch.manual_seed(seed)
    model = getattr(transformers, family.hf.hf_model_class)(family.hf.hf_config(config)).float()
    model.save_pretrained(out)
    return {"model": family.hf.hf_model_class, "parameters": f"{model.num_parameters():,}",
            "dtype": "float32", "seed": seed}

