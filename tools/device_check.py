"""Check the kernel backends on this machine, and run one LongStraw step of a reduced-depth,
full-width GLM-5.2 and Qwen3.6 on one GPU (under 8 minutes on an H100/H200).

    python tools/device_check.py [--kernels auto] [--budget-s 420] [--steps glm52,qwen36] [--json out.json]

1. environment: torch, CUDA, GPU, flash-linear-attention, and why each kernel backend is or is not
   usable here;
2. the Triton sparse-MLA kernels in Triton's CPU interpreter (tiny shape; runs everywhere);
3. parity: each usable backend against its reference on fresh random inputs at GLM-5.2 shapes
   (relative error against an fp64 reference, tolerance by dtype: kernels/parity.py), and
   DeepGEMM's FP8 GEMM (the FP8 base's) against `fp8.linear` on the same FP8 activations;
4. timing: each backend and its reference, median of repeats after warm-up;
5. Qwen3.6 Gated DeltaNet: FLA's Triton `chunk_gated_delta_rule` (what Megatron's GatedDeltaNet
   runs on a GPU) and Megatron's `torch_chunk_gated_delta_rule` in fp32 against the same algorithm
   in fp64, at Qwen3.6 head shapes (48 value heads, 16 QK heads expanded to 48, d_k = d_v = 128):
   output and final state from zero and from a nonzero initial state, and the split property
   capture and replay rely on (tokens [0, n) then [n, N) from the carried state equal [0, N) in one
   call); gradients; timing. Without CUDA or FLA only the torch rule runs, at a tiny shape;
6. one LongStraw GRPO step (capture, scoring, replay with backward) of GLM-5.2 with 4 layers at the
   real widths (1 dense + 3 MoE layers, 16 routed experts) in bf16, at prompt lengths doubling from
   --start-prompt-len until memory or its share of the time budget runs out: peak
   torch.cuda.max_memory_allocated, capture tokens/s, replay time per step;
8. capacity (after part 6, same model): streamed capture alone at --start-prompt-len and twice
   it, the device peak (LiveBytesMeter: max_memory_allocated, pinned host memory not counted)
   beside the planner's capture lines for the same setup, and its growth (device_checks/capacity.py);
7. the same for Qwen3.6 with 4 layers at the full.yaml widths (`G-G-G-*`: 3 Gated DeltaNet + 1
   gated full attention), also reporting the fixed GDN state bytes against the per-token K/V page
   bytes, and at the first prompt length the replay log-probs against a full-sequence forward.
Without CUDA the script runs parts 1, 2 and the CPU part of 5, says what it did not run, and stops
(exit 0 when those passed). Each part reports its own failure with the traceback and the script
goes on; the exit status is 1 when any part failed. --budget-s bounds the whole run: the GDN part
and the Qwen3.6 step are skipped when too little is left for them, and each model step gets a
share of what is left (GLM-5.2 half, Qwen3.6 the rest) and stops doubling the prompt when the
next length would not fit in it.

The sections are in tools/device_checks/ (one module per part: see its __init__.py); this script
parses the arguments, runs them in order within the time budget and writes the report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
if str(REPO / "tools") not in sys.path:   # this tool's own sections, tools/device_checks/
    sys.path.append(str(REPO / "tools"))

import torch  # noqa: E402

from device_checks.common import RESULTS, run_section, say  # noqa: E402
from device_checks.environment import environment  # noqa: E402
from device_checks.gdn import TINY_GDN, qwen36_gdn_parity  # noqa: E402, F401 - TINY_GDN: tests
from device_checks.kernels import (  # noqa: E402
    fp8_gemm_parity_and_timing, indexer_parity_and_timing, sparse_mla_parity, sparse_mla_timing,
    te_and_apex, triton_interpreter,
)
from device_checks.capacity import capacity  # noqa: E402
from device_checks.steps import model_step, qwen36_step  # noqa: E402

START = time.perf_counter()


def share_of_budget(args, fraction: float) -> float:
    """A deadline (time.perf_counter()) `fraction` of the way from now to the end of --budget-s."""
    now = time.perf_counter()
    return now + fraction * max(0.0, START + args.budget_s - now)


# The families (registry names) with a model step here; each step is written for its family.
STEPS = ("glm52", "qwen36")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", default="auto", help="--longstraw-kernels spec for the steps")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="Wall-clock budget for the whole script (shared by the model steps, "
                             "which stop growing the prompt when their share runs out)")
    parser.add_argument("--start-prompt-len", type=int, default=8192)
    parser.add_argument("--max-prompt-len", type=int, default=1 << 20)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--steps", default=",".join(STEPS),
                        help=f"Comma-separated model steps to run, from {', '.join(STEPS)}")
    parser.add_argument("--skip-step", action="store_true", help="Kernel checks only")
    parser.add_argument("--json", type=str, default=None, help="Write the results here")
    args = parser.parse_args(argv)
    steps = [] if args.skip_step else [s for s in args.steps.split(",") if s]
    if set(steps) - set(STEPS):
        parser.error(f"--steps {args.steps}: choose from {', '.join(STEPS)}")

    run_section("environment", environment)
    run_section("triton sparse MLA in the CPU interpreter", triton_interpreter)
    RESULTS["gpu"] = torch.cuda.is_available()
    if RESULTS["gpu"]:
        torch.manual_seed(0)
        run_section("sparse MLA parity (GPU)", sparse_mla_parity)
        run_section("sparse MLA timing (GPU)", sparse_mla_timing)
        run_section("indexer parity and timing (GPU)", indexer_parity_and_timing)
        run_section("FP8 GEMM parity and timing (GPU)", fp8_gemm_parity_and_timing)
        run_section("TransformerEngine, apex, DeepEP", te_and_apex)
    run_section("qwen36 GDN kernel parity",
                lambda: qwen36_gdn_parity(deadline=START + args.budget_s))
    # Each model step gets an equal share of what is left when it starts (GLM-5.2 half of it,
    # Qwen3.6 all that remains after), and stops doubling the prompt before its share runs out.
    if "glm52" in steps and RESULTS["gpu"]:
        run_section("LongStraw step, GLM-5.2 4 layers full width",
                    lambda: model_step(args, share_of_budget(args, 1 / len(steps))))
    if "glm52" in steps and RESULTS["gpu"]:
        run_section("capacity: streamed capture at P and 2P, GLM-5.2 full width",
                    lambda: capacity(args))
    if "qwen36" in steps:
        run_section("qwen36 step", lambda: qwen36_step(args, share_of_budget(args, 1.0)))
    if not RESULTS["gpu"]:
        say("\nNo CUDA device here: the GPU parity checks, the timings, FLA's GDN kernel and the "
            "model steps were NOT run. Only the CPU-checkable parts ran: the Triton interpreter "
            "check and the GDN checks of Megatron's torch rule at a tiny shape.")
    RESULTS["seconds"] = time.perf_counter() - START
    say(f"\nfailures: {RESULTS['failures'] or 'none'}; total {RESULTS['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(RESULTS, indent=2, default=str))
    return 1 if RESULTS["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
