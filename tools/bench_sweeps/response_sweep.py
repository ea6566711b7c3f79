"""The measured largest-R table of tools/bench.py (`--response-sweep`, `make bench`): at one P
and G, LongStraw blockwise and conventional GRPO at growing R, each until its first point over the
cap, LongStraw's live bytes from a second run with the meter, then blockwise against whole-branch
replay time (`run_response_sweep`); its summary and table, and the table again from saved JSONs
(`render_response_sweep`, `--response-sweep --from-json`). Every figure is from a run."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .common import MiB, ROOT, exceeds_cap, fits_cap, median, mib, run_point, sweep_until_over


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
            "blockwise_median": median(block), "whole_median": median(whole),
            "ratios": ratios, "ratio": median(ratios), "within_goal": median(ratios) <= 1.3}
        reuse = [(runs[("reuse", k)], runs[("whole", k)]) for v, k in sorted(runs)
                 if v == "whole" and ("reuse", k) in runs]
        if reuse:      # blockwise with reuse_branch_pages: replay over scoring's pages
            ratios = [r["phase_seconds"]["replay"] / w["phase_seconds"]["replay"]
                      for r, w in reuse]
            summary["replay_time"][f"R={R}"].update(
                reuse_replay_seconds=[r["phase_seconds"]["replay"] for r, _ in reuse],
                reuse_ratios=ratios, reuse_ratio=median(ratios),
                reuse_within_goal=median(ratios) <= 1.3)
    return summary


def markdown_response_sweep(summary: dict, settings: dict) -> str:
    cap = summary["cap_bytes"]
    phases = ("capture", "scoring", "replay")
    lines = [f"Measured (every cell is a run; no extrapolation). Model {settings['config']}, "
             f"P = {settings['prompt_len']:,}, G = {settings['group_size']}, every response R "
             f"tokens; LongStraw with response_block {settings['response_block']:,} (blockwise "
             "scoring and replay); conventional: plain Megatron forward-backward of "
             "[prompt; response] per member, full layer recompute. One process, one thread. Cap: "
             f"peak RSS <= {cap / 2 ** 30:g} GiB ({mib(cap)} MiB) per process, enforced by a "
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
            cells += [mib(ls["peak_rss_bytes"]), f"{ls['step_seconds']:.1f}",
                      f"{ph.get('scoring', 0):.1f}", f"{ph.get('replay', 0):.1f}",
                      " / ".join(f"{live.get(p, 0) / MiB:,.1f}" for p in phases) if live
                      else "not measured",
                      f"{host / MiB:,.1f}" if host is not None and live else ""]
        elif ls["status"] == "exceeds cap":
            cells += [f"**exceeds cap** (killed at {mib(ls['rss_bytes'])})", "", "", "", "", ""]
        elif ls["status"] == "not run":
            first = summary["first_over_cap"]["longstraw"]
            cells += [f"not run (over the cap at R = {first:,})" if first else "not run",
                      "", "", "", "", ""]
        else:
            cells += [f"error ({ls['error'].split(':')[0]})", "", "", "", "", ""]
        if conv["status"] == "fits":
            cells += [mib(conv["peak_rss_bytes"]), f"{conv['step_seconds']:.1f}"]
        elif conv["status"] == "exceeds cap":
            cells += [f"**exceeds cap** (killed at {mib(conv['rss_bytes'])})", ""]
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
