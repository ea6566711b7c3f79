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

The reuse table (`--reuse-sweep`, also in `make bench`; tools/bench_sweeps/reuse_sweep.py): time
per optimizer step with K updates per capture (1, 4, 8) at P = 32,768, G = 2, one launcher run of
one capture each, back to back; the ratios against K = 1 and K = 1's capture share.
Output: runs/bench/bench-reuse.{json,md}.

The measured largest-R table (`--response-sweep`, also in `make bench`; the same model): at P =
`--response-sweep-prompt` (4096) and G = 2, every response R tokens, LongStraw with
`response_block` = `--response-block` (default 2048: a response longer than it is scored and
replayed block by block, step/replay.py) and conventional at growing R (`--response-points`),
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
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if str(ROOT / "tools") not in sys.path:   # this tool's own sections, tools/bench_sweeps/
    sys.path.append(str(ROOT / "tools"))

from bench_sweeps.child import run_one  # noqa: E402
from bench_sweeps.common import METHODS, exceeds_cap, fits_cap, sweep_until_over  # noqa: E402, F401
from bench_sweeps.predicted import run_predicted  # noqa: E402
from bench_sweeps.prompt_sweep import (  # noqa: E402, F401 - the summaries: tests/test_bench.py
    markdown_sweep,
    render_sweep,
    run_sweep,
    summarise_sweep,
)
from bench_sweeps.reuse_sweep import markdown_reuse, run_reuse_sweep, summarise_reuse  # noqa: E402, F401
from bench_sweeps.response_sweep import (  # noqa: E402, F401
    markdown_response_sweep,
    render_response_sweep,
    run_response_sweep,
    summarise_response_sweep,
)


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
    p.add_argument("--reuse-sweep", action="store_true",
                   help="the reuse table (`make bench`): time per optimizer step with K updates "
                        "per capture at --reuse-points K against K = 1, one launcher run each at "
                        "P = --reuse-prompt, the first --groups G; model examples/glm52/bench.yaml; "
                        "runs/bench/bench-reuse.{json,md}")
    p.add_argument("--reuse-points", default="1,4,8")
    p.add_argument("--reuse-prompt", type=int, default=32768)
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
                   help="with --one: the reuse_branch_pages setting (scoring's blocks' pages "
                        "serve replay)")
    args = p.parse_args(argv)
    if (args.sweep or args.response_sweep or args.reuse_sweep) and args.config is None:
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
    if args.reuse_sweep:
        return run_reuse_sweep(args)
    return run_predicted(args)


if __name__ == "__main__":
    main()
