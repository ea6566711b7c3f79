"""The default mode of tools/bench.py (`--quick`, `--points`): every method at a few P and G, each
in a fresh child; the largest P under `--cap-gib` PREDICTED from measured growth (`summarise`:
the peak RSS at the largest P plus a least-squares slope, never below the captured page bytes
per token); the table (bench.md), the JSON (bench.json) and the memory plot (bench_memory.png,
matplotlib: the bench extra)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from .common import METHODS, MiB, run_point


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


def run_predicted(args) -> dict:
    """The points (`--points`, `--longstraw-points`, `--groups`, `--methods`; `--quick`'s
    defaults), `--jobs` at a time; then the summary, the table, the plot and the JSON."""
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
