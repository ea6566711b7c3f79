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


def _version(module: str) -> str | None:
    """A package's version, None when it is not installed (optional extras)."""
    from importlib import metadata

    try:
        return metadata.version(module)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    """What produced a receipt: the versions the numerics depend on (constraints.txt pins them)
    and the CPU capability torch dispatches on (AVX512 / AVX2 / DEFAULT: bitsandbytes and torch
    take other CPU kernels on other capabilities)."""
    return {
        "python": pyplatform.python_version(),
        "torch": torch.__version__,
        "megatron_core": _version("megatron-core") or "unknown",
        "bitsandbytes": _version("bitsandbytes"),
        "transformers": _version("transformers"),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda": torch.cuda.is_available(),
        "host": pyplatform.node(),
    }


def page_bytes_summary(by_kind_per_rank: list[dict[str, int]], fixed_kinds: list[str],
                       num_tokens: int) -> dict:
    """Receipt fields for the captured pages of one step, from each rank's bytes per page kind
    (`StepResult.page_bytes_by_kind`, in rank order) and the kinds that are fixed-size on any rank
    (`StepResult.fixed_page_kinds`; recurrent state such as `gdn_state`, `conv_tail`).
    `num_tokens` is the number of captured prompt tokens (P - 1: the last prompt token is the first
    input of every response).

        page_bytes_by_kind           {kind: bytes over all ranks}
        page_bytes_by_kind_per_rank  the input, one mapping per rank
        fixed_page_kinds             sorted; their bytes do not grow with the prompt
        fixed_page_bytes             bytes of the fixed kinds over all ranks
        sequence_page_bytes          bytes of every other kind (rows per prompt token)
        page_bytes_per_token         sequence_page_bytes / num_tokens (DESIGN section 9)
    """
    total: dict[str, int] = {}
    for by_kind in by_kind_per_rank:
        for kind, nbytes in by_kind.items():
            total[kind] = total.get(kind, 0) + int(nbytes)
    fixed = sorted(set(fixed_kinds))
    fixed_bytes = sum(nbytes for kind, nbytes in total.items() if kind in fixed)
    sequence_bytes = sum(total.values()) - fixed_bytes
    return {
        "page_bytes_by_kind": total,
        "page_bytes_by_kind_per_rank": [{k: int(v) for k, v in b.items()} for b in by_kind_per_rank],
        "fixed_page_kinds": fixed,
        "fixed_page_bytes": fixed_bytes,
        "sequence_page_bytes": sequence_bytes,
        "page_bytes_per_token": sequence_bytes / max(num_tokens, 1),
    }


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """Receipt fields for the model's parameters, the whole model (experts of every EP rank
    counted once) unless named per rank. Collective under expert parallelism.

        trainable_params           parameters with requires_grad (LoRA: the adapters)
        total_params               every parameter; an NF4 base weight counts its values
        nf4_base_bytes             bytes of the NF4 base weights with their statistics (QLoRA)
        nf4_base_bytes_per_rank    the largest rank's share (each CP rank holds the dense part)
    """
    import torch.distributed as dist

    from megatron_longstraw.adapters import lora_modules, nf4_module_bytes
    from megatron_longstraw.finalize import _groups, is_expert_param

    counts = torch.zeros(2, 3, dtype=torch.int64)   # [dense, expert] x [trainable, total, NF4 B]
    for param in model.parameters():
        row = int(is_expert_param(param))
        counts[row, 1] += param.numel()
        if param.requires_grad:
            counts[row, 0] += param.numel()
    for _, module in lora_modules(model):
        if module.quant_state is not None:   # the weight lives in an NF4 buffer, not a parameter
            row = int(is_expert_param(module.lora_A))
            counts[row, 1] += module.out_features * module.in_features
            counts[row, 2] += nf4_module_bytes(module)
    per_rank = counts[:, 2].sum().reshape(1)
    _, _, expert_mp = _groups()
    if expert_mp is not None and dist.get_world_size(expert_mp) > 1:
        dist.all_reduce(counts[1], group=expert_mp)      # distinct experts on each EP rank
        dist.all_reduce(per_rank, op=dist.ReduceOp.MAX)
    total = counts.sum(0)
    return {"trainable_params": int(total[0]), "total_params": int(total[1]),
            "nf4_base_bytes": int(total[2]), "nf4_base_bytes_per_rank": int(per_rank[0])}


def format_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
