#!/usr/bin/env python
"""Convert a Hugging Face checkpoint to megatron_longstraw's model format, and back.

    python tools/convert_hf.py --family glm52 --hf-dir GLM-5.2 --out glm52-ls --dtype bf16
    python tools/convert_hf.py --family glm52 --hf-dir GLM-5.2-back --out glm52-ls --to-hf
    python tools/convert_hf.py --family qwen36 --hf-dir Qwen3.6-27B --out qwen36-ls --dtype bf16

`--hf-dir` is always the Hugging Face directory (config.json + *.safetensors, sharded with
model.safetensors.index.json or not) and `--out` the plugin-format directory
(megatron_longstraw/checkpoint.py documents it): the command reads the first and writes the second,
and the same command with `--to-hf` goes back (it never overwrites a non-empty directory).

The tensor mapping is the family's hf.py (the one its state-dict functions and logit-parity tests
use), applied to tensors by name: no model and no process group are built. What differs between the
families is their record's `hf` (`HF_CONVERSION` in models/<family>/hf.py, collected by
megatron_longstraw/families.py); the reading, checking and writing are shared here. HF tensors
are read lazily, one at a time (safetensors `safe_open`); `--to-hf` writes shard by shard. Memory:
HF -> plugin holds the converted weights once (the format is a single safetensors file); --to-hf
holds one shard. FP8 block-quantised checkpoints must be dequantised first.

glm52 (transformers `glm_moe_dsa`): on disk HF keeps routed experts as
`mlp.experts.{e}.{gate,up,down}_proj.weight` (transformers stacks them into `gate_up_proj` /
`down_proj` when loading); both layouts are read, the on-disk one is written. Multi-token-prediction
layers (`model.layers.{num_hidden_layers}.*`) are skipped (the model has no MTP head).

qwen36 (transformers `qwen3_5_text`, i.e. `Qwen3_5ForCausalLM`, or a `qwen3_5` vision-language
checkpoint): a vision-language checkpoint's text model is converted (`model.language_model.*`);
`model.visual.*` and the MTP head `mtp.*` are skipped, and `--to-hf` writes a text-only
`Qwen3_5ForCausalLM` checkpoint. Values are transformed, not only renamed (hf.py): the GDN
`in_proj_{qkv,z,b,a}` and the FFN `[gate; up]` are concatenated, `q_proj` (per head [q; gate]) with
`k_proj` / `v_proj` becomes Megatron's per-group `linear_qkv`, and the GDN output norm's plain gain
w becomes Megatron's zero-centred w - 1 (and w + 1 on the way back). w - 1 and back is exact when
the model format is wider than the checkpoint (fp32 -> fp64) or when w lies in [0.5, 2] (Sterbenz's
lemma), which holds for trained gains near 1; otherwise it rounds once in the format's dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron_longstraw import model_format  # noqa: E402
from megatron_longstraw.families import FAMILIES, Family  # noqa: E402

Transform = Callable[[torch.Tensor], torch.Tensor]


class ConversionError(ValueError):
    """A checkpoint this tool cannot convert; the message says why and what to do."""


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


def hf_to_longstraw(family: Family, hf_dir: Path, out: Path, dtype: torch.dtype | None) -> dict:
    """Hugging Face directory of `family` -> model format. Returns a summary."""
    config_path = hf_dir / "config.json"
    if not config_path.exists():
        raise ConversionError(f"{hf_dir} has no config.json.")
    hf_cfg = json.loads(config_path.read_text())
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
    quantised = [n for n in hf if n.endswith("_scale_inv") or hf.dtype_name(n).startswith("F8")]
    if quantised:
        raise ConversionError(f"{hf_dir} is FP8 block-quantised ({len(quantised)} tensors such as "
                              f"{quantised[0]}); dequantise it to bf16 first.")
    expected = _expected_hf_shapes(family, family.hf.text_config(hf_cfg))
    on_disk = family.hf.text_names(cfg, list(hf))  # {mapping name: on-disk name}
    used: set[str] = set()

    def read(name: str) -> torch.Tensor:
        if name not in on_disk:
            raise ConversionError(f"{hf_dir} lacks tensor {name}.")
        disk = on_disk[name]
        if name in expected and hf.shape(disk) != expected[name]:
            raise ConversionError(f"{hf_dir}: {disk} has shape {hf.shape(disk)}, but config.json "
                                  f"implies {expected[name]}.")
        used.add(name)
        return hf[disk]

    tensors: dict[str, torch.Tensor] = {}
    for entry in family.hf.mapping(cfg):
        for name, value in family.hf.to_ours(cfg, entry, read, dtype, on_disk):
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
    model_format.write_model(out, tensors, family.name, cfg.to_dict(), dtype,
                           layout={"world_size": 1, "context_parallel_size": 1,
                                   "expert_parallel_size": 1, "data_parallel_size": 1},
                           source=str(hf_dir.resolve()),
                           # --to-hf restores what the model config does not carry (token ids).
                           extra_meta={"hf_config": hf_cfg})
    return {"tensors": len(tensors), "skipped": len(hf) - len(on_disk),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


# ---- back to Hugging Face -----------------------------------------------------------------------


def parse_size(text: str) -> int:
    """'5GB' (10^9), '500MiB' (2^20), '123' (bytes) -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MiB)")
    power = "KMGT".find(m.group(2).upper()) + 1 if m.group(2) else 0
    return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)


def longstraw_to_hf(family: Family, model_dir: Path, hf_dir: Path, dtype: torch.dtype | None,
                    max_shard_bytes: int) -> dict:
    """Model format -> Hugging Face directory of `family` (config.json + safetensors shards)."""
    import transformers

    meta, tensors = model_format.read_model(model_dir)
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
    expected = _expected_hf_shapes(family, config.to_dict())

    # (hf name, model-format name, transform of the model-format tensor)
    plan = [item for entry in family.hf.mapping(cfg) for item in family.hf.to_hf(cfg, entry)]
    missing = sorted({meg for _, meg, _ in plan} - set(tensors))
    if missing:
        raise ConversionError(f"{model_dir} lacks {len(missing)} tensors, e.g. {missing[:5]}.")

    def out_dtype(hf_name: str) -> torch.dtype:
        return torch.float32 if hf_name.endswith(family.hf.float32_names) else dtype

    def nbytes(hf_name: str) -> int:
        return (int(torch.Size(expected[hf_name]).numel())
                * torch.empty((), dtype=out_dtype(hf_name)).element_size())

    shards: list[list[tuple[str, str, Transform]]] = [[]]
    size = 0
    for item in plan:
        n = nbytes(item[0])
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += n
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])

    if hf_dir.exists() and any(hf_dir.iterdir()):
        raise ConversionError(f"{hf_dir} exists and is not empty; --to-hf never overwrites a "
                              "checkpoint: choose a new --hf-dir.")
    hf_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = hf_dir.with_name(f".tmp-{hf_dir.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        weight_map, total = {}, 0
        for file_name, shard in zip(names, shards):
            out = {}
            for hf_name, meg, transform in shard:  # one shard in memory at a time
                value = transform(tensors[meg]).to(out_dtype(hf_name))
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
        os.rename(tmp, hf_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"tensors": len(plan), "shards": len(shards), "bytes": total}


# ---- command line -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", required=True, choices=sorted(FAMILIES),
                        help="Model family (" + "; ".join(
                            f"{name}: model_type {' / '.join(f.hf.model_types)}, {f.hf.title}"
                            for name, f in sorted(FAMILIES.items())) + ").")
    parser.add_argument("--hf-dir", required=True, type=Path,
                        help="Hugging Face checkpoint directory (read; written with --to-hf).")
    parser.add_argument("--out", required=True, type=Path,
                        help="megatron_longstraw model-format directory (written; read with --to-hf).")
    parser.add_argument("--to-hf", action="store_true",
                        help="Convert --out back to a Hugging Face checkpoint in --hf-dir.")
    parser.add_argument("--dtype", choices=sorted(model_format.DTYPES), default=None,
                        help="Weight dtype written (default: the source's; GLM-5.2 routers' "
                             "expert bias stays float32).")
    parser.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"),
                        help="Largest safetensors shard written with --to-hf (default 5GB).")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    family = FAMILIES[args.family]
    dtype = model_format.DTYPES[args.dtype] if args.dtype else None
    try:
        if args.to_hf:
            summary = longstraw_to_hf(family, args.out, args.hf_dir, dtype, args.max_shard_size)
            where = args.hf_dir
        else:
            if args.out.exists() and any(args.out.iterdir()):
                raise ConversionError(f"{args.out} exists and is not empty; choose a new --out.")
            summary = hf_to_longstraw(family, args.hf_dir, args.out, dtype)
            where = args.out
    except (ConversionError, FileNotFoundError, FileExistsError, KeyError, ValueError) as exc:
        sys.exit(f"convert_hf.py: error: {exc}")
    print(f"wrote {where}: " + ", ".join(f"{k} {v}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
