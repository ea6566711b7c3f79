"""How far the detached prompt gradient is from the exact one: the figure the paper calls
unquantified.

    python tools/gradient_bias.py --family glm52 --prompt-lens 1K,2K,4K,8K,16K,32K \
        --group-sizes 4,8 --lora --train-steps 10 --out runs/gradient-bias

For every prompt length P, group size G and trainable set (all parameters; with --lora also LoRA
adapters on the family's targets), one GRPO group is run twice from the same weights: with
`prompt_grad = "detached"` (d loss / d theta at fixed prompt state, the paper's) and "exact"
(prompt_backward.py: standard GRPO's gradient, tested equal to full-sequence autograd in
tests/test_exact_gradient.py). Reported per run: cosine and relative L2 distance ||d - e|| / ||e||
of the whole gradient and per parameter group (embeddings, attention, indexer, experts, mlp,
head, other), and the step time of each mode. With --train-steps N, two short trainings from the
same weights on the same groups, one per mode: loss, gradient norm and the mean log-prob of each
group's best-rewarded response, per step, side by side (TensorBoard under OUT/tb/<mode>, a PNG).
The rewards are supplied with the groups (synthetic data, no generation loop), so they do not move;
the best response's log-prob is what the update pushes up.

Outputs: OUT/gradient_bias.json, OUT/gradient_bias.md (the table), OUT/training.png. One process
(the exact mode runs at CP 1); tiny models from the family's registry record by default.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GROUPS = (("indexer", ("indexer",)), ("embeddings", ("embedding",)),
          ("head", ("output_layer", "final_norm")),
          ("experts", ("mlp.experts", "mlp.router", "mlp.shared_experts")),
          ("attention", ("self_attention",)), ("mlp", ("mlp.",)))
"""Parameter groups by name, first match wins (the indexer sits inside the attention)."""


def param_group(name: str) -> str:
    for group, needles in GROUPS:
        if any(needle in name for needle in needles):
            return group
    return "other"


def compare(detached: dict, exact: dict) -> dict:
    """Cosine and relative L2 distance of the detached to the exact gradient, whole and per
    parameter group. A parameter without a detached gradient counts as zeros there."""
    import torch

    def stats(names):
        e = torch.cat([exact[n].double().flatten() for n in names])
        d = torch.cat([detached[n].double().flatten() if n in detached
                       else torch.zeros_like(exact[n], dtype=torch.float64).flatten()
                       for n in names])
        norm_e, norm_d = float(e.norm()), float(d.norm())
        cosine = float(d @ e) / (norm_d * norm_e) if norm_d and norm_e else float("nan")
        return {"cosine": cosine, "rel_l2": float((d - e).norm()) / norm_e if norm_e else 0.0,
                "norm_exact": norm_e, "norm_detached": norm_d, "params": len(names)}

    by_group: dict[str, list[str]] = {}
    for name in exact:
        by_group.setdefault(param_group(name), []).append(name)
    return {"all": stats(list(exact)), "groups": {g: stats(n) for g, n in sorted(by_group.items())}}


def build(args, trainable: str, dtype):
    """The family's tiny model with reproducible weights (models/seeded.py); with
    `trainable == "lora"`, LoRA adapters on the family's targets, B drawn small (not its zero
    init) so that both factors have gradients, as after some training."""
    import torch

    from megatron_longstraw.models.registry import get_family
    from megatron_longstraw.models.seeded import build_seeded_model

    family = get_family(args.family)
    cfg, model = build_seeded_model(dtype, args.seed, args.config or family.tiny_config,
                                    args.family)
    if trainable == "lora":
        from megatron_longstraw.adapters.lora import LoRAConfig, apply_lora

        apply_lora(model, LoRAConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank,
                                     targets=family.lora_targets))
        gen = torch.Generator().manual_seed(args.seed + 7)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.requires_grad and name.endswith("lora_B"):
                    p.copy_(0.01 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return cfg, model


def longstraw_config(args, group_size: int, mode: str):
    from megatron_longstraw.config.settings import LongStrawConfig

    return LongStrawConfig.of(group_size=group_size, max_response_len=args.response_len,
                           clip_eps_high=0.28, prompt_grad=mode)


def group_for(args, vocab: int, prompt_len: int, group_size: int, seed: int):
    """A synthetic group: responses of varied length up to --response-len, spread rewards."""
    from megatron_longstraw.data.groups import random_group

    lens = [max(1, args.response_len * (i + 1) // group_size) for i in range(group_size)]
    return random_group(vocab, prompt_len, lens, seed)


def gradients(model, group, cfg) -> tuple[dict, float]:
    from megatron_longstraw.step.schedule import forward_backward_longstraw

    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    forward_backward_longstraw(model, group, cfg)
    seconds = time.perf_counter() - start
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}, seconds


def sweep(args, dtype) -> list[dict]:
    rows = []
    for trainable in ["full"] + (["lora"] if args.lora else []):
        cfg, model = build(args, trainable, dtype)
        for prompt_len in args.prompt_lens:
            for group_size in args.group_sizes:
                group = group_for(args, cfg.vocab_size, prompt_len, group_size, args.seed)
                detached, t_detached = gradients(model, group,
                                                 longstraw_config(args, group_size, "detached"))
                exact, t_exact = gradients(model, group, longstraw_config(args, group_size, "exact"))
                row = {"trainable": trainable, "prompt_len": prompt_len, "group_size": group_size,
                       "seconds_detached": t_detached, "seconds_exact": t_exact,
                       **compare(detached, exact)}
                rows.append(row)
                print(f"{trainable:4s} P={prompt_len:6d} G={group_size}: cosine "
                      f"{row['all']['cosine']:.6f}, rel L2 {row['all']['rel_l2']:.4f}, step "
                      f"{t_detached:.1f} s detached / {t_exact:.1f} s exact", flush=True)
    return rows


def train(args, dtype, mode: str) -> list[dict]:
    """`--train-steps` GRPO steps in `mode` from the sweep's weights, on the same groups."""
    import torch

    from megatron_longstraw.step.schedule import train_step

    cfg, model = build(args, "full", dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    group_size = args.group_sizes[0]
    curve = []
    for step in range(args.train_steps):
        group = group_for(args, cfg.vocab_size, args.train_prompt_len, group_size,
                          args.seed + 1000 + step % args.train_groups)
        result = train_step(model, optimizer, group, longstraw_config(args, group_size, mode),
                            max_grad_norm=1.0)
        best = int(torch.argmax(group.rewards))
        curve.append({"step": step, "loss": result.loss, "grad_norm": result.stats["grad_norm"],
                      "best_logprob_mean": float(result.logps[best].double().mean()),
                      "reward_mean": result.stats["reward_mean"]})
    return curve


def write_outputs(args, report: dict) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gradient_bias.json").write_text(json.dumps(report, indent=2) + "\n")
    groups = sorted({g for row in report["sweep"] for g in row["groups"]})
    head = ["trainable", "P", "G", "cosine", "rel L2", *(f"rel L2 {g}" for g in groups),
            "step s (detached / exact)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in report["sweep"]:
        cells = [row["trainable"], str(row["prompt_len"]), str(row["group_size"]),
                 f"{row['all']['cosine']:.6f}", f"{row['all']['rel_l2']:.4f}",
                 *(f"{row['groups'][g]['rel_l2']:.4f}" if g in row["groups"] else "-"
                   for g in groups),
                 f"{row['seconds_detached']:.1f} / {row['seconds_exact']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    (out / "gradient_bias.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if report.get("training"):
        from torch.utils.tensorboard import SummaryWriter

        for mode, curve in report["training"].items():
            writer = SummaryWriter(log_dir=str(out / "tb" / mode))
            for point in curve:
                for key in ("loss", "grad_norm", "best_logprob_mean", "reward_mean"):
                    writer.add_scalar(f"train/{key}", point[key], point["step"])
            writer.close()
        plot(report["training"], out / "training.png")


def plot(training: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for key, ax in zip(("loss", "grad_norm", "best_logprob_mean"), axes):
        for mode, curve in training.items():
            ax.plot([p["step"] for p in curve], [p[key] for p in curve], marker="o", label=mode)
        ax.set_title({"loss": "GRPO loss (0 on-policy: ratio 1, advantages sum to 0)"}.get(key, key),
                     fontsize=9)
        ax.set_xlabel("step")
        ax.legend()
    fig.suptitle("detached vs exact prompt gradient: same weights, same groups")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv=None):
    from megatron_longstraw.models.registry import FAMILIES

    def sizes(text: str) -> list[int]:
        out = []
        for item in text.split(","):
            item = item.strip().upper()
            scale = {"K": 1024, "M": 1024 * 1024}.get(item[-1:], 1)
            out.append(int(item.rstrip("KM")) * scale)
        if not out or min(out) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: give positive sizes, e.g. 1K,4K,32K")
        return out

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(FAMILIES), default="glm52")
    p.add_argument("--config", default=None, help="Model YAML (default: the family's tiny one).")
    p.add_argument("--prompt-lens", type=sizes, default=sizes("1K,2K,4K,8K,16K,32K"))
    p.add_argument("--group-sizes", type=sizes, default=[4, 8])
    p.add_argument("--response-len", type=int, default=32)
    p.add_argument("--lora", action="store_true", help="Also compare with LoRA adapters trained.")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--dtype", choices=("fp32", "fp64"), default="fp32")
    p.add_argument("--train-steps", type=int, default=10)
    p.add_argument("--train-prompt-len", type=int, default=1024)
    p.add_argument("--train-groups", type=int, default=4, help="Groups cycled in the training.")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/gradient-bias")
    args = p.parse_args(argv)
    if min(args.group_sizes) < 2:
        p.error("--group-sizes: GRPO needs at least 2 responses per group")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    import warnings

    import torch

    from megatron_longstraw.distributed import parallel

    warnings.filterwarnings("ignore")
    parallel.initialize(context_parallel_size=1, expert_parallel_size=1)
    dtype = {"fp32": torch.float32, "fp64": torch.float64}[args.dtype]
    report = {"family": args.family, "dtype": args.dtype, "response_len": args.response_len,
              "sweep": sweep(args, dtype)}
    if args.train_steps > 0:
        report["training"] = {mode: train(args, dtype, mode) for mode in ("detached", "exact")}
    write_outputs(args, report)
    return report


if __name__ == "__main__":
    main()
