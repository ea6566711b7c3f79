"""Score responses with LongStraw's capture + replay scoring and compare with the inference engine.

    python tools/score.py --family glm52 --config examples/glm52/tiny.yaml --checkpoint DIR \
        --input groups.jsonl --out scores.jsonl [--tokenizer PATH] [--dtype fp32|fp64]
    python tools/score.py --family qwen36 --config examples/qwen36/tiny.yaml --checkpoint DIR ...
    python tools/score.py --checkpoint CONVERTED --input groups.jsonl --out scores.jsonl
    python tools/score.py --checkpoint runs/ckpt --input groups.jsonl --out scores.jsonl  # its latest
    torchrun --nproc-per-node 2 tools/score.py ... --context-parallel-size 2     # GLM: CP = EP = 2

A model-format directory (tools/convert_hf.py's output, megatron_longstraw/checkpointing/model_format.py) carries
its family and model config in longstraw.json, a training checkpoint (a step_N folder or a --save
folder) in meta.json: `--family` and `--config` may then be left out (the step settings, block
sizes and kernels, are then LongStrawConfig's defaults); given, they must match it. A bare
checkpoint (a folder with model.safetensors only) and `--random-init` need both.

The model families are the launcher's (megatron_longstraw/models/registry.py: config class, builder,
expert-parallel limit). GLM-5.2 folds EP on the CP ranks (EP = CP); Qwen3.6 has no experts (EP 1).

For every group of the input JSONL (examples/data/README.md) the prompt is captured once and each
response is scored over the captured state, exactly as the training step's pre-step scoring does
(`capture_prompt` + `score_member`, with the engine's `routed_experts` / `dsa_topk` when the
line has them: routing replay; no autograd, no optimizer). Rank 0 writes one JSON line per
group: id, prompt_len, response_lens, per-token `logprobs` of every member, their `logprob_sum`
and `logprob_mean`. When the input carries `logprobs_old` (the engine's per-token log-probs), each
line also has a `mismatch` summary (diff = ours - engine's: max / mean |diff|, mean diff (bias),
fraction of tokens with |diff| > threshold, the worst tokens with their positions), and the summary
over all groups is printed and written to `<out>.summary.json`. Multi-turn members with loss masks
(`loss_masks`, `response_segments`, chat `messages`; examples/data/README.md) are scored on every
token (untrained tokens are context, scored all the same); the line then carries `loss_masks`
(0 marks an untrained token's log-prob), `trained_logprob_sum` / `trained_logprob_mean`, and the
mismatch counts the trained tokens only (`logprobs_old` may be null at the others).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

from megatron_longstraw.checkpointing.model_source import (
    DTYPES, build_model, expert_parallel_size, load_weights, model_config, resolve_model_source,
)
from megatron_longstraw.models.registry import FAMILIES
from megatron_longstraw.step.scoring import MismatchStats, agreed_records, iter_scores


# ---- command line -------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(FAMILIES), default=None,
                   help="Model family (megatron_longstraw/models/registry.py); default: what "
                        "the --checkpoint records (a model-format directory or a training "
                        "checkpoint).")
    p.add_argument("--config", default=None,
                   help="Model YAML (`model:` and `longstraw:`); default: the model config the "
                        "--checkpoint records (longstraw.json of a model-format directory, "
                        "meta.json of a training checkpoint; step settings: the defaults).")
    weights = p.add_mutually_exclusive_group(required=True)
    weights.add_argument("--checkpoint", help="Checkpoint directory with model.safetensors, a "
                         "model-format directory, or a full-parameter training checkpoint (a "
                         "step_N folder or a --save folder) of any CP/EP layout.")
    weights.add_argument("--random-init", action="store_true",
                         help="Random weights from --seed (smoke tests), the same at every "
                              "CP/EP layout (megatron_longstraw/models/expert_init.py).")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--input", required=True, help="JSONL of groups (examples/data/README.md).")
    p.add_argument("--out", required=True, help="Output JSONL (one line per group).")
    p.add_argument("--tokenizer", help="Local tokenizer.json or tokenizer directory (text input).")
    p.add_argument("--context-parallel-size", type=int, default=1,
                   help="CP size (GLM-5.2: also the EP size; Qwen3.6: EP 1); must equal the "
                        "number of processes.")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--mismatch-threshold", type=float, default=0.1,
                   help="Count tokens with |ours - logprobs_old| above this.")
    p.add_argument("--num-worst", type=int, default=10, help="Worst tokens listed per summary.")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """The tool (module docstring); raises user errors (errors.py) like the launcher, which
    `__main__` reports as one line with exit code 2."""
    args = parse_args(argv)
    warnings.filterwarnings("ignore", module=r"megatron\..*")
    import torch.distributed as dist

    from megatron_longstraw.runtime import errors
    from megatron_longstraw.distributed import parallel, cp_layout
    from megatron_longstraw.training.arguments import longstraw_config_from_yaml
    from megatron_longstraw.config.settings import LongStrawConfig
    from megatron_longstraw.data.groups import read_records
    from megatron_longstraw.training.metrics import configure_logging

    configure_logging()
    with errors.configuration():   # flags, YAML, the model config's values
        family, source = resolve_model_source(args.family, args.config, args.checkpoint)
        cfg = model_config(family, source)
        ls = longstraw_config_from_yaml(args.config) if args.config else LongStrawConfig()
    cp = args.context_parallel_size
    ep = expert_parallel_size(family, cp)
    parallel.initialize(context_parallel_size=cp, expert_parallel_size=ep, seed=args.seed)
    if dist.get_world_size() != cp:
        raise errors.ConfigError(f"score.py runs one context-parallel group: launch {cp} "
                                 f"processes for --context-parallel-size {cp} (got "
                                 f"{dist.get_world_size()}).")
    rank0 = dist.get_rank() == 0
    log = (lambda msg: print(f"[score] {msg}", file=sys.stderr, flush=True)) if rank0 else None

    model_cfg, model, num_experts = build_model(family, cfg, DTYPES[args.dtype], ep)
    if args.checkpoint:
        load_weights(model, args.checkpoint, num_experts)
    model.eval()

    records = read_records(args.input, tokenizer=args.tokenizer, vocab_size=model_cfg.vocab_size,
                           require_rewards=False)
    overall = MismatchStats(args.mismatch_threshold, args.num_worst)
    scores = iter_scores(model, agreed_records(records, cp_layout.CPLayout.current()), ls,
                         args.mismatch_threshold, args.num_worst, overall, log)
    results = _write_lines(args.out, scores) if rank0 else list(scores)

    summary = None
    if any("mismatch" in r for r in results):
        summary = {"input": str(args.input), "diff": "ours - logprobs_old",
                   "overall": overall.summary(),
                   "groups": [{"id": r["id"], **r["mismatch"]} for r in results if "mismatch" in r]}
        if rank0:
            from megatron_longstraw.training.receipts import write_json_atomic

            write_json_atomic(f"{args.out}.summary.json", summary)
            print(format_summary(summary))
    if log:
        log(f"wrote {len(results)} groups to {args.out}")
    return {"results": results, "summary": summary, "out": str(args.out)}


def _write_lines(out: str, scores) -> list[dict]:
    """Stream results to `out` (via a temporary file renamed at the end)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    results = []
    try:
        with tmp.open("w", encoding="utf-8") as f:
            for result in scores:
                f.write(json.dumps(result) + "\n")
                f.flush()
                results.append(result)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return results


def format_summary(summary: dict) -> str:
    """The printed report: overall, the 10 groups with the largest |d|, the worst tokens."""
    def line(name, s):
        return (f"  {str(name):<16} tokens {s['num_tokens']:>8}  max|d| {s['max_abs_diff']:.4f}  "
                f"mean|d| {s['mean_abs_diff']:.4f}  bias {s['mean_diff']:+.4f}  "
                f"|d|>{s['threshold']:g} {100 * s['frac_abs_diff_over_threshold']:.2f}%")

    overall = summary["overall"]
    rows = [f"log-prob mismatch, d = ours - logprobs_old ({summary['input']})",
            line("overall", overall)]
    worst_groups = sorted(summary["groups"], key=lambda g: -g["max_abs_diff"])[:10]
    rows += [line(g["id"], g) for g in worst_groups]
    rows.append(f"  worst tokens:\n    {'group':<16} {'member':>6} {'token_idx':>9} {'position':>9} "
                f"{'token_id':>9} {'ours':>9} {'old':>9} {'d':>9}")
    rows += [f"    {str(w['id']):<16} {w['member_idx']:>6} {w['token_idx']:>9} {w['position']:>9} "
             f"{w['token_id']:>9} {w['logprob']:>9.4f} {w['logprob_old']:>9.4f} {w['diff']:>+9.4f}"
             for w in overall["worst"]]
    return "\n".join(rows)


if __name__ == "__main__":
    from megatron_longstraw.runtime.errors import run_entry

    run_entry(main)
