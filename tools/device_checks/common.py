"""What every section of tools/device_check.py shares: the results it reports (RESULTS, written
to --json) and the report helpers."""

from __future__ import annotations

import statistics
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
RESULTS: dict = {"sections": {}, "failures": []}


def say(msg: str = "") -> None:
    print(msg, flush=True)


def run_section(name: str, fn) -> None:
    """One report section: a failure prints its traceback and is recorded; the script goes on."""
    say(f"\n== {name} " + "=" * max(0, 70 - len(name)))
    t0 = time.perf_counter()
    try:
        RESULTS["sections"][name] = fn()
    except Exception:  # noqa: BLE001 - report and go on
        RESULTS["failures"].append(name)
        RESULTS["sections"][name] = {"error": traceback.format_exc()}
        say(f"FAILED: {name}\n{traceback.format_exc()}")
    say(f"-- {name}: {time.perf_counter() - t0:.1f} s")


def check(name: str, errors: dict, tolerance: float) -> dict:
    worst = max(errors.values())
    ok = worst <= tolerance
    say(f"  {'ok  ' if ok else 'FAIL'} {name}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
        + f"  (tolerance {tolerance:.0e})")
    if not ok:
        RESULTS["failures"].append(name)
    return {"errors": errors, "tolerance": tolerance, "ok": ok}


def median_ms(fn, warmup: int = 3, repeats: int = 10) -> float:
    """Median wall time of fn() in ms (CUDA events), after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
