"""Score responses with LongStraw's capture + replay scoring and compare with the inference engine.

    python tools/score.py --family glm52 --config examples/glm52/tiny.yaml --checkpoint DIR \
        --input groups.jsonl --out scores.jsonl [--tokenizer PATH] [--dtype fp32|fp64]
    python tools/score.py --family qwen36 --config examples/qwen36/tiny.yaml --checkpoint DIR ...
    python tools/score.py --checkpoint CONVERTED --input groups.jsonl --out scores.jsonl
    torchrun --nproc-per-node 2 tools/score.py ... --context-parallel-size 2     # GLM: CP = EP = 2

A model-format directory (tools/convert_hf.py's output, megatron_longstraw/checkpointing/model_format.py) carries
its family and model config in longstraw.json: `--family` and `--config` may then be left out (the
step settings, block sizes and kernels, are then LongStrawConfig's defaults); given, they must
match it. A bare checkpoint (a folder with model.safetensors only) and `--random-init` need both.

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
over all groups is printed and written to `<out>.summary.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

from megatron_longstraw.models.registry import FAMILIES

DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


# ---- models -------------------------------------------------------------------------------------


def expert_parallel_size(family: str, context_parallel_size: int) -> int:
    """EP folded on the CP ranks, as far as the family's model has experts to shard."""
    from megatron_longstraw.models.registry import get_family

    limit = get_family(family).max_expert_parallel_size
    return context_parallel_size if limit is None else min(context_parallel_size, limit)


def model_config(family: str, config):
    """`family`'s model config from the `model:` section of the YAML at `config`, a config dict (a
    model-format directory's longstraw.json "model"), or a config object (returned as is)."""
    from megatron_longstraw.models.registry import get_family

    config_class = get_family(family).config_class
    if isinstance(config, dict):
        return config_class.from_dict(config)
    if isinstance(config, (str, os.PathLike)):
        return config_class.from_yaml(config)
    return config


def build_model(family: str, config, dtype: torch.dtype, expert_parallel_size: int = 1):
    """(model config, model, number of routed experts) of `family` from `config` (`model_config`:
    a YAML path, a config dict or object), built by the family's registry record (model-parallel
    state initialised)."""
    from megatron_longstraw.runtime import precision
    from megatron_longstraw.models.registry import get_family

    entry = get_family(family)
    cfg = model_config(family, config)
    precision.use_dtype(dtype)
    model = entry.build(cfg, dtype, expert_parallel_size)
    return cfg, model, entry.num_routed_experts(cfg)


def load_checkpoint(model, path: str | Path, num_experts: int) -> Path:
    """Load a plugin-format checkpoint (a directory with `model.safetensors` holding the
    single-process Megatron state dict, or that file itself) into `model` (this rank's experts).
    A model-format directory's longstraw.json must describe the model built."""
    from safetensors.torch import load_file

    from megatron_longstraw.checkpointing import model_format
    from megatron_longstraw.distributed import parallel
    from megatron_longstraw.runtime.errors import CheckpointError, InputNotFound

    path = Path(path)
    file = path / "model.safetensors" if path.is_dir() else path
    if not file.is_file():
        raise InputNotFound(f"--checkpoint {path}: no model.safetensors there; pass a "
                            "checkpoint directory written by the plugin (or --random-init).")
    if path.is_dir() and model_format.is_model_format(path):
        meta = model_format.read_meta(path / model_format.MODEL_META, model_format.MODEL_FORMAT)
        model_format.check_model_config(meta, model, path / model_format.MODEL_META)
    full = load_file(str(file))
    for name, tensor in model.state_dict().items():
        source = full.get(parallel.global_name(name, num_experts))
        if source is not None and source.shape != tensor.shape:
            raise CheckpointError(f"--checkpoint {file}: {name} has shape "
                                  f"{tuple(source.shape)} there but {tuple(tensor.shape)} in the "
                                  "model built from --config; the config does not match the "
                                  "checkpoint.")
    parallel.load_full_state_dict(model, full, num_experts)
    return file


# ---- scoring ------------------------------------------------------------------------------------


class MismatchStats:
    """Running comparison of our per-token log-probs with the engine's (diff = ours - old)."""

    def __init__(self, threshold: float = 0.1, num_worst: int = 10):
        self.threshold, self.num_worst = threshold, num_worst
        self.num_tokens, self.num_over = 0, 0
        self.sum_abs, self.sum_diff, self.max_abs = 0.0, 0.0, 0.0
        self.worst: list[dict] = []

    def add(self, logp: torch.Tensor, logp_old: torch.Tensor, response_ids: torch.Tensor,
            group_id, member_idx: int, prompt_len: int) -> None:
        """One member: logp, logp_old, response_ids [R]."""
        diff = logp.double() - logp_old.double()
        abs_diff = diff.abs()
        self.num_tokens += diff.numel()
        self.num_over += int((abs_diff > self.threshold).sum())
        self.sum_abs += float(abs_diff.sum())
        self.sum_diff += float(diff.sum())
        self.max_abs = max(self.max_abs, float(abs_diff.max()))
        order = torch.argsort(abs_diff, descending=True, stable=True)[:self.num_worst]
        self._keep([{"id": group_id, "member_idx": member_idx, "token_idx": int(t),
                     "position": prompt_len + int(t), "token_id": int(response_ids[t]),
                     "logprob": float(logp[t]), "logprob_old": float(logp_old[t]),
                     "diff": float(diff[t])} for t in order])

    def merge(self, other: "MismatchStats") -> None:
        self.num_tokens += other.num_tokens
        self.num_over += other.num_over
        self.sum_abs += other.sum_abs
        self.sum_diff += other.sum_diff
        self.max_abs = max(self.max_abs, other.max_abs)
        self._keep(other.worst)

    def _keep(self, entries: list[dict]) -> None:
        # Stable sort: among equal |diff|, earlier groups / members / tokens come first.
        self.worst = sorted(self.worst + entries, key=lambda e: -abs(e["diff"]))[:self.num_worst]

    def summary(self) -> dict:
        n = max(self.num_tokens, 1)
        return {"num_tokens": self.num_tokens, "max_abs_diff": self.max_abs,
                "mean_abs_diff": self.sum_abs / n, "mean_diff": self.sum_diff / n,
                "threshold": self.threshold, "frac_abs_diff_over_threshold": self.num_over / n,
                "worst": list(self.worst)}


def iter_scores(model, groups, cfg, threshold: float = 0.1, num_worst: int = 10,
                overall: MismatchStats | None = None, log=None):
    """Yield one result dict per group. `groups`: `GroupRecord`s (megatron_longstraw.data.groups) or
    `GRPOGroup`s (id: their index). `cfg`: LongStrawConfig (block sizes). `overall` accumulates
    the mismatch over all groups that carry logps_old. Under CP every rank passes the same groups
    and gets the same results."""
    from megatron_longstraw.context.capture import capture_prompt
    from megatron_longstraw.kernels import select
    from megatron_longstraw.training import routing_replay
    from megatron_longstraw.training.replay import score_member

    select.use(cfg.kernels)
    for idx, item in enumerate(groups):
        group, group_id = getattr(item, "group", item), getattr(item, "id", idx)
        prompt_len = int(group.prompt_ids.numel())
        start = time.perf_counter()
        try:
            routing_replay.validate_group(model, group)   # the engine's routing, when given
            with torch.no_grad():
                captured = capture_prompt(model, group.prompt_ids, cfg)
                logps = [score_member(model, captured, r, cfg, *routing_replay.member_inputs(
                             model, group, i, captured.prefix_len, captured.layout))[0]
                         for i, r in enumerate(group.response_ids)]
            del captured
        except ValueError as exc:
            raise ValueError(f"group {group_id!r}: {exc}") from exc
        result = {"id": group_id, "prompt_len": prompt_len,
                  "response_lens": [int(r.numel()) for r in group.response_ids],
                  "logprobs": [lp.double().tolist() for lp in logps],
                  "logprob_sum": [float(lp.double().sum()) for lp in logps],
                  "logprob_mean": [float(lp.double().mean()) for lp in logps]}
        if group.logps_old is not None:
            stats = MismatchStats(threshold, num_worst)
            for member_idx, (lp, old, ids) in enumerate(zip(logps, group.logps_old,
                                                            group.response_ids)):
                stats.add(lp, old, ids, group_id, member_idx, prompt_len)
            result["mismatch"] = stats.summary()
            if overall is not None:
                overall.merge(stats)
        if log is not None:
            log(f"group {group_id}: prompt {prompt_len} tokens, {len(logps)} responses, "
                f"{time.perf_counter() - start:.1f} s")
        yield result


def score_groups(model, groups, cfg, threshold: float = 0.1, num_worst: int = 10) -> list[dict]:
    """Per-group results of `iter_scores` as a list."""
    return list(iter_scores(model, groups, cfg, threshold, num_worst))


def _agreed(records, layout):
    """Yield records; under CP the ranks first agree that they read the same group (or the same
    end of file), and a rank that failed to read takes every rank down with its message."""
    from megatron_longstraw.distributed.agreement import check_agreement

    records = iter(records)
    while True:
        record, error, own = None, None, None
        try:
            record = next(records)
        except StopIteration:
            pass
        except (ValueError, OSError) as exc:
            if layout.size == 1:
                raise
            error, own = str(exc), exc
        if layout.size > 1:
            try:
                check_agreement(error, _fingerprint(record), layout)
            except ValueError:
                if own is not None:   # this rank's own error (a DataError names file and line)
                    raise own from None
                raise
        if record is None:
            return
        yield record


def _fingerprint(record) -> dict:
    if record is None:
        return {"end_of_file": True}
    prompt = record.group.prompt_ids.long()
    weights = torch.arange(1, prompt.numel() + 1) % 1009
    return {"id": record.id, "line": record.line, "prompt_len": int(prompt.numel()),
            "prompt_checksum": int((prompt * weights).sum()),
            "response_lens": [int(r.numel()) for r in record.group.response_ids]}


# ---- command line -------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(FAMILIES), default=None,
                   help="Model family (megatron_longstraw/models/registry.py); default: the "
                        "--checkpoint model-format directory's.")
    p.add_argument("--config", default=None,
                   help="Model YAML (`model:` and `longstraw:`); default: the model config in the "
                        "--checkpoint model-format directory's longstraw.json (step settings: "
                        "the defaults).")
    weights = p.add_mutually_exclusive_group(required=True)
    weights.add_argument("--checkpoint", help="Checkpoint directory with model.safetensors.")
    weights.add_argument("--random-init", action="store_true",
                         help="Random weights from --seed (smoke tests). They depend on the CP/EP "
                              "layout too (each rank initialises its own experts): compare layouts "
                              "with --checkpoint.")
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


def resolve_model_source(args) -> tuple[str, str | dict]:
    """(family, model config: the --config YAML path or longstraw.json's "model" dict) from the
    flags and, where they are left out, the --checkpoint model-format directory."""
    from megatron_longstraw.checkpointing import model_format
    from megatron_longstraw.runtime.errors import CheckpointError, ConfigError

    meta = None
    if args.checkpoint and model_format.is_model_format(args.checkpoint):
        meta = model_format.read_meta(Path(args.checkpoint) / model_format.MODEL_META,
                                      model_format.MODEL_FORMAT)
    if meta is None and (args.family is None or args.config is None):
        missing = " and ".join(f for f, v in (("--family", args.family),
                                              ("--config", args.config)) if v is None)
        source = ("--random-init" if args.random_init else
                  f"--checkpoint {args.checkpoint} is not a model-format directory (no "
                  f"{model_format.MODEL_META})")
        raise ConfigError(f"{missing} needed: {source}, so nothing says which model to build; "
                          "pass them, or a tools/convert_hf.py output as --checkpoint.")
    family = args.family or meta.get("family")
    if meta is not None and meta.get("family") != family:
        raise CheckpointError(f"--checkpoint {args.checkpoint} holds a {meta.get('family')!r} "
                              f"model, not --family {family}.")
    if family not in FAMILIES:
        raise CheckpointError(f"--checkpoint {args.checkpoint}: family {family!r} is not one "
                              f"of {sorted(FAMILIES)}.")
    if args.config is not None:
        return family, args.config
    if not isinstance(meta.get("model"), dict):
        raise CheckpointError(f"{Path(args.checkpoint) / model_format.MODEL_META}: no \"model\" "
                              "config; pass --config.")
    return family, meta["model"]


def main(argv=None) -> dict:
    """The tool (module docstring); raises user errors (errors.py) like the launcher, which
    `__main__` reports as one line with exit code 2."""
    args = parse_args(argv)
    warnings.filterwarnings("ignore", module=r"megatron\..*")
    import torch.distributed as dist

    from megatron_longstraw.runtime import errors
    from megatron_longstraw.distributed import parallel
    from megatron_longstraw.training.arguments import longstraw_config_from_yaml
    from megatron_longstraw.config.settings import LongStrawConfig
    from megatron_longstraw.data.groups import read_records
    from megatron_longstraw.training.metrics import configure_logging

    configure_logging()
    with errors.configuration():   # flags, YAML, the model config's values
        family, source = resolve_model_source(args)
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
        load_checkpoint(model, args.checkpoint, num_experts)
    model.eval()

    records = read_records(args.input, tokenizer=args.tokenizer, vocab_size=model_cfg.vocab_size,
                           require_rewards=False)
    overall = MismatchStats(args.mismatch_threshold, args.num_worst)
    scores = iter_scores(model, _agreed(records, parallel.CPLayout.current()), ls,
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
