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
        page_bytes_per_token         sequence_page_bytes / num_tokens (docs/design.md section 9)
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
        fp8_base_bytes             bytes of the FP8 base weights with their block scales
        fp8_base_bytes_per_rank    the largest rank's share
    """
    import torch.distributed as dist

    from megatron_longstraw.adapters.lora import lora_modules, nf4_module_bytes
    from megatron_longstraw.distributed.finalize import is_expert_param
    from megatron_longstraw.adapters.fp8_base import fp8_modules
    from megatron_longstraw.distributed.parallel import gradient_groups

    # [dense, expert] x [trainable, total, NF4 bytes, FP8 bytes]
    counts = torch.zeros(2, 4, dtype=torch.int64)
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
    for _, module in fp8_modules(model):   # FP8 base weights live in buffers, not parameters
        row = int(not module.allreduce)
        counts[row, 1] += module.out_features * module.in_features
        counts[row, 3] += module.nbytes()
    per_rank = counts[:, 2:].sum(0)
    _, _, expert_mp = gradient_groups()
    if expert_mp is not None and dist.get_world_size(expert_mp) > 1:
        dist.all_reduce(counts[1], group=expert_mp)      # distinct experts on each EP rank
        dist.all_reduce(per_rank, op=dist.ReduceOp.MAX)
    total = counts.sum(0)
    return {"trainable_params": int(total[0]), "total_params": int(total[1]),
            "nf4_base_bytes": int(total[2]), "nf4_base_bytes_per_rank": int(per_rank[0]),
            "fp8_base_bytes": int(total[3]), "fp8_base_bytes_per_rank": int(per_rank[1])}


def format_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


LIVE_PHASES = ("step", "capture", "scoring", "replay", "prompt_backward")
"""The phases whose peak live tensor bytes a step records (memory.LiveBytesMeter)."""


def step_memory(peak_saved_tensor_bytes: int, page_bytes: int,
                peak_live_bytes: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
    """What a step logs (and the receipt records) about memory, over all ranks (collective): the
    largest peak RSS, peak saved-tensor bytes and peak live tensor bytes per phase of any rank,
    and the page bytes of all ranks. `peak_saved_tensor_bytes`: this rank's
    `SavedTensorMeter.peak_bytes`; `page_bytes`: this rank's `StepResult.page_bytes`;
    `peak_live_bytes`: this rank's `LiveBytesMeter` figures by phase (LIVE_PHASES; "step" the
    whole step's), from the step's start: what the phase held at its peak, pages included; None
    when not measured (`--no-longstraw-live-bytes`): no live-bytes lines then."""
    import torch.distributed as dist

    from megatron_longstraw.runtime.memory import peak_rss_bytes

    phases = LIVE_PHASES if peak_live_bytes is not None else ()
    peaks = torch.tensor([peak_rss_bytes(), peak_saved_tensor_bytes,
                          *(peak_live_bytes.get(p, 0) for p in phases), page_bytes],
                         dtype=torch.float64)
    dist.all_reduce(peaks[:-1], op=dist.ReduceOp.MAX)
    page_total = peaks[-1:].clone()
    dist.all_reduce(page_total)
    return {"memory/peak_rss_bytes": peaks[0], "memory/peak_saved_tensor_bytes": peaks[1],
            **{f"memory/peak_live_bytes/{p}": peaks[2 + i] for i, p in enumerate(phases)},
            "memory/page_bytes_all_ranks": page_total[0]}


def step_receipt(*, name: str, family: str, config: str | None, group, result, memory: dict,
                 params: dict, meta: dict, sizes: dict, dtype: torch.dtype, steps: int,
                 start: float) -> dict:
    """The receipt of a run's last step (collective: every rank calls it; rank 0 writes it).

    `group`: the last `GRPOGroup`; `result`: its `StepResult`; `memory`: its `step_memory`;
    `params`: `parameter_counts(model)`; `meta`:
    what the run's checkpoints record (initial weights, LoRA); `sizes`: `world_size`,
    `context_parallel_size`, `expert_parallel_size`, `data_parallel_size`; `steps`: the run's
    last step + 1; `start`: `time.perf_counter()` when the run began."""
    import time

    import torch.distributed as dist

    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (result.page_bytes_by_kind, result.fixed_page_kinds))
    pages = page_bytes_summary([by_kind for by_kind, _ in per_rank],
                               [kind for _, fixed in per_rank for kind in fixed],
                               num_tokens=int(group.prompt_ids.numel()) - 1)
    return {
        "name": name,
        "family": family,
        "config": config,
        "prompt_len": int(group.prompt_ids.numel()),
        "group_size": len(group.response_ids),
        "response_lens": [int(r.numel()) for r in group.response_ids],
        "rewards": [float(r) for r in group.rewards],
        "page_bytes": int(memory["memory/page_bytes_all_ranks"]),
        "page_bytes_per_rank": result.page_bytes,
        **pages,
        "peak_rss_bytes": int(memory["memory/peak_rss_bytes"]),
        "peak_saved_tensor_bytes": int(memory["memory/peak_saved_tensor_bytes"]),
        "peak_live_bytes": ({p: int(memory[f"memory/peak_live_bytes/{p}"]) for p in LIVE_PHASES}
                            if "memory/peak_live_bytes/step" in memory else None),
        "phase_seconds": result.phase_seconds,
        "loss": result.loss,
        "stats": result.stats,
        "steps": steps,
        "total_seconds": time.perf_counter() - start,
        **sizes,
        "dtype": str(dtype).replace("torch.", ""),
        **params,
        "lora": meta["lora"] and {k: v for k, v in meta["lora"].items() if k != "base"},
        "initial_weights": meta["initial_weights"],
        "environment": environment(),
    }


def step_summary(receipt: dict, *, model: str, lora, backend: str, path: Path) -> str:
    """The table rank 0 prints after a run, from its receipt. `model`: the family's description of
    the model; `lora`: the run's `LoRASettings` or None; `backend`: the process group's backend;
    `path`: where the receipt was written."""
    phase = receipt["phase_seconds"]
    if lora is not None and (lora.quantize_base or getattr(lora, "fp8_base", False)):
        kind = "nf4" if lora.quantize_base else "fp8"
        adapters = (f" ({lora.describe()}; {kind.upper()} base "
                    f"{human_bytes(receipt.get(f'{kind}_base_bytes', 0))}, "
                    f"{human_bytes(receipt.get(f'{kind}_base_bytes_per_rank', 0))} per rank)")
    else:
        adapters = f" ({lora.describe()})" if lora is not None else ""
    rows = [
        ("model", f"{receipt['family']} ({model})"),
        ("parallel", f"{receipt['world_size']} processes, CP={receipt['context_parallel_size']}, "
                     f"EP={receipt['expert_parallel_size']}, DP={receipt['data_parallel_size']} "
                     f"({backend})"),
        ("parameters", f"{receipt['trainable_params']:,} trainable of {receipt['total_params']:,}"
                       + adapters),
        ("prompt / group", f"{receipt['prompt_len']} tokens, G={receipt['group_size']}, responses "
                           f"{receipt['response_lens']}"),
        ("capture", f"{phase['capture']:.1f} s"),
        ("scoring", f"{phase['scoring']:.1f} s"),
        ("replay+backward", f"{phase['replay']:.1f} s"),
        ("page bytes", f"{human_bytes(receipt['page_bytes'])} in all, "
                       f"{human_bytes(receipt['page_bytes_per_rank'])} on rank 0 "
                       f"({receipt['page_bytes_per_token']:.0f} B/token)"),
        ("pages by kind", ", ".join(
            f"{kind} {human_bytes(nbytes)}"
            + (" (fixed)" if kind in receipt["fixed_page_kinds"] else "")
            for kind, nbytes in receipt["page_bytes_by_kind"].items())),
        ("peak RSS (max rank)", human_bytes(receipt["peak_rss_bytes"])),
        ("peak live tensors", ", ".join(f"{p} {human_bytes(n)}"
                                        for p, n in receipt["peak_live_bytes"].items())
         if receipt["peak_live_bytes"] is not None else "not measured (--no-longstraw-live-bytes)"),
        ("peak saved tensors", human_bytes(receipt["peak_saved_tensor_bytes"])),
        ("loss", f"{receipt['loss']:.6f}"),
        ("mean reward", f"{receipt['stats']['reward_mean']:.3f}"),
        ("grad norm", f"{receipt['stats']['grad_norm']:.4f}"),
        ("receipt", str(path)),
    ]
    if "prompt_backward" in phase:   # --longstraw-prompt-grad exact: after replay
        rows.insert(7, ("prompt backward", f"{phase['prompt_backward']:.1f} s"))
    return "LongStraw GRPO step\n" + format_table(rows)
