"""Reward against wall-clock with K updates per capture: does a run reach the same reward sooner?

    python tools/reuse_reward.py run --ks 1,4,8 --seeds 1,2,3 --out runs/reuse-reward -- \\
        --prompt-len 8192 --steps 96                      # flags after -- go to tools/demo_rl.py
    python tools/reuse_reward.py table --out runs/reuse-reward

`run` starts `tools/demo_rl.py --updates-per-capture K --out <out>/K<K>` for each K (a subprocess:
no tool imports another), with the same task, prompts (`--data-seed`), seeds and recipe, each
seed's run beside its control (`--longstraw-control zeros`: the prompt state zeroed, the policy
blind to the prompt). `--steps` counts optimizer steps (updates), a multiple of every K.

`table` reads `<out>/K*/receipt.json` and writes `<out>/reuse_reward.{json,md,png}`: per K, the
runs' final reward (mean over the last 10% of updates, demo_rl.start_end), the controls' final
reward, and the wall-clock to reach the target, with its ratio to K = 1's. The clock is the run's
own (each update's `time/step_s` summed: capture, generation, scoring, replay and the optimizer;
the launcher's start-up left out, the same for every K). The target is `--target-fraction`
(default 0.9) of the K = 1 runs' mean final reward; a run reaches it at the first update where its
reward averaged over the last `--window` updates (default a tenth of the run) is at or above it.
The plot draws each run's averaged reward against its clock (controls dashed).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("run", "table"))
    p.add_argument("--out", default="runs/reuse-reward")
    p.add_argument("--ks", default="1,4,8", help="updates per capture to compare (with 1)")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--target-fraction", type=float, default=0.9)
    p.add_argument("--window", type=int, default=None,
                   help="updates the reward is averaged over (default: a tenth of the run)")
    p.epilog = "After --: tools/demo_rl.py's flags (task, prompt length, --steps, ...)."
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:split])
    args.demo_rl = argv[split + 1:]
    args.ks = sorted({int(k) for k in args.ks.split(",")})
    if 1 not in args.ks:
        p.error(f"--ks {args.ks}: the comparison is against K = 1; include it")
    return args


def run(args) -> None:
    out = Path(args.out)
    for k in args.ks:
        cmd = [sys.executable, str(ROOT / "tools" / "demo_rl.py"), "--out", str(out / f"K{k}"),
               "--seeds", args.seeds, "--updates-per-capture", str(k), *args.demo_rl]
        print(f"[reuse-reward] K = {k}: {' '.join(cmd[1:])}", flush=True)
        # demo_rl exits 1 when its learning criterion fails: the table still reads its receipt
        subprocess.run(cmd, cwd=ROOT, check=False)


def averaged(curve: list[float], window: int) -> list[float]:
    from megatron_longstraw.training.run_plot import moving_average

    return moving_average(curve, window)


def time_to(curve: list[float], elapsed: list[float], target: float, window: int) -> float:
    """The run's clock at the first update whose reward averaged over the last `window` updates
    is >= target; inf when it never is."""
    for value, clock in zip(averaged(curve, window), elapsed):
        if value >= target:
            return clock
    return math.inf


def summarise(receipts: dict[int, dict], target_fraction: float = 0.9,
              window: int | None = None) -> dict:
    """{K: demo_rl receipt} -> per K the runs' and controls' final rewards, the clock to the
    target and its ratio to K = 1's (module docstring)."""
    if 1 not in receipts:
        raise ValueError("no K = 1 receipt: the comparison is against one update per capture")
    base = [s["run"]["reward_end"] for s in receipts[1]["seeds"]]
    target = target_fraction * sum(base) / len(base)
    rows = []
    for k, receipt in sorted(receipts.items()):
        seeds = receipt["seeds"]
        steps = len(seeds[0]["run"]["curve"])
        w = window or max(1, steps // 10)
        clocks = [time_to(s["run"]["curve"], s["run"]["elapsed_s"], target, w) for s in seeds]
        rows.append({
            "updates_per_capture": k, "seeds": [s["seed"] for s in seeds], "updates": steps,
            "run_end": [s["run"]["reward_end"] for s in seeds],
            "control_end": [s["control"]["reward_end"] for s in seeds if s.get("control")],
            "clock_s": [s["run"]["elapsed_s"][-1] for s in seeds],
            "time_to_target_s": clocks})
    first = rows[0]
    for row in rows:
        row["time_to_target_vs_k1"] = [
            (t / b if math.isfinite(t) and math.isfinite(b) else math.inf)
            for t, b in zip(row["time_to_target_s"], first["time_to_target_s"])]
        row["clock_vs_k1"] = [c / b for c, b in zip(row["clock_s"], first["clock_s"])]
    return {"target": target, "target_fraction": target_fraction, "rows": rows}


def _mean(values: list[float]) -> str:
    if not values:
        return "-"
    if any(not math.isfinite(v) for v in values):
        return "not reached" if all(not math.isfinite(v) for v in values) else \
            f"{sum(v for v in values if math.isfinite(v)) / sum(map(math.isfinite, values)):.2f}" \
            f" ({sum(not math.isfinite(v) for v in values)} not reached)"
    mean = sum(values) / len(values)
    std = (math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
           if len(values) > 1 else 0.0)
    return f"{mean:.3f} ± {std:.3f}"


def markdown(summary: dict) -> str:
    lines = [f"Target: {summary['target']:.3f} ({summary['target_fraction']:g} of the K = 1 runs' "
             "mean final reward).", "",
             "| K | updates | run final reward | control final reward | clock to target (s) | "
             "vs K = 1 | whole run (s) |", "|---:|---:|---|---|---|---|---|"]
    for r in summary["rows"]:
        lines.append(f"| {r['updates_per_capture']} | {r['updates']} | {_mean(r['run_end'])} | "
                     f"{_mean(r['control_end'])} | {_mean(r['time_to_target_s'])} | "
                     f"{_mean(r['time_to_target_vs_k1'])} | {_mean(r['clock_s'])} |")
    return "\n".join(lines)


def write_png(receipts: dict[int, dict], summary: dict, path: Path, window: int | None) -> None:
    from megatron_longstraw.training.run_plot import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (k, receipt) in enumerate(sorted(receipts.items())):
        for j, s in enumerate(receipt["seeds"]):
            for kind, style in (("run", "-"), ("control", "--")):
                if not s.get(kind):
                    continue
                curve = s[kind]["curve"]
                w = window or max(1, len(curve) // 10)
                ax.plot(s[kind]["elapsed_s"], averaged(curve, w), style,
                        color=colors[i % len(colors)], lw=1,
                        label=f"K = {k}" + (" control" if kind == "control" else "")
                        if j == 0 else None)
    ax.axhline(summary["target"], color="grey", lw=0.8, ls=":", label="target")
    ax.set_xlabel("run clock (s): each update's time summed")
    ax.set_ylabel("mean reward (moving average)")
    ax.set_title("reward against wall-clock, K updates per capture (controls: prompt state "
                 "zeroed)", fontsize=9)
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(args) -> dict:
    out = Path(args.out)
    receipts = {}
    for k in args.ks:
        path = out / f"K{k}" / "receipt.json"
        if not path.exists():
            raise SystemExit(f"reuse_reward.py: error: {path} is missing: run `tools/reuse_reward.py "
                             f"run --ks {k} --out {out}` first.")
        receipts[k] = json.loads(path.read_text())
    summary = summarise(receipts, args.target_fraction, args.window)
    text = markdown(summary)
    (out / "reuse_reward.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "reuse_reward.md").write_text(text + "\n")
    write_png(receipts, summary, out / "reuse_reward.png", args.window)
    print(text)
    return summary


def main(argv=None):
    args = parse_args(argv)
    return run(args) if args.mode == "run" else table(args)


if __name__ == "__main__":
    main()
