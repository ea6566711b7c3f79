"""Any checkpoint as the model format's tensors (the single-process state dict, global expert
names), for `tools/convert_hf.py --to-hf` and the scoring tools: a model-format directory, or a
training checkpoint (checkpoint.py: a `step_N` folder, or a `--save` folder, meaning its latest).

`read_weights(path)` -> (meta, tensors): `meta` as a model-format longstraw.json has it (family,
model config, dtype, and the HF config.json when the run started from converted weights),
`tensors` a lazy name -> tensor mapping (`shape`, `dtype_name` like `SafetensorsReader`).

- Full-parameter training checkpoint, any CP/EP layout: `model.safetensors` (the non-expert
  tensors) and every `experts_ep<e>.safetensors` (EP rank e's routed experts, already under their
  global names) read together: the shards are reassembled by name, nothing is built. Tensors a
  run did not train (none, for full-parameter runs; checked) would come from its initial weights.
- LoRA / QLoRA training checkpoint: the checkpoint holds the adapters only (checkpoint.py says
  why). The model is built in this process (EP 1, the local spec), its base loaded the way the
  launcher loads it (the recorded model-format source, or the seeded initialisation, which is the
  same at every layout: models/expert_init.py) and checked against the base fingerprints the run
  recorded, the adapters applied (on the FP8 or NF4 base when the run used one) and loaded, and
  the merged weights base + scaling * B A taken (adapters.merged_state_dict): the policy the
  adapters define, under the names of the model without adapters. The unmerged export (the
  adapters as a PEFT LoRA adapter, fused linears split by rows) is peft_export.py's.
  Memory: the whole model once, in the run's dtype.

`fp8_layout(meta, tensors, fp8)` applies `--fp8`: "keep" writes every weight that the source
(the model-format directory, or the run's initial weights) held in block FP8 in block FP8 again,
unchanged ones byte for byte with their scales, changed ones (trained, merged) quantised anew
(kernels/fp8.quantize, 128 x 128 blocks, one rounding); "dequantize" writes them all in the
export's dtype.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from megatron_longstraw.checkpointing import checkpoint, model_format
from megatron_longstraw.kernels import fp8
from megatron_longstraw.runtime.errors import CheckpointError, InputNotFound

FP8_MODES = ("keep", "dequantize")


class TensorDict(Mapping):
    """name -> tensor in memory, with `SafetensorsReader`'s `shape` and `dtype_name`."""

    _CODES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16",
              torch.float16: "F16", fp8.FP8_DTYPE: fp8.SAFETENSORS_DTYPE, torch.int64: "I64",
              torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self._tensors = dict(tensors)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def dtype_name(self, name: str) -> str:
        return self._CODES.get(self._tensors[name].dtype, str(self._tensors[name].dtype))


class Overlay(Mapping):
    """`top` over `base` (lazy mappings with `shape` / `dtype_name`): names in `top` win; a base
    FP8 weight's scale is hidden when `top` replaces the weight."""

    def __init__(self, top, base):
        self._top, self._base = top, base
        self._names = list(top) + [n for n in base if n not in top and not (
            n.endswith(fp8.SCALE_SUFFIX) and n[:-len(fp8.SCALE_SUFFIX)] in top)]
        self._set = set(self._names)

    def _owner(self, name):
        return self._top if name in self._top else self._base

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._set:
            raise KeyError(name)
        return self._owner(name)[name]

    def __contains__(self, name) -> bool:
        return name in self._set

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._owner(name).shape(name)

    def dtype_name(self, name: str) -> str:
        return self._owner(name).dtype_name(name)


def resolve_training_checkpoint(path: str | os.PathLike) -> Path | None:
    """The training checkpoint folder `path` names (a `step_N` folder, or a save folder: its
    latest), None when `path` is neither."""
    path = Path(path)
    if (path / checkpoint.TRAIN_META).is_file():
        return path
    return checkpoint.latest_checkpoint(path)


def read_weights(path: str | os.PathLike) -> tuple[dict, Mapping]:
    """(meta, lazy tensors) of a model-format directory or a training checkpoint (module
    docstring)."""
    path = Path(path)
    if model_format.is_model_format(path):
        return model_format.read_model(path)
    found = resolve_training_checkpoint(path)
    if found is None:
        if not path.exists():
            raise InputNotFound(f"{path} does not exist.")
        raise CheckpointError(f"{path} is neither a model-format directory (no "
                              f"{model_format.MODEL_META}) nor a training checkpoint (a step_N "
                              f"folder with {checkpoint.TRAIN_META}, or a --save folder holding "
                              "one).")
    meta = checkpoint.read_checkpoint_meta(found)
    if not meta.get("family") or not isinstance(meta.get("model"), dict):
        raise CheckpointError(f"{found / checkpoint.TRAIN_META} does not record the model "
                              "(\"family\" and \"model\"); it was not written by the launcher.")
    initial = meta.get("initial_weights")
    base_meta = None
    if initial and model_format.is_model_format(initial):
        base_meta = model_format.read_meta(Path(initial) / model_format.MODEL_META,
                                           model_format.MODEL_FORMAT)
    out = {"format": model_format.MODEL_FORMAT, "family": meta["family"], "model": meta["model"],
           "parallel": meta["parallel"], "source": str(found.resolve()), "step": meta.get("step"),
           "initial_weights": initial}
    if base_meta is not None and "hf_config" in base_meta:
        out["hf_config"] = base_meta["hf_config"]
    if meta.get("lora"):
        tensors = _merged_lora(found, meta)
    else:
        tensors = _full_parameters(found, meta, initial if base_meta is not None else None)
    out["dtype"] = _dtype_of(tensors, found)
    return out, tensors


def _shard_files(found: Path, meta: dict) -> list[Path]:
    """model.safetensors and every EP rank's expert shard the layout implies (all present)."""
    files = [found / model_format.MODEL_WEIGHTS]
    shards = sorted(found.glob("experts_ep*.safetensors"))
    ep = int(meta["parallel"]["expert_parallel_size"])
    if shards:
        expected = [found / f"experts_ep{e:03d}.safetensors" for e in range(ep)]
        missing = [p.name for p in expected if not p.is_file()]
        if missing or len(shards) != ep:
            raise CheckpointError(f"{found}: saved with EP={ep}, but the expert shards are "
                                  f"{[p.name for p in shards]} (missing {missing}); the "
                                  "checkpoint is incomplete: copy it again or use another step.")
        files += expected
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{found}: {file.name} is missing; the checkpoint is "
                                  "incomplete: copy it again or use another step.")
    return files


def _full_parameters(found: Path, meta: dict, initial: str | None) -> Mapping:
    tensors = model_format.SafetensorsReader(_shard_files(found, meta))
    if initial is not None:   # frozen tensors (if any) come from the run's initial weights
        return Overlay(tensors, model_format.read_model(initial)[1])
    return tensors


def _dtype_of(tensors: Mapping, where: Path) -> str:
    """The export's dtype: the word embedding's (the model's parameter dtype)."""
    name = "embedding.word_embeddings.weight"
    if name not in tensors:
        raise CheckpointError(f"{where} has no {name}.")
    return model_format.DTYPE_NAMES[tensors[name].dtype]


# ---- LoRA: build, load the base, apply and load the adapters, merge -----------------------------


def _run_dtype(found: Path, meta: dict) -> torch.dtype:
    """The run's parameter dtype, as the launcher records it in meta.json ("dtype")."""
    if meta.get("dtype"):
        return {v: k for k, v in model_format.DTYPE_NAMES.items()}[meta["dtype"]]
    raise CheckpointError(f"{found / checkpoint.TRAIN_META} does not record the run's parameter "
                          "dtype (\"dtype\"; checkpoints written before the LoRA export existed): "
                          "export the merged model from the run itself with "
                          "--longstraw-save-merged DIR.")


def _merged_lora(found: Path, meta: dict) -> TensorDict:
    from megatron_longstraw.adapters import fp8_base, lora as adapters
    from megatron_longstraw.distributed import parallel
    from megatron_longstraw.models.registry import get_family
    from megatron_longstraw.runtime import precision

    record, family = meta["lora"], get_family(meta["family"])
    base = record["base"]
    dtype = _run_dtype(found, meta)
    parallel.initialize(1, 1, seed=base.get("seed") if base.get("seed") is not None else 0)
    precision.use_dtype(dtype)
    cfg = family.config_class.from_dict(meta["model"])
    model = family.build_model(cfg, params_dtype=dtype)
    sources = {} if record.get("fp8_base") else None
    if base.get("source"):
        if not model_format.is_model_format(base["source"]):
            raise CheckpointError(f"{found} trained adapters on the base model in "
                                  f"{base['source']}, which is no longer a model-format "
                                  "directory; put the base back there to export.")
        model_format.load_model(base["source"], model, family=family.name, fp8_sources=sources)
    _check_base(found, base, model, meta["parallel"], cfg)
    if sources is not None:
        fp8_base.apply_fp8_base(model, family.fp8_linears, sources)
    config = adapters.LoRAConfig(rank=record["rank"], alpha=record["alpha"],
                                 dropout=record.get("dropout", 0.0),
                                 targets=tuple(record["targets"]),
                                 exclude=tuple(record.get("exclude") or ()))
    adapters.apply_lora(model, config, quantize_base=record["quantize_base"])
    saved = model_format.SafetensorsReader(_shard_files(found, meta))
    own = model_format.local_tensors(model, trainable_only=True)
    missing, unexpected = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
    if missing or unexpected:
        raise CheckpointError(f"{found}: its adapters do not match the LoRA settings it records "
                              f"(missing {missing[:5]}, unexpected {unexpected[:5]}).")
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(saved[name])
    return TensorDict(model_format.merged_tensors(model))


def _check_base(found: Path, base: dict, model, layout: dict, cfg) -> None:
    """The rebuilt base is the one the adapters were trained on: each rank's recorded
    `model_fingerprint` equals that of this model's tensors seen from that rank's EP shard."""
    saved = base.get("fingerprints") or []
    ep = int(layout["expert_parallel_size"])
    full = model_format.local_tensors(model)
    num_experts = getattr(cfg, "n_routed_experts", 1)
    per_expert = num_experts // ep
    for rank, recorded in enumerate(saved):
        ep_rank = rank % ep
        local = {}
        for name, tensor in full.items():
            if ".mlp.experts.local_experts." in name:
                head, tail = name.split(".mlp.experts.local_experts.")
                expert, rest = tail.split(".", 1)
                if int(expert) // per_expert != ep_rank:
                    continue
                name = f"{head}.mlp.experts.local_experts.{int(expert) % per_expert}.{rest}"
            local[name] = tensor
        if checkpoint.tensors_fingerprint(local) != recorded:
            what = base.get("source") or f"the random initialisation of seed {base.get('seed')}"
            raise CheckpointError(
                f"{found}: the base model rebuilt from {what} differs from the one its adapters "
                f"were trained on (fingerprint of rank {rank}); merged weights would be wrong. "
                "Put the original base weights back at the recorded source.")


# ---- --fp8 ---------------------------------------------------------------------------------------


def fp8_layout(meta: dict, tensors: Mapping, mode: str) -> Mapping:
    """`tensors` with the FP8 weights written as `mode` says (module docstring)."""
    if mode not in FP8_MODES:
        raise ValueError(f"--fp8 {mode!r}: choose one of {FP8_MODES}.")
    pairs = fp8.find_pairs(tensors, tensors.dtype_name, tensors.shape, str(meta.get("source")),
                           fp8.row_parts)
    dtype = {v: k for k, v in model_format.DTYPE_NAMES.items()}[meta["dtype"]]
    if mode == "dequantize":
        if not pairs:
            return tensors
        dequantized = fp8.Dequantized(tensors, pairs, {n: dtype for n in pairs})
        return TensorDict({n: dequantized[n] for n in dequantized})
    source = _fp8_source(meta)
    if source is None:
        return tensors
    src_meta, src = source
    src_pairs = fp8.find_pairs(src, src.dtype_name, src.shape, str(meta["initial_weights"]),
                               fp8.row_parts)
    if not src_pairs:
        return tensors
    out = {n: tensors[n] for n in tensors}
    for name, scale in src_pairs.items():
        if name in pairs or name not in out:
            continue   # already FP8 / not exported
        value = out[name]
        original = fp8.dequantize(src[name], src[scale], value.dtype, fp8.row_parts(name))
        if torch.equal(original, value):
            out[name], out[scale] = src[name], src[scale]
        else:
            out[name], out[scale] = fp8.quantize(value, name, fp8.row_parts(name))
    return TensorDict(out)


def _fp8_source(meta: dict):
    """(longstraw.json, tensors) of the FP8 model-format directory a training checkpoint's run
    started from, None for a model-format input (its FP8 weights are the tensors themselves)."""
    initial = meta.get("initial_weights")
    if not initial or not model_format.is_model_format(initial):
        return None
    src_meta, src = model_format.read_model(initial)
    return (src_meta, src) if src_meta.get("fp8") else None


def describe(meta: dict) -> str:
    """One line: what was read."""
    if meta.get("step") is None:
        return f"model format {meta.get('source')}"
    return (f"training checkpoint {meta['source']} (step {meta['step']}, "
            f"{model_format.describe_layout(meta['parallel'], with_dp=False)})")


__all__ = ["FP8_MODES", "Overlay", "TensorDict", "describe", "fp8_layout", "read_weights",
           "resolve_training_checkpoint"]
