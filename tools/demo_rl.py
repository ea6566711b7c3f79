"""A run that learns, with a control: `make demo-rl`.

    python tools/demo_rl.py --out runs/demo-rl            (the defaults are docs/benchmarks.md's demo)

The defaults are the recipe the sweep chose (tools/demo_rl_sweep.py, recipe I;
docs/demo_rl_sweep.md) on its majority task (rewards.make_marker_task): each prompt is
`--prompt-len` tokens of filler with marker tokens scattered through its first half only; one
marker occurs more often than the others, and it is the answer. The last prompt token is the
same question cue in every prompt, so nothing near the end tells the answer: the policy must read
it from the captured prompt state. Reward (`longstraw:marker_majority`): 1 when the response's
first token is the majority marker.
`--task copy | missing | first` runs the suite's other tasks (long_tasks.make_long_task).

`--task tool` (`make demo-agent`) is a two-turn agent task whose answer needs a tool: the prompt
holds one marker (the key: the copy task's prompt); a table from every marker to a value marker,
drawn per prompt, is held by the tool only (example_env's lookup, `meta.table`). Turn 1 is the
call, and the tool answers [asked id, value]: the value of the prompt's key whatever is asked
(`--tool-query any`, the default), or of the id asked for (`--tool-query key`); turn 2 is the
answer, rewarded 1 by the environment when it is the value of the prompt's key (`tool_rows`).
The control is `--longstraw-control blind`: the tool is called and rewards as before, but its
observation never enters the trajectory, so no policy can beat chance (the values are a random
permutation per prompt, the answers balanced).

For every seed, two online GRPO runs through the launcher (`--longstraw-rollout online`, tiny
Qwen3.6 of examples/demo_rl/qwen36_demo_v64.yaml, a 64-token vocabulary), identical but for
`--longstraw-control zeros` in the second: its captured prompt state is replaced by zeros before
generation and training, so the policy sees only the question cue and cannot do better than
guessing a marker. Each pair runs side by side (two processes, OMP_NUM_THREADS=1 each).

Outputs in --out: prompts.jsonl (+ prompts.prompts/*.npy), one launcher folder per run
(receipt.json with the per-step history), receipt.json (per seed: reward_start / reward_end of the
run and the control, the mean rewards over the first and the last 10% of steps, and the curves;
their mean and spread over the seeds; the criterion and whether it passed), reward_curves.png
(every seed's run and control; each launcher folder also has its own run_curves.png).
Exit status 1 when the learning criterion (`criterion`) fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = "examples/demo_rl/qwen36_demo_v64.yaml"
REWARD_KEY = "grpo/reward_mean"
GENERATED_KEY = "sampling/generated_reward_mean"
REWARDS = {"majority": "longstraw:marker_majority", "copy": "longstraw:marker_copy",
           "missing": "longstraw:marker_missing", "first": "longstraw:marker_first",
           "tool": None}
"""The suite's tasks (rewards.make_marker_task, long_tasks.make_long_task) and their rewards
(the tool task's reward is its environment's: `tool_rows`)."""
TOOL_ENV = "megatron_longstraw.rollout.example_env:lookup"


# ---- the receipt's figures ----------------------------------------------------------------------


def start_end(curve: list[float], fraction: float = 0.1) -> tuple[float, float]:
    """(mean of the first, mean of the last) `fraction` of the steps' rewards; at least one step
    each (ceil), so a 5-step curve compares its first step with its last."""
    if not curve:
        raise ValueError("no steps: an empty reward curve has no start or end")
    n = max(1, math.ceil(fraction * len(curve)))
    return sum(curve[:n]) / n, sum(curve[-n:]) / n


def summarise_run(history: list[dict]) -> dict:
    """A launcher receipt's history -> {"reward_start", "reward_end", "curve", ...}."""
    # with dynamic sampling the trained groups' mean skips the all-equal groups: read the mean
    # over every generated member instead (the policy's reward on fresh prompts)
    curve = [float(h.get(GENERATED_KEY, h[REWARD_KEY])) for h in history]
    start, end = start_end(curve)
    seconds = [sum(v for k, v in h.items() if k.startswith("time/") and k != "time/step_s")
               for h in history]
    elapsed, wall = 0.0, []   # the run's clock at each update's end (time/step_s summed)
    for h in history:
        elapsed += float(h.get("time/step_s", 0.0))
        wall.append(elapsed)
    return {"reward_start": start, "reward_end": end, "steps": len(curve), "curve": curve,
            "response_len_mean": [float(h.get("grpo/response_len_mean", float("nan")))
                                  for h in history],
            "step_s_mean": sum(seconds) / len(seconds), "elapsed_s": wall}


def spread(values: list[float]) -> dict:
    """Mean, sample standard deviation (0 for one value), min and max."""
    mean = sum(values) / len(values)
    std = (math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
           if len(values) > 1 else 0.0)
    return {"mean": mean, "std": std, "min": min(values), "max": max(values)}


def criterion(seeds: list[dict], chance: float, min_gain: float, max_control_gain: float) -> dict:
    """The learning criterion: on every seed the run's reward_end >= chance + min_gain, and the
    control's reward_end <= chance + max_control_gain (chance: one marker guessed uniformly, the
    best a policy blind to the prompt can do on a task whose answers are uniform over the
    markers). Returns the thresholds, the failures (one line each) and `passed`."""
    run_min, control_max = chance + min_gain, chance + max_control_gain
    failures = []
    for s in seeds:
        if not s["run"]["reward_end"] >= run_min:
            failures.append(f"seed {s['seed']}: run reward_end {s['run']['reward_end']:.3f} < "
                            f"{run_min:.3f} (chance {chance:.3f} + {min_gain})")
        if s["control"] is not None and not s["control"]["reward_end"] <= control_max:
            failures.append(f"seed {s['seed']}: control reward_end "
                            f"{s['control']['reward_end']:.3f} > {control_max:.3f} (chance "
                            f"{chance:.3f} + {max_control_gain})")
    return {"rule": f"every seed: run reward_end >= chance + {min_gain} and control reward_end "
                    f"<= chance + {max_control_gain}",
            "run_min": run_min, "control_max": control_max, "failures": failures,
            "passed": not failures}


def build_receipt(args, seeds: list[dict], task: dict, wall_s: float) -> dict:
    chance = 1.0 / len(task["markers"])
    check = criterion(seeds, chance, args.min_gain, args.max_control_gain)
    return {
        "task": task,
        "chance": {"marker": chance, "uniform_vocab": 1.0 / task["vocab_size"],
                   "best_blind": task["best_blind"],
                   "note": "marker: a uniform guess among the markers; uniform_vocab: a uniform "
                           "guess over the model's vocabulary (the untrained policy); "
                           "best_blind: always answering the most frequent answer of the data"},
        "settings": {k: getattr(args, k) for k in (
            "config", "task", "prompt_len", "num_markers", "group_size", "batch", "steps", "lr",
            "decoupled_lr", "lr_decay_style", "min_lr", "decoupled_min_lr", "prompt_grad",
            "num_prompts", "temperature", "dynamic_sampling", "loss_aggregation", "parallel",
            "updates_per_capture", "tool_query")},
        "criterion": check,
        "seeds": seeds,
        "summary": {f"{kind}_reward_{end}": spread([s[kind][f"reward_{end}"] for s in seeds])
                    for kind in ("run", "control") for end in ("start", "end")
                    if all(s[kind] is not None for s in seeds)},
        "wall_s": wall_s,
        "passed": check["passed"],
    }


def table(receipt: dict) -> str:
    """The markdown table of docs/benchmarks.md ("A run that learns")."""
    rows = ["| seed | run start | run end | control start | control end |",
            "|---:|---:|---:|---:|---:|"]

    def cell(figures, key):
        return "-" if figures is None else f"{figures[key]:.3f}"

    for s in receipt["seeds"]:
        rows.append(f"| {s['seed']} | {cell(s['run'], 'reward_start')} | "
                    f"{cell(s['run'], 'reward_end')} | {cell(s['control'], 'reward_start')} | "
                    f"{cell(s['control'], 'reward_end')} |")
    summary = receipt["summary"]

    def mean(key, std=False):
        if key not in summary:
            return "-"
        return f"{summary[key]['mean']:.3f}" + (f" ± {summary[key]['std']:.3f}" if std else "")

    rows.append(f"| mean ± std | {mean('run_reward_start')} | {mean('run_reward_end', True)} | "
                f"{mean('control_reward_start')} | {mean('control_reward_end', True)} |")
    return "\n".join(rows)


def text_plot(receipt: dict, width: int = 60, height: int = 20) -> str:
    """The reward curves as text (for docs: no binary): the mean over the seeds of the runs'
    curves (`R`) and of the controls' (`c`; `*` where both fall in one cell), each a moving
    average over a tenth of the steps, the steps binned into `width` columns, the rewards
    0..1 into `height` rows; the chance among the markers as a row of dots."""
    from megatron_longstraw.training.run_plot import moving_average

    window = max(1, receipt["settings"]["steps"] // 10)
    curves = {}
    for kind, mark in (("run", "R"), ("control", "c")):
        per_seed = [s[kind]["curve"] for s in receipt["seeds"] if s[kind] is not None]
        if per_seed:
            steps = min(len(c) for c in per_seed)
            mean = [sum(c[i] for c in per_seed) / len(per_seed) for i in range(steps)]
            curves[mark] = moving_average(mean, window)
    steps = max(len(c) for c in curves.values())
    width = min(width, steps)
    grid = [[" "] * width for _ in range(height + 1)]

    def row_of(value: float) -> int:
        return height - min(height, max(0, round(value * height)))

    for col in range(width):
        grid[row_of(receipt["chance"]["marker"])][col] = "."
    for mark, curve in curves.items():
        for col in range(width):
            lo, hi = col * len(curve) // width, max(col * len(curve) // width + 1,
                                                    (col + 1) * len(curve) // width)
            cell = grid[row_of(sum(curve[lo:hi]) / (hi - lo))]
            cell[col] = mark if cell[col] in (" ", ".", mark) else "*"    # the other curve
    lines = [f"{1 - r / height:4.2f} |{''.join(row)}" for r, row in enumerate(grid)]
    lines.append("     +" + "-" * width)
    lines.append(f"      step 1 .. {steps}: R run, c control (means over "
                 f"{len(receipt['seeds'])} seeds, moving average {window}), . chance")
    return "\n".join(lines) + "\n"


# ---- PNG (matplotlib, the bench extra; each launcher run also writes its own run_curves.png) -----


def write_png(receipt: dict, path: Path) -> None:
    from megatron_longstraw.training.run_plot import moving_average, pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    window = max(1, receipt["settings"]["steps"] // 10)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, s in enumerate(receipt["seeds"]):
        color = colors[i % len(colors)]
        for kind, style in (("run", "-"), ("control", "--")):
            if s[kind] is None:
                continue
            curve = s[kind]["curve"]
            ax.plot(range(len(curve)), moving_average(curve, window), style, color=color,
                    label=f"seed {s['seed']} {kind}")
    chance = receipt["chance"]
    ax.axhline(chance["marker"], color="grey", lw=0.8, ls=":", label="chance (markers)")
    ax.axhline(chance["uniform_vocab"], color="black", lw=0.8, ls=":", label="chance (vocab)")
    ax.set_xlabel("step")
    ax.set_ylabel(f"mean reward (moving average over {window} steps)")
    task = receipt["task"]
    ax.set_title(f"online GRPO, {task['task']} task, tiny Qwen3.6, P = {task['prompt_len']}, G = "
                 f"{receipt['settings']['group_size']}: run vs control ("
                 f"{'observations withheld' if task['task'] == 'tool' else 'prompt state zeroed'})",
                 fontsize=9)
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- the runs -----------------------------------------------------------------------------------


def balanced_rows(rows: list[dict], markers: list[int], seed: int) -> list[dict]:
    """`rows` reordered into blocks of len(markers) prompts, one per answer, each block in a
    seeded order (rows past the last complete block dropped). With --global-batch-size equal to
    the number of markers and the file's order, every step sees each answer once: the GRPO
    update then cannot raise one marker for all prompts (a step's groups pull the prior towards
    their own answers, which cancel), only the marker the prompt's evidence points to."""
    import numpy as np

    buckets = {m: [r for r in rows if r["meta"]["answer"] == m] for m in markers}
    rng = np.random.default_rng(seed)
    out = []
    for k in range(min(len(b) for b in buckets.values())):
        block = [buckets[m][k] for m in markers]
        out.extend(block[i] for i in rng.permutation(len(block)))
    return out


def tool_rows(rows: list[dict], markers: list[int], unknown_id: int, seed: int,
              query: str = "key", vocab_size: int | None = None) -> list[dict]:
    """The tool task from copy-task rows (`meta.answer`: the one marker the prompt holds, the
    key): per prompt a table, a seeded random permutation of the markers (every marker a key,
    distinct values: a wrong key never returns the right value), that only the tool holds;
    `answer` becomes the key's value, `answer_turn` 2 (turn 1 the call, turn 2 the answer), ids
    not in the table answered with `unknown_id` (example_env's lookup reads these fields).
    query "any": the tool answers the key's value whatever id the call asks for (the table
    maps every id of the vocabulary to it): the policy need only call and relay."""
    import numpy as np

    if query not in ("key", "any"):
        raise ValueError(f"tool query {query!r}: expected 'key' or 'any'")
    out = []
    for k, row in enumerate(rows):
        rng = np.random.default_rng([seed, k, 7])
        value_of = dict(zip(markers, (markers[int(i)] for i in rng.permutation(len(markers)))))
        key = row["meta"]["answer"]
        answer = value_of[key]
        table = ([[i, answer] for i in range(vocab_size)] if query == "any"
                 else [[m, v] for m, v in value_of.items()])
        meta = {**row["meta"], "task": "tool", "key": key, "answer": answer,
                "answer_turn": 2, "unknown_id": unknown_id, "table": table}
        out.append({**row, "id": f"tool-{k}", "meta": meta})
    return out


def make_task(args, out: Path) -> dict:
    """The prompts (JSONL, prompt ids inline) and the task's description for the receipt."""
    import yaml

    from megatron_longstraw.rollout.long_tasks import make_long_task
    from megatron_longstraw.rollout.rewards import make_marker_task

    vocab = yaml.safe_load((ROOT / args.config).read_text())["model"]["vocab_size"]
    markers = list(range(vocab - args.num_markers, vocab))
    filler = list(range(vocab - args.num_markers))   # the first id is the question cue
    if len(filler) < 2:
        raise SystemExit(f"vocabulary {vocab} leaves no filler beside {args.num_markers} markers "
                         "and the question cue")
    # Answers are drawn uniformly: 3x the prompts (+ a margin) leaves enough of each to balance.
    num_rows = 3 * args.num_prompts + 10 * len(markers)
    if args.task == "majority":
        rows = make_marker_task(num_rows, args.prompt_len, markers, filler, seed=args.data_seed,
                                majority_count=args.majority_count,
                                minority_max=args.minority_max,
                                evidence_fraction=args.evidence_fraction)
    else:
        rows = make_long_task("copy" if args.task == "tool" else args.task, num_rows,
                              args.prompt_len, markers, filler, seed=args.data_seed,
                              count=args.count, evidence_fraction=args.evidence_fraction)
        if args.task == "tool":
            rows = tool_rows(rows, markers, filler[0], args.data_seed, args.tool_query, vocab)
    rows = balanced_rows(rows, markers, args.data_seed)[:args.num_prompts]
    path = out / "prompts.jsonl"
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    answers = [r["meta"]["answer"] for r in rows]
    counts = ({"majority_count": args.majority_count,
               "minority_max": args.minority_max or args.majority_count // 2}
              if args.task == "majority" else {"count": args.count})
    return {"task": args.task, "reward": REWARDS[args.task] or f"the environment ({TOOL_ENV})",
            "path": str(path),
            "num_prompts": len(rows),
            "prompt_len": args.prompt_len, "vocab_size": vocab, "markers": markers,
            "question_id": filler[0], "filler_ids": filler[1:],
            **counts, "evidence": f"first {args.evidence_fraction:g} of the prompt", "order": "balanced blocks, file order",
            "best_blind": max(answers.count(m) for m in markers) / len(answers)}


def launcher_argv(args, task: dict, seed: int, control: bool, out: Path) -> list[str]:
    name = f"seed{seed}-{'control' if control else 'run'}"
    if args.task == "tool":
        # turn 1: one token (the key asked for), the tool's 2-token answer, turn 2: one token
        rollout = ["--longstraw-env", TOOL_ENV, "--longstraw-env-turn-tokens", "1",
                   "--longstraw-env-max-turns", "2", "--longstraw-max-new-tokens", "4"]
    else:
        rollout = ["--longstraw-reward", REWARDS[args.task], "--longstraw-max-new-tokens", "1"]
    argv = ["--longstraw", "--longstraw-family", "qwen36", "--longstraw-config", args.config,
            "--longstraw-data", task["path"], "--longstraw-rollout", "online", *rollout,
            "--longstraw-group-size", str(args.group_size),
            "--longstraw-temperature", str(args.temperature),
            "--longstraw-dtype", "fp32", "--lr", str(args.lr),
            "--lr-decay-style", args.lr_decay_style, "--clip-grad", "1.0",
            "--train-iters", str(args.steps),
            *(["--decoupled-lr", str(args.decoupled_lr)] if args.decoupled_lr else []),
            *(["--min-lr", str(args.min_lr)] if args.min_lr else []),
            *(["--decoupled-min-lr", str(args.decoupled_min_lr)]
              if args.decoupled_lr and args.decoupled_min_lr else []),
            *(["--longstraw-dynamic-sampling", "--longstraw-dynamic-sampling-rounds",
               str(args.dynamic_sampling)] if args.dynamic_sampling else []),
            *(["--longstraw-loss-aggregation", args.loss_aggregation]
              if args.loss_aggregation else []),
            *(["--longstraw-updates-per-capture", str(args.updates_per_capture)]
              if args.updates_per_capture > 1 else []),
            "--global-batch-size", str(args.batch), "--seed", str(seed),
            "--no-longstraw-data-shuffle", "--no-longstraw-live-bytes",
            "--longstraw-out-dir", str(out), "--longstraw-run-name", name]
    # The zeros control needs the detached gradient (its prompt state is not a function of the
    # weights): with --prompt-grad exact only the run back-propagates through the prompt.
    if args.prompt_grad == "exact" and not control:
        argv += ["--longstraw-prompt-grad", "exact"]
    if not control:
        return argv
    return argv + ["--longstraw-control", "blind" if args.task == "tool" else "zeros"]


def child_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1",
               PYTHONWARNINGS="ignore")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def run_one(args, task: dict, seed: int, control: bool, out: Path) -> dict:
    """One launcher run in its own process; its receipt's history summarised."""
    argv = launcher_argv(args, task, seed, control, out)
    name = argv[argv.index("--longstraw-run-name") + 1]
    start = time.perf_counter()
    with (out / f"{name}.log").open("w") as log:
        proc = subprocess.run([sys.executable, str(ROOT / "examples" / "pretrain_gpt.py"), *argv],
                              stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT)
    if proc.returncode != 0:
        tail = (out / f"{name}.log").read_text().strip().splitlines()[-3:]
        raise SystemExit(f"{name} failed (exit {proc.returncode}): {' | '.join(tail)}")
    receipt = json.loads((out / name / "receipt.json").read_text())
    return {**summarise_run(receipt["history"]), "wall_s": time.perf_counter() - start}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/demo-rl")
    p.add_argument("--config", default=CONFIG, help="Model YAML (relative to the repository).")
    p.add_argument("--task", choices=tuple(REWARDS), default="majority",
                   help="majority: rewards.make_marker_task; copy, missing, first: "
                        "long_tasks.make_long_task (the sweep's suite, docs/demo_rl_sweep.md); "
                        "tool: the two-turn tool task (tool_rows; its control is blind).")
    p.add_argument("--tool-query", choices=("key", "any"), default="any",
                   help="tool task: any: the tool answers the prompt's key whatever the call "
                        "asks (the policy must call, then relay the answer); key: it answers the "
                        "id the call asks for (the policy must also ask for the prompt's marker; "
                        "not learned in 60 steps from scratch: docs/benchmarks.md). tool_rows.")
    p.add_argument("--seeds", default="1,2,3", help="Comma-separated training seeds.")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=4, help="Prompts per step (--global-batch-size).")
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--num-prompts", type=int, default=150)
    p.add_argument("--num-markers", type=int, default=4)
    p.add_argument("--majority-count", type=int, default=250)
    p.add_argument("--minority-max", type=int, default=60,
                   help="Every other marker occurs 1..this many times.")
    p.add_argument("--count", type=int, default=32,
                   help="copy / missing / first: occurrences of each marker present.")
    p.add_argument("--evidence-fraction", type=float, default=0.5,
                   help="Markers sit in this leading fraction of the prompt; the rest is filler.")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3,
                   help="Learning rate of every parameter but the embedding and output layer.")
    p.add_argument("--decoupled-lr", type=float, default=5e-3,
                   help="Learning rate of the embedding and output layer (Megatron's "
                        "--decoupled-lr); 0: --lr for them too.")
    p.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"),
                   default="cosine", help="Megatron's --lr-decay-style, over the run's steps.")
    p.add_argument("--min-lr", type=float, default=1e-4,
                   help="The model's lr at the end of a decay (Megatron's --min-lr).")
    p.add_argument("--decoupled-min-lr", type=float, default=5e-4,
                   help="The embedding and output layer's (Megatron's --decoupled-min-lr).")
    p.add_argument("--temperature", type=float, default=1.5,
                   help="Sampling temperature (the trained policy is the model's, temperature 1).")
    p.add_argument("--prompt-grad", choices=("detached", "exact"), default="detached",
                   help="The run's prompt gradient (exact: standard GRPO's, through the prompt); "
                        "the control is always detached (its zeroed state is no function of the "
                        "weights).")
    p.add_argument("--updates-per-capture", type=int, default=1, metavar="K",
                   help="--longstraw-updates-per-capture: each capture serves K updates (G x K "
                        "members generated from it); --steps counts updates, a multiple of K.")
    p.add_argument("--dynamic-sampling", type=int, default=2, metavar="ROUNDS",
                   help="--longstraw-dynamic-sampling with this many extra rounds (0: off).")
    p.add_argument("--loss-aggregation", default=None,
                   help="--longstraw-loss-aggregation (default: the launcher's).")
    p.add_argument("--control", action=argparse.BooleanOptionalAction, default=True,
                   help="Run each seed's control (--no-control: the runs only, for a sweep's "
                        "screening; the criterion then checks the runs only).")
    p.add_argument("--parallel", type=int, default=2, help="Runs at a time (one process each).")
    p.add_argument("--min-gain", type=float, default=0.25,
                   help="Criterion: the run's reward_end >= chance + this, every seed.")
    p.add_argument("--max-control-gain", type=float, default=0.15,
                   help="Criterion: the control's reward_end <= chance + this, every seed.")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    out = (ROOT / args.out) if not Path(args.out).is_absolute() else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    task = make_task(args, out)
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs = [(seed, control) for seed in seeds
            for control in ((False, True) if args.control else (False,))]
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        results = list(pool.map(lambda job: run_one(args, task, *job, out), jobs))
    by_job = dict(zip(jobs, results))
    per_seed = [{"seed": seed, "run": by_job[(seed, False)], "control": by_job.get((seed, True))}
                for seed in seeds]
    receipt = build_receipt(args, per_seed, task, time.perf_counter() - start)
    from megatron_longstraw.training.receipts import write_json_atomic

    write_json_atomic(out / "receipt.json", receipt)
    write_png(receipt, out / "reward_curves.png")
    (out / "reward_curves.txt").write_text(text_plot(receipt))
    chance = receipt["chance"]
    print(table(receipt))
    print(text_plot(receipt))
    print(f"chance: {chance['marker']:.3f} (a marker guessed uniformly), "
          f"{chance['uniform_vocab']:.3f} (uniform over the vocabulary), best blind "
          f"{chance['best_blind']:.3f}; wall {receipt['wall_s']:.0f} s")
    check = receipt["criterion"]
    print(f"criterion: {check['rule']}: {'PASSED' if check['passed'] else 'FAILED'}")
    for line in check["failures"]:
        print(f"  {line}")
    print(f"receipt {out / 'receipt.json'}, plot {out / 'reward_curves.png'}")
    return receipt


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
