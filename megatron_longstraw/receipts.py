"""Run receipts: what a step did, in a JSON file a user can keep and compare (runs/<name>/)."""

from __future__ import annotations

import json
import os
import platform as pyplatform
import tempfile
from pathlib import Path

import torch


def write_json_atomic(path: str | Path, payload: dict) -> Path:
    """Write JSON to `path` atomically (temp file in the same folder, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def environment() -> dict:
    import megatron.core

    return {
        "python": pyplatform.python_version(),
        "torch": torch.__version__,
        "megatron_core": getattr(megatron.core, "__version__", "unknown"),
        "cuda": torch.cuda.is_available(),
        "host": pyplatform.node(),
    }


def format_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
