"""The plugin's model format on disk (converted weights, exports) and the pieces every on-disk
write shares: atomic files, the parallel layout (agreement across ranks: distributed/agreement.py).

Model format (written by `tools/convert_hf.py` and `save_model`, read by `load_model`), a directory:

    longstraw.json      {"format": "longstraw-model", "format_version": 1,
                         "family": "glm52" | "qwen36",
                         "model": GLM52Config / Qwen36Config .to_dict(), "dtype": "float64",
                         "parallel": {"world_size", "context_parallel_size", "expert_parallel_size",
                                      "data_parallel_size"}  (the layout it was saved from),
                         "source": free-form provenance (e.g. the HF directory)}
    model.safetensors   the single-process state dict: the names of `build_glm52_model(cfg)
                        .state_dict()` (or `build_qwen36_model`'s) at EP = 1, routed experts
                        under their global index (`expert_names.global_name`), without
                        `_extra_state` entries and the routers' `local_tokens_per_expert`
                        statistics. Routers' `expert_bias` stays float32
                        whatever "dtype" says (Megatron keeps it in float32).
                        A block-FP8 checkpoint's linears (tools/convert_hf.py keeps them):
                        `<linear>.weight` float8_e4m3fn plus `<linear>.weight_scale_inv`
                        float32, 128 x 128 blocks (megatron_longstraw/kernels/fp8.py; a gated
                        `linear_fc1` holds gate's and up's grids stacked); "dtype" is then
                        the other tensors' dtype, and longstraw.json has an "fp8" entry.

An expert-parallel model loads it with `load_model` (each rank reads only its own experts, lazily).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_longstraw.kernels import fp8
from megatron_longstraw.runtime.errors import CheckpointError, InputNotFound
from megatron_longstraw.distributed.agreement import together
from megatron_longstraw.distributed.finalize import is_expert_param
from megatron_longstraw.distributed.expert_names import global_name, load_full_state_dict

MODEL_FORMAT = "longstraw-model"
FORMAT_VERSION = 1
MODEL_META, MODEL_WEIGHTS = "longstraw.json", "model.safetensors"
_SKIPPED_SUFFIXES = ("_extra_state", "local_tokens_per_expert")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64",
               torch.float16: "float16"}


# ---- files --------------------------------------------------------------------------------------


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """`path` holds either its old content or `text`, never a mix (temp file, fsync, os.replace)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> None:
    """safetensors file of CPU copies of `tensors`, fsynced. Tensors that share storage with an
    earlier one (views such as a chunked [gate; up]) are cloned: safetensors refuses aliases."""
    from safetensors.torch import save_file

    seen, out = set(), {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu()
        ptr = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if ptr in seen else tensor.contiguous()
        seen.add(ptr)
    save_file(out, str(path), metadata={"format": "pt", **(metadata or {})})
    fsync_file(path)


class DamagedFile(CheckpointError):
    """A file of a checkpoint or model-format directory that is missing or cannot be read
    (truncated by a full disk or an interrupted copy, overwritten, not the expected format)."""


def damaged(path, exc: BaseException) -> DamagedFile:
    """A DamagedFile naming `path` and what reading it found, in one line (no advice to unpickle
    with weights_only=False: the file is broken, not untrusted)."""
    import pickle

    path = Path(path)
    if isinstance(exc, FileNotFoundError):
        return DamagedFile(f"{path} is missing.")
    if isinstance(exc, pickle.UnpicklingError):
        reason = "not a readable torch.save file"
    elif isinstance(exc, EOFError):
        reason = "it ends early"
    else:
        reason = " ".join(str(exc).split()) or type(exc).__name__
    size = f"{path.stat().st_size} bytes" if path.exists() else "gone"
    return DamagedFile(f"{path} is damaged ({reason}; {size}).")


class SafetensorsReader(Mapping):
    """Read-only `name -> tensor` over one or more safetensors files. Opening reads the headers
    only; a tensor is read from disk when it is looked up (`load_full_state_dict` then reads just
    this rank's tensors). A file that cannot be read raises DamagedFile naming it."""

    def __init__(self, files):
        from safetensors import safe_open

        self._handles, self._where = {}, {}
        for path in map(str, files):
            try:
                handle = safe_open(path, framework="pt", device="cpu")
            except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError: the file named
                raise damaged(path, exc) from None
            self._handles[path] = handle
            for name in handle.keys():
                if name in self._where:
                    raise ValueError(f"tensor {name} is in both {self._where[name]} and {path}.")
                self._where[name] = path

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self._handles[self._where[name]].get_tensor(name)
        except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError: the file named
            raise damaged(self._where[name], exc) from None

    def __contains__(self, name) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def dtype_name(self, name: str) -> str:
        """safetensors dtype code ("BF16", "F32", "F8_E4M3", ...)."""
        return self._handles[self._where[name]].get_slice(name).get_dtype()


# ---- parallel layout ----------------------------------------------------------------------------


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def parallel_layout() -> dict[str, int]:
    """World size and CP / EP / DP sizes of this run (all 1 without Megatron's parallel state)."""
    from megatron.core import parallel_state as ps

    if not (dist.is_initialized() and ps.model_parallel_is_initialized()):
        return {"world_size": 1, "context_parallel_size": 1, "expert_parallel_size": 1,
                "data_parallel_size": 1}
    return {"world_size": dist.get_world_size(),
            "context_parallel_size": ps.get_context_parallel_world_size(),
            "expert_parallel_size": ps.get_expert_model_parallel_world_size(),
            "data_parallel_size": ps.get_data_parallel_world_size()}


def expert_ranks() -> tuple[int, int]:
    """(EP rank, expert-data-parallel rank) of this process."""
    from megatron.core import parallel_state as ps

    if not (dist.is_initialized() and ps.model_parallel_is_initialized()):
        return 0, 0
    return ps.get_expert_model_parallel_rank(), ps.get_expert_data_parallel_rank()


def describe_layout(layout: dict, with_dp: bool) -> str:
    text = f"CP={layout['context_parallel_size']}/EP={layout['expert_parallel_size']}"
    return text + (f"/DP={layout['data_parallel_size']}" if with_dp else "")


# ---- model tensors ------------------------------------------------------------------------------


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module  # DDP / Float16Module wrappers
    return model


def count_experts(model) -> int:
    cfg = getattr(unwrap(model), "longstraw_config", None)
    return getattr(cfg, "n_routed_experts", 1) if cfg is not None else 1


def local_tensors(model: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """This rank's persistent model tensors under local names (`state_dict` without `_extra_state`
    and router statistics); `trainable_only` drops parameters with requires_grad=False."""
    model = unwrap(model)
    params = dict(model.named_parameters())
    out = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name.endswith(_SKIPPED_SUFFIXES) or not isinstance(tensor, torch.Tensor):
            continue
        if trainable_only and name in params and not params[name].requires_grad:
            continue
        out[name] = tensor.detach()
    return out


def routed_expert_names(model: torch.nn.Module) -> set[str]:
    """Local names of the routed-expert parameters (distinct on each EP rank)."""
    return {n for n, p in unwrap(model).named_parameters() if is_expert_param(p)}


def merged_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`local_tensors` of the model with its LoRA adapters merged (adapters.merged_state_dict)."""
    from megatron_longstraw.adapters.lora import merged_state_dict

    return {n: t for n, t in merged_state_dict(unwrap(model)).items()
            if not n.endswith(_SKIPPED_SUFFIXES)}


def full_state_dict(model: torch.nn.Module,
                    merge_adapters: bool = False) -> dict[str, torch.Tensor] | None:
    """The single-process (EP = 1) state dict, global expert names, on global rank 0; None on the
    other ranks. Under EP > 1, a collective over rank 0's expert-parallel group (its other ranks
    send their experts; ranks outside it do nothing). `merge_adapters`: a LoRA model's weights
    with base + scaling * B A folded in, under the names of the model without adapters."""
    num_experts = count_experts(model)
    layout = parallel_layout()
    if layout["expert_parallel_size"] == 1 and global_rank() != 0:
        return None
    tensors = merged_tensors(model) if merge_adapters else local_tensors(model)
    out = {global_name(n, num_experts): t for n, t in tensors.items()}
    if layout["expert_parallel_size"] == 1:
        return out
    from megatron.core import parallel_state as ps

    group = ps.get_expert_model_parallel_group()
    members = dist.get_process_group_ranks(group)
    if 0 not in members:
        return None
    experts = routed_expert_names(model)
    if merge_adapters:   # <expert>.linear_fc1.{base.weight,lora_A,lora_B} -> <expert>.linear_fc1.weight
        from megatron_longstraw.adapters.fp8_base import expert_weight_names

        experts = {re.sub(r"\.lora_[AB]$", ".weight", n).replace(".base.", ".") for n in experts}
        experts |= expert_weight_names(model)   # FP8 base experts: weights in buffers
    mine = {global_name(n, num_experts): t.cpu() for n, t in tensors.items() if n in experts}
    parts = [None] * len(members) if global_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0, group=group)
    if global_rank() != 0:
        return None
    for part in parts:
        out.update(part)
    return out


# ---- model format -------------------------------------------------------------------------------


def write_model(out_dir: str | os.PathLike, tensors: Mapping[str, torch.Tensor], family: str,
                model_config: dict, dtype: torch.dtype, layout: dict | None = None,
                source: str | None = None, extra_meta: dict | None = None) -> Path:
    """Write the model format into `out_dir` (which must not exist or be empty), atomically: a
    temp folder beside it, renamed when complete. `extra_meta` adds keys to longstraw.json (the
    converter keeps the original HF config.json as "hf_config")."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose a new output directory.")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_safetensors(tmp / MODEL_WEIGHTS, tensors)
        meta = {"format": MODEL_FORMAT, "format_version": FORMAT_VERSION, "family": family,
                "model": model_config, "dtype": DTYPE_NAMES.get(dtype, str(dtype)),
                "parallel": layout or parallel_layout(), "source": source, **(extra_meta or {})}
        write_text_atomic(tmp / MODEL_META, json.dumps(meta, indent=2, sort_keys=True) + "\n")
        fsync_dir(tmp)
        os.rename(tmp, out)  # replaces an empty `out`
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def is_model_format(path: str | os.PathLike) -> bool:
    """Whether `path` is a model-format directory (has longstraw.json), as opposed to a folder of
    training checkpoints."""
    return (Path(path) / MODEL_META).is_file()


def read_model(model_dir: str | os.PathLike) -> tuple[dict, SafetensorsReader]:
    """(longstraw.json contents, lazy tensors) of a model-format directory."""
    path = Path(model_dir)
    meta = read_meta(path / MODEL_META, MODEL_FORMAT)
    return meta, SafetensorsReader([path / MODEL_WEIGHTS])


def read_meta(path: Path, kind: str) -> dict:
    if not path.exists():
        raise InputNotFound(f"{path} not found: {path.parent} is not a {kind} directory.")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} line {exc.lineno}: not valid JSON ({exc.msg} at column "
                              f"{exc.colno}); the file is damaged (an interrupted copy?): copy or "
                              "write the directory again.") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path}: not readable as JSON ({exc}); the file is damaged: copy "
                              "or write the directory again.") from None
    if not isinstance(meta, dict) or meta.get("format") != kind:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{path}: format {found!r}, expected {kind!r}.")
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {meta['format_version']} is newer than "
                              f"this megatron_longstraw reads ({FORMAT_VERSION}); upgrade the "
                              "package.")
    return meta


INIT_ONLY_FIELDS = ("init_std",)
"""Model-config fields that only shape a random initialisation: loaded weights replace it, so a
saved model and the built one may differ in them."""


def check_model_config(meta: dict, model, where: Path) -> None:
    """Raise CheckpointError when the model saved in `where` (its meta.json `model`) is not the
    architecture `model` was built with (fields in INIT_ONLY_FIELDS aside)."""
    cfg = getattr(unwrap(model), "longstraw_config", None)
    if cfg is None or meta.get("model") is None:
        return
    ours = cfg.to_dict()
    diff = {k: (meta["model"].get(k), v) for k, v in ours.items()
            if k not in INIT_ONLY_FIELDS and meta["model"].get(k) != v}
    if diff:
        raise CheckpointError(
            f"{where} holds a different model than the one built: "
            + ", ".join(f"{k} (saved {a!r}, model {b!r})" for k, (a, b) in diff.items())
            + "; build the model with the saved values (the `model:` section of the config, or "
              "Megatron's model flags) or pass the directory of this model.")


def save_model(out_dir: str | os.PathLike, model: torch.nn.Module, family: str = "glm52",
               source: str | None = None, merge_adapters: bool = False) -> Path:
    """Write `model` in the model format (every rank calls it; global rank 0 writes).
    `merge_adapters`: a LoRA model is written as the plain model whose weights are base +
    scaling * B A (adapters.merged_state_dict), loadable by `load_model` into a model built
    without adapters."""
    full = full_state_dict(model, merge_adapters)
    cfg = unwrap(model).longstraw_config
    dtype = next(unwrap(model).parameters()).dtype
    layout = parallel_layout()
    together("save_model", lambda: write_model(out_dir, full, family, cfg.to_dict(), dtype,
                                                layout, source) if full is not None else None)
    return Path(out_dir)


def load_model(model_dir: str | os.PathLike, model: torch.nn.Module, family: str = "glm52",
               fp8_sources: dict | None = None) -> dict:
    """Load a model-format directory into `model` (this rank's experts only); returns its
    longstraw.json. Values are cast to each model tensor's dtype. FP8 weights (float8_e4m3fn with
    their `_scale_inv`) load dequantised (`fp8.dequantize`, in the model tensor's dtype); with
    `fp8_sources` (a dict), each of this rank's FP8 weights is also recorded there, local name ->
    `fp8.CheckpointFP8` (read lazily), for `fp8_base.apply_fp8_base` to keep its FP8 bytes."""
    meta, stored = read_model(model_dir)
    pairs = fp8.find_pairs(stored, stored.dtype_name, stored.shape, str(model_dir), fp8.row_parts)
    if meta.get("family") != family:
        raise CheckpointError(f"{model_dir} holds a {meta.get('family')!r} model, not "
                              f"{family!r}.")
    check_model_config(meta, model, Path(model_dir) / MODEL_META)
    num_experts = count_experts(model)
    dtypes = {global_name(n, num_experts): t.dtype for n, t in local_tensors(model).items()}
    tensors = fp8.Dequantized(stored, pairs, dtypes)   # FP8 weights read dequantised
    if parallel_layout()["expert_parallel_size"] == 1:
        unexpected = sorted(set(tensors) - set(local_tensors(model)))
        if unexpected:
            raise CheckpointError(f"{model_dir} has {len(unexpected)} tensors the model lacks, "
                                  f"e.g. {unexpected[:3]}.")
    # load_full_state_dict copies with broadcasting: check shapes first (headers only).
    bad = [f"{n}: saved {stored.shape(g)}, model {tuple(t.shape)}"
           for n, t in local_tensors(model).items()
           if (g := global_name(n, num_experts)) in tensors and stored.shape(g) != tuple(t.shape)]
    if bad:
        raise CheckpointError(f"{model_dir}: shape mismatch for {len(bad)} tensors: {bad[:5]}.")
    load_full_state_dict(unwrap(model), tensors, num_experts)
    if fp8_sources is not None:
        for name in local_tensors(model):
            if (g := global_name(name, num_experts)) in pairs:
                fp8_sources[name] = fp8.CheckpointFP8(stored, g, pairs[g])
    return meta
