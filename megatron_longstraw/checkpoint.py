"""Checkpoints on disk: the plugin's model format (converted weights) and atomic training
checkpoints (save / resume).

Model format (written by `tools/convert_hf.py` and `save_model`, read by `load_model`), a directory:

    longstraw.json      {"format": "longstraw-model", "format_version": 1,
                         "family": "glm52" | "qwen36",
                         "model": GLM52Config / Qwen36Config .to_dict(), "dtype": "float64",
                         "parallel": {"world_size", "context_parallel_size", "expert_parallel_size",
                                      "data_parallel_size"}  (the layout it was saved from),
                         "source": free-form provenance (e.g. the HF directory)}
    model.safetensors   the single-process state dict: the names of `build_glm52_model(cfg)
                        .state_dict()` (or `build_qwen36_model`'s) at EP = 1, routed experts
                        under their global index (`parallel.global_name`), without
                        `_extra_state` entries and the routers' `local_tokens_per_expert`
                        statistics. Routers' `expert_bias` stays float32
                        whatever "dtype" says (Megatron keeps it in float32).

An expert-parallel model loads it with `load_model` (each rank reads only its own experts, lazily).

Training checkpoint, a directory per save under the run's save folder:

    <save>/latest                   text: the name of the newest complete checkpoint ("step_00000002")
    <save>/step_00000002/
        meta.json                   format, version, step, parallel layout, model config, file list
        model.safetensors           trainable non-expert parameters and persistent buffers (rank 0;
                                    identical on every rank after finalize.py)
        experts_ep000.safetensors   trainable expert parameters of EP rank 0, global names (written
                                    by the expert-data-parallel rank 0 of that EP rank), ...
        rank_00000.pt               per rank: optimizer state (+ the parameter name of every slot),
                                    RNG states (python, numpy, torch, CUDA, Megatron's tracker), and
                                    the `extra` dict that rank passed
    <save>/.tmp-step_00000003/      a save in progress (or interrupted): never read

Atomicity: every rank writes into `.tmp-step_N` (files fsynced); the ranks agree that all writes
succeeded (a failed rank's error is raised on every rank; nothing waits for a dead peer beyond the
process-group timeout); rank 0 writes meta.json, fsyncs, renames the folder to `step_N`, then
replaces `latest` (temp file + fsync + os.replace). A crash at any point leaves the previous
checkpoint and `latest` untouched; the next save removes leftover `.tmp-*` folders. Resume
requires the same world size, CP and EP sizes (optimizer state and expert shards are per rank); the
error says how to continue otherwise. The save folder must be visible to every rank.

Frozen parameters (requires_grad=False) are not saved. In a LoRA / QLoRA run that is the whole base
model: a checkpoint holds the adapters (`lora_A` / `lora_B`), persistent buffers and the adapters'
optimizer state. For Qwen3.6-27B at rank 19 the adapters are 0.46 GB (fp32); the base would add
about 12.6 GB of NF4 linears (54 GB in bf16) every `--save-interval` steps. Training never changes
the base, so it is recoverable from where it came from, and a copy per checkpoint would only cost
disk and save time. Instead
`meta.json` carries (the launcher passes it as `meta_extra`)

    "lora": {"rank", "alpha", "dropout", "targets", "exclude", "quantize_base",
             "base": {"source": the model-format directory the base was loaded from (absolute),
                                or null for the seeded random initialisation,
                      "seed": that seed, "fingerprints": [model_fingerprint of each rank's base]}}

and a resume loads the base again (`--pretrained-checkpoint`, else the recorded source), checks it
against the fingerprints before applying adapters (`check_lora_base`), and refuses a base that
differs, or LoRA settings that differ (`check_lora_resume`), with a message naming the fix.
`save_model(..., merge_adapters=True)` exports base + adapters merged as a model-format directory.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megatron_longstraw.finalize import is_expert_param
from megatron_longstraw.parallel import global_name, load_full_state_dict

MODEL_FORMAT = "longstraw-model"
TRAIN_FORMAT = "longstraw-train"
FORMAT_VERSION = 1
MODEL_META, MODEL_WEIGHTS = "longstraw.json", "model.safetensors"
TRAIN_META, LATEST = "meta.json", "latest"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_SKIPPED_SUFFIXES = ("_extra_state", "local_tokens_per_expert")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64",
               torch.float16: "float16"}


# ---- files --------------------------------------------------------------------------------------


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
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
    _fsync_dir(path.parent)


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
    _fsync_file(path)


class SafetensorsReader(Mapping):
    """Read-only `name -> tensor` over one or more safetensors files. Opening reads the headers
    only; a tensor is read from disk when it is looked up (`load_full_state_dict` then reads just
    this rank's tensors)."""

    def __init__(self, files):
        from safetensors import safe_open

        self._handles, self._where = {}, {}
        for path in map(str, files):
            handle = safe_open(path, framework="pt", device="cpu")
            self._handles[path] = handle
            for name in handle.keys():
                if name in self._where:
                    raise ValueError(f"tensor {name} is in both {self._where[name]} and {path}.")
                self._where[name] = path

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._handles[self._where[name]].get_tensor(name)

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


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
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


def _expert_ranks() -> tuple[int, int]:
    """(EP rank, expert-data-parallel rank) of this process."""
    from megatron.core import parallel_state as ps

    if not (dist.is_initialized() and ps.model_parallel_is_initialized()):
        return 0, 0
    return ps.get_expert_model_parallel_rank(), ps.get_expert_data_parallel_rank()


def describe_layout(layout: dict, with_dp: bool) -> str:
    text = f"CP={layout['context_parallel_size']}/EP={layout['expert_parallel_size']}"
    return text + (f"/DP={layout['data_parallel_size']}" if with_dp else "")


def _agree(error: BaseException | None, what: str) -> None:
    """Raise on every rank when any rank failed `what`: the failing rank raises its own error, the
    others say which rank failed and why (no rank is left waiting in a later collective)."""
    if not _distributed():
        if error is not None:
            raise error
        return
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    for rank, message in enumerate(messages):
        if message:
            raise RuntimeError(f"{what} failed on rank {rank}: {message}")


def _together(what: str, fn, *args) -> Any:
    try:
        result, error = fn(*args), None
    except Exception as exc:  # noqa: BLE001 - re-raised by _agree on this rank
        result, error = None, exc
    _agree(error, what)
    return result


# ---- model tensors ------------------------------------------------------------------------------


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module  # DDP / Float16Module wrappers
    return model


def _num_experts(model) -> int:
    cfg = getattr(_unwrap(model), "longstraw_config", None)
    return getattr(cfg, "n_routed_experts", 1) if cfg is not None else 1


def local_tensors(model: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """This rank's persistent model tensors under local names (`state_dict` without `_extra_state`
    and router statistics); `trainable_only` drops parameters with requires_grad=False."""
    model = _unwrap(model)
    params = dict(model.named_parameters())
    out = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name.endswith(_SKIPPED_SUFFIXES) or not isinstance(tensor, torch.Tensor):
            continue
        if trainable_only and name in params and not params[name].requires_grad:
            continue
        out[name] = tensor.detach()
    return out


def _expert_names(model: torch.nn.Module) -> set[str]:
    """Local names of the routed-expert parameters (distinct on each EP rank)."""
    return {n for n, p in _unwrap(model).named_parameters() if is_expert_param(p)}


def _merged_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`local_tensors` of the model with its LoRA adapters merged (adapters.merged_state_dict)."""
    from megatron_longstraw.adapters import merged_state_dict

    return {n: t for n, t in merged_state_dict(_unwrap(model)).items()
            if not n.endswith(_SKIPPED_SUFFIXES)}


def full_state_dict(model: torch.nn.Module,
                    merge_adapters: bool = False) -> dict[str, torch.Tensor] | None:
    """The single-process (EP = 1) state dict, global expert names, on global rank 0; None on the
    other ranks. Under EP > 1, a collective over rank 0's expert-parallel group (its other ranks
    send their experts; ranks outside it do nothing). `merge_adapters`: a LoRA model's weights
    with base + scaling * B A folded in, under the names of the model without adapters."""
    num_experts = _num_experts(model)
    layout = parallel_layout()
    if layout["expert_parallel_size"] == 1 and _rank() != 0:
        return None
    tensors = _merged_tensors(model) if merge_adapters else local_tensors(model)
    out = {global_name(n, num_experts): t for n, t in tensors.items()}
    if layout["expert_parallel_size"] == 1:
        return out
    from megatron.core import parallel_state as ps

    group = ps.get_expert_model_parallel_group()
    members = dist.get_process_group_ranks(group)
    if 0 not in members:
        return None
    experts = _expert_names(model)
    if merge_adapters:   # <expert>.linear_fc1.{base.weight,lora_A,lora_B} -> <expert>.linear_fc1.weight
        experts = {re.sub(r"\.lora_[AB]$", ".weight", n).replace(".base.", ".") for n in experts}
    mine = {global_name(n, num_experts): t.cpu() for n, t in tensors.items() if n in experts}
    parts = [None] * len(members) if _rank() == 0 else None
    dist.gather_object(mine, parts, dst=0, group=group)
    if _rank() != 0:
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
        _fsync_dir(tmp)
        os.rename(tmp, out)  # replaces an empty `out`
        _fsync_dir(out.parent)
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
    meta = _read_meta(path / MODEL_META, MODEL_FORMAT)
    return meta, SafetensorsReader([path / MODEL_WEIGHTS])


def _read_meta(path: Path, kind: str) -> dict:
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: {path.parent} is not a {kind} directory.")
    meta = json.loads(path.read_text())
    if meta.get("format") != kind:
        raise ValueError(f"{path}: format {meta.get('format')!r}, expected {kind!r}.")
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(f"{path}: format version {meta['format_version']} is newer than this "
                         f"megatron_longstraw reads ({FORMAT_VERSION}); upgrade the package.")
    return meta


def _check_model_config(meta: dict, model, where: Path) -> None:
    cfg = getattr(_unwrap(model), "longstraw_config", None)
    if cfg is None or meta.get("model") is None:
        return
    ours = cfg.to_dict()
    diff = {k: (meta["model"].get(k), v) for k, v in ours.items() if meta["model"].get(k) != v}
    if diff:
        raise ValueError(f"{where} holds a different model than the one built: "
                         + ", ".join(f"{k} (saved {a!r}, model {b!r})" for k, (a, b) in diff.items())
                         + ".")


def save_model(out_dir: str | os.PathLike, model: torch.nn.Module, family: str = "glm52",
               source: str | None = None, merge_adapters: bool = False) -> Path:
    """Write `model` in the model format (every rank calls it; global rank 0 writes).
    `merge_adapters`: a LoRA model is written as the plain model whose weights are base +
    scaling * B A (adapters.merged_state_dict), loadable by `load_model` into a model built
    without adapters."""
    full = full_state_dict(model, merge_adapters)
    cfg = _unwrap(model).longstraw_config
    dtype = next(_unwrap(model).parameters()).dtype
    layout = parallel_layout()
    _together("save_model", lambda: write_model(out_dir, full, family, cfg.to_dict(), dtype,
                                                layout, source) if full is not None else None)
    return Path(out_dir)


def load_model(model_dir: str | os.PathLike, model: torch.nn.Module, family: str = "glm52") -> dict:
    """Load a model-format directory into `model` (this rank's experts only); returns its
    longstraw.json. Values are cast to each model tensor's dtype."""
    meta, tensors = read_model(model_dir)
    if meta.get("family") != family:
        raise ValueError(f"{model_dir} holds a {meta.get('family')!r} model, not {family!r}.")
    _check_model_config(meta, model, Path(model_dir))
    if parallel_layout()["expert_parallel_size"] == 1:
        unexpected = sorted(set(tensors) - set(local_tensors(model)))
        if unexpected:
            raise KeyError(f"{model_dir} has {len(unexpected)} tensors the model lacks, e.g. "
                           f"{unexpected[:3]}.")
    num_experts = _num_experts(model)
    # load_full_state_dict copies with broadcasting: check shapes first (headers only).
    bad = [f"{n}: saved {tensors.shape(g)}, model {tuple(t.shape)}"
           for n, t in local_tensors(model).items()
           if (g := global_name(n, num_experts)) in tensors and tensors.shape(g) != tuple(t.shape)]
    if bad:
        raise ValueError(f"{model_dir}: shape mismatch for {len(bad)} tensors: {bad[:5]}.")
    load_full_state_dict(_unwrap(model), tensors, num_experts)
    return meta


# ---- training checkpoints -----------------------------------------------------------------------


def rng_states() -> dict:
    """Every RNG stream this process may draw from."""
    from megatron.core.tensor_parallel import random as mrandom

    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        states["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached)
    except ImportError:
        pass
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    tracker = mrandom.get_cuda_rng_tracker()
    if tracker.is_initialized():
        states["megatron"] = dict(tracker.get_states())
    return states


def set_rng_states(states: dict) -> None:
    from megatron.core.tensor_parallel import random as mrandom

    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    if "numpy" in states:
        import numpy as np

        kind, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "megatron" in states:
        mrandom.get_cuda_rng_tracker().set_states(states["megatron"])


def _step_name(step: int) -> str:
    return f"step_{step:08d}"


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _experts_file(ep_rank: int) -> str:
    return f"experts_ep{ep_rank:03d}.safetensors"


def _optimizer_param_names(model, optimizer) -> list[str]:
    names = {id(p): n for n, p in _unwrap(model).named_parameters()}
    missing = [i for g in optimizer.param_groups for i, p in enumerate(g["params"])
               if id(p) not in names]
    if missing:
        raise ValueError(f"the optimizer holds {len(missing)} tensors that are not parameters of "
                         "the model; build the optimizer from model.parameters().")
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


def _rank_state(model, optimizer, extra) -> dict:
    state = {"rng": rng_states(), "extra": extra}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
        state["optimizer_params"] = _optimizer_param_names(model, optimizer)
    return state


def _write_rank_files(tmp: Path, model, optimizer, extra) -> None:
    """This rank's files: the shared tensors (rank 0), its EP rank's experts (expert-DP rank 0),
    its optimizer/RNG state (every rank). Model files first, the rank state last."""
    rank, (ep_rank, expert_dp_rank) = _rank(), _expert_ranks()
    tensors = local_tensors(model, trainable_only=True)
    num_experts, expert_names = _num_experts(model), _expert_names(model)
    experts = {global_name(n, num_experts): t for n, t in tensors.items() if n in expert_names}
    if rank == 0:
        write_safetensors(tmp / MODEL_WEIGHTS,
                          {n: t for n, t in tensors.items() if n not in expert_names})
    if experts and expert_dp_rank == 0:
        write_safetensors(tmp / _experts_file(ep_rank), experts)
    path = tmp / _rank_file(rank)
    with open(path, "wb") as f:
        torch.save(_rank_state(model, optimizer, extra), f)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(save_dir: str | os.PathLike, model: torch.nn.Module, optimizer, step: int,
                    extra: dict | None = None, keep_last: int | None = None,
                    meta_extra: dict | None = None) -> Path:
    """Save trainable parameters, optimizer state, RNG states, `step` and this rank's `extra`
    (tensors and plain Python values) as `save_dir/step_<step>`, atomically, and point `latest` at
    it. Collective: every rank calls it with the same `step`. `keep_last` deletes older
    checkpoints beyond the newest `keep_last`. `meta_extra` (JSON values, rank 0's) adds keys to
    meta.json (the launcher's "family", "lora", "initial_weights"; `read_checkpoint_meta` reads
    them back). Returns the checkpoint folder."""
    save_dir = Path(save_dir)
    name = _step_name(int(step))
    tmp, final = save_dir / f".tmp-{name}", save_dir / name
    layout = parallel_layout()

    def prepare():
        if _distributed():
            steps = [None] * dist.get_world_size()
            dist.all_gather_object(steps, int(step))
            if len(set(steps)) > 1:
                raise ValueError(f"ranks disagree on the step being saved: {steps}.")
        if _rank() == 0:
            save_dir.mkdir(parents=True, exist_ok=True)
            for stale in save_dir.glob(".tmp-step_*"):   # interrupted earlier saves
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()

    _together("checkpoint save (prepare)", prepare)
    _together("checkpoint save (write)", _write_rank_files, tmp, model, optimizer, extra)

    def publish():
        if _rank() != 0:
            return
        files = sorted(p.name for p in tmp.iterdir())
        cfg = getattr(_unwrap(model), "longstraw_config", None)
        meta = {**(meta_extra or {}), "format": TRAIN_FORMAT, "format_version": FORMAT_VERSION,
                "step": int(step), "parallel": layout,
                "model": cfg.to_dict() if cfg is not None else None, "files": files}
        write_text_atomic(tmp / TRAIN_META, json.dumps(meta, indent=2, sort_keys=True) + "\n")
        _fsync_dir(tmp)
        trash = save_dir / f".tmp-step_replaced-{name}"
        if final.exists():  # the same step saved again (e.g. after resuming from an older one)
            os.rename(final, trash)
        os.rename(tmp, final)
        _fsync_dir(save_dir)
        write_text_atomic(save_dir / LATEST, name + "\n")
        shutil.rmtree(trash, ignore_errors=True)
        if keep_last:
            for old in sorted(_complete_checkpoints(save_dir))[:-keep_last]:
                if old[1] != final:
                    shutil.rmtree(old[1], ignore_errors=True)

    _together("checkpoint save (publish)", publish)
    return final


def _complete_checkpoints(save_dir: Path) -> list[tuple[int, Path]]:
    return [(int(m.group(1)), p) for p in save_dir.iterdir()
            if (m := _STEP_DIR.match(p.name)) and (p / TRAIN_META).exists()]


def latest_checkpoint(save_dir: str | os.PathLike) -> Path | None:
    """The checkpoint `latest` names; if `latest` is missing or names a missing folder, the highest
    complete `step_*` folder; None when there is none. `.tmp-*` folders are never returned."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return None
    pointer = save_dir / LATEST
    if pointer.exists():
        target = save_dir / pointer.read_text().strip()
        if _STEP_DIR.match(target.name) and (target / TRAIN_META).exists():
            return target
    found = sorted(_complete_checkpoints(save_dir))
    return found[-1][1] if found else None


def read_checkpoint_meta(path: str | os.PathLike) -> dict:
    """meta.json of a checkpoint folder (or of a save folder's latest checkpoint)."""
    path = Path(path)
    if not (path / TRAIN_META).exists() and (resolved := latest_checkpoint(path)) is not None:
        path = resolved
    return _read_meta(path / TRAIN_META, TRAIN_FORMAT)


# ---- LoRA runs: the frozen base is not saved; check it on resume ----------------------------------


def model_fingerprint(model: torch.nn.Module) -> str:
    """A content checksum of this rank's model tensors (names, shapes, dtypes, bits): equal for
    bitwise-equal weights, different for other weights whatever the summation order or device
    (integer sums of the bits, exact). One pass over the weights, on their device."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(local_tensors(model).items()):
        flat = tensor.detach().reshape(-1)
        if flat.dtype == torch.bool:
            flat = flat.to(torch.uint8)
        words = flat.view(torch.int16) if flat.element_size() % 2 == 0 else flat.view(torch.uint8)
        plain, weighted, chunk = 0, 0, 1 << 24
        for start in range(0, words.numel(), chunk):
            part = words[start:start + chunk].to(torch.int64)
            # |bits| < 2^15, weights <= 65521 < 2^16, 2^24 terms: |sum| < 2^55, no overflow.
            weight = torch.arange(start, start + part.numel(), device=part.device) % 65521 + 1
            plain += int(part.sum())
            weighted += int((part * weight).sum())
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|{plain}|{weighted};".encode())
    return digest.hexdigest()[:32]


def lora_flags(record: dict) -> str:
    """The launcher flags that ask for the adapters `record` (LoRASettings.record()) describes."""
    flags = ["--longstraw-qlora" if record["quantize_base"] else "--longstraw-lora",
             f"--longstraw-lora-rank {record['rank']}", f"--longstraw-lora-alpha {record['alpha']:g}",
             "--longstraw-lora-targets " + " ".join(record["targets"])]
    if record.get("exclude"):
        flags.append("--longstraw-lora-exclude " + " ".join(record["exclude"]))
    return " ".join(flags)


_LORA_RESUME_KEYS = ("quantize_base", "rank", "alpha", "targets", "exclude")
"""Settings a resumed LoRA run must keep (dropout may change between runs: it has no state)."""


def check_lora_resume(path: str | os.PathLike, saved: dict | None, requested: dict | None) -> None:
    """Refuse to resume checkpoint `path` (meta.json "lora": `saved`) as a run that asks for other
    adapters (`requested`; None for either means full-parameter training)."""
    if saved is None and requested is None:
        return
    if saved is None:
        raise ValueError(f"{path} is a full-parameter checkpoint; a LoRA run cannot resume it. "
                         "Resume without the LoRA flags, or start a new LoRA run (another --save "
                         "folder) from its weights in model format (--pretrained-checkpoint DIR, "
                         "written by checkpoint.save_model).")
    if requested is None:
        raise ValueError(f"{path} holds LoRA adapters, not a full model (its frozen base is not "
                         f"saved); resume it with the same adapters: {lora_flags(saved)}.")
    diff = [f"{key} {saved.get(key)!r} (this run: {requested.get(key)!r})"
            for key in _LORA_RESUME_KEYS if saved.get(key) != requested.get(key)]
    if diff:
        raise ValueError(f"{path} was trained with other LoRA settings: {', '.join(diff)}. Resume "
                         f"with the checkpoint's settings ({lora_flags(saved)}), or start a new "
                         "run with another --save folder.")


def _describe_base(base: dict) -> str:
    if base.get("source"):
        return str(base["source"])
    return f"the random initialisation of seed {base.get('seed')}"


def check_lora_base(path: str | os.PathLike, saved_base: dict, fingerprint: str,
                    current: dict) -> None:
    """Collective: every rank compares its base's `model_fingerprint` (taken before the adapters
    were applied) with the one checkpoint `path` recorded for it (`saved_base`, meta.json
    "lora"."base"); `current` describes this run's base ({"source", "seed"}). Raises on every rank
    when any rank's base differs: adapters trained on one base are meaningless on another."""

    def check():
        saved = saved_base.get("fingerprints") or []
        rank = _rank()
        if rank >= len(saved) or saved[rank] != fingerprint:
            raise ValueError(
                f"the frozen base model differs from the one the adapters in {path} were trained "
                f"on: they were trained on {_describe_base(saved_base)}, this run's base is "
                f"{_describe_base(current)} (weights fingerprint {fingerprint} on rank {rank}, "
                f"saved {saved[rank] if rank < len(saved) else 'none'}). Pass the original base "
                "weights with --pretrained-checkpoint DIR (a model-format directory)"
                + ("" if saved_base.get("source") else
                   f", or resume with the same --seed ({saved_base.get('seed')})") + ".")

    _together("LoRA base check", check)


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer=None) -> tuple[int, dict | None]:
    """Resume from a checkpoint folder (or a save folder: its latest checkpoint). Restores this
    rank's trainable parameters, optimizer state and RNG states; returns (step, this rank's extra).
    Everything is checked before anything is modified; every rank calls it, and an error on one
    rank is raised on all of them."""
    return _together("checkpoint load", _load_checkpoint, Path(path), model, optimizer)


def _load_checkpoint(path: Path, model, optimizer) -> tuple[int, dict | None]:
    if not (path / TRAIN_META).exists() and (resolved := latest_checkpoint(path)) is not None:
        path = resolved
    meta = _read_meta(path / TRAIN_META, TRAIN_FORMAT)
    saved, current = meta["parallel"], parallel_layout()
    if saved != current:
        with_dp = saved["data_parallel_size"] != 1 or current["data_parallel_size"] != 1
        raise ValueError(
            f"checkpoint was saved with {describe_layout(saved, with_dp)}, this run has "
            f"{describe_layout(current, with_dp)}; {path} stores optimizer state and expert shards "
            "per rank, so resume with the same context- and expert-parallel sizes (and world size "
            f"{saved['world_size']}). To continue on another layout, save the weights with "
            "checkpoint.save_model from a run on the saved layout and start a new run from them "
            "(load_model; the optimizer state starts fresh).")
    _check_model_config(meta, model, path)

    ep_rank, _ = _expert_ranks()
    files = [path / MODEL_WEIGHTS]
    if (path / _experts_file(ep_rank)).exists():
        files.append(path / _experts_file(ep_rank))
    tensors = SafetensorsReader(files)
    num_experts = _num_experts(model)
    own = {global_name(n, num_experts): t for n, t in local_tensors(model, trainable_only=True).items()}
    missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or unexpected:
        raise KeyError(f"{path} does not match the model's trainable tensors: missing "
                       f"{len(missing)} {missing[:5]}, unexpected {len(unexpected)} "
                       f"{unexpected[:5]} (were different parameters frozen when it was saved?).")
    bad = [f"{n}: saved {tensors.shape(n)}, model {tuple(t.shape)}" for n, t in own.items()
           if tensors.shape(n) != tuple(t.shape)]
    if bad:
        raise ValueError(f"{path}: shape mismatch for {len(bad)} tensors: {bad[:5]}.")
    state = torch.load(path / _rank_file(_rank()), map_location="cpu", weights_only=True)
    if optimizer is not None:
        if "optimizer" not in state:
            raise ValueError(f"{path} was saved without optimizer state.")
        names = _optimizer_param_names(model, optimizer)
        if names != state["optimizer_params"]:
            raise ValueError(f"{path}: the optimizer's parameters differ from the saved ones "
                             f"({len(names)} vs {len(state['optimizer_params'])} tensors, first "
                             "difference at " + next((f"{a} vs {b}" for a, b in zip(
                                 names, state["optimizer_params"]) if a != b), "the end") + ").")
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(tensors[name])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    set_rng_states(state["rng"])
    return int(meta["step"]), state["extra"]
