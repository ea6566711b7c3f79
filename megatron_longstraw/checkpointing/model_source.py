"""The model a scoring or generating entry point runs (tools/score.py, tools/generate.py): which
family and model config (`resolve_model_source`: given, or read from a model-format directory's
longstraw.json), the model built by the family's registry record (`build_model`) and its weights
(`load_weights`: a model-format directory, a full-parameter training checkpoint of any CP/EP
layout, or a bare checkpoint, a folder with model.safetensors only).

A model-format directory (tools/convert_hf.py's output, model_format.py) and a training checkpoint
(its meta.json) carry their family and model config: the family and config may then be left out;
given, they must match it. A bare checkpoint and random initialisation need both.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from megatron_longstraw.models.registry import FAMILIES, get_family

DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
"""The `--dtype` choices of the scoring tools."""


def expert_parallel_size(family: str, context_parallel_size: int) -> int:
    """EP folded on the CP ranks, as far as the family's model has experts to shard."""
    limit = get_family(family).max_expert_parallel_size
    return context_parallel_size if limit is None else min(context_parallel_size, limit)


def model_config(family: str, config):
    """`family`'s model config from the `model:` section of the YAML at `config`, a config dict (a
    model-format directory's longstraw.json "model"), or a config object (returned as is)."""
    config_class = get_family(family).config_class
    if isinstance(config, dict):
        return config_class.from_dict(config)
    if isinstance(config, (str, os.PathLike)):
        return config_class.from_yaml(config)
    return config


def build_model(family: str, config, dtype: torch.dtype, expert_parallel_size: int = 1):
    """(model config, model, number of routed experts) of `family` from `config` (`model_config`:
    a YAML path, a config dict or object), built by the family's registry record (model-parallel
    state initialised)."""
    from megatron_longstraw.runtime import precision

    entry = get_family(family)
    cfg = model_config(family, config)
    precision.use_dtype(dtype)
    model = entry.build(cfg, dtype, expert_parallel_size)
    return cfg, model, entry.num_routed_experts(cfg)


def load_weights(model, path: str | Path, num_experts: int) -> Path:
    """Load a plugin-format checkpoint (a directory with `model.safetensors` holding the
    single-process Megatron state dict, or that file itself) into `model` (this rank's experts).
    A model-format directory's longstraw.json must describe the model built. Returns the file."""
    from safetensors.torch import load_file

    from megatron_longstraw.checkpointing import model_format
    from megatron_longstraw.distributed import expert_names
    from megatron_longstraw.runtime.errors import CheckpointError, InputNotFound

    from megatron_longstraw.checkpointing import export

    path = Path(path)
    if path.is_dir() and not model_format.is_model_format(path) and (
            found := export.resolve_training_checkpoint(path)) is not None:
        return _load_training_checkpoint(model, found, num_experts)
    file = path / "model.safetensors" if path.is_dir() else path
    if not file.is_file():
        raise InputNotFound(f"--checkpoint {path}: no model.safetensors there; pass a "
                            "checkpoint directory written by the plugin (or --random-init).")
    if path.is_dir() and model_format.is_model_format(path):
        meta = model_format.read_meta(path / model_format.MODEL_META, model_format.MODEL_FORMAT)
        model_format.check_model_config(meta, model, path / model_format.MODEL_META)
    full = load_file(str(file))
    for name, tensor in model.state_dict().items():
        source = full.get(expert_names.global_name(name, num_experts))
        if source is not None and source.shape != tensor.shape:
            raise CheckpointError(f"--checkpoint {file}: {name} has shape "
                                  f"{tuple(source.shape)} there but {tuple(tensor.shape)} in the "
                                  "model built from --config; the config does not match the "
                                  "checkpoint.")
    expert_names.load_full_state_dict(model, full, num_experts)
    return file


def _load_training_checkpoint(model, found: Path, num_experts: int) -> Path:
    """A full-parameter training checkpoint (any CP/EP layout: export.read_weights reassembles
    its expert shards) into `model`; a LoRA checkpoint is refused (export it merged first)."""
    from megatron_longstraw.checkpointing import checkpoint, export, model_format
    from megatron_longstraw.distributed import expert_names
    from megatron_longstraw.runtime.errors import CheckpointError

    saved = checkpoint.read_checkpoint_meta(found)
    if saved.get("lora"):
        raise CheckpointError(f"--checkpoint {found} holds LoRA adapters only; write the merged "
                              "model first (tools/convert_hf.py --to-hf, or the run's "
                              "--longstraw-save-merged) and score that.")
    meta, tensors = export.read_weights(found)
    model_format.check_model_config(meta, model, found / checkpoint.TRAIN_META)
    bad = [f"{n}: saved {tensors.shape(g)}, model {tuple(t.shape)}"
           for n, t in model_format.local_tensors(model).items()
           if (g := expert_names.global_name(n, num_experts)) in tensors
           and tensors.shape(g) != tuple(t.shape)]
    if bad:
        raise CheckpointError(f"--checkpoint {found}: shape mismatch for {len(bad)} tensors: "
                              f"{bad[:5]}.")
    expert_names.load_full_state_dict(model, tensors, num_experts)
    return found


def resolve_model_source(family: str | None, config: str | None,
                         checkpoint: str | None) -> tuple[str, str | dict]:
    """(family, model config: the `config` YAML path or the recorded "model" dict) from the
    `--family`, `--config` and `--checkpoint` flags (None: not given; no checkpoint: random
    initialisation) and, where they are left out, what the checkpoint records: a model-format
    directory's longstraw.json, or a training checkpoint's meta.json (a step_N folder, or a
    --save folder: its latest)."""
    from megatron_longstraw.checkpointing import model_format
    from megatron_longstraw.runtime.errors import CheckpointError, ConfigError

    meta, meta_file = None, None
    if checkpoint and model_format.is_model_format(checkpoint):
        meta_file = Path(checkpoint) / model_format.MODEL_META
        meta = model_format.read_meta(meta_file, model_format.MODEL_FORMAT)
    elif checkpoint and Path(checkpoint).is_dir() and (family is None or config is None):
        from megatron_longstraw.checkpointing import checkpoint as training
        from megatron_longstraw.checkpointing.export import resolve_training_checkpoint

        if (found := resolve_training_checkpoint(checkpoint)) is not None:
            meta_file = found / training.TRAIN_META   # the launcher records family and model
            meta = training.read_checkpoint_meta(found)
    if meta is None and (family is None or config is None):
        missing = " and ".join(f for f, v in (("--family", family),
                                              ("--config", config)) if v is None)
        source = ("--random-init" if not checkpoint else
                  f"--checkpoint {checkpoint} is neither a model-format directory (no "
                  f"{model_format.MODEL_META}) nor a training checkpoint")
        raise ConfigError(f"{missing} needed: {source}, so nothing says which model to build; "
                          "pass them, or a tools/convert_hf.py output or a training checkpoint "
                          "as --checkpoint.")
    family = family or meta.get("family")
    if meta is not None and meta.get("family") != family:
        raise CheckpointError(f"--checkpoint {checkpoint} holds a {meta.get('family')!r} "
                              f"model, not --family {family}.")
    if family not in FAMILIES:
        raise CheckpointError(f"--checkpoint {checkpoint}: family {family!r} is not one "
                              f"of {sorted(FAMILIES)}.")
    if config is not None:
        return family, config
    if not isinstance(meta.get("model"), dict):
        raise CheckpointError(f"{meta_file}: no \"model\" config; pass --config.")
    return family, meta["model"]
