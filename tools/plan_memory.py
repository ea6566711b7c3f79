"""Per-rank device peak and host page bytes of a LongStraw GRPO step, and the largest prompt that fits
(logic: megatron_longstraw/planner/).

    python tools/plan_memory.py --config examples/glm52/full.yaml --prompt-len 2.1M --group-size 8 \\
        --response-len 8192 --cp 32 --ep 32 --gpu H20 --trainable lora --json plan.json
    python tools/plan_memory.py --family qwen36 --prompt-len 1M --cp 8 --gpu H20 --trainable lora \\
        --lora-rank 19                    # config: examples/qwen36/full.yaml (the family's default)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_longstraw import planner  # noqa: E402
from megatron_longstraw.config.choices import PromptGrad  # noqa: E402
from megatron_longstraw.models.registry import FAMILIES, family_of_config  # noqa: E402

# The full-size plan's layout per family (Family.planner), for --help.
_LAYOUTS = {name: (f.planner.cp, f.planner.ep) for name, f in sorted(FAMILIES.items())}

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40,
          "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}


def quantity(text: str) -> int:
    """'2.1M' -> 2100000, '96GB' -> 96e9, '1TiB' -> 2**40, '116e6' -> 116000000."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a quantity: {text!r} (e.g. 2.1M, 96GB, 1TiB)")
    return int(round(float(m.group(1)) * _UNITS[m.group(2).lower()]))


def gpu_bytes(text: str) -> int:
    return planner.GPU_BYTES[text.upper()] if text.upper() in planner.GPU_BYTES else quantity(text)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(FAMILIES), default=None,
                   help="default: the family whose config fields --config has, else glm52")
    p.add_argument("--config", default=None,
                   help="model YAML (default: the family's full-size example, "
                        "examples/<family>/full.yaml); its longstraw: section gives the block sizes")
    p.add_argument("--prompt-len", type=quantity, default=quantity("2.1M"))
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--response-len", type=quantity, default=8192)
    p.add_argument("--updates-per-capture", type=int, default=1, metavar="K",
                   help="--longstraw-updates-per-capture: G x K members per prompt, held through "
                        "the capture's K updates (host: their tables and DSA selections)")
    p.add_argument("--drift", action="store_true",
                   help="the drift measured (--longstraw-drift-every / -first-last, K > 1): a "
                        "fresh capture's pages beside the kept ones while it runs")
    p.add_argument("--reuse-branch-pages", action="store_true",
                   help="--longstraw-reuse-branch-pages: scoring keeps every member's branch "
                        "pages for replay (host: the branch lines times G)")
    p.add_argument("--response-block", type=quantity, default=None,
                   help="--longstraw-response-block: a longer response is scored and replayed "
                        "block by block (default: the config's, else LongStrawConfig's)")
    p.add_argument("--cp", type=int, default=None, help="default: " + ", ".join(
        f"{cp} ({name})" for name, (cp, _) in _LAYOUTS.items()))
    p.add_argument("--ep", type=int, default=None, help="default: " + ", ".join(
        f"{ep} ({name})" for name, (_, ep) in _LAYOUTS.items()))
    p.add_argument("--weight-dtype", choices=sorted(planner.DTYPE_BYTES), default="bf16",
                   help="fp8: the FP8 base (--longstraw-fp8-base): the family's FP8 linears in "
                        "FP8 with an fp32 scale per 128x128 block, the rest in --act-dtype; nf4: "
                        "QLoRA, the adapted linears in NF4")
    p.add_argument("--act-dtype", choices=["fp64", "fp32", "bf16", "fp16"], default=None,
                   help="default: the weight dtype (bf16 for fp8/nf4 weights)")
    p.add_argument("--latent-dtype", choices=["fp64", "fp32", "bf16", "fp16"], default="bf16",
                   help="page rows: GLM latents, Qwen K/V rows and GDN conv tails (the model's "
                        "dtype; the GDN state is fp32)")
    p.add_argument("--index-key-dtype", choices=["fp64", "fp32", "bf16", "fp8"], default=None,
                   help="fp8: one byte per value plus one fp32 scale per row (default: the "
                        "config's longstraw index_key_pages: fp8, or model = --latent-dtype)")
    p.add_argument("--gpu", type=gpu_bytes, default=planner.GPU_BYTES["H20"],
                   help=f"{', '.join(planner.GPU_BYTES)} or a size (e.g. 96GB)")
    p.add_argument("--device-reserve", type=quantity, default=4 * planner.GiB)
    p.add_argument("--host-memory", type=quantity, default=1024 * planner.GiB, help="per node")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--host-reserve", type=quantity, default=4 * planner.GiB, help="per rank")
    p.add_argument("--trainable", choices=sorted(planner.TRAINABLE), default="all")
    p.add_argument("--lora-rank", type=int, default=64)
    p.add_argument("--lora-experts", action="store_true",
                   help="adapters on the routed experts too (default: attention, dense and shared MLP)")
    p.add_argument("--trainable-params", type=quantity, default=None)
    p.add_argument("--shard-optimizer", action="store_true",
                   help="distributed optimizer: master weights and moments sharded over DP x CP")
    p.add_argument("--kl", action="store_true", help="a reference capture for the KL term")
    p.add_argument("--moe-imbalance", type=float, default=1.0)
    p.add_argument("--prompt-grad", choices=[g.value for g in PromptGrad],
                   default=PromptGrad.DETACHED.value,
                   help="exact: add what the exact prompt gradient keeps (host: layer inputs; "
                        "device: page leaves and cotangents)")
    p.add_argument("--gdn-kernels", choices=("fla", "torch"), default="fla",
                   help="Qwen3.6's delta rule: fla (the GPU's kernels; their working sets are "
                        "analytic) or torch (Megatron-Core's chunked rule, what the CPU runs: "
                        "every line checked against the live-bytes meter)")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    if args.family is None:
        from megatron_longstraw.training.arguments import load_yaml

        found = family_of_config(load_yaml(args.config).get("model") or {}) if args.config \
            else None
        args.family = found or "glm52"
    return args


def build_spec(args) -> planner.PlanSpec:
    from megatron_longstraw.config.settings import LongStrawConfig

    family = FAMILIES[args.family]
    if args.weight_dtype == "fp8" and not family.fp8_linears:
        sys.exit(f"plan_memory.py: error: --weight-dtype fp8 plans the FP8 base "
                 f"(--longstraw-fp8-base), which --family {args.family} does not have "
                 "(Family.fp8_linears is empty); plan bf16 or nf4 weights.")
    config = args.config or str(ROOT / family.full_config)
    blocks = LongStrawConfig.from_yaml(config)
    model = family.config_class.from_yaml(config)
    key_width = family.planner.index_key_width(model)
    cp = args.cp if args.cp is not None else family.planner.cp
    ep = args.ep if args.ep is not None else family.planner.ep
    weight = planner.DTYPE_BYTES[args.weight_dtype]
    act = planner.DTYPE_BYTES[args.act_dtype] if args.act_dtype else (weight if weight >= 2 else 2.0)
    # The launcher's index-key pages (--longstraw-index-key-pages, YAML index_key_pages): "model"
    # stores them like the latents, "fp8" with one fp32 scale per row (pages.py).
    index_dtype = args.index_key_dtype or ("fp8" if blocks.capture.index_key_pages == "fp8"
                                           else args.latent_dtype)
    index = (1 + 4 / key_width if index_dtype == "fp8"
             else planner.DTYPE_BYTES[index_dtype])
    return planner.PlanSpec(
        family=args.family, model=model, prompt_len=args.prompt_len, group_size=args.group_size,
        response_len=args.response_len, cp=cp, ep=ep, weight_bytes=weight, act_bytes=act,
        fp8_base=args.weight_dtype == "fp8",
        latent_bytes=planner.DTYPE_BYTES[args.latent_dtype], index_key_bytes=index,
        trainable=args.trainable, lora_rank=args.lora_rank, lora_experts=args.lora_experts,
        trainable_params=args.trainable_params,
        shard_optimizer=args.shard_optimizer, kl=args.kl, page_tokens=blocks.capture.page_tokens,
        response_block=args.response_block or blocks.replay.response_block,
        reuse_branch_pages=args.reuse_branch_pages or blocks.replay.reuse_branch_pages,
        token_block=blocks.capture.token_block, query_block=blocks.capture.query_block, key_block=blocks.capture.key_block,
        gpu_bytes=args.gpu, device_reserve=args.device_reserve, host_bytes=args.host_memory,
        ranks_per_node=args.ranks_per_node, host_reserve_per_rank=args.host_reserve,
        moe_imbalance=args.moe_imbalance, prompt_grad=args.prompt_grad,
        gdn_kernels=args.gdn_kernels, updates_per_capture=args.updates_per_capture,
        drift=args.drift)


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = planner.plan(build_spec(args))
    print(planner.format_plan(result))
    figures = result.to_dict()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
    return figures


if __name__ == "__main__":
    main()
