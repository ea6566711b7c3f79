"""The reuse table (`tools/bench.py --reuse-sweep`, in `make bench`): time per optimizer step with
K updates per capture (`--longstraw-updates-per-capture K`) against one update per capture, at a
setting where capture is most of the step.

For each K of `--reuse-points` (default 1, 4, 8), one launcher run in a fresh process
(`examples/pretrain_gpt.py`, one process, OMP_NUM_THREADS=1) of exactly one capture: model
`--config` (examples/glm52/bench.yaml), synthetic groups at P = `--reuse-prompt` (32,768), G =
the first `--groups`, responses up to `--response-len` tokens, full-parameter Adam in fp32,
`--train-iters K`. Time per update: the run's update times (`time/step_s` in its history: the
first update carries capture and the scoring of all G x K members) summed over the capture, over
K. The runs go back to back in one invocation, so the ratios against K = 1 come from one machine
state; the K = 1 run's capture share (capture seconds over its step) says whether the setting is
capture-dominated (the goal asks >= 80%). Output: runs/bench/bench-reuse.{json,md}.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from bench_sweeps.common import ROOT, child_env


def reuse_argv(args, updates: int, out: Path) -> list[str]:
    group = int(str(args.groups).split(",")[0])
    return [sys.executable, str(ROOT / "examples" / "pretrain_gpt.py"), "--longstraw",
            "--longstraw-config", args.config,
            "--longstraw-synthetic-prompt-len", str(args.reuse_prompt),
            "--longstraw-synthetic-response-len", str(args.response_len),
            "--longstraw-group-size", str(group), "--longstraw-dtype", "fp32",
            "--lr", "1e-5", "--lr-decay-style", "constant", "--clip-grad", "1.0",
            "--seed", str(args.seed), "--no-longstraw-live-bytes",
            "--train-iters", str(updates), "--longstraw-updates-per-capture", str(updates),
            "--longstraw-out-dir", str(out), "--longstraw-run-name", f"K{updates}"]


def summarise_reuse(runs: dict[int, list[dict]]) -> dict:
    """{K: the run's history} -> per K the update times, their mean, the first update's phases,
    and the ratio of the mean to K = 1's (which must be among the runs)."""
    if 1 not in runs:
        raise ValueError("the reuse table compares against K = 1: include 1 in --reuse-points")
    rows = {}
    for k, history in sorted(runs.items()):
        if len(history) != k:
            raise ValueError(f"K = {k}: the run logged {len(history)} updates, not {k}")
        times = [h["time/step_s"] for h in history]
        first = history[0]
        rows[k] = {"updates": k, "update_s": times, "per_update_s": sum(times) / k,
                   "first_update_s": times[0],
                   "first_capture_s": first["time/capture_s"],
                   "first_scoring_s": first["time/scoring_s"],
                   "first_replay_s": first["time/replay_s"]}
    base = rows[1]["per_update_s"]
    for row in rows.values():
        row["vs_k1"] = row["per_update_s"] / base
    capture_share = rows[1]["first_capture_s"] / rows[1]["first_update_s"]
    return {"rows": list(rows.values()), "capture_share_k1": capture_share}


def markdown_reuse(summary: dict, setting: str) -> str:
    lines = [f"Setting: {setting}; capture is {100 * summary['capture_share_k1']:.1f}% of the "
             "K = 1 step.", "",
             "| K | per update | vs K = 1 | first update (capture, scoring, replay) | later updates |",
             "|---:|---:|---:|---|---|"]
    for r in summary["rows"]:
        later = r["update_s"][1:]
        lines.append(
            f"| {r['updates']} | {r['per_update_s']:.1f} s | {r['vs_k1']:.2f}x | "
            f"{r['first_update_s']:.1f} s ({r['first_capture_s']:.1f}, {r['first_scoring_s']:.1f}, "
            f"{r['first_replay_s']:.1f}) | "
            + (f"{min(later):.1f}-{max(later):.1f} s" if later else "-") + " |")
    return "\n".join(lines)


def run_reuse_sweep(args) -> dict:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    points = [int(k) for k in str(args.reuse_points).split(",")]
    runs, walls = {}, {}
    for k in points:
        start = time.perf_counter()
        proc = subprocess.run(reuse_argv(args, k, out / "reuse"), cwd=ROOT, env=child_env(),
                              capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode:
            raise RuntimeError(f"reuse sweep K = {k} failed:\n{proc.stderr[-3000:]}")
        walls[k] = time.perf_counter() - start
        receipt = json.loads((out / "reuse" / f"K{k}" / "receipt.json").read_text())
        runs[k] = receipt["history"]
        print(f"[bench] reuse K={k}: {walls[k]:.0f} s wall", flush=True)
    summary = summarise_reuse(runs)
    group = int(str(args.groups).split(",")[0])
    setting = (f"{Path(args.config).name}, P = {args.reuse_prompt:,}, G = {group}, responses up "
               f"to {args.response_len} tokens, full-parameter Adam, fp32, one process, one thread")
    summary.update(setting=setting, wall_s=walls, argv={k: reuse_argv(args, k, out / "reuse")[1:]
                                                        for k in points})
    (out / "bench-reuse.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = markdown_reuse(summary, setting)
    (out / "bench-reuse.md").write_text(text + "\n")
    print(text)
    return summary
