"""LongStraw against conventional GRPO on CPU: same tiny model (GLM-5.2 unless --family), same
weights, same data.

    python tools/bench.py --sweep --cap-gib 2.5 --timing-repeats 3   # `make bench`: measured largest-P table
    python tools/bench.py --response-sweep --cap-gib 1.25 --timing-repeats 3   # and the largest-R table
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
(`memory.LiveBytesMeter`: every allocation, inside checkpoint frames too; on CPU host buffers
such as the pages and the residual stream included).

The measured largest-P table (`--sweep`, what `make bench` runs; model examples/glm52/bench.yaml,
GLM-5.2's width ratios): LongStraw at every `--sweep-points` P (default 4K..128K, doubling),
conventional GRPO at the same P in growing order until the first point over `--cap-gib`, and the
no-grad forward at `--forward-points` (default 4K and 32K) for capture / forward. A point fits if it
ran to the end with peak RSS (ru_maxrss) <= the cap; a watchdog here reads each child's RSS every
0.05 s and kills it the first time it is above the cap (recorded as `exceeded_cap`, with the RSS
seen), so no run grows past the cap by more than what it allocates in 0.05 s. Every number in that
table is a run. Capture / forward: wall seconds of capture (the step's `capture` phase) over those
of the forward, and the same for the child's CPU seconds (user + sys, one thread: what other load on
the machine moves least); `--timing-repeats N` adds pairs at the end and reports the median.
Output: runs/bench/bench-sweep.{json,md} (the JSON rewritten after every point);
`--from-json a.json,b.json` renders the table again from saved runs (b's points replace a's; b's
cap), `--timing-json c.json` adds c's capture / forward pairs as repeats.

The measured largest-R table (`--response-sweep`, also in `make bench`; the same model): at P =
`--response-sweep-prompt` (4096) and G = 2, every response R tokens, LongStraw with
`response_block` = `--response-block` (default 2048: a response longer than it is scored and
replayed block by block, training/replay.py) and conventional at growing R (`--response-points`),
each until its first point over `--cap-gib` (the same watchdog). These capacity runs have no
live-bytes meter (its record of allocation events grows with the step's allocations and with it
the RSS, more for LongStraw's many block-sized ones: at R = 8K, 1,403 against 946 MiB); at every R
where LongStraw fitted it runs again with the meter, uncapped, host storage left out
(`exclude_host`: what a device would hold), for its live bytes per phase. Then blockwise replay
(`response_block` R / 4, four blocks) against the whole branch (`response_block` R) at
`--replay-timing-points`, `--timing-repeats` pairs run back to back, no meter: the replay phase's
seconds and the median of the pairs' ratios (goal: within x1.3). Output:
runs/bench/bench-response.{json,md}.

Prediction (the other modes, not the sweep): the largest P under `--cap-gib` is *predicted* from
measured growth: the peak RSS of the largest measured P plus a least-squares slope over the points
at P >= one key block (below it the indexer-score scratch still grows), never below the captured
page bytes per token (they persist to the end of the step); the report labels it a prediction and
says how far it extrapolates.
"""

from __future__ import annotations

import argparse
import contextlib
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

    from megatron_longstraw.grpo.loss import grpo_loss

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
    from megatron_longstraw.distributed import parallel
    from megatron_longstraw.runtime import platform, precision
    from megatron_longstraw.config.settings import LongStrawConfig
    from megatron_longstraw.state.attention_pass import PromptGrad
    from megatron_longstraw.data.groups import synthetic_group
    from megatron_longstraw.models.registry import get_family
    from megatron_longstraw.runtime.memory import (
        LiveBytesMeter,
        SavedTensorMeter,
        current_rss_bytes,
        peak_rss_bytes,
    )
    from megatron_longstraw.training.schedule import forward_backward_longstraw

    parallel.initialize(seed=args.seed)
    family = get_family(args.family)
    cfg = family.config_class.from_yaml(args.config)
    platform.manual_seed(args.seed)
    precision.use_dtype(torch.float32)
    model = family.build_model(cfg, params_dtype=torch.float32)
    ls = LongStrawConfig.from_yaml(args.config)
    ls.group_size, ls.max_response_len = args.group_size, args.response_len
    if args.response_block:
        ls.response_block = args.response_block
    ls.reuse_branch_pages = args.reuse_branch_pages
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
        ls.prompt_grad = PromptGrad.EXACT
    elif args.method == "conventional":
        model.config.recompute_granularity = "full"
        model.config.recompute_method = "uniform"
        model.config.recompute_num_layers = 1
        recompute = _checkpoint_layers(model)
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    base_rss = current_rss_bytes()
    start = time.perf_counter()
    # This process's CPU seconds (user + sys; one thread) of the forward and of capture, next to
    # their wall seconds: the ratio that other load on the machine does not move.
    cpu_seconds: dict[str, float] = {}
    live_meter = contextlib.nullcontext() if args.no_live_meter else LiveBytesMeter(
        "cpu", exclude_host=args.live_exclude_host)
    with SavedTensorMeter(model) as meter, live_meter as live:
        if args.method == "forward":
            cpu = time.process_time()
            with torch.no_grad():
                model(group.prompt_ids[None], None, None)
            cpu_seconds["forward"] = time.process_time() - cpu
            out = {"logps": [], "phase_seconds": {"forward": time.perf_counter() - start},
                   "loss": 0.0, "page_bytes": 0}
        elif args.method.startswith("longstraw"):
            from megatron_longstraw.training import schedule

            def timed_capture(*a, _capture=schedule.capture_prompt, **k):
                cpu = time.process_time()
                try:
                    return _capture(*a, **k)
                finally:
                    cpu_seconds["capture"] = time.process_time() - cpu

            schedule.capture_prompt = timed_capture
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
        "response_len": args.response_len,
        "response_lens": [int(r.numel()) for r in group.response_ids], "recompute": recompute,
        "peak_rss_bytes": peak_rss_bytes(), "base_rss_bytes": base_rss,
        "saved_peak_bytes": meter.peak_bytes, "page_bytes": out["page_bytes"],
        "live_peak_bytes": None if live is None else live.peak_bytes,
        "live_phase_bytes": None if live is None else live.phase_peaks,
        "live_excludes_host": bool(args.live_exclude_host),
        "live_host_peak_bytes": None if live is None else live.host_peak_bytes,
        "step_seconds": seconds, "phase_seconds": out["phase_seconds"], "loss": out["loss"],
        "cpu_seconds": cpu_seconds,
        "logps": [lp.double().tolist() for lp in out["logps"]], "grad_norm": grad_norm,
        "capture_blocks": {"token_block": ls.token_block, "query_block": ls.query_block,
                           "key_block": ls.key_block, "capture": ls.capture},
        "response_block": ls.response_block,
        "param_checksum": checksum, "threads": torch.get_num_threads(),
    }


# ---- the sweep (parent) -------------------------------------------------------------------------


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
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", "--method", method,
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
              "PREDICTED, not measured (the measured table is --sweep / make bench), from measured growth (peak RSS at the largest measured P plus a "
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


# ---- the measured largest-P sweep (--sweep, `make bench`) ---------------------------------------


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


def summarise_sweep(results: list[dict], cap_bytes: int, points, forward_points,
                    limit: float = 1.05) -> dict:
    """The measured largest-P table: per P, LongStraw's and conventional's runs side by side; per
    method the largest measured P that fits the cap and the first P over it; capture over a no-grad
    forward at `forward_points`. Every figure is from a run (no extrapolation)."""
    # Rows: each point's first run; timing repeats (`repeat` >= 1) only enter capture / forward.
    by = {(r["method"], r["prompt_len"]): r for r in results if not r.get("repeat")}
    summary: dict = {"cap_bytes": cap_bytes, "points": sorted(points), "rows": [],
                     "largest_measured_under_cap": {}, "first_over_cap": {},
                     "capture_vs_forward": {}, "capture_vs_forward_limit": limit}
    for p in sorted(points):
        row = {"prompt_len": p}
        for method in ("longstraw", "conventional"):
            r = by.get((method, p))
            if r is None:
                row[method] = {"status": "not run"}
            elif exceeds_cap(r, cap_bytes):
                row[method] = {"status": "exceeds cap",
                               "rss_bytes": r.get("killed_at_rss_bytes", r.get("peak_rss_bytes"))}
            elif "error" in r:
                row[method] = {"status": "error", "error": r["error"]}
            else:
                row[method] = {"status": "fits", "peak_rss_bytes": r["peak_rss_bytes"],
                               "live_peak_bytes": r["live_peak_bytes"],
                               "page_bytes": r["page_bytes"], "step_seconds": r["step_seconds"],
                               "capture_seconds": r["phase_seconds"].get("capture")}
        summary["rows"].append(row)
    for method in ("longstraw", "conventional"):
        runs = [r for (m, _), r in by.items() if m == method]
        summary["largest_measured_under_cap"][method] = max(
            (r["prompt_len"] for r in runs if fits_cap(r, cap_bytes)), default=None)
        summary["first_over_cap"][method] = min(
            (r["prompt_len"] for r in runs if exceeds_cap(r, cap_bytes)), default=None)
    ls, conv = (summary["largest_measured_under_cap"][m] for m in ("longstraw", "conventional"))
    summary["largest_measured_ratio"] = ls / conv if ls and conv else None
    for p in sorted(forward_points):
        # Pairs of runs at P: the forward and LongStraw of the same repeat (0: the table's runs).
        runs = {(r["method"], r.get("repeat", 0)): r for r in results if r["prompt_len"] == p
                and r["method"] in ("longstraw", "forward") and "error" not in r}
        pairs = [(runs[("longstraw", k)], runs[("forward", k)]) for m, k in sorted(runs)
                 if m == "forward" and ("longstraw", k) in runs]
        if not pairs:
            summary["capture_vs_forward"][f"P={p}"] = {"error": "longstraw or forward missing"}
            continue
        wall = [r["phase_seconds"]["capture"] / fw["phase_seconds"]["forward"] for r, fw in pairs]
        cpu_pairs = [(r["cpu_seconds"]["capture"], fw["cpu_seconds"]["forward"]) for r, fw in pairs
                     if r.get("cpu_seconds", {}).get("capture")
                     and fw.get("cpu_seconds", {}).get("forward")]
        cpu = [c / f for c, f in cpu_pairs]
        median = lambda xs: sorted(xs)[(len(xs) - 1) // 2] if len(xs) % 2 else (
            sorted(xs)[len(xs) // 2 - 1] + sorted(xs)[len(xs) // 2]) / 2
        r, fw = pairs[0]
        entry = summary["capture_vs_forward"][f"P={p}"] = {
            "capture_seconds": r["phase_seconds"]["capture"],
            "forward_seconds": fw["phase_seconds"]["forward"],
            "pairs": len(pairs), "ratios": wall, "ratio": median(wall),
            "within_limit": median(wall) <= limit}
        if cpu:   # the pairs whose children reported CPU seconds
            entry.update({"capture_cpu_seconds": cpu_pairs[0][0],
                          "forward_cpu_seconds": cpu_pairs[0][1], "cpu_pairs": len(cpu),
                          "cpu_ratios": cpu, "cpu_ratio": median(cpu),
                          "cpu_within_limit": median(cpu) <= limit})
    return summary


def _mib(b) -> str:
    return f"{b / MiB:,.0f}"


def markdown_sweep(summary: dict, settings: dict) -> str:
    cap = summary["cap_bytes"]
    lines = [f"Measured (every cell is a run; no extrapolation). Model {settings['config']}, "
             f"G = {settings['group_size']}, responses {settings['response_len']} tokens, one process, "
             f"one thread. Cap: peak RSS <= {cap / 2 ** 30:g} GiB ({_mib(cap)} MiB) per process, "
             "enforced by a watchdog that kills a child above it.", "",
             "| P | LongStraw peak RSS (MiB) | LongStraw live tensors (MiB) | pages (MiB) "
             "| LongStraw step (s) | capture (s) | conventional peak RSS (MiB) "
             "| conventional live tensors (MiB) | conventional step (s) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in summary["rows"]:
        cells = [f"{row['prompt_len']:,}"]
        ls, conv = row["longstraw"], row["conventional"]
        if ls["status"] == "fits":
            cells += [_mib(ls["peak_rss_bytes"]), _mib(ls["live_peak_bytes"]),
                      f"{ls['page_bytes'] / MiB:,.1f}", f"{ls['step_seconds']:.1f}",
                      f"{ls['capture_seconds']:.1f}"]
        elif ls["status"] == "exceeds cap":
            cells += [f"exceeds cap ({_mib(ls['rss_bytes'])})", "", "", "", ""]
        else:
            cells += [f"error ({ls.get('error', ls['status']).split(':')[0]})", "", "", "", ""]
        if conv["status"] == "fits":
            cells += [_mib(conv["peak_rss_bytes"]), _mib(conv["live_peak_bytes"]),
                      f"{conv['step_seconds']:.1f}"]
        elif conv["status"] == "exceeds cap":
            cells += [f"**exceeds cap** (killed at {_mib(conv['rss_bytes'])})", "", ""]
        elif conv["status"] == "not run":
            first = summary["first_over_cap"]["conventional"]
            cells += [f"not run (over the cap at P = {first:,})" if first else "not run", "", ""]
        else:
            cells += [f"error ({conv.get('error', conv['status']).split(':')[0]})", "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    lim = summary["largest_measured_under_cap"]
    fmt = lambda v: f"{v:,}" if v else "none"
    lines += ["", f"Largest measured P under the cap: LongStraw {fmt(lim['longstraw'])}, "
              f"conventional GRPO {fmt(lim['conventional'])}"
              + (f" (x{summary['largest_measured_ratio']:g})" if summary["largest_measured_ratio"]
                 else "") + "; conventional first over the cap at P = "
              + fmt(summary["first_over_cap"]["conventional"]) + ".", "",
              f"Capture (streamed) against one no-grad forward of the prompt (limit "
              f"x{summary['capture_vs_forward_limit']}):"]
    for key, v in summary["capture_vs_forward"].items():
        if "error" in v:
            lines.append(f"- {key}: {v['error']}")
        else:
            several = v["pairs"] > 1
            line = (f"- {key}: wall: capture {v['capture_seconds']:.2f} s / forward "
                    f"{v['forward_seconds']:.2f} s = x{v['ratios'][0]:.3f}"
                    + (f"; median of {v['pairs']} pairs x{v['ratio']:.3f} (pairs: "
                       + ", ".join(f"{x:.3f}" for x in v["ratios"]) + ")" if several else "")
                    + f" ({'within' if v['within_limit'] else 'NOT within'} "
                    f"x{summary['capture_vs_forward_limit']})")
            if "cpu_ratio" in v:
                line += (f"; CPU time: {v['capture_cpu_seconds']:.2f} s / "
                         f"{v['forward_cpu_seconds']:.2f} s = x{v['cpu_ratios'][0]:.3f}"
                         + (f", median of {v['cpu_pairs']} x{v['cpu_ratio']:.3f} (pairs: "
                            + ", ".join(f"{x:.3f}" for x in v["cpu_ratios"]) + ")"
                            if v["cpu_pairs"] > 1 else "")
                         + f" ({'within' if v['cpu_within_limit'] else 'NOT within'})")
            lines.append(line)
    return "\n".join(lines)


def run_sweep(args) -> dict:
    """LongStraw at every P; conventional at growing P until the first point over the cap; the
    no-grad forward at `--forward-points`. Points run one at a time (undisturbed timings); the JSON
    is rewritten after each point, so an interrupted sweep keeps what it measured."""
    points = [int(p) for p in args.sweep_points.split(",")]
    forward_points = [int(p) for p in args.forward_points.split(",") if p]
    group = int(args.groups.split(",")[0])
    cap = int(args.cap_gib * 2 ** 30)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = Path(args.json) if args.json else out_dir / "bench-sweep.json"
    settings = {"points": points, "forward_points": forward_points, "group_size": group,
                "timing_repeats": args.timing_repeats, "sweep_methods": args.sweep_methods,
                "response_len": args.response_len, "family": args.family,
                "config": os.path.relpath(args.config, ROOT), "cap_bytes": cap,
                "cap_method": "watchdog: child killed when its RSS (read every 0.05 s) is above the "
                              "cap; a finished point fits if its ru_maxrss <= cap",
                "child_env": {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "1048576"}}
    results: list[dict] = []
    start = time.perf_counter()

    def one(method, p, repeat=0):
        # The forward is the timing reference for capture, not a row of the capacity table: no cap.
        r = run_point(args, method, p, group, kill_above=None if method == "forward" else cap)
        if repeat:
            r["repeat"] = repeat
        status = r.get("error") or (f"peak RSS {r['peak_rss_bytes'] / MiB:.0f} MiB, "
                                    f"{r['step_seconds']:.1f} s")
        print(f"  {method:>13} P={p:>7} G={group}{f' (repeat {repeat})' if repeat else ''}: "
              f"{status}", flush=True)
        results.append(r)
        json_path.write_text(json.dumps({"results": results, "settings": settings,
                                         "partial": True}, indent=2) + "\n")
        return r

    methods = args.sweep_methods.split(",")
    conventional_stopped = "conventional" not in methods
    for p in sorted(set(points) | set(forward_points)):
        if p in forward_points:
            one("forward", p)
        if "longstraw" in methods and (p in points or p in forward_points):
            one("longstraw", p)
        if p in points and not conventional_stopped:
            r = one("conventional", p)
            conventional_stopped = exceeds_cap(r, cap) or "error" in r
    for repeat in range(1, args.timing_repeats):      # more capture / forward pairs, at the end
        for p in sorted(forward_points):
            one("forward", p, repeat)
            one("longstraw", p, repeat)
    summary = summarise_sweep(results, cap, points, forward_points)
    summary["wall_seconds"] = time.perf_counter() - start
    table = markdown_sweep(summary, settings) + f"\n\nWall time {summary['wall_seconds'] / 60:.1f} min.\n"
    (out_dir / "bench-sweep.md").write_text(table)
    payload = {"results": results, "summary": summary, "settings": settings}
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    print(table)
    return payload


def render_sweep(args) -> dict:
    """The sweep's summary and table from saved JSONs (`--from-json`), no runs."""
    by, settings, walls = {}, None, []
    for path in args.from_json.split(","):
        data = json.loads(Path(path).read_text())
        if settings is None:
            settings = dict(data["settings"])
        else:   # the last file's cap; the union of the points
            settings["cap_bytes"] = data["settings"]["cap_bytes"]
            settings["points"] = sorted(set(settings["points"]) | set(data["settings"]["points"]))
        walls.append(data.get("summary", {}).get("wall_seconds"))
        for r in data["results"]:   # a later file's point replaces an earlier one's
            by[(r["method"], r["prompt_len"], r.get("repeat", 0))] = {**r, "source": path}
    results = list(by.values())
    for path in (args.timing_json or "").split(","):
        if not path:
            continue
        for r in json.loads(Path(path).read_text())["results"]:
            if r["method"] in ("forward", "longstraw") and r["prompt_len"] in settings["forward_points"]:
                # Another run's capture / forward pairs: further timing repeats, in their order.
                taken = [x.get("repeat", 0) for x in results
                         if (x["method"], x["prompt_len"]) == (r["method"], r["prompt_len"])]
                results.append({**r, "repeat": max(taken, default=-1) + 1, "source": path})
    summary = summarise_sweep(results, settings["cap_bytes"], settings["points"],
                              settings["forward_points"])
    table = markdown_sweep(summary, settings) + "\n\nFrom " + args.from_json + (
        f" (capture / forward pairs also from {args.timing_json})" if args.timing_json else "") + (
        "; wall time " + ", ".join(f"{w / 60:.1f} min" for w in walls if w) if any(walls) else "")
    out = Path(args.out_dir) / "bench-sweep-merged.md"
    out.write_text(table + "\n")
    print(table)
    return {"results": results, "summary": summary, "settings": settings}


# ---- the measured largest-R sweep (--response-sweep, `make bench`) ------------------------------


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def _response_row(r: dict | None, cap_bytes: int) -> dict:
    if r is None:
        return {"status": "not run"}
    if exceeds_cap(r, cap_bytes):
        return {"status": "exceeds cap",
                "rss_bytes": r.get("killed_at_rss_bytes", r.get("peak_rss_bytes"))}
    if "error" in r:
        return {"status": "error", "error": r["error"]}
    return {"status": "fits", "peak_rss_bytes": r["peak_rss_bytes"],
            "step_seconds": r["step_seconds"], "phase_seconds": r["phase_seconds"]}


def summarise_response_sweep(results: list[dict], cap_bytes: int, points, timing_points) -> dict:
    """The measured largest-R table and blockwise against whole-branch replay time.

    `results` holds runs tagged by `role`: "capacity" (one per method and R, no live-bytes meter,
    under the watchdog cap: peak RSS and step seconds), "live" (LongStraw again at an R whose
    capacity run fitted, with the meter: device live bytes per phase, host storage left out) and
    "timing" (LongStraw, `variant` "blockwise" or "whole", `repeat` k; the pair of repeat k at one
    R runs back to back). Every figure is from a run (no extrapolation)."""
    cap = {(r["method"], r["response_len"]): r for r in results if r.get("role") == "capacity"}
    live = {r["response_len"]: r for r in results if r.get("role") == "live" and "error" not in r}
    summary: dict = {"cap_bytes": cap_bytes, "points": sorted(points), "rows": [],
                     "largest_measured_under_cap": {}, "first_over_cap": {}, "replay_time": {}}
    for R in sorted(points):
        row = {"response_len": R}
        for method in ("longstraw", "conventional"):
            row[method] = _response_row(cap.get((method, R)), cap_bytes)
        if row["longstraw"]["status"] == "fits" and R in live:
            row["longstraw"]["live_phase_bytes"] = live[R]["live_phase_bytes"]
            row["longstraw"]["live_host_peak_bytes"] = live[R].get("live_host_peak_bytes")
        summary["rows"].append(row)
    for method in ("longstraw", "conventional"):
        runs = [r for (m, _), r in cap.items() if m == method]
        summary["largest_measured_under_cap"][method] = max(
            (r["response_len"] for r in runs if fits_cap(r, cap_bytes)), default=None)
        summary["first_over_cap"][method] = min(
            (r["response_len"] for r in runs if exceeds_cap(r, cap_bytes)), default=None)
    ls, conv = (summary["largest_measured_under_cap"][m] for m in ("longstraw", "conventional"))
    summary["largest_measured_ratio"] = ls / conv if ls and conv else None
    # A method that fitted at every R it ran has a limit above the largest R tried: its largest
    # measured R is a lower bound (and so is the ratio, when it is LongStraw's).
    summary["limit_above_points"] = {m: summary["first_over_cap"][m] is None
                                     and summary["largest_measured_under_cap"][m] == max(points)
                                     for m in ("longstraw", "conventional")}
    for R in sorted(timing_points):
        runs = {(r["variant"], r.get("repeat", 0)): r for r in results
                if r.get("role") == "timing" and r["response_len"] == R and "error" not in r}
        pairs = [(runs[("blockwise", k)], runs[("whole", k)]) for v, k in sorted(runs)
                 if v == "whole" and ("blockwise", k) in runs]
        if not pairs:
            summary["replay_time"][f"R={R}"] = {"error": "blockwise or whole-branch run missing"}
            continue
        block = [b["phase_seconds"]["replay"] for b, _ in pairs]
        whole = [w["phase_seconds"]["replay"] for _, w in pairs]
        ratios = [b / w for b, w in zip(block, whole)]
        summary["replay_time"][f"R={R}"] = {
            "response_len": R, "blockwise_block": pairs[0][0]["response_block"],
            "whole_block": pairs[0][1]["response_block"], "pairs": len(pairs),
            "blockwise_replay_seconds": block, "whole_replay_seconds": whole,
            "blockwise_median": _median(block), "whole_median": _median(whole),
            "ratios": ratios, "ratio": _median(ratios), "within_goal": _median(ratios) <= 1.3}
        reuse = [(runs[("reuse", k)], runs[("whole", k)]) for v, k in sorted(runs)
                 if v == "whole" and ("reuse", k) in runs]
        if reuse:      # blockwise with reuse_branch_pages: replay over scoring's pages
            ratios = [r["phase_seconds"]["replay"] / w["phase_seconds"]["replay"]
                      for r, w in reuse]
            summary["replay_time"][f"R={R}"].update(
                reuse_replay_seconds=[r["phase_seconds"]["replay"] for r, _ in reuse],
                reuse_ratios=ratios, reuse_ratio=_median(ratios),
                reuse_within_goal=_median(ratios) <= 1.3)
    return summary


def markdown_response_sweep(summary: dict, settings: dict) -> str:
    cap = summary["cap_bytes"]
    phases = ("capture", "scoring", "replay")
    lines = [f"Measured (every cell is a run; no extrapolation). Model {settings['config']}, "
             f"P = {settings['prompt_len']:,}, G = {settings['group_size']}, every response R "
             f"tokens; LongStraw with response_block {settings['response_block']:,} (blockwise "
             "scoring and replay); conventional: plain Megatron forward-backward of "
             "[prompt; response] per member, full layer recompute. One process, one thread. Cap: "
             f"peak RSS <= {cap / 2 ** 30:g} GiB ({_mib(cap)} MiB) per process, enforced by a "
             "watchdog that kills a child above it; the capacity runs have no live-bytes meter "
             "(its event record adds RSS); LongStraw's live bytes are from a second run at the "
             "same R with the meter, host storage (pages, residual stream) left out: what a "
             "device would hold.", "",
             "| R | LongStraw peak RSS (MiB) | LongStraw step (s) | scoring (s) | replay (s) "
             "| live capture / scoring / replay (MiB) | host peak (MiB) "
             "| conventional peak RSS (MiB) | conventional step (s) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in summary["rows"]:
        cells = [f"{row['response_len']:,}"]
        ls, conv = row["longstraw"], row["conventional"]
        if ls["status"] == "fits":
            ph = ls["phase_seconds"]
            live = ls.get("live_phase_bytes")
            host = ls.get("live_host_peak_bytes")
            cells += [_mib(ls["peak_rss_bytes"]), f"{ls['step_seconds']:.1f}",
                      f"{ph.get('scoring', 0):.1f}", f"{ph.get('replay', 0):.1f}",
                      " / ".join(f"{live.get(p, 0) / MiB:,.1f}" for p in phases) if live
                      else "not measured",
                      f"{host / MiB:,.1f}" if host is not None and live else ""]
        elif ls["status"] == "exceeds cap":
            cells += [f"**exceeds cap** (killed at {_mib(ls['rss_bytes'])})", "", "", "", "", ""]
        elif ls["status"] == "not run":
            first = summary["first_over_cap"]["longstraw"]
            cells += [f"not run (over the cap at R = {first:,})" if first else "not run",
                      "", "", "", "", ""]
        else:
            cells += [f"error ({ls['error'].split(':')[0]})", "", "", "", "", ""]
        if conv["status"] == "fits":
            cells += [_mib(conv["peak_rss_bytes"]), f"{conv['step_seconds']:.1f}"]
        elif conv["status"] == "exceeds cap":
            cells += [f"**exceeds cap** (killed at {_mib(conv['rss_bytes'])})", ""]
        elif conv["status"] == "not run":
            first = summary["first_over_cap"]["conventional"]
            cells += [f"not run (over the cap at R = {first:,})" if first else "not run", ""]
        else:
            cells += [f"error ({conv['error'].split(':')[0]})", ""]
        lines.append("| " + " | ".join(cells) + " |")
    lim, first = summary["largest_measured_under_cap"], summary["first_over_cap"]
    above = summary["limit_above_points"]
    fmt = lambda v: f"{v:,}" if v else "none"
    over = lambda m: (f"not reached (it fitted at every R run, up to {max(summary['points']):,}: "
                      "its limit under this cap is above that)" if above[m]
                      else f"R = {fmt(first[m])}")
    ratio = summary["largest_measured_ratio"]
    lines += ["", f"Largest measured R under the cap: LongStraw {fmt(lim['longstraw'])}, "
              f"conventional {fmt(lim['conventional'])}"
              + (f" ({'at least ' if above['longstraw'] else ''}x{ratio:g})" if ratio else "")
              + f"; first over the cap: LongStraw {over('longstraw')}, "
              f"conventional {over('conventional')}."]
    if summary["replay_time"]:
        lines += ["", "Replay phase seconds, blockwise against whole-branch at equal R (same P, G, "
                  "data and weights; no live-bytes meter; pairs run back to back; goal: blockwise "
                  "within x1.3 of whole-branch):"]
        for key, v in summary["replay_time"].items():
            if "error" in v:
                lines.append(f"- {key}: {v['error']}")
                continue
            lines.append(
                f"- {key}: blockwise (response_block {v['blockwise_block']:,}, "
                f"{-(-v['response_len'] // v['blockwise_block'])} blocks) median "
                f"{v['blockwise_median']:.2f} s, whole branch (response_block "
                f"{v['whole_block']:,}) median {v['whole_median']:.2f} s; ratio median of "
                f"{v['pairs']} pair{'s' if v['pairs'] > 1 else ''} x{v['ratio']:.3f} (pairs: "
                + ", ".join(f"{x:.3f}" for x in v["ratios"]) + ") "
                + ("within x1.3" if v["within_goal"] else "NOT within x1.3")
                + ("" if "reuse_ratio" not in v else
                   f"; with --longstraw-reuse-branch-pages (replay over scoring's pages) "
                   f"x{v['reuse_ratio']:.3f} (pairs: "
                   + ", ".join(f"{x:.3f}" for x in v["reuse_ratios"]) + ") "
                   + ("within x1.3" if v["reuse_within_goal"] else "NOT within x1.3")))
    return "\n".join(lines)


def run_response_sweep(args) -> dict:
    """LongStraw (blockwise, `--response-block`) and conventional at growing R, each until its
    first point over the cap; LongStraw again with the live-bytes meter at each R that fitted; then
    blockwise against whole-branch replay at `--replay-timing-points`, `--timing-repeats` pairs.
    One point at a time; the JSON is rewritten after each."""
    points = sorted(int(r) for r in args.response_points.split(","))
    timing_points = [int(r) for r in args.replay_timing_points.split(",") if r]
    group, prompt_len = int(args.groups.split(",")[0]), args.response_sweep_prompt
    cap = int(args.cap_gib * 2 ** 30)
    block = args.response_block or 2048
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = Path(args.json) if args.json else out_dir / "bench-response.json"
    settings = {"points": points, "timing_points": timing_points, "prompt_len": prompt_len,
                "group_size": group, "response_block": block, "timing_repeats": args.timing_repeats,
                "methods": args.sweep_methods,
                "family": args.family, "config": os.path.relpath(args.config, ROOT),
                "cap_bytes": cap,
                "cap_method": "watchdog: child killed when its RSS (read every 0.05 s) is above the "
                              "cap; a finished point fits if its ru_maxrss <= cap; capacity runs "
                              "without the live-bytes meter",
                "child_env": {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "1048576"}}
    results: list[dict] = []
    start = time.perf_counter()

    def one(method, R, role, block_=block, kill=True, meter=False, extra=(), **tags):
        flags = (("--live-exclude-host",) if meter else ("--no-live-meter",)) + tuple(extra)
        r = run_point(args, method, prompt_len, group, kill_above=cap if kill else None,
                      response_len=R, response_block=block_ if method != "conventional" else None,
                      child_flags=flags)
        r.update(role=role, response_len=R, **tags)
        status = r.get("error") or (f"peak RSS {r['peak_rss_bytes'] / MiB:.0f} MiB, "
                                    f"{r['step_seconds']:.1f} s" + (
                                        f", replay {r['phase_seconds']['replay']:.1f} s"
                                        if "replay" in r["phase_seconds"] else ""))
        label = f"{method} {role} {tags.get('variant', '')}".strip()
        shown_block = "-" if method == "conventional" else block_
        repeat = f" (repeat {tags['repeat']})" if tags.get("repeat") else ""
        print(f"  {label:>27} R={R:>7} block={shown_block}{repeat}: {status}", flush=True)
        results.append(r)
        json_path.write_text(json.dumps({"results": results, "settings": settings,
                                         "partial": True}, indent=2) + "\n")
        return r

    for method in [m for m in ("longstraw", "conventional") if m in args.sweep_methods.split(",")]:
        for r in sweep_until_over(points, lambda R: one(method, R, "capacity"), cap):
            if method == "longstraw" and fits_cap(r, cap):
                # The meter's record inflates RSS: no cap on this run, its RSS is not the table's.
                one(method, r["response_len"], "live", kill=False, meter=True)
    for repeat in range(max(1, args.timing_repeats)):
        for R in timing_points:
            one("longstraw", R, "timing", block_=R, kill=False, variant="whole", repeat=repeat)
            one("longstraw", R, "timing", block_=max(1, R // 4), kill=False, variant="blockwise",
                repeat=repeat)
            one("longstraw", R, "timing", block_=max(1, R // 4), kill=False, variant="reuse",
                repeat=repeat, extra=("--reuse-branch-pages",))
    summary = summarise_response_sweep(results, cap, points, timing_points)
    summary["wall_seconds"] = time.perf_counter() - start
    table = (markdown_response_sweep(summary, settings)
             + f"\n\nWall time {summary['wall_seconds'] / 60:.1f} min.\n")
    (out_dir / "bench-response.md").write_text(table)
    json_path.write_text(json.dumps({"results": results, "summary": summary, "settings": settings},
                                    indent=2) + "\n")
    print(table)
    return {"results": results, "summary": summary, "settings": settings}


def render_response_sweep(args) -> dict:
    """The largest-R table again from saved `--response-sweep` JSONs (`--response-sweep
    --from-json a.json,b.json`), no runs: the union of their points; a later file's run replaces an
    earlier one's of the same method, role, R, variant and repeat; the last file's cap."""
    by, settings, walls = {}, None, []
    for path in args.from_json.split(","):
        data = json.loads(Path(path).read_text())
        if settings is None:
            settings = dict(data["settings"])
        else:
            settings["cap_bytes"] = data["settings"]["cap_bytes"]
            for key in ("points", "timing_points"):
                settings[key] = sorted(set(settings[key]) | set(data["settings"][key]))
        walls.append(data.get("summary", {}).get("wall_seconds"))
        for r in data["results"]:
            key = (r["method"], r["role"], r["response_len"], r.get("variant"), r.get("repeat", 0))
            by[key] = {**r, "source": path}
    results = list(by.values())
    summary = summarise_response_sweep(results, settings["cap_bytes"], settings["points"],
                                       settings["timing_points"])
    table = markdown_response_sweep(summary, settings) + "\n\nFrom " + args.from_json + (
        "; wall time " + " + ".join(f"{w / 60:.1f} min" for w in walls if w) if any(walls) else "")
    out = Path(args.out_dir) / "bench-response-merged.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table + "\n")
    print(table)
    return {"results": results, "summary": summary, "settings": settings}


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
    from megatron_longstraw.models.registry import FAMILIES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(FAMILIES), default="glm52",
                   help="model family (megatron_longstraw/models/registry.py)")
    p.add_argument("--config", default=None,
                   help="model YAML (default: the family's tiny example, examples/<family>/tiny.yaml)")
    p.add_argument("--quick", action="store_true",
                   help="P in {4K, 5K} at G=2, P=4K at G=8, LongStraw also at 12K: under 5 minutes")
    p.add_argument("--sweep", action="store_true",
                   help="the measured largest-P table (`make bench`): LongStraw at every "
                        "--sweep-points, conventional until the first point over --cap-gib, the "
                        "no-grad forward at --forward-points; model examples/glm52/bench.yaml")
    p.add_argument("--sweep-points", default="4096,8192,16384,32768,65536,131072")
    p.add_argument("--response-sweep", action="store_true",
                   help="the measured largest-R table (`make bench`): LongStraw blockwise "
                        "(--response-block, default 2048) and conventional at every "
                        "--response-points R, each until its first point over --cap-gib, at P = "
                        "--response-sweep-prompt and the first --groups G; then blockwise "
                        "(response_block R/4) against whole-branch (response_block R) replay time "
                        "at --replay-timing-points, --timing-repeats pairs; model "
                        "examples/glm52/bench.yaml; runs/bench/bench-response.{json,md}")
    p.add_argument("--response-points", default="2048,4096,8192,16384",
                   help="response sweep: R (LongStraw's step about doubles per doubling of R, "
                        "conventional's grows up to 4x: 16K about 1.5 minutes for LongStraw, 4 "
                        "for conventional; LongStraw runs twice per point, with the meter)")
    p.add_argument("--response-sweep-prompt", type=int, default=4096)
    p.add_argument("--replay-timing-points", default="4096,8192",
                   help="response sweep: R at which blockwise and whole-branch replay are timed")
    p.add_argument("--forward-points", default="4096,32768",
                   help="sweep: P at which capture is timed against a no-grad forward")
    p.add_argument("--timing-repeats", type=int, default=1,
                   help="sweep: pairs (forward, LongStraw) per --forward-points P; the ratio "
                        "reported is their median (the extra pairs run after the table's points)")
    p.add_argument("--sweep-methods", default="longstraw,conventional",
                   help="sweep, response sweep: longstraw alone skips conventional (e.g. a "
                        "timing-only run, or more R for LongStraw to merge with --from-json)")
    p.add_argument("--from-json", default=None,
                   help="sweep: no runs; the table again from saved sweep JSONs (comma-separated; a "
                        "later file's point replaces an earlier one's at the same method and P; the "
                        "last file's cap); with --response-sweep the same for its JSONs "
                        "(runs/bench/bench-response-merged.md)")
    p.add_argument("--timing-json", default=None,
                   help="with --from-json: sweep JSONs whose capture / forward pairs are added as "
                        "further repeats (their other points are not used)")
    p.add_argument("--points", default=None, help="comma-separated prompt lengths (default 4K..16K)")
    p.add_argument("--longstraw-points", default=None,
                   help="extra prompt lengths for LongStraw alone, at the smallest G (default: "
                        "32K; quick: 12K)")
    p.add_argument("--groups", default="2,8")
    p.add_argument("--response-len", type=int, default=32)
    p.add_argument("--response-block", type=int, default=None,
                   help="LongStraw's response_block (tokens per block of a branch in scoring and "
                        "replay; default: the config's)")
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
    p.add_argument("--no-live-meter", action="store_true",
                   help="with --one: run the point without the live-bytes meter (its event "
                        "record grows with the allocations, so with the prompt: the RSS it adds "
                        "is the difference); live bytes are then not reported")
    p.add_argument("--live-exclude-host", action="store_true",
                   help="with --one: the live-bytes meter leaves out host storage (pages, the "
                        "residual stream: what `note_host` names), i.e. what a device would hold")
    p.add_argument("--reuse-branch-pages", action="store_true",
                   help="with --one: LongStrawConfig.reuse_branch_pages (scoring's blocks' pages "
                        "serve replay)")
    args = p.parse_args(argv)
    if (args.sweep or args.response_sweep) and args.config is None:
        args.config = str(ROOT / "examples" / "glm52" / "bench.yaml")
    args.config = args.config or str(ROOT / FAMILIES[args.family].tiny_config)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.one:
        import warnings

        warnings.filterwarnings("ignore")
        print("BENCH_JSON " + json.dumps(run_one(args)), flush=True)
        return {}
    if args.from_json:
        return render_response_sweep(args) if args.response_sweep else render_sweep(args)
    if args.sweep:
        return run_sweep(args)
    if args.response_sweep:
        return run_response_sweep(args)
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
