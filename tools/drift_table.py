"""How stale one capture gets over K updates: a drift table from one launcher run.

    python tools/drift_table.py --out runs/drift-bench --preset bench-lora
    python tools/drift_table.py --out runs/drift-demo -- <the launcher's flags of a run>

Runs `examples/pretrain_gpt.py` once (a subprocess, one process) with the given launcher flags
plus `--longstraw-updates-per-capture K --longstraw-drift-every 1 --train-iters K`, so the run
is one capture serving K updates and the drift is measured before every update after the first
(step/staleness.py: the prompt captured again at the current weights, the update's members
scored and replayed over both states). From the run's receipt it writes `drift.json` and prints
a markdown table: per number of updates since the capture (`--rows`, default 1, 2, 4, 8), mean
and max |delta log-prob| of the kept against the fresh state, the k3 KL estimate, the cosine and
relative norm of the update's gradient over the two states, and beside them the update's ratio
range and clip fraction and the loss's clip range.

`--preset bench-lora`: examples/glm52/bench.yaml (GLM-5.2's shape, tools/bench.py's model) at
P = 32,768 on synthetic groups (G = 4, responses up to 32 tokens), LoRA rank 16 (alpha 32) on the
family's targets at lr 5e-5 (constant, Adam, --clip-grad 1.0), fp32, K = 9.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PRESETS = {
    "bench-lora": ["--longstraw-config", "examples/glm52/bench.yaml",
                   "--longstraw-synthetic-prompt-len", "32768",
                   "--longstraw-synthetic-response-len", "32", "--longstraw-group-size", "4",
                   "--longstraw-lora", "--longstraw-lora-rank", "16", "--longstraw-lora-alpha", "32",
                   "--lr", "5e-5", "--lr-decay-style", "constant", "--clip-grad", "1.0",
                   "--longstraw-dtype", "fp32", "--seed", "1", "--no-longstraw-live-bytes"],
}
FIGURES = (("drift/logp_abs_mean", "mean abs dlogp", "{:.1e}"),
           ("drift/logp_abs_max", "max abs dlogp", "{:.1e}"),
           ("drift/kl", "k3 KL", "{:.1e}"),
           ("drift/grad_cosine", "grad cosine", "{:.4f}"),
           ("drift/grad_rel_norm", "grad rel norm", "{:.3f}"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for the run and drift.json")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="launcher flags of a named setting (module docstring)")
    p.add_argument("--updates", type=int, default=9, metavar="K",
                   help="updates of the one capture (default 9: drift after 1 .. 8 updates)")
    p.add_argument("--rows", default="1,2,4,8",
                   help="updates since the capture to tabulate (default 1,2,4,8)")
    p.add_argument("launcher", nargs=argparse.REMAINDER,
                   help="after --: the launcher's flags (with or instead of --preset)")
    args = p.parse_args(argv)
    args.launcher = [a for a in args.launcher if a != "--"]
    if not args.preset and not args.launcher:
        p.error("give --preset or the launcher's flags after --")
    if args.updates < 2:
        p.error(f"--updates {args.updates}: one capture must serve at least 2 updates")
    args.rows = sorted({int(r) for r in args.rows.split(",")})
    if not all(0 < r < args.updates for r in args.rows):
        p.error(f"--rows {args.rows}: each must be between 1 and --updates - 1 = "
                f"{args.updates - 1}")
    return args


def run_launcher(args, out: Path) -> dict:
    """The run (one capture, K updates, drift before each update after the first); its receipt."""
    argv = ([sys.executable, str(ROOT / "examples" / "pretrain_gpt.py"), "--longstraw"]
            + PRESETS.get(args.preset, []) + args.launcher
            + ["--train-iters", str(args.updates),
               "--longstraw-updates-per-capture", str(args.updates),
               "--longstraw-drift-every", "1",
               "--longstraw-out-dir", str(out), "--longstraw-run-name", "drift"])
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", PYTHONWARNINGS="ignore")
    env.setdefault("OMP_NUM_THREADS", "1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)   # a one-process run of its own, not a rank of the caller's job
    start = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, env=env, check=True)
    receipt = json.loads((out / "drift" / "receipt.json").read_text())
    receipt["drift_tool"] = {"argv": argv[1:], "wall_s": time.perf_counter() - start}
    return receipt


def table(receipt: dict, rows: list[int]) -> tuple[list[dict], str]:
    """(the rows as dicts, the markdown table) from the receipt's per-update history."""
    history = receipt["history"]
    settings = receipt["settings"]
    clip = (settings.get("clip_eps_low"), settings.get("clip_eps_high"))
    found = []
    for h in history:
        k = int(h.get("grpo/update_in_capture", -1))
        if k in rows:
            if "grpo/drift/logp_abs_mean" not in h:
                raise ValueError(f"update {k} of the run has no drift figures: was the drift "
                                 "measured (--longstraw-drift-every 1)?")
            found.append({"updates_since_capture": k,
                          **{key: h[f"grpo/{key}"] for key, _, _ in FIGURES},
                          "ratio_min": h["grpo/ratio_min"], "ratio_max": h["grpo/ratio_max"],
                          "clip_frac": h["grpo/clip_frac"]})
    missing = sorted(set(rows) - {r["updates_since_capture"] for r in found})
    if missing:
        raise ValueError(f"the run's history has no update {missing} (it ran "
                         f"{len(history)} updates)")
    head = ("| updates since capture | " + " | ".join(name for _, name, _ in FIGURES)
            + " | ratio range | clip frac |")
    lines = [head, "|" + "---|" * (len(FIGURES) + 3)]
    for r in found:
        lines.append(f"| {r['updates_since_capture']} | "
                     + " | ".join(fmt.format(r[key]) for key, _, fmt in FIGURES)
                     + f" | {r['ratio_min']:.3f} - {r['ratio_max']:.3f} | {r['clip_frac']:.2f} |")
    if None not in clip:
        lines.append(f"\nclip range: ratio in [{1 - clip[0]:.2f}, {1 + clip[1]:.2f}]")
    return found, "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    receipt = run_launcher(args, out)
    rows, text = table(receipt, args.rows)
    result = {"rows": rows, "argv": receipt["drift_tool"]["argv"],
              "wall_s": receipt["drift_tool"]["wall_s"]}
    (out / "drift.json").write_text(json.dumps(result, indent=2) + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
