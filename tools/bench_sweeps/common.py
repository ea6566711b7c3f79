"""What every mode of tools/bench.py shares: one point in a fresh child process under the RSS
watchdog (`run_point`, the child's environment), the cap tests a point is judged by, and the
small formatting helpers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "tools" / "bench.py"   # the command line each point's child runs (`--one`)
MiB = 2 ** 20
METHODS = ("longstraw", "longstraw-exact", "conventional", "forward")


def child_env() -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576", OMP_NUM_THREADS="1",
               TORCHDYNAMO_DISABLE="1", PYTHONWARNINGS="ignore")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _rss_of(pid: int) -> int | None:
    """Current resident set size of process `pid` (bytes), from /proc/<pid>/status; None if gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def run_point(args, method: str, prompt_len: int, group_size: int,
              kill_above: int | None = None, poll_s: float = 0.05, response_len: int | None = None,
              response_block: int | None = None, child_flags: tuple[str, ...] = ()) -> dict:
    """One point in a fresh child. With `kill_above` (bytes) a watchdog here reads the child's RSS
    every `poll_s` and kills it the first time it is above: the point is then recorded as
    `exceeded_cap` (with the RSS seen), not run to the end. Either way the result carries the
    largest RSS the watchdog saw (`watchdog_peak_rss_bytes`; sampled, so at most the child's own
    ru_maxrss). `response_len` / `response_block` (default: `args`'s) and `child_flags` (e.g.
    --no-live-meter) are passed to the child."""
    import tempfile

    response_len = response_len or args.response_len
    response_block = response_block or args.response_block
    cmd = [sys.executable, str(BENCH), "--one", "--method", method,
           "--prompt-len", str(prompt_len), "--group-size", str(group_size),
           "--response-len", str(response_len), "--seed", str(args.seed),
           "--family", args.family, "--config", args.config, *child_flags]
    if response_block:
        cmd += ["--response-block", str(response_block)]
    point = {"method": method, "prompt_len": prompt_len, "group_size": group_size,
             "response_len": response_len, "response_block": response_block}
    start, seen, killed = time.perf_counter(), 0, None
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=child_env(), cwd=ROOT)
        while proc.poll() is None:
            rss = _rss_of(proc.pid)
            seen = max(seen, rss or 0)
            if kill_above is not None and rss is not None and rss > kill_above:
                proc.kill()
                proc.wait()
                killed = rss
                break
            if time.perf_counter() - start > args.timeout:
                proc.kill()
                proc.wait()
                return {**point, "error": f"timed out after {args.timeout} s",
                        "watchdog_peak_rss_bytes": seen}
            time.sleep(poll_s)
        seconds = time.perf_counter() - start
        if killed is not None:
            return {**point, "exceeded_cap": True, "killed_at_rss_bytes": killed,
                    "cap_bytes": kill_above, "seconds_to_kill": seconds,
                    "watchdog_peak_rss_bytes": seen,
                    "error": f"exceeded the cap: killed at RSS {killed / MiB:.0f} MiB "
                             f"> {kill_above / MiB:.0f} MiB after {seconds:.0f} s"}
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    for line in stdout.splitlines():
        if line.startswith("BENCH_JSON "):
            return {**json.loads(line[len("BENCH_JSON "):]), "watchdog_peak_rss_bytes": seen}
    tail = (stderr or stdout).strip().splitlines()[-3:]
    return {**point, "error": f"exit {proc.returncode}: {' | '.join(tail)}"}


def exceeds_cap(r: dict, cap_bytes: int) -> bool:
    """A point is over the cap if the watchdog killed it above the cap or its measured peak RSS is
    above. (Killed under a smaller cap, below this one: neither fits nor exceeds.)"""
    if r.get("exceeded_cap"):
        return r["killed_at_rss_bytes"] > cap_bytes
    return "error" not in r and r["peak_rss_bytes"] > cap_bytes


def fits_cap(r: dict, cap_bytes: int) -> bool:
    """A point fits if it ran to the end and its measured peak RSS (ru_maxrss) is <= the cap."""
    return "error" not in r and r["peak_rss_bytes"] <= cap_bytes


def sweep_until_over(points, run, cap_bytes: int) -> list[dict]:
    """`run(P)` at growing P, stopping after the first point over the cap (or failing)."""
    results = []
    for p in sorted(points):
        r = run(p)
        results.append(r)
        if exceeds_cap(r, cap_bytes) or "error" in r:
            break
    return results


def mib(b) -> str:
    """`b` bytes as whole MiB with thousands separators (the tables' cells)."""
    return f"{b / MiB:,.0f}"


def median(xs: list[float]) -> float:
    """The median (the mean of the two middle values for an even count)."""
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
