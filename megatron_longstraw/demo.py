"""`make demo`: one LongStraw GRPO step of the tiny GLM-5.2 on CPU with a long synthetic prompt,
context and expert parallelism folded on the same ranks (CP = EP = world size).

    torchrun --standalone --nproc-per-node 4 -m megatron_longstraw.demo [--prompt-len 32768]
    python -m megatron_longstraw.demo          # one process

Rank 0 prints a short table and writes runs/<name>/receipt.json.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import torch

from megatron_longstraw import parallel
from megatron_longstraw.config import LongStrawConfig
from megatron_longstraw.data import synthetic_group
from megatron_longstraw.memory import SavedTensorMeter, peak_rss_bytes
from megatron_longstraw.receipts import environment, format_table, human_bytes, write_json_atomic

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "examples" / "glm52" / "tiny.yaml"))
    p.add_argument("--prompt-len", type=int, default=32768)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--response-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--name", default="demo")
    p.add_argument("--out-dir", default="runs")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", module=r"megatron\..*")
    start = time.perf_counter()
    import torch.distributed as dist

    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    parallel.initialize(context_parallel_size=world, expert_parallel_size=world, seed=args.seed)
    rank = dist.get_rank()
    from megatron_longstraw.models.glm52.config import GLM52Config
    from megatron_longstraw.models.glm52.model import build_glm52_model
    from megatron_longstraw.schedule import train_step

    cfg = GLM52Config.from_yaml(args.config)
    ls = LongStrawConfig.from_yaml(args.config)
    ls.group_size = args.group_size
    ls.max_response_len = max(ls.max_response_len, args.response_len)
    model = build_glm52_model(cfg, params_dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    group = synthetic_group(cfg.vocab_size, args.prompt_len, args.group_size, args.response_len,
                            seed=args.seed)
    with SavedTensorMeter(model) as meter:
        result = train_step(model, optimizer, group, ls, max_grad_norm=1.0)
    # Across ranks: pages add up, peaks are per process (report the largest).
    totals = torch.tensor([result.page_bytes, 0, 0], dtype=torch.float64)
    peaks = torch.tensor([peak_rss_bytes(), meter.peak_bytes], dtype=torch.float64)
    dist.all_reduce(totals)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    page_bytes = int(totals[0])

    receipt = {
        "name": args.name,
        "family": "glm52",
        "config": str(args.config),
        "prompt_len": args.prompt_len,
        "group_size": args.group_size,
        "response_lens": [int(r.numel()) for r in group.response_ids],
        "rewards": [float(r) for r in group.rewards],
        "page_bytes": page_bytes,
        "page_bytes_per_rank": result.page_bytes,
        "page_bytes_per_token": page_bytes / max(args.prompt_len - 1, 1),
        "peak_rss_bytes": int(peaks[0]),
        "peak_saved_tensor_bytes": int(peaks[1]),
        "phase_seconds": result.phase_seconds,
        "loss": result.loss,
        "stats": result.stats,
        "total_seconds": time.perf_counter() - start,
        "world_size": world,
        "context_parallel_size": world,
        "expert_parallel_size": world,
        "environment": environment(),
    }
    if rank != 0:
        return receipt
    path = write_json_atomic(Path(args.out_dir) / args.name / "receipt.json", receipt)
    rows = [
        ("model", f"GLM-5.2 tiny ({cfg.num_hidden_layers} layers, {cfg.indexer_types().count('full')} "
                  f"full indexer layers, {cfg.n_routed_experts} experts)"),
        ("parallel", f"{world} processes, CP={world}, EP={world} (gloo)"),
        ("prompt / group", f"{args.prompt_len} tokens, G={args.group_size}, responses "
                           f"{receipt['response_lens']}"),
        ("capture", f"{result.phase_seconds['capture']:.1f} s"),
        ("scoring", f"{result.phase_seconds['scoring']:.1f} s"),
        ("replay+backward", f"{result.phase_seconds['replay']:.1f} s"),
        ("page bytes", f"{human_bytes(page_bytes)} in all, {human_bytes(result.page_bytes)} on "
                       f"rank 0 ({receipt['page_bytes_per_token']:.0f} B/token)"),
        ("peak RSS (max rank)", human_bytes(receipt["peak_rss_bytes"])),
        ("peak saved tensors", human_bytes(receipt["peak_saved_tensor_bytes"])),
        ("loss", f"{result.loss:.6f} (first step: ratio 1, advantages sum to 0)"),
        ("mean reward", f"{result.stats['reward_mean']:.3f}"),
        ("grad norm", f"{result.stats['grad_norm']:.4f}"),
        ("receipt", str(path)),
    ]
    print("LongStraw GRPO step\n" + format_table(rows))
    return receipt


if __name__ == "__main__":
    main()
