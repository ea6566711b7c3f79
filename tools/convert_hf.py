#!/usr/bin/env python
"""Convert a Hugging Face checkpoint to megatron_longstraw's model format, and back.

    python tools/convert_hf.py --family glm52 --hf-dir GLM-5.2 --out glm52-ls --dtype bf16
    python tools/convert_hf.py --family glm52 --hf-dir GLM-5.2-back --out glm52-ls --to-hf
    python tools/convert_hf.py --family qwen36 --hf-dir Qwen3.6-27B --out qwen36-ls --dtype bf16
    python tools/convert_hf.py --hf-dir glm52-trained --out runs/ckpt --to-hf
    python tools/convert_hf.py --hf-dir glm52-adapter --out runs/ckpt --to-peft --dtype bf16

`--family` may be left out: it is then the source's (the Hugging Face config's `model_type`; with
`--to-hf`, the family the model-format directory or training checkpoint records), and when given
it is checked against the source.

`--hf-dir` is always the Hugging Face directory (config.json + *.safetensors, sharded with
model.safetensors.index.json or not) and `--out` the plugin-format directory
(megatron_longstraw/checkpointing/checkpoint.py documents it): the command reads the first and writes the second,
and the same command with `--to-hf` goes back (it never overwrites a non-empty directory).

`--to-hf` also reads a training checkpoint as `--out`: a `step_N` folder, or the run's `--save`
folder (its latest checkpoint); megatron_longstraw/checkpointing/export.py reads it. A
full-parameter checkpoint of any CP/EP layout is reassembled by name (`model.safetensors` plus
every EP rank's `experts_ep<e>.safetensors`); a LoRA / QLoRA checkpoint is exported merged
(base + scaling * B A, the base rebuilt from the recorded source or seed and checked against the
run's fingerprints; `--to-peft` below writes the adapters unmerged). The HF config.json of the run's initial
weights (a tools/convert_hf.py output) is kept when it still describes the model. `--fp8 keep`
(default) writes the weights the source held in block FP8 in FP8 again (unchanged ones byte for
byte, trained or merged ones quantised anew in 128 x 128 blocks); `--fp8 dequantize` writes them
in `--dtype`.

`--to-peft` writes a LoRA / QLoRA training checkpoint's adapters unmerged, as a PEFT LoRA
adapter for the Hugging Face base model (`adapter_config.json` + `adapter_model.safetensors` in
`--hf-dir`; `--dtype` default fp32, bf16 for serving; `--base-model` names the base in the config,
default the HF directory the run's base was converted from). A fused Megatron linear's adapter
becomes its HF modules' adapters exactly (B's rows split and permuted as the weight's rows, A
shared); a trained module PEFT cannot express (routed experts, which transformers stacks) is
refused by name: export merged with `--to-hf`. On GLM-5.2 / DeepSeek-V3, peft 0.21 takes every
`gate_proj` / `up_proj` / `down_proj` target for the stacked routed experts, so stock
`PeftModel.from_pretrained` would drop the dense-layer and shared-expert FFN adapters: such an
adapter is refused too (train without FFN adapters, or export merged), unless `--peft-keep-ffn`
writes them for a loader that maps modules by name. A QLoRA adapter sits on the original, unquantised
base (training saw its NF4 round trip: the adapter on it is the trained policy up to NF4's
error; `--to-hf` is exact); an adapter trained on the FP8 base sits on the dequantised base.
megatron_longstraw/checkpointing/peft_export.py.

The tensor mapping is the family's hf.py (the one its state-dict functions and logit-parity tests
use), applied to tensors by name: no model and no process group are built. What differs between the
families is their record's `hf` (`HF_CONVERSION` in models/<family>/hf.py, collected by
megatron_longstraw/models/registry.py); the reading, checking and writing are shared
(megatron_longstraw/checkpointing/hf.py; this script parses the arguments). HF tensors
are read lazily, one at a time (safetensors `safe_open`); `--to-hf` writes shard by shard. Memory:
HF -> plugin holds the converted weights once (the format is a single safetensors file); --to-hf
holds one shard.

Block-FP8 checkpoints (GLM-5.2's FP8 release, DeepSeek-V3 style: `weight` float8_e4m3fn plus
`weight_scale_inv` float32, one scale per 128 x 128 block; config.json `quantization_config`
with `weight_block_size` [128, 128]) convert as they ship, for a family whose record allows it
(`HFConversion.fp8_checkpoints`: glm52): every FP8 weight keeps its bytes and its scales, under
the model format's names (megatron_longstraw/kernels/fp8.py; fused rows such as `linear_fc1` =
[gate; up] stack the parts' scale grids), no dequantised copy is written, and `--to-hf` writes
them back byte for byte. `--dtype` applies to the other tensors. The launcher keeps them in FP8
with `--longstraw-lora --longstraw-fp8-base`, and loads them dequantised otherwise.

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
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron_longstraw.checkpointing import model_format  # noqa: E402
from megatron_longstraw.checkpointing.hf import (  # noqa: E402
    ConversionError, hf_to_longstraw, longstraw_to_hf,
)
from megatron_longstraw.checkpointing.peft_export import longstraw_to_peft  # noqa: E402
from megatron_longstraw.models.registry import FAMILIES  # noqa: E402


# ---- command line -------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """'5GB' (10^9), '500MiB' (2^20), '123' (bytes) -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MiB)")
    power = "KMGT".find(m.group(2).upper()) + 1 if m.group(2) else 0
    return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)



def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default=None, choices=sorted(FAMILIES),
                        help="Model family (" + "; ".join(
                            f"{name}: model_type {' / '.join(f.hf.model_types)}, {f.hf.title}"
                            for name, f in sorted(FAMILIES.items())) + "). Default: the "
                             "source's (the HF config's model_type; with --to-hf, the family "
                             "the model-format directory or training checkpoint records); "
                             "given, it is checked against the source.")
    parser.add_argument("--hf-dir", required=True, type=Path,
                        help="Hugging Face checkpoint directory (read; written with --to-hf).")
    parser.add_argument("--out", required=True, type=Path,
                        help="megatron_longstraw model-format directory (written; read with "
                             "--to-hf, like a training checkpoint).")
    parser.add_argument("--to-hf", action="store_true",
                        help="Convert --out back to a Hugging Face checkpoint in --hf-dir; --out "
                             "may also be a training checkpoint (a step_N folder, or a --save "
                             "folder: its latest), full-parameter at any CP/EP layout or LoRA "
                             "(exported merged).")
    parser.add_argument("--to-peft", action="store_true",
                        help="Write the adapters of the LoRA / QLoRA training checkpoint --out "
                             "(a step_N folder or a --save folder: its latest) unmerged, as a "
                             "PEFT LoRA adapter for the Hugging Face base model into --hf-dir "
                             "(adapter_config.json + adapter_model.safetensors). QLoRA: the "
                             "adapter is over the original (unquantised) base; LoRA on the FP8 "
                             "base: over the dequantised base. --dtype: the adapter's (default "
                             "fp32; bf16 for serving). Modules PEFT cannot express (routed "
                             "experts) are refused by name: use --to-hf (merged).")
    parser.add_argument("--base-model", default=None,
                        help="With --to-peft: adapter_config.json's base_model_name_or_path "
                             "(default: the HF directory the run's base was converted from, "
                             "if it was).")
    parser.add_argument("--peft-keep-ffn", action="store_true",
                        help="With --to-peft on GLM-5.2 / DeepSeek-V3: write the dense-layer and "
                             "shared-expert FFN adapters (gate_proj / up_proj / down_proj) that "
                             "are refused by default, for a loader that maps modules by name; "
                             "stock peft.PeftModel.from_pretrained drops them (peft 0.21 takes "
                             "those targets for the stacked routed experts).")
    parser.add_argument("--fp8", choices=("keep", "dequantize"), default="keep",
                        help="With --to-hf: weights the source holds in block FP8 (an FP8 "
                             "conversion, or a run started from one) are written in FP8 (keep; "
                             "changed ones quantised anew) or dequantised to --dtype.")
    parser.add_argument("--dtype", choices=sorted(model_format.DTYPES), default=None,
                        help="Weight dtype written (default: the source's, fp32 for --to-peft; "
                             "GLM-5.2 routers' expert bias stays float32).")
    parser.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"),
                        help="Largest safetensors shard written with --to-hf (default 5GB).")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    family = FAMILIES[args.family] if args.family else None
    dtype = model_format.DTYPES[args.dtype] if args.dtype else None
    if args.to_hf and args.to_peft:
        sys.exit("convert_hf.py: error: --to-hf (merged) and --to-peft (adapter) exclude each "
                 "other; run the command twice for both.")
    for flag, given in (("--base-model", args.base_model is not None),
                        ("--peft-keep-ffn", args.peft_keep_ffn)):
        if given and not args.to_peft:
            sys.exit(f"convert_hf.py: error: {flag} goes with --to-peft.")
    try:
        if args.to_peft:
            summary = longstraw_to_peft(family, args.out, args.hf_dir, dtype or
                                        model_format.DTYPES["fp32"], args.base_model,
                                        args.peft_keep_ffn)
            where = args.hf_dir
        elif args.to_hf:
            summary = longstraw_to_hf(family, args.out, args.hf_dir, dtype, args.max_shard_size,
                                      args.fp8)
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
