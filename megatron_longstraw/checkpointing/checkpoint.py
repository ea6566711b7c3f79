"""Atomic training checkpoints (save / resume); the model format is `model_format.py`.

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

Failures are one line (CheckpointError, a user error): a save that cannot write (a full disk, a
quota: safetensors and torch.save report it as their own errors) names the file, removes the
unfinished `.tmp-step_N` and says that the previous checkpoint is intact; a checkpoint file that
cannot be read (truncated safetensors header, a damaged rank file) raises `DamagedFile` naming it
and the newest earlier checkpoint whose files are all there and open, with how to resume from it.

Frozen parameters (requires_grad=False) are not saved. In a LoRA / QLoRA run that is the whole base
model: a checkpoint holds the adapters (`lora_A` / `lora_B`), persistent buffers and the adapters'
optimizer state. For Qwen3.6-27B at rank 19 the adapters are 0.46 GB (fp32); the base would add
about 12.6 GB of NF4 linears (54 GB in bf16) every `--save-interval` steps. Training never changes
the base, so it is recoverable from where it came from, and a copy per checkpoint would only cost
disk and save time. Instead
`meta.json` carries (the launcher passes it as `meta_extra`)

    "lora": {"rank", "alpha", "dropout", "targets", "exclude", "quantize_base", "fp8_base",
             "base": {"source": the model-format directory the base was loaded from (absolute),
                                or null for the seeded random initialisation,
                      "seed": that seed, "fingerprints": [model_fingerprint of each rank's base]}}

and a resume loads the base again (`--pretrained-checkpoint`, else the recorded source), checks it
against the fingerprints before applying adapters (`check_lora_base`), and refuses a base that
differs, or LoRA settings that differ (`check_lora_resume`), with a message naming the fix.
`save_model(..., merge_adapters=True)` exports base + adapters merged as a model-format directory.
"""


from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from megatron_longstraw.runtime.errors import CheckpointError, PeerFailure
from megatron_longstraw.checkpointing.model_format import (
    FORMAT_VERSION, MODEL_WEIGHTS, DamagedFile, SafetensorsReader, check_model_config,
    count_experts, damaged,
    describe_layout, expert_ranks, fsync_dir, global_rank, local_tensors, parallel_layout,
    read_meta, routed_expert_names, unwrap, write_safetensors, write_text_atomic,
)
from megatron_longstraw.distributed.agreement import check_same, together
from megatron_longstraw.distributed.expert_names import global_name

TRAIN_FORMAT = "longstraw-train"
TRAIN_META, LATEST = "meta.json", "latest"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


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
    names = {id(p): n for n, p in unwrap(model).named_parameters()}
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
    rank, (ep_rank, expert_dp_rank) = global_rank(), expert_ranks()
    tensors = local_tensors(model, trainable_only=True)
    num_experts, expert_names = count_experts(model), routed_expert_names(model)
    experts = {global_name(n, num_experts): t for n, t in tensors.items() if n in expert_names}
    if rank == 0:
        with _writing(tmp / MODEL_WEIGHTS):
            write_safetensors(tmp / MODEL_WEIGHTS,
                              {n: t for n, t in tensors.items() if n not in expert_names})
    if experts and expert_dp_rank == 0:
        with _writing(tmp / _experts_file(ep_rank)):
            write_safetensors(tmp / _experts_file(ep_rank), experts)
    path, state = tmp / _rank_file(rank), _rank_state(model, optimizer, extra)
    with _writing(path), open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


class _WriteFailed(Exception):
    """Writing a checkpoint file failed; safetensors and torch.save report a full disk as their
    own error types (SafetensorError "I/O error: ...", RuntimeError "unexpected pos ..."), not
    as OSError."""

    def __init__(self, path: Path, exc: BaseException):
        super().__init__(str(path))
        self.filename = str(path)
        self.strerror = " ".join(str(exc).split()) or type(exc).__name__


@contextlib.contextmanager
def _writing(path: Path):
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - _disk_errors names the file and the cause
        raise _WriteFailed(path, exc) from exc


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
        check_same(int(step), "the step being saved")
        if global_rank() == 0:
            save_dir.mkdir(parents=True, exist_ok=True)
            for stale in save_dir.glob(".tmp-step_*"):   # interrupted earlier saves
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()

    def publish():
        if global_rank() != 0:
            return
        files = sorted(p.name for p in tmp.iterdir())
        cfg = getattr(unwrap(model), "longstraw_config", None)
        meta = {**(meta_extra or {}), "format": TRAIN_FORMAT, "format_version": FORMAT_VERSION,
                "step": int(step), "parallel": layout,
                "model": cfg.to_dict() if cfg is not None else None, "files": files}
        write_text_atomic(tmp / TRAIN_META, json.dumps(meta, indent=2, sort_keys=True) + "\n")
        fsync_dir(tmp)
        trash = save_dir / f".tmp-step_replaced-{name}"
        if final.exists():  # the same step saved again (e.g. after resuming from an older one)
            os.rename(final, trash)
        os.rename(tmp, final)
        fsync_dir(save_dir)
        write_text_atomic(save_dir / LATEST, name + "\n")
        shutil.rmtree(trash, ignore_errors=True)
        if keep_last:
            for old in sorted(_complete_checkpoints(save_dir))[:-keep_last]:
                if old[1] != final:
                    shutil.rmtree(old[1], ignore_errors=True)

    previous = latest_checkpoint(save_dir)
    disk = _disk_errors(int(step), save_dir, previous)
    try:
        together("checkpoint save (prepare)", disk(prepare))
        together("checkpoint save (write)", disk(_write_rank_files), tmp, model, optimizer, extra)
        together("checkpoint save (publish)", disk(publish))
    except (CheckpointError, PeerFailure):
        if global_rank() == 0:   # every rank is past its writes (together): free the space
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _disk_errors(step: int, save_dir: Path, previous: Path | None):
    """Wraps a save phase: an OSError (a full disk, a quota, a folder that went away) becomes one
    CheckpointError naming the file, saying that the previous checkpoint is intact and what to
    do (the caller removes the unfinished `.tmp-step_*`)."""

    def wrap(fn):
        def run(*args):
            try:
                return fn(*args)
            except (OSError, _WriteFailed) as exc:
                where = f" writing {exc.filename}" if exc.filename else ""
                kept = (f"the previous checkpoint {previous} is intact (`latest` still names it)"
                        if previous is not None else "no earlier checkpoint was saved")
                try:
                    free = f", {shutil.disk_usage(save_dir).free / 2**20:.0f} MiB free there"
                except OSError:
                    free = ""
                raise CheckpointError(
                    f"saving step {step} into {save_dir} failed{where}: "
                    f"{exc.strerror or exc}{free}; {kept} and the unfinished save is removed. "
                    f"Free space (or pass another --save) and resume with --load "
                    f"{save_dir}.") from None
        return run

    return wrap


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
    return read_meta(path / TRAIN_META, TRAIN_FORMAT)


# ---- LoRA runs: the frozen base is not saved; check it on resume ----------------------------------


def model_fingerprint(model: torch.nn.Module) -> str:
    """A content checksum of this rank's model tensors (names, shapes, dtypes, bits): equal for
    bitwise-equal weights, different for other weights whatever the summation order or device
    (integer sums of the bits, exact). One pass over the weights, on their device."""
    return tensors_fingerprint(local_tensors(model))


def tensors_fingerprint(tensors: dict[str, torch.Tensor]) -> str:
    """`model_fingerprint` of a name -> tensor dict (a rank's local tensors, however obtained:
    checkpointing/export.py rebuilds each rank's view of a base to check it)."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(tensors.items()):
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
             *(["--longstraw-fp8-base"] if record.get("fp8_base") else []),
             f"--longstraw-lora-rank {record['rank']}", f"--longstraw-lora-alpha {record['alpha']:g}",
             "--longstraw-lora-targets " + " ".join(record["targets"])]
    if record.get("exclude"):
        flags.append("--longstraw-lora-exclude " + " ".join(record["exclude"]))
    return " ".join(flags)


_LORA_RESUME_KEYS = ("quantize_base", "fp8_base", "rank", "alpha", "targets", "exclude")
"""Settings a resumed LoRA run must keep (dropout may change between runs: it has no state)."""
_LORA_RECORD_DEFAULTS = {"fp8_base": False}
"""Values of keys that records written before the key existed lack."""


def check_lora_resume(path: str | os.PathLike, saved: dict | None, requested: dict | None) -> None:
    """Refuse to resume checkpoint `path` (meta.json "lora": `saved`) as a run that asks for other
    adapters (`requested`; None for either means full-parameter training)."""
    if saved is None and requested is None:
        return
    if saved is None:
        raise CheckpointError(
            f"{path} is a full-parameter checkpoint; a LoRA run cannot resume it. Resume without "
            "the LoRA flags, or start a new LoRA run (another --save folder) from its weights in "
            "model format (--pretrained-checkpoint DIR, written by model_format.save_model).")
    if requested is None:
        raise CheckpointError(f"{path} holds LoRA adapters, not a full model (its frozen base is "
                              f"not saved); resume it with the same adapters: "
                              f"{lora_flags(saved)}.")
    def value(record: dict, key: str):
        return record.get(key, _LORA_RECORD_DEFAULTS.get(key))

    diff = [f"{key} {value(saved, key)!r} (this run: {value(requested, key)!r})"
            for key in _LORA_RESUME_KEYS if value(saved, key) != value(requested, key)]
    if diff:
        raise CheckpointError(f"{path} was trained with other LoRA settings: {', '.join(diff)}. "
                              f"Resume with the checkpoint's settings ({lora_flags(saved)}), or "
                              "start a new run with another --save folder.")


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
        rank = global_rank()
        if rank >= len(saved) or saved[rank] != fingerprint:
            raise CheckpointError(
                f"the frozen base model differs from the one the adapters in {path} were trained "
                f"on: they were trained on {_describe_base(saved_base)}, this run's base is "
                f"{_describe_base(current)} (weights fingerprint {fingerprint} on rank {rank}, "
                f"saved {saved[rank] if rank < len(saved) else 'none'}). Pass the original base "
                "weights with --pretrained-checkpoint DIR (a model-format directory)"
                + ("" if saved_base.get("source") else
                   f", or resume with the same --seed ({saved_base.get('seed')})") + ".")

    together("LoRA base check", check)


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer=None) -> tuple[int, dict | None]:
    """Resume from a checkpoint folder (or a save folder: its latest checkpoint). Restores this
    rank's trainable parameters, optimizer state and RNG states; returns (step, this rank's extra).
    Everything is checked before anything is modified; every rank calls it, and an error on one
    rank is raised on all of them."""
    return together("checkpoint load", _load_checkpoint, Path(path), model, optimizer)


def _load_checkpoint(path: Path, model, optimizer) -> tuple[int, dict | None]:
    if not (path / TRAIN_META).exists() and (resolved := latest_checkpoint(path)) is not None:
        path = resolved
    meta = read_meta(path / TRAIN_META, TRAIN_FORMAT)
    saved, current = meta["parallel"], parallel_layout()
    if saved != current:
        with_dp = saved["data_parallel_size"] != 1 or current["data_parallel_size"] != 1
        raise CheckpointError(
            f"checkpoint was saved with {describe_layout(saved, with_dp)}, this run has "
            f"{describe_layout(current, with_dp)}; {path} stores optimizer state and expert shards "
            "per rank, so resume with the same context- and expert-parallel sizes (and world size "
            f"{saved['world_size']}). To continue on another layout, save the weights with "
            "model_format.save_model from a run on the saved layout and start a new run from them "
            "(load_model; the optimizer state starts fresh).")
    check_model_config(meta, model, path)

    try:
        return _restore(path, meta, model, optimizer)
    except DamagedFile as exc:
        raise DamagedFile(f"{exc} {_fallback(path)}") from None


def _fallback(path: Path) -> str:
    """What to resume from when checkpoint `path` is damaged: the newest earlier checkpoint whose
    files are all there and open (safetensors headers, meta.json), or advice without one."""
    save_dir = path.parent
    for _, older in sorted(_complete_checkpoints(save_dir), reverse=True):
        if older != path and _looks_intact(older):
            return (f"The previous checkpoint {older} is intact: resume from it by writing "
                    f"{older.name} into {save_dir / LATEST} (or move {path} away).")
    return (f"No other intact checkpoint is in {save_dir}: copy the folder again from where it "
            "came from, or start a new run.")


def _looks_intact(folder: Path) -> bool:
    try:
        meta = read_meta(folder / TRAIN_META, TRAIN_FORMAT)
        files = [folder / name for name in meta.get("files", [])]
        if not files or not all(f.is_file() and f.stat().st_size > 0 for f in files):
            return False
        SafetensorsReader([f for f in files if f.suffix == ".safetensors"])
        return True
    except (CheckpointError, OSError):
        return False


def _restore(path: Path, meta: dict, model, optimizer) -> tuple[int, dict | None]:
    ep_rank, _ = expert_ranks()
    files = [path / MODEL_WEIGHTS]
    if (path / _experts_file(ep_rank)).exists():
        files.append(path / _experts_file(ep_rank))
    tensors = SafetensorsReader(files)
    num_experts = count_experts(model)
    own = {global_name(n, num_experts): t for n, t in local_tensors(model, trainable_only=True).items()}
    missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or unexpected:
        raise CheckpointError(f"{path} does not match the model's trainable tensors: missing "
                              f"{len(missing)} {missing[:5]}, unexpected {len(unexpected)} "
                              f"{unexpected[:5]} (were different parameters frozen when it was "
                              "saved?).")
    bad = [f"{n}: saved {tensors.shape(n)}, model {tuple(t.shape)}" for n, t in own.items()
           if tensors.shape(n) != tuple(t.shape)]
    if bad:
        raise CheckpointError(f"{path}: shape mismatch for {len(bad)} tensors: {bad[:5]}.")
    rank_file = path / _rank_file(global_rank())
    try:
        state = torch.load(rank_file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unpickling, zip, EOF, OSError: the file named
        raise damaged(rank_file, exc) from None
    if optimizer is not None:
        if "optimizer" not in state:
            raise CheckpointError(f"{path} was saved without optimizer state.")
        names = _optimizer_param_names(model, optimizer)
        if names != state["optimizer_params"]:
            raise CheckpointError(
                f"{path}: the optimizer's parameters differ from the saved ones ({len(names)} vs "
                f"{len(state['optimizer_params'])} tensors, first difference at "
                + next((f"{a} vs {b}" for a, b in zip(names, state["optimizer_params"])
                        if a != b), "the end") + ").")
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(tensors[name])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    set_rng_states(state["rng"])
    return int(meta["step"]), state["extra"]
