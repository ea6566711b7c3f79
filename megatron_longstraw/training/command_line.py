"""The launcher's command line: Megatron's flags plus the `--longstraw-*` flags parsed (one parser,
arguments.py), resolved with the YAML config (`--longstraw-config`; flags win) into the run's
family, model config, LongStrawConfig and dtype, the LoRA / QLoRA settings checked against them,
and the outputs that could only fail after training refused before any work (train.configure
runs them all).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from megatron_longstraw.models.registry import check_parallel_sizes, family_of_config, get_family
from megatron_longstraw.runtime.errors import FlagError
from megatron_longstraw.config.choices import PromptGrad
from megatron_longstraw.training import arguments
from megatron_longstraw.training.arguments import (
    LoRASettings,
    explicit_flags,
    longstraw_config_from_args,
    lora_settings,
    model_config_values,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def build_parser() -> argparse.ArgumentParser:
    """Megatron's parser (as `megatron.training.arguments.parse_args` builds it) + ours
    (arguments.build_parser: printable help, one-line flag errors)."""
    return arguments.build_parser()


def parse(argv: list[str] | None = None):
    """(args, names of the flags given on the command line)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    return args, explicit_flags(parser, argv)


def resolve(args, given: set[str]):
    """(family, model config, LongStrawConfig, dtype) from YAML + flags, validated."""
    from megatron_longstraw.distributed import parallel

    if not args.longstraw:
        raise FlagError("This launcher runs the LongStraw GRPO schedule: pass --longstraw (for "
                        "standard Megatron pre-training use Megatron-LM's pretrain_gpt.py).")
    parallel.check_model_parallel_sizes(args.tensor_model_parallel_size,
                                        args.pipeline_model_parallel_size,
                                        args.expert_tensor_parallel_size)
    saved = None if args.longstraw_config else saved_model(args)
    args.longstraw_model_source = str(saved[0]) if saved else None   # model_setup says so
    if saved is not None:   # a converted folder or the run's checkpoint names family and model
        if "longstraw_family" in given and args.longstraw_family != saved[1]:
            raise FlagError(f"--longstraw-family {args.longstraw_family}: {saved[0]} holds a "
                            f"{saved[1]!r} model.")
        args.longstraw_family = saved[1]
    elif "longstraw_family" not in given and args.longstraw_config:   # the YAML's model fields
        args.longstraw_family = family_of_config(
            arguments.load_yaml(args.longstraw_config).get("model") or {}) or args.longstraw_family
    family = get_family(args.longstraw_family)
    check_parallel_sizes(family, args.expert_model_parallel_size)
    ls = longstraw_config_from_args(args)
    values = model_config_values(args, given, family.from_megatron,
                                 base=saved[2] if saved else None)
    if not values:
        raise FlagError(f"No model configuration: pass --longstraw-config {family.tiny_config} "
                        "(or full.yaml beside it) and/or Megatron's model flags, or a "
                        "tools/convert_hf.py output as --pretrained-checkpoint (its model config "
                        "is used).")
    model_cfg = family.config_class.from_dict(values)
    dtype_name = args.longstraw_dtype or ("bf16" if args.bf16 else "fp32")
    return family.name, model_cfg, ls, DTYPES[dtype_name]


def saved_model(args) -> tuple[Path, str, dict] | None:
    """(file, family, model config) that the run's starting point records, for a run without
    --longstraw-config: --pretrained-checkpoint or --load as a model-format directory
    (tools/convert_hf.py's longstraw.json), else the latest training checkpoint in --load (its
    meta.json). None when neither names one, or it records no model config."""
    from megatron_longstraw.checkpointing import checkpoint, model_format

    found = None
    for path in (args.pretrained_checkpoint, args.load):
        if path and model_format.is_model_format(path):
            file = Path(path) / model_format.MODEL_META
            found = file, model_format.read_meta(file, model_format.MODEL_FORMAT)
            break
    if found is None and args.load and Path(args.load).is_dir() and (
            latest := checkpoint.latest_checkpoint(args.load)) is not None:
        found = latest / checkpoint.TRAIN_META, checkpoint.read_checkpoint_meta(latest)
    if found is None or not found[1].get("family") or not isinstance(found[1].get("model"), dict):
        return None
    return found[0], found[1]["family"], found[1]["model"]


def resolve_lora(args, family: str, ls):
    """(LoRASettings or None, LongStrawConfig) for this run, validated before any process group
    starts. LoRA wraps Megatron's local linears: under `--longstraw-kernels auto` the dense layers
    are then built with the local spec (`dense=ref`, logged) instead of TransformerEngine's; an
    explicit `dense=te` is refused. A KL penalty needs a reference policy, which the launcher has
    for LoRA runs only (the base with adapters off)."""
    from megatron_longstraw.kernels import select

    lora = lora_settings(ls.adapters, get_family(family).lora_targets, ls.run.seed)
    if lora is None:
        if ls.loss.kl_coef > 0:
            raise ValueError(
                f"--longstraw-kl-coef {ls.loss.kl_coef:g} needs a reference policy. The launcher "
                "provides it for LoRA / QLoRA runs (--longstraw-lora / --longstraw-qlora: the "
                "frozen base with adapters off, no second copy of the model); a full-parameter "
                "run would need a frozen copy of the initial model, which the launcher does not "
                "build. Set --longstraw-kl-coef 0 or train adapters.")
        return None, ls
    if ls.replay.prompt_grad is PromptGrad.EXACT and lora.config.dropout > 0:
        raise ValueError(f"--longstraw-lora-dropout {lora.config.dropout:g} with "
                         "--longstraw-prompt-grad exact: the prompt backward recomputes the "
                         "prompt's forward, which capture ran without dropout; a dropout sample "
                         "there would differentiate another function. Set the dropout to 0 or "
                         "use the detached prompt gradient.")
    dense = select.parse_spec(ls.run.kernels)["dense"]
    if dense == "te":
        raise ValueError(f"--longstraw-kernels {ls.run.kernels}: LoRA wraps Megatron's local linear "
                         "layers (ColumnParallelLinear / RowParallelLinear), not "
                         "TransformerEngine's; add dense=ref (e.g. --longstraw-kernels "
                         "auto,dense=ref).")
    if dense == "auto":
        ls = ls.replace(kernels=f"{ls.run.kernels},dense=ref")
    return lora, ls


def check_outputs(args, lora: LoRASettings | None) -> None:
    """Refuse, before any work, outputs that could only fail after training."""
    merged = args.longstraw_save_merged
    if merged is None:
        return
    if lora is None:
        raise ValueError("--longstraw-save-merged writes base + LoRA adapters merged; this run "
                         "trains every parameter (use --save: its checkpoints hold the weights).")
    if Path(merged).exists() and (not Path(merged).is_dir() or any(Path(merged).iterdir())):
        raise ValueError(f"--longstraw-save-merged {merged} exists and is not an empty directory; "
                         "choose a new one (nothing is overwritten).")
