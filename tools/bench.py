"""LongStraw against conventional GRPO on CPU: same tiny model (GLM-5.2 unless --family), same
weights, same data.

    python tools/bench.py --quick                       # under 5 minutes
    python tools/bench.py --points 4096,8192,16384 --groups 2,8 --cap-gib 4 --json runs/bench/bench.json

Methods (each point (method, P, G) runs in a fresh process: `bench.py --one ...` prints one JSON line):
- longstraw: `forward_backward_longstraw` (capture once, score, serial replay with whole-layer
  checkpointing), the detached prompt gradient;
- longstraw-exact: the same with `prompt_grad = "exact"` (prompt_backward.py: the prompt's layers
  recomputed in reverse, standard GRPO's gradient); the report gives its step time and peak live
  bytes per phase against the detached run at the same P and G;
- conventional: what Megatron-based RL frameworks do today: log-probs of the sampling policy from a
  no-grad forward of each `[prompt; response_i]`, then one forward-backward per member (a
  micro-batch of one sequence, gradients accumulated over the G members) through the plain
  Megatron forward `model(ids[None], None, None)` with full activation recompute of every layer;
  the loss is `grpo.grpo_loss` with only that member's log-probs carrying autograd. Recompute is
  Megatron-Core's own (recompute_granularity=full, method=uniform, num_layers=1) where it runs; on
  CPU its `CheckpointFunction` reads the CUDA RNG state and fails, so the child falls back to
  torch.utils.checkpoint around every HybridStack layer (the same granularity); the report says
  which was used.
  (The whole group in one graph is not offered: with recompute, the attention's implicit full pass
  keeps IndexShare selections in class-level state, so interleaved recomputes of several live
  graphs read another sequence's top-k; one graph at a time, as here, is unaffected.)
- forward: one no-grad plain forward of the prompt alone (`model(prompt[None])`, the LM head
  included): what capture is timed against ("streaming costs no time": the report gives LongStraw's
  capture seconds over it at each P both ran).
Both use the same attention blocks (query 1024, key 4096: the plain forward's defaults). Neither
method runs the optimizer step (the same cost for both). Children run with
OMP_NUM_THREADS=1 and MALLOC_MMAP_THRESHOLD_=1048576 (RSS drift).

Memory: per-process peak RSS (ru_maxrss: weights, pages, activations, allocator slack), the peak
of live saved-tensor bytes (`memory.SavedTensorMeter`: what autograd holds outside checkpoint
frames) and the peak of live tensor bytes from the allocator, per phase for LongStraw
(`memory.LiveBytesMeter`: every allocation, inside checkpoint frames too). The largest P under `--cap-gib` is predicted from measured growth: the peak RSS of the
largest measured P plus a least-squares slope over the points at P >= one key block (below it the
indexer-score scratch still grows), never below the captured page bytes per token (they persist to
the end of the step); the report says how far it extrapolates. (No RLIMIT_AS run: the DSA indexer
is O(P^2) in time on both paths, so P near the cap is out of reach on a CPU.)
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
sys.path.insert(0, str(ROOT))
MiB = 2 ** 20
METHODS = ("longstraw", "longstraw-exact", "conventional", "forward")


# ---- one point (child process) ------------------------------------------------------------------


def _checkpoint_layers(model) -> str:
    """Full activation recompute of every HybridStack layer. Megatron-Core's own recompute
    (recompute_granularity=full, method=uniform, num_layers=1) when it runs here; otherwise
    torch.utils.checkpoint around each layer (the same granularity). Returns which."""
    import functools

    import torch
    from torch.utils.checkpoint import checkpoint

    try:
        ids = torch.zeros(4, dtype=torch.long)
        model(ids[None], None, None)[0].float().sum().backward()
        model.zero_grad(set_to_none=True)
        return "megatron-core recompute (full, uniform, 1 layer)"
    except RuntimeError as exc:
        model.zero_grad(set_to_none=True)
        model.config.recompute_granularity = None
        model.config.recompute_method = None
        model.config.recompute_num_layers = None
        for layer in model.decoder.layers:
            layer.forward = functools.partial(
                lambda fn, *a, **k: checkpoint(fn, *a, use_reentrant=False, **k), layer.forward)
        reason = str(exc).splitlines()[0][:80]
        return f"torch.utils.checkpoint per layer (Megatron recompute failed here: {reason})"


def _conventional(model, group, cfg) -> dict:
    """Per-member log-probs of one plain forward over [prompt; response]; see module docstring."""
    import torch

    from megatron_longstraw.grpo import grpo_loss

    prompt = group.prompt_ids

    def logprobs(response):
        ids = torch.cat([prompt, response])
        logits = model(ids[None], None, None)[0]                       # [S, V]
        logp = torch.log_softmax(logits.float(), dim=-1)
        start = prompt.numel() - 1                                     # scores response[0]
        return logp[start:start + response.numel()].gather(-1, response[:, None]).squeeze(-1)

    timings = {}
    start = time.perf_counter()
    with torch.no_grad():
        olds = [logprobs(r) for r in group.response_ids]
    timings["old_logprobs"] = time.perf_counter() - start
    start = time.perf_counter()
    loss_cfg = cfg.loss_config()
    logps = []
    for i, response in enumerate(group.response_ids):
        logp = logprobs(response)
        # grpo_loss over the group with member i live and the others constant: its gradient is
        # member i's share (1/(G R_i) included); summed over i it is the group gradient.
        members = [logp if j == i else olds[j] for j in range(len(olds))]
        grpo_loss(members, olds, group.rewards, loss_cfg).backward()
        logps.append(logp.detach())
    timings["forward_backward"] = time.perf_counter() - start
    return {"logps": logps, "phase_seconds": timings,
            "loss": float(grpo_loss(logps, olds, group.rewards, loss_cfg)), "page_bytes": 0}


def run_one(args) -> dict:
    import torch

    torch.set_num_threads(1)
    from megatron_longstraw import parallel, platform, precision
    from megatron_longstraw.config import LongStrawConfig
    from megatron_longstraw.data import synthetic_group
    from megatron_longstraw.families import get_family
    from megatron_longstraw.memory import (
        LiveBytesMeter,
        SavedTensorMeter,
        current_rss_bytes,
        peak_rss_bytes,
    )
    from megatron_longstraw.schedule import forward_backward_longstraw

    parallel.initialize(seed=args.seed)
    family = get_family(args.family)
    cfg = family.config_class.from_yaml(args.config)
    platform.manual_seed(args.seed)
    precision.use_dtype(torch.float32)
    model = family.build_model(cfg, params_dtype=torch.float32)
    ls = LongStrawConfig.from_yaml(args.config)
    ls.group_size, ls.max_response_len = args.group_size, args.response_len
    # The blocks of the plain forward's implicit full pass (state.AttentionPass defaults), so both
    # methods hold the same indexer-score scratch.
    ls.query_block, ls.key_block = 1024, 4096
    group = synthetic_group(cfg.vocab_size, args.prompt_len, args.group_size, args.response_len,
                            seed=args.seed)
    # Every response R tokens long (synthetic_group varies them in [R/2, R]): the extra tokens are
    # seeded per member, so the first members of G=8 are the members of G=2, rewards unchanged.
    pad = lambda i, n: torch.randint(0, cfg.vocab_size, (n,),
                                     generator=torch.Generator().manual_seed(args.seed + i))
    group.response_ids = [torch.cat([r, pad(i, args.response_len - r.numel())])
                          for i, r in enumerate(group.response_ids)]
    recompute = "whole-decoder-layer checkpointing in replay (replay.py)"
    if args.method == "longstraw-exact":
        ls.prompt_grad = "exact"
    elif args.method == "conventional":
        model.config.recompute_granularity = "full"
        model.config.recompute_method = "uniform"
        model.config.recompute_num_layers = 1
        recompute = _checkpoint_layers(model)
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    base_rss = current_rss_bytes()
    start = time.perf_counter()
    with SavedTensorMeter(model) as meter, LiveBytesMeter("cpu") as live:
        if args.method == "forward":
            with torch.no_grad():
                model(group.prompt_ids[None], None, None)
            out = {"logps": [], "phase_seconds": {"forward": time.perf_counter() - start},
                   "loss": 0.0, "page_bytes": 0}
        elif args.method.startswith("longstraw"):
            result = forward_backward_longstraw(model, group, ls)
            out = {"logps": result.logps, "phase_seconds": result.phase_seconds,
                   "loss": result.loss, "page_bytes": result.page_bytes}
        else:
            out = _conventional(model, group, ls)
    seconds = time.perf_counter() - start
    grad_norm = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()
                    if p.grad is not None) ** 0.5
    return {
        "method": args.method, "prompt_len": args.prompt_len, "group_size": args.group_size,
        "response_lens": [int(r.numel()) for r in group.response_ids], "recompute": recompute,
        "peak_rss_bytes": peak_rss_bytes(), "base_rss_bytes": base_rss,
        "saved_peak_bytes": meter.peak_bytes, "page_bytes": out["page_bytes"],
        "live_peak_bytes": live.peak_bytes, "live_phase_bytes": live.phase_peaks,
        "step_seconds": seconds, "phase_seconds": out["phase_seconds"], "loss": out["loss"],
        "logps": [lp.double().tolist() for lp in out["logps"]], "grad_norm": grad_norm,
        "capture_blocks": {"token_block": ls.token_block, "query_block": ls.query_block,
                           "key_block": ls.key_block, "capture": ls.capture},
        "param_checksum": checksum, "threads": torch.get_num_threads(),
    }


# ---- the sweep (parent) -------------------------------------------------------------------------


def child_env() -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576", OMP_NUM_THREADS="1",
               TORCHDYNAMO_DISABLE="1", PYTHONWARNINGS="ignore")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def run_point(args, method: str, prompt_len: int, group_size: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", "--method", method,
           "--prompt-len", str(prompt_len), "--group-size", str(group_size),
           "--response-len", str(args.response_len), "--seed", str(args.seed),
           "--family", args.family, "--config", args.config]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                              env=child_env(), cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"method": method, "prompt_len": prompt_len, "group_size": group_size,
                "error": f"timed out after {args.timeout} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH_JSON "):
            return json.loads(line[len("BENCH_JSON "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"method": method, "prompt_len": prompt_len, "group_size": group_size,
            "error": f"exit {proc.returncode}: {' | '.join(tail)}"}


def _fit_line(xs, ys):
    """Least-squares (intercept, slope) of y against x; slope 0 with one point."""
    if len(xs) == 1:
        return ys[0], 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def summarise(results: list[dict], cap_bytes: int, fit_min_prompt: int = 4096) -> dict:
    ok = [r for r in results if "error" not in r]
    by = {(r["method"], r["prompt_len"], r["group_size"]): r for r in ok}
    methods = sorted({r["method"] for r in ok}, key=METHODS.index)
    groups = sorted({r["group_size"] for r in ok})
    summary: dict = {"cap_bytes": cap_bytes, "largest_prompt_under_cap": {},
                     "memory_g_growth": {}, "step_time_ratio": {}, "fidelity": {},
                     "exact_vs_detached": {}, "capture_vs_forward": {}}
    for method in [m for m in methods if m != "forward"]:
        slopes = {}
        for g in groups:
            pts = sorted((p, r["peak_rss_bytes"]) for (m, p, gg), r in by.items()
                         if m == method and gg == g)
            if not pts:
                continue
            # Below one key block the indexer-score scratch still grows with P: fit above it.
            fit = [(p, y) for p, y in pts if p >= fit_min_prompt]
            slope, source = 0.0, "none"
            if len(fit) >= 2:
                slope, source = _fit_line([p for p, _ in fit], [y for _, y in fit])[1], "fit"
            elif slopes:  # one point: memory does not depend on G here (measured), borrow the slope
                slope, source = next(iter(slopes.values())), f"fit at G={next(iter(slopes))}"
            # Pages persist to the end of the step: growth cannot be below their bytes per token
            # (two nearby points under-read it while freed scratch is reused for pages).
            pages = max(by[(method, p, g)]["page_bytes"] / max(p - 1, 1) for p, _ in pts)
            if pages > slope:
                slope, source = pages, "captured page bytes per token (fit below them)"
            if source.startswith("fit") and g not in slopes and len(fit) >= 2:
                slopes[g] = slope
            p_last, y_last = pts[-1]
            predicted = int(p_last + (cap_bytes - y_last) / slope) if slope > 0 else None
            measured_ok = [p for p, y in pts if y <= cap_bytes]
            summary["largest_prompt_under_cap"][f"{method} G={g}"] = {
                "predicted": predicted, "largest_measured_under_cap": max(measured_ok, default=None),
                "bytes_per_prompt_token": slope, "slope_source": source,
                "fit_points": [p for p, _ in fit],
                "extrapolation_factor": (predicted / p_last) if predicted else None}
    for method in methods:
        for p in sorted({p for (m, p, _) in by if m == method}):
            lo, hi = by.get((method, p, min(groups))), by.get((method, p, max(groups)))
            if lo and hi and lo is not hi:
                summary["memory_g_growth"][f"{method} P={p}"] = {
                    "rss_ratio": hi["peak_rss_bytes"] / lo["peak_rss_bytes"],
                    "rss_delta_bytes": hi["peak_rss_bytes"] - lo["peak_rss_bytes"],
                    "saved_ratio": hi["saved_peak_bytes"] / max(lo["saved_peak_bytes"], 1)}
    for (m, p, g), r in by.items():
        conv = by.get(("conventional", p, g))
        if m == "longstraw" and conv:
            summary["step_time_ratio"][f"P={p} G={g}"] = r["step_seconds"] / conv["step_seconds"]
            diff = max(abs(a - b) for x, y in zip(r["logps"], conv["logps"]) for a, b in zip(x, y))
            summary["fidelity"][f"P={p} G={g}"] = {
                "max_abs_logp_diff": diff,
                "same_weights": r["param_checksum"] == conv["param_checksum"],
                # LongStraw's gradient holds the prompt state constant; conventional's does not.
                "grad_norm_rel_diff": abs(r["grad_norm"] - conv["grad_norm"]) / conv["grad_norm"]}
    for (m, p, g), r in by.items():
        detached = by.get(("longstraw", p, g))
        if m == "longstraw-exact" and detached:
            summary["exact_vs_detached"][f"P={p} G={g}"] = {
                "step_time_ratio": r["step_seconds"] / detached["step_seconds"],
                "live_peak_ratio": r["live_peak_bytes"] / max(detached["live_peak_bytes"], 1),
                "live_phase_bytes_exact": r["live_phase_bytes"],
                "live_phase_bytes_detached": detached["live_phase_bytes"]}
    for (m, p, g), r in by.items():
        forward = by.get(("forward", p, g))
        if m == "longstraw" and forward:
            summary["capture_vs_forward"][f"P={p}"] = {
                "capture_seconds": r["phase_seconds"]["capture"],
                "forward_seconds": forward["phase_seconds"]["forward"],
                "ratio": r["phase_seconds"]["capture"] / forward["phase_seconds"]["forward"]}
    lim = summary["largest_prompt_under_cap"]
    for g in groups:
        ls, conv = lim.get(f"longstraw G={g}", {}), lim.get(f"conventional G={g}", {})
        if ls.get("predicted") and conv.get("predicted"):
            summary[f"largest_prompt_ratio_G{g}"] = ls["predicted"] / conv["predicted"]
    return summary


def markdown(results: list[dict], summary: dict) -> str:
    lines = ["| method | P | G | peak RSS (MiB) | RSS growth in step (MiB) | peak saved tensors (MiB) "
             "| peak live tensors (MiB) | pages (MiB) | step (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    order = lambda r: (METHODS.index(r["method"]), r["prompt_len"], r["group_size"])
    for r in sorted(results, key=order):
        if "error" in r:
            lines.append(f"| {r['method']} | {r['prompt_len']} | {r['group_size']} | "
                         f"error: {r['error']} ||||||")
            continue
        growth = (r["peak_rss_bytes"] - r["base_rss_bytes"]) / MiB
        lines.append(
            f"| {r['method']} | {r['prompt_len']} | {r['group_size']} | "
            f"{r['peak_rss_bytes'] / MiB:.1f} | {growth:.1f} | {r['saved_peak_bytes'] / MiB:.2f} "
            f"| {r['live_peak_bytes'] / MiB:.2f} | {r['page_bytes'] / MiB:.2f} "
            f"| {r['step_seconds']:.2f} |")
    recompute = sorted({r["recompute"] for r in results
                        if "recompute" in r and not r["method"].startswith("longstraw")})
    lines += ["", f"Conventional recompute: {'; '.join(recompute) or 'n/a'}.",
              f"Memory cap {summary['cap_bytes'] / MiB:.0f} MiB per process; largest prompt under it "
              "predicted from measured growth (peak RSS at the largest measured P plus a "
              "least-squares slope of peak RSS against P, never below the captured page bytes "
              "per token):", ""]
    for key, v in summary["largest_prompt_under_cap"].items():
        pred = f"{v['predicted']:,}" if v["predicted"] else "n/a (no growth measured)"
        ext = (f", x{v['extrapolation_factor']:.1f} beyond the largest measured P"
               if v["extrapolation_factor"] else "")
        lines.append(f"- {key}: {pred} tokens ({v['bytes_per_prompt_token']:.0f} B per prompt "
                     f"token from {v['slope_source']}{ext})")
    for key in sorted(k for k in summary if k.startswith("largest_prompt_ratio_G")):
        lines.append(f"- largest P ratio LongStraw / conventional at G={key.rsplit('G', 1)[1]}: "
                     f"{summary[key]:.1f}x")
    lines += ["", "Peak memory G=max / G=min:"]
    lines += [f"- {k}: RSS x{v['rss_ratio']:.3f} ({v['rss_delta_bytes'] / MiB:+.1f} MiB), saved tensors "
              f"x{v['saved_ratio']:.2f}" for k, v in summary["memory_g_growth"].items()]
    lines += ["", "Step time LongStraw / conventional at equal P, G (and max |logp difference|, "
              "same weights):"]
    lines += [f"- {k}: {v:.3f} (|dlogp| {summary['fidelity'][k]['max_abs_logp_diff']:.1e}, "
              f"same weights: {summary['fidelity'][k]['same_weights']}; gradient-norm gap of the "
              f"detached prompt state {summary['fidelity'][k]['grad_norm_rel_diff']:.2%})"
              for k, v in summary["step_time_ratio"].items()]
    if summary["exact_vs_detached"]:
        lines += ["", "Exact vs detached prompt gradient at equal P, G: step time ratio, peak live "
                  "tensor bytes ratio, and per phase (MiB, exact / detached; from the step's "
                  "start, pages included):"]
        for key, v in summary["exact_vs_detached"].items():
            ex, de = v["live_phase_bytes_exact"], v["live_phase_bytes_detached"]
            phases = ", ".join(f"{ph} {ex[ph] / MiB:.1f} / {de.get(ph, 0) / MiB:.1f}" for ph in ex)
            lines.append(f"- {key}: time x{v['step_time_ratio']:.2f}, live x"
                         f"{v['live_peak_ratio']:.2f} ({phases})")
    if summary["capture_vs_forward"]:
        lines += ["", "LongStraw's capture (streamed on one process) against one no-grad forward of "
                  "the prompt, same process settings:"]
        lines += [f"- {k}: capture {v['capture_seconds']:.2f} s / forward "
                  f"{v['forward_seconds']:.2f} s = x{v['ratio']:.2f}"
                  for k, v in summary["capture_vs_forward"].items()]
    return "\n".join(lines)


# ---- PNG (matplotlib, the bench extra) -----------------------------------------------------------


_COLORS = {"longstraw": (31, 119, 180), "longstraw-exact": (44, 160, 44),
           "conventional": (214, 39, 40)}


def _series(results):
    series = {}
    for r in results:
        if "error" not in r and r["method"] in _COLORS:
            series.setdefault((r["method"], r["group_size"]), []).append(
                (r["prompt_len"], r["peak_rss_bytes"] / MiB))
    return {k: sorted(v) for k, v in sorted(series.items())}


def write_png(results: list[dict], cap_bytes: int, path: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = _series(results)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (m, g), pts in series.items():
        ax.plot(*zip(*pts), marker="o", linestyle="-" if g == max(k[1] for k in series) else "--",
                color=[c / 255 for c in _COLORS[m]], label=f"{m} G={g}")
    top = max(y for pts in series.values() for _, y in pts)
    if cap_bytes / MiB <= 1.5 * top:
        ax.axhline(cap_bytes / MiB, color="gray", linewidth=1, label="cap")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt length P (tokens)")
    ax.set_ylabel("peak RSS per process (MiB)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"matplotlib {matplotlib.__version__}"


# ---- CLI ----------------------------------------------------------------------------------------


def parse_args(argv=None):
    from megatron_longstraw.families import FAMILIES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(FAMILIES), default="glm52",
                   help="model family (megatron_longstraw/families.py)")
    p.add_argument("--config", default=None,
                   help="model YAML (default: the family's tiny example, examples/<family>/tiny.yaml)")
    p.add_argument("--quick", action="store_true",
                   help="P in {4K, 5K} at G=2, P=4K at G=8, LongStraw also at 12K: under 5 minutes")
    p.add_argument("--points", default=None, help="comma-separated prompt lengths (default 4K..16K)")
    p.add_argument("--longstraw-points", default=None,
                   help="extra prompt lengths for LongStraw alone, at the smallest G (default: "
                        "32K; quick: 12K)")
    p.add_argument("--groups", default="2,8")
    p.add_argument("--response-len", type=int, default=32)
    p.add_argument("--methods", default="longstraw,longstraw-exact,conventional,forward")
    p.add_argument("--large-group-max-prompt", type=int, default=None,
                   help="run groups larger than the smallest only at P up to this")
    p.add_argument("--fit-min-prompt", type=int, default=4096,
                   help="fit memory growth on points from this P (the forward's key block) up")
    p.add_argument("--conventional-max-prompt", type=int, default=None,
                   help="skip conventional points above this P (time: its indexer is O(S^2) per member)")
    p.add_argument("--cap-gib", type=float, default=2.0, help="per-process memory cap (peak RSS)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=float, default=3600.0, help="per point (s)")
    p.add_argument("--jobs", type=int, default=1,
                   help="points run at once (1: step times undisturbed by each other)")
    p.add_argument("--out-dir", default=str(ROOT / "runs" / "bench"))
    p.add_argument("--json", default=None, help="default: <out-dir>/bench.json")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--prompt-len", type=int, help=argparse.SUPPRESS)
    p.add_argument("--group-size", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.config = args.config or str(ROOT / FAMILIES[args.family].tiny_config)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.one:
        import warnings

        warnings.filterwarnings("ignore")
        print("BENCH_JSON " + json.dumps(run_one(args)), flush=True)
        return {}
    default_points = "4096,5120" if args.quick else "4096,8192,16384"
    points = [int(p) for p in (args.points or default_points).split(",")]
    extra = args.longstraw_points if args.longstraw_points is not None else (
        "" if args.points else "12288" if args.quick else "32768")
    extra = [int(p) for p in extra.split(",") if p and int(p) not in points]
    groups = [int(g) for g in args.groups.split(",")]
    if args.quick and args.large_group_max_prompt is None:
        args.large_group_max_prompt = min(points)
    methods = args.methods.split(",")
    cap = int(args.cap_gib * 2 ** 30)
    start = time.perf_counter()
    todo = [(m, p, g) for p in points for m in methods for g in groups
            if (m == "longstraw" or not args.conventional_max_prompt or p <= args.conventional_max_prompt)
            and (g == min(groups) or not args.large_group_max_prompt or p <= args.large_group_max_prompt)]
    todo += [(m, p, min(groups)) for p in extra for m in METHODS[:2] if m in methods]
    if "longstraw" in methods and "forward" in methods:   # capture against a no-grad forward
        todo += [("forward", p, min(groups)) for p in sorted({p for m, p, _ in todo
                                                            if m == "longstraw"})]

    def one(point):
        r = run_point(args, *point)
        status = r.get("error") or (f"peak RSS {r['peak_rss_bytes'] / MiB:.0f} MiB, "
                                    f"{r['step_seconds']:.1f} s")
        print(f"  {point[0]:>20} P={point[1]:>7} G={point[2]}: {status}", flush=True)
        return r

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(one, todo))
    summary = summarise(results, cap, args.fit_min_prompt)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / "bench_memory.png"
    summary["plot"] = {"path": str(png), "writer": write_png(results, cap, png)}
    summary["wall_seconds"] = time.perf_counter() - start
    table = markdown(results, summary) + f"\n\nPlot: {png} ({summary['plot']['writer']}).\n"
    (out_dir / "bench.md").write_text(table)
    payload = {"results": results, "summary": summary,
               "settings": {"points": points, "longstraw_points": extra, "groups": groups,
                            "methods": methods,
                            "response_len": args.response_len, "family": args.family,
                            "config": args.config,
                            "cap_bytes": cap, "child_env": {"OMP_NUM_THREADS": "1",
                                                            "MALLOC_MMAP_THRESHOLD_": "1048576"},
                            "cap_method": "predicted from measured growth (see module docstring)"}}
    json_path = Path(args.json) if args.json else out_dir / "bench.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    print(table)
    return payload


if __name__ == "__main__":
    main()
