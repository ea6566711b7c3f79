"""What the model steps of tools/device_check.py (parts 6 and 7) share: building a model on the
GPU, a synthetic GRPO group there, and the sweep of one LongStraw step per prompt length."""

from __future__ import annotations

import math
import time
import traceback

import torch

from .common import say


def build_on_gpu(build):
    """build(**overrides) -> model on the GPU, initialised there directly (CPU initialisation of
    billions of parameters is slow); on the CPU if that fails."""
    try:
        model = build(use_cpu_initialization=False)
    except Exception:  # noqa: BLE001
        say("  GPU initialisation failed; building on the CPU:\n" + traceback.format_exc())
        model = build()
    return model.cuda()


def cuda_group(cfg, prompt_len: int, response_len: int, seed: int):
    from megatron_longstraw.data.groups import synthetic_group

    group = synthetic_group(cfg.vocab_size, prompt_len, group_size=2, response_len=response_len,
                            seed=seed)
    group.prompt_ids = group.prompt_ids.cuda()
    group.response_ids = [r.cuda() for r in group.response_ids]
    return group


def prompt_sweep(model, cfg, ls, args, deadline: float, out: dict, on_first_step=None) -> None:
    """One LongStraw step per prompt length, doubling from --start-prompt-len until memory,
    --max-prompt-len or `deadline` (time.perf_counter()) runs out; per step its peak
    torch.cuda.max_memory_allocated, phase times and page bytes go to out["steps"].
    `on_first_step(result, group)` runs after the first step (checks at the smallest length)."""
    from megatron_longstraw.step.schedule import forward_backward_longstraw

    prompt_len = args.start_prompt_len
    while prompt_len <= args.max_prompt_len:
        now = time.perf_counter()
        last = out["steps"][-1]["step_seconds"] if out["steps"] else None
        # Capture is linear in P, attention (GLM-5.2's indexer top-k, Qwen3.6's full attention)
        # quadratic: a doubling costs <= 4x.
        if now >= deadline or (last is not None and now + 4 * last > deadline):
            say(f"  stopping before P = {prompt_len}: this step's share of the time budget "
                f"({args.budget_s:.0f} s in all) would run out")
            out["stopped"] = "time budget"
            break
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        group = cuda_group(cfg, prompt_len, args.response_len, seed=prompt_len)
        try:
            t0 = time.perf_counter()
            result = forward_backward_longstraw(model, group, ls)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        except torch.cuda.OutOfMemoryError:
            say(f"  P = {prompt_len}: out of memory; the longest prompt that fit is the previous one")
            out["stopped"] = f"out of memory at P = {prompt_len}"
            del group
            break
        phases = result.phase_seconds
        fixed = sum(n for k, n in result.page_bytes_by_kind.items() if k in result.fixed_page_kinds)
        step = {"prompt_len": prompt_len, "step_seconds": seconds,
                "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                "capture_tokens_per_s": (prompt_len - 1) / max(phases.get("capture", math.nan), 1e-9),
                "capture_s": phases.get("capture"), "scoring_s": phases.get("scoring"),
                "replay_s": phases.get("replay"), "page_gib": result.page_bytes / 2**30,
                "page_bytes_by_kind": result.page_bytes_by_kind, "fixed_page_bytes": fixed,
                "loss": result.loss, "response_lens": [int(r.numel()) for r in group.response_ids]}
        out["steps"].append(step)
        fixed_note = (f" | fixed state {fixed / 2**20:.1f} MiB + per-token pages "
                      f"{(result.page_bytes - fixed) / 2**30:.3f} GiB" if fixed else "")
        say(f"  P = {prompt_len:8d}: step {seconds:7.1f} s | capture {step['capture_s']:6.1f} s "
            f"({step['capture_tokens_per_s']:9.0f} tok/s) | scoring {step['scoring_s']:5.1f} s | "
            f"replay {step['replay_s']:5.1f} s | max_memory_allocated "
            f"{step['max_memory_allocated_gib']:6.1f} GiB | pages {step['page_gib']:.2f} GiB (host)"
            + fixed_note)
        if on_first_step is not None and len(out["steps"]) == 1:
            on_first_step(result, group)
        prompt_len *= 2
    if out["steps"]:
        out["longest_prompt"] = out["steps"][-1]["prompt_len"]
        say(f"  longest prompt run: {out['longest_prompt']} tokens "
            f"({out.get('stopped', 'reached --max-prompt-len')})")
