"""The measured largest-P table of tools/bench.py (`--sweep`, `make bench`): LongStraw at every
P, conventional GRPO at growing P until its first point over the cap, the no-grad forward at
`--forward-points` for capture / forward (`run_sweep`); its summary and table (`summarise_sweep`,
`markdown_sweep`), and the table again from saved JSONs (`render_sweep`, `--from-json`). Every
figure is from a run."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .common import MiB, ROOT, exceeds_cap, fits_cap, median, mib, run_point


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


def markdown_sweep(summary: dict, settings: dict) -> str:
    cap = summary["cap_bytes"]
    lines = [f"Measured (every cell is a run; no extrapolation). Model {settings['config']}, "
             f"G = {settings['group_size']}, responses {settings['response_len']} tokens, one process, "
             f"one thread. Cap: peak RSS <= {cap / 2 ** 30:g} GiB ({mib(cap)} MiB) per process, "
             "enforced by a watchdog that kills a child above it.", "",
             "| P | LongStraw peak RSS (MiB) | LongStraw live tensors (MiB) | pages (MiB) "
             "| LongStraw step (s) | capture (s) | conventional peak RSS (MiB) "
             "| conventional live tensors (MiB) | conventional step (s) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in summary["rows"]:
        cells = [f"{row['prompt_len']:,}"]
        ls, conv = row["longstraw"], row["conventional"]
        if ls["status"] == "fits":
            cells += [mib(ls["peak_rss_bytes"]), mib(ls["live_peak_bytes"]),
                      f"{ls['page_bytes'] / MiB:,.1f}", f"{ls['step_seconds']:.1f}",
                      f"{ls['capture_seconds']:.1f}"]
        elif ls["status"] == "exceeds cap":
            cells += [f"exceeds cap ({mib(ls['rss_bytes'])})", "", "", "", ""]
        else:
            cells += [f"error ({ls.get('error', ls['status']).split(':')[0]})", "", "", "", ""]
        if conv["status"] == "fits":
            cells += [mib(conv["peak_rss_bytes"]), mib(conv["live_peak_bytes"]),
                      f"{conv['step_seconds']:.1f}"]
        elif conv["status"] == "exceeds cap":
            cells += [f"**exceeds cap** (killed at {mib(conv['rss_bytes'])})", "", ""]
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
