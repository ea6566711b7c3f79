"""The demo recipe's sweep (issue 32 item 4): runs tools/demo_rl.py over a suite of long-range tasks,
recipes and seeds, one process at a time, and writes the table of docs/demo_rl_sweep.md from the
receipts.

    python tools/demo_rl_sweep.py run --recipe R [--tasks majority,copy,missing] --seeds 1,2,3 \
        [--parallel 2] [--no-control]
    python tools/demo_rl_sweep.py table             (docs/demo_rl_sweep.json and .md, from runs/)

`run` starts `tools/demo_rl.py --out runs/demo-rl-sweep/<R>-<task>-s<seeds>` for each task (a
subprocess: no tool imports another), with the recipe's flags (RECIPES) and the suite's task sizes
(TASK_FLAGS); --no-control runs the runs only (screening). `table` reads every
runs/demo-rl-sweep/*/receipt.json, keeps per (recipe, task, seed, run | control) the start / end
rewards (means over the first / last 10% of steps, demo_rl.start_end) and the curve, writes them
to docs/demo_rl_sweep.json, and the markdown tables (screening: recipe x task; the chosen recipe:
task x seed, run vs control, and the criterion of demo_rl.criterion) to docs/demo_rl_sweep.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "runs" / "demo-rl-sweep"
DOCS = ROOT / "docs"

# The suite at P = 1024 (evidence in the first 512 tokens, so at least 512 tokens back), 4 markers
# of the 64-token vocabulary: chance 1/4 for a policy blind to the prompt, 1/64 for the untrained
# one.
TASK_FLAGS = ["--config", "examples/demo_rl/qwen36_demo_v64.yaml", "--prompt-len", "1024", "--num-markers", "4", "--batch", "4",
              "--majority-count", "250", "--minority-max", "60", "--count", "32"]
RECIPES = {
    # Adam, constant; lr 1e-4 for the model, the decoupled lr for the embedding and output layer
    # (Megatron's --decoupled-lr); dynamic sampling (DAPO) with at most 2 extra rounds a step
    "A": ["--decoupled-lr", "5e-3", "--lr", "1e-4", "--dynamic-sampling", "2", "--steps", "40"],
    # the model's lr 10x: the features that tell the answers apart must be learned, not only read
    "C": ["--decoupled-lr", "5e-3", "--lr", "1e-3", "--dynamic-sampling", "2", "--steps", "60"],
    # C sampling hotter: keep exploring once the marker set is learned (C and A collapse there)
    "D": ["--decoupled-lr", "5e-3", "--lr", "1e-3", "--dynamic-sampling", "2", "--steps", "60",
          "--temperature", "1.5"],
    # C with a lower embedding / output lr: the marker set learned slower than the features
    "E": ["--decoupled-lr", "1e-3", "--lr", "1e-3", "--dynamic-sampling", "2", "--steps", "60"],
    # between D and E: a slower marker set, sampling a little hotter, longer
    "F": ["--decoupled-lr", "2e-3", "--lr", "1e-3", "--dynamic-sampling", "2", "--steps", "100",
          "--temperature", "1.2"],
    # D with G = 16: more members find the answer once the policy narrows
    "G": ["--decoupled-lr", "5e-3", "--lr", "1e-3", "--dynamic-sampling", "2", "--steps", "80",
          "--temperature", "1.5", "--group-size", "16"],
    # G for 160 steps (the first-occurrence task was still at chance at 80)
    "H": ["--decoupled-lr", "5e-3", "--lr", "1e-3", "--dynamic-sampling", "2", "--steps", "160",
          "--temperature", "1.5", "--group-size", "16"],
    # G with both lrs decayed (cosine, to a tenth) over 100 steps: G at a constant lr learned
    # copy on seed 2 to ~0.75 by step 67, then lost it (gradient-norm spikes, reward 0.3-0.45)
    "I": ["--decoupled-lr", "5e-3", "--lr", "1e-3", "--dynamic-sampling", "2", "--steps", "100",
          "--temperature", "1.5", "--group-size", "16", "--lr-decay-style", "cosine",
          "--min-lr", "1e-4", "--decoupled-min-lr", "5e-4"],
}
CHOSEN = "I"
"""The recipe of the table task x seed: the first that learned every task of the suite on each of
3 seeds (majority, copy, missing; docs/demo_rl_sweep.md). tools/demo_rl.py's defaults are this
recipe at TASK_FLAGS' sizes (tests/test_demo_rl.py checks it)."""
SUITE = ("majority", "copy", "missing")
"""The tasks of the chosen recipe's table (first occurrence, not learned by any recipe, stays in the
screening table)."""
CHANCE_GAIN = {"min_gain": 0.25, "max_control_gain": 0.15}   # demo_rl's criterion


def run(args) -> None:
    SWEEP.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    for task in args.tasks.split(","):
        name = f"{args.recipe}-{task}-s{args.seeds.replace(',', '')}" + (
            "" if args.control else "-runs")
        argv = [sys.executable, str(ROOT / "tools" / "demo_rl.py"), "--out", str(SWEEP / name),
                "--task", task, "--seeds", args.seeds, "--parallel", str(args.parallel),
                *TASK_FLAGS,
                *RECIPES[args.recipe], *([] if args.control else ["--no-control"])]
        print(" ".join(argv[1:]), flush=True)
        subprocess.run(argv, env=env, cwd=ROOT, check=False)


def _key(r: dict) -> tuple:
    return r["recipe"], r["task"], r["seed"], r["kind"]


def collect() -> list[dict]:
    """One record per (recipe, task, seed, kind) from the sweep's receipts (a seed run twice, in
    screening and with the other seeds: the later folder's, in name order)."""
    records = {}
    for path in sorted(SWEEP.glob("*/receipt.json")):
        receipt = json.loads(path.read_text())
        recipe = path.parent.name.split("-")[0]
        for s in receipt["seeds"]:
            for kind in ("run", "control"):
                figures = s.get(kind)
                if figures is None:
                    continue
                record = {"recipe": recipe, "task": receipt["task"]["task"],
                          "seed": s["seed"], "kind": kind, "folder": path.parent.name,
                          "chance": receipt["chance"]["marker"],
                          "settings": receipt["settings"],
                          **{k: figures[k] for k in ("reward_start", "reward_end",
                                                     "steps", "curve")}}
                records[_key(record)] = record
    return list(records.values())


def _find(records, recipe, task, seed, kind):
    found = [r for r in records if _key(r) == (recipe, task, seed, kind)]
    return found[-1] if found else None


def _seed_table(records: list[dict], recipe: str, tasks) -> list[str]:
    """Task x seed, run vs control, with the criterion's verdict per seed."""
    out = ["| task | seed | run start | run end | control start | control end | criterion |",
           "|---|---:|---:|---:|---:|---:|---|"]
    picked = [r for r in records if r["recipe"] == recipe and r["task"] in tasks]
    for task in dict.fromkeys(r["task"] for r in picked):
        for seed in sorted({r["seed"] for r in picked if r["task"] == task}):
            run_, control = (_find(records, recipe, task, seed, k) for k in ("run", "control"))
            chance = (run_ or control)["chance"]
            cells, verdict = [], []
            for figures in (run_, control):
                cells += (["-", "-"] if figures is None else
                          [f"{figures['reward_start']:.3f}", f"{figures['reward_end']:.3f}"])
            if run_ is not None:
                verdict.append("run learns" if run_["reward_end"] >= chance +
                               CHANCE_GAIN["min_gain"] else "run FAILS")
            if control is not None:
                verdict.append("control at chance" if control["reward_end"] <= chance +
                               CHANCE_GAIN["max_control_gain"] else "control FAILS")
            if run_ is None or control is None:
                verdict.append("not run yet: " + ", ".join(
                    k for k, f in (("run", run_), ("control", control)) if f is None))
            out.append(f"| {task} | {seed} | {' | '.join(cells)} | {'; '.join(verdict)} |")
    return out


def tables(records: list[dict], chosen: str | None = CHOSEN) -> str:
    out = ["## Screening: recipe x task (seed 1, run only)", "",
           "| recipe | task | start | end | steps |", "|---|---|---:|---:|---:|"]
    for r in records:
        if r["seed"] == 1 and r["kind"] == "run":
            out.append(f"| {r['recipe']} | {r['task']} | {r['reward_start']:.3f} | "
                       f"{r['reward_end']:.3f} | {r['steps']} |")
    if chosen is None:
        return "\n".join(out + ["", "No recipe chosen yet: none has learned every task on seed 1 "
                                     "(docs/demo_rl_sweep.md)."])
    out += ["", f"## The chosen recipe ({chosen}): task x seed, run vs control", "",
            *_seed_table(records, chosen, SUITE)]
    # the other recipes that ran more than screening (other seeds, or controls)
    for recipe in dict.fromkeys(r["recipe"] for r in records):
        if recipe != chosen and any(r["recipe"] == recipe and (r["seed"] != 1 or
                                                               r["kind"] == "control")
                                    for r in records):
            out += ["", f"## Recipe {recipe}: task x seed, run vs control", "",
                    *_seed_table(records, recipe, SUITE)]
    return "\n".join(out)


def table(args) -> None:
    records = collect()
    # records already in the JSON whose runs are not in runs/ (a run folder is not committed:
    # another machine's or session's sweep) are kept; a run here replaces its old record
    saved = DOCS / "demo_rl_sweep.json"
    if saved.exists():
        here = {_key(r) for r in records}
        records = [r for r in json.loads(saved.read_text())["records"]
                   if _key(r) not in here] + records
    chosen = args.chosen or CHOSEN
    DOCS.mkdir(exist_ok=True)
    (DOCS / "demo_rl_sweep.json").write_text(json.dumps(
        {"recipes": RECIPES, "task_flags": TASK_FLAGS, "chosen": chosen,
         "criterion": CHANCE_GAIN, "records": records}, indent=1) + "\n")
    text = tables(records, chosen)
    md = DOCS / "demo_rl_sweep.md"
    head = md.read_text().split("<!-- tables -->")[0] if md.exists() else "# Demo RL sweep\n\n"
    md.write_text(head + "<!-- tables -->\n" + text + "\n")
    print(text)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--recipe", choices=tuple(RECIPES), required=True)
    r.add_argument("--tasks", default=",".join(SUITE))
    r.add_argument("--seeds", default="1,2,3")
    r.add_argument("--control", action=argparse.BooleanOptionalAction, default=True)
    r.add_argument("--parallel", type=int, default=1,
                   help="Runs at a time (demo_rl.py --parallel: a seed's run beside its control).")
    t = sub.add_parser("table")
    t.add_argument("--chosen", choices=tuple(RECIPES), default=None,
                   help="The recipe of the task x seed table (default: CHOSEN).")
    args = p.parse_args(argv)
    {"run": run, "table": table}[args.cmd](args)


if __name__ == "__main__":
    main()
