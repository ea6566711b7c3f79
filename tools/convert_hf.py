#!/usr/bin/env python
"""Convert a Hugging Face checkpoint to megatron_longstraw's model format, and back.

    python tools/convert_hf.py --family glm52 --hf-dir GLM-5.2 --out glm52-ls --dtype bf16
    python tools/convert_hf.py --family glm52 --hf-dir GLM-5.2-back --out glm52-ls --to-hf

`--hf-dir` is always the Hugging Face directory (config.json + *.safetensors, sharded with
model.safetensors.index.json or not) and `--out` the plugin-format directory
(megatron_longstraw/checkpoint.py documents it): the command reads the first and writes the second,
and the same command with `--to-hf` goes back (it never overwrites a non-empty directory).

The tensor mapping is hf.py's (the one its state-dict functions and logit-parity test use), applied
to tensors by name: no model and no process group are built. HF tensors are read lazily, one at a
time (safetensors `safe_open`); `--to-hf` writes shard by shard. On disk HF keeps routed experts as
`mlp.experts.{e}.{gate,up,down}_proj.weight` (transformers stacks them into `gate_up_proj` /
`down_proj` when loading); both layouts are read, the on-disk one is written.
Multi-token-prediction layers (`model.layers.{num_hidden_layers}.*`) are skipped (the model has no
MTP head); FP8 block-quantised checkpoints must be dequantised first. Memory: HF -> plugin holds
the converted weights once (the format is a single safetensors file); --to-hf holds one shard.
`--family qwen36` is not implemented yet and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron_longstraw import checkpoint  # noqa: E402

FAMILIES = {"glm52": "glm_moe_dsa", "qwen36": None}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


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


def _expert_slot(stacked: str, expert: int) -> list[str]:
    """On-disk names of routed expert `expert` inside transformers' stacked tensor `stacked`
    (`...mlp.experts.gate_up_proj` [E, 2I, H] = [gate; up] per expert, `...down_proj` [E, H, I])."""
    prefix, kind = stacked.rsplit(".", 1)
    if kind == "gate_up_proj":
        return [f"{prefix}.{expert}.gate_proj.weight", f"{prefix}.{expert}.up_proj.weight"]
    return [f"{prefix}.{expert}.down_proj.weight"]


def _expected_hf_shapes(hf_config_dict: dict) -> dict[str, tuple[int, ...]]:
    """Tensor shapes the config implies, transformers' in-memory names plus on-disk expert names
    (a meta-device model: no memory, no weights)."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig.from_dict(dict(hf_config_dict)))
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for name, shape in list(shapes.items()):
        if name.endswith("experts.gate_up_proj"):
            for e in range(shape[0]):
                for part in _expert_slot(name, e):
                    shapes[part] = (shape[1] // 2, shape[2])
        elif name.endswith("experts.down_proj"):
            for e in range(shape[0]):
                shapes[_expert_slot(name, e)[0]] = shape[1:]
    return shapes


def hf_to_longstraw(hf_dir: Path, out: Path, dtype: torch.dtype | None) -> dict:
    """GLM-5.2 Hugging Face directory -> model format. Returns a summary."""
    # hf.py's name-level mapping (private there: its public functions need a built model).
    from megatron_longstraw.models.glm52.hf import _mapping, glm52_config_from_hf

    config_path = hf_dir / "config.json"
    if not config_path.exists():
        raise ConversionError(f"{hf_dir} has no config.json.")
    hf_cfg = json.loads(config_path.read_text())
    if hf_cfg.get("model_type") != FAMILIES["glm52"]:
        raise ConversionError(f"{config_path}: model_type {hf_cfg.get('model_type')!r} is not "
                              f"{FAMILIES['glm52']!r} (GLM-5.2 text model); nothing else converts "
                              "to --family glm52.")
    cfg = glm52_config_from_hf(hf_cfg)
    if dtype is None:
        declared = hf_cfg.get("dtype") or hf_cfg.get("torch_dtype")
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32,
                 "float64": torch.float64}.get(declared)
        if dtype is None:
            raise ConversionError(f"{config_path} declares dtype {declared!r}; pass --dtype "
                                  "bf16|fp32|fp64.")
    hf = checkpoint.SafetensorsReader(hf_weight_files(hf_dir))
    quantised = [n for n in hf if n.endswith("_scale_inv") or hf.dtype_name(n).startswith("F8")]
    if quantised:
        raise ConversionError(f"{hf_dir} is FP8 block-quantised ({len(quantised)} tensors such as "
                              f"{quantised[0]}); dequantise it to bf16 first.")
    expected = _expected_hf_shapes(hf_cfg)
    used: set[str] = set()

    def read(name: str) -> torch.Tensor:
        if name not in hf:
            raise ConversionError(f"{hf_dir} lacks tensor {name}.")
        if name in expected and hf.shape(name) != expected[name]:
            raise ConversionError(f"{hf_dir}: {name} has shape {hf.shape(name)}, but config.json "
                                  f"implies {expected[name]}.")
        used.add(name)
        return hf[name]

    tensors: dict[str, torch.Tensor] = {}
    for entry in _mapping(cfg):
        if entry.kind == "copy":
            values = [read(entry.hf[0])]
        elif entry.kind == "cat":  # dense / shared-expert [gate; up]
            values = [torch.cat([read(n) for n in entry.hf])]
        elif entry.hf[0] in hf:    # routed experts saved stacked (transformers' in-memory layout)
            values = list(read(entry.hf[0]).unbind(0))
        else:                      # routed experts one by one (the layout save_pretrained writes)
            values = [torch.cat([read(n) for n in _expert_slot(entry.hf[0], e)])
                      for e in range(len(entry.meg))]
        for name, value in zip(entry.meg, values):
            # Megatron keeps the routers' expert_bias in float32 whatever the parameter dtype.
            target = torch.float32 if name.endswith("router.expert_bias") else dtype
            tensors[name] = value.to(target).contiguous()
    if cfg.tie_word_embeddings and "lm_head.weight" in hf:
        if not torch.equal(read("lm_head.weight"), hf["model.embed_tokens.weight"]):
            raise ConversionError("tie_word_embeddings is true but lm_head.weight differs from "
                                  "model.embed_tokens.weight.")
    left = sorted(set(hf) - used)
    mtp = [n for n in left if (m := _LAYER.match(n)) and int(m.group(1)) >= cfg.num_hidden_layers]
    unknown = sorted(set(left) - set(mtp))
    if unknown:
        raise ConversionError(f"{hf_dir} has {len(unknown)} tensors with no place in the model, "
                              f"e.g. {unknown[:5]}.")
    checkpoint.write_model(out, tensors, "glm52", cfg.to_dict(), dtype,
                           layout={"world_size": 1, "context_parallel_size": 1,
                                   "expert_parallel_size": 1, "data_parallel_size": 1},
                           source=str(hf_dir.resolve()),
                           # --to-hf restores what the model config does not carry (token ids).
                           extra_meta={"hf_config": hf_cfg})
    return {"tensors": len(tensors), "skipped_mtp": len(mtp),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


# ---- back to Hugging Face -----------------------------------------------------------------------


def parse_size(text: str) -> int:
    """'5GB' (10^9), '500MiB' (2^20), '123' (bytes) -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MiB)")
    power = "KMGT".find(m.group(2).upper()) + 1 if m.group(2) else 0
    return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)


def longstraw_to_hf(model_dir: Path, hf_dir: Path, dtype: torch.dtype | None,
                    max_shard_bytes: int) -> dict:
    """Model format -> GLM-5.2 Hugging Face directory (config.json + safetensors shards)."""
    from transformers import GlmMoeDsaConfig

    from megatron_longstraw.models.glm52.config import GLM52Config
    from megatron_longstraw.models.glm52.hf import _mapping, glm52_config_from_hf, hf_config

    meta, tensors = checkpoint.read_model(model_dir)
    if meta["family"] != "glm52":
        raise ConversionError(f"{model_dir} holds a {meta['family']!r} model, not glm52.")
    cfg = GLM52Config.from_dict(meta["model"])
    dtype = dtype or {v: k for k, v in checkpoint.DTYPE_NAMES.items()}[meta["dtype"]]
    stored = meta.get("hf_config")
    if stored is not None and glm52_config_from_hf(stored) == cfg:
        config = GlmMoeDsaConfig.from_dict(dict(stored))
    else:
        config = hf_config(cfg)
    config.architectures = ["GlmMoeDsaForCausalLM"]
    config.dtype = dtype

    # (hf name, megatron name, rows of the megatron tensor or None for all)
    plan: list[tuple[str, str, slice | None]] = []
    for entry in _mapping(cfg):
        if entry.kind == "copy":
            plan.append((entry.hf[0], entry.meg[0], None))
        elif entry.kind == "cat":
            half = tensors.shape(entry.meg[0])[0] // 2
            plan += [(entry.hf[0], entry.meg[0], slice(0, half)),
                     (entry.hf[1], entry.meg[0], slice(half, None))]
        else:
            for e, meg in enumerate(entry.meg):
                parts = _expert_slot(entry.hf[0], e)
                half = tensors.shape(meg)[0] // 2
                rows = [slice(0, half), slice(half, None)] if len(parts) == 2 else [None]
                plan += [(hf, meg, r) for hf, r in zip(parts, rows)]
    missing = sorted({meg for _, meg, _ in plan} - set(tensors))
    if missing:
        raise ConversionError(f"{model_dir} lacks {len(missing)} tensors, e.g. {missing[:5]}.")

    def out_dtype(hf_name: str) -> torch.dtype:
        return torch.float32 if hf_name.endswith("e_score_correction_bias") else dtype

    def nbytes(hf_name: str, meg: str, rows: slice | None) -> int:
        shape = list(tensors.shape(meg))
        if rows is not None:
            shape[0] = len(range(shape[0])[rows])
        return int(torch.Size(shape).numel()) * torch.empty((), dtype=out_dtype(hf_name)).element_size()

    shards: list[list[tuple[str, str, slice | None]]] = [[]]
    size = 0
    for item in plan:
        n = nbytes(*item)
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
            for hf_name, meg, rows in shard:  # one shard in memory at a time
                value = tensors[meg]
                out[hf_name] = (value if rows is None else value[rows]).to(out_dtype(hf_name))
                weight_map[hf_name] = file_name
                total += out[hf_name].numel() * out[hf_name].element_size()
            checkpoint.write_safetensors(tmp / file_name, out)
            del out
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            checkpoint.write_text_atomic(tmp / "model.safetensors.index.json",
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
                        help="Model family (glm52: transformers' glm_moe_dsa text models).")
    parser.add_argument("--hf-dir", required=True, type=Path,
                        help="Hugging Face checkpoint directory (read; written with --to-hf).")
    parser.add_argument("--out", required=True, type=Path,
                        help="megatron_longstraw model-format directory (written; read with --to-hf).")
    parser.add_argument("--to-hf", action="store_true",
                        help="Convert --out back to a Hugging Face checkpoint in --hf-dir.")
    parser.add_argument("--dtype", choices=sorted(checkpoint.DTYPES), default=None,
                        help="Weight dtype written (default: the source's; routers' expert bias "
                             "stays float32).")
    parser.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"),
                        help="Largest safetensors shard written with --to-hf (default 5GB).")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.family == "qwen36":
        sys.exit("convert_hf.py: error: --family qwen36 is not implemented yet: this tool "
                 "converts only GLM-5.2 checkpoints (--family glm52); it has no Qwen3.6 "
                 "(Gated-DeltaNet hybrid) mapping. Nothing was written.")
    dtype = checkpoint.DTYPES[args.dtype] if args.dtype else None
    try:
        if args.to_hf:
            summary = longstraw_to_hf(args.out, args.hf_dir, dtype, args.max_shard_size)
            where = args.hf_dir
        else:
            if args.out.exists() and any(args.out.iterdir()):
                raise ConversionError(f"{args.out} exists and is not empty; choose a new --out.")
            summary = hf_to_longstraw(args.hf_dir, args.out, dtype)
            where = args.out
    except (ConversionError, FileNotFoundError, FileExistsError, KeyError, ValueError) as exc:
        sys.exit(f"convert_hf.py: error: {exc}")
    print(f"wrote {where}: " + ", ".join(f"{k} {v}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
