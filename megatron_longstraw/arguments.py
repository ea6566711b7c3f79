"""The `--longstraw*` command-line flags, as Megatron's `extra_args_provider`, and their resolution
with a YAML config (`--longstraw-config`; command-line flags win).

    from megatron.training.arguments import parse_args
    args = parse_args(extra_args_provider=add_longstraw_args)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import yaml

from megatron_longstraw.config import LongStrawConfig
from megatron_longstraw.kernels.select import KernelChoices

FAMILIES = ("glm52", "qwen36")
# Backend names; membership also accepts per-part specs ("sparse_mla=triton,indexer=ref"); see
# kernels/select.py.
KERNELS = KernelChoices(("auto", "ref", "flashmla", "triton", "deepgemm", "deepep", "te", "apex"))


def _add_schedule_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("longstraw: schedule")
    group.add_argument("--longstraw", action="store_true",
                       help="Run the LongStraw GRPO schedule (capture once, replay each response).")
    group.add_argument("--longstraw-config", type=str, default=None,
                       help="YAML with `model:` and `longstraw:` sections; command-line flags win.")
    group.add_argument("--longstraw-family", choices=FAMILIES, default="glm52",
                       help="Model family.")
    group.add_argument("--longstraw-group-size", type=int, default=None,
                       help="G: responses per prompt (>= 2).")
    group.add_argument("--longstraw-max-response-len", type=int, default=None,
                       help="Longest response accepted; longer ones are rejected before any work.")
    group.add_argument("--longstraw-clip-eps-low", type=float, default=None,
                       help="PPO clip below 1 (ratio >= 1 - eps).")
    group.add_argument("--longstraw-clip-eps-high", type=float, default=None,
                       help="PPO clip above 1 (ratio <= 1 + eps).")
    group.add_argument("--longstraw-kl-coef", type=float, default=None,
                       help="k3 KL coefficient to the reference policy (0 disables it).")
    group.add_argument("--longstraw-seed", type=int, default=None,
                       help="Seed for initialisation and synthetic data (defaults to --seed).")
    return parser


def _add_memory_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("longstraw: memory and kernels")
    group.add_argument("--longstraw-offload-pages", action=argparse.BooleanOptionalAction,
                       default=None, help="Keep prompt pages in host memory and stream them.")
    group.add_argument("--longstraw-page-tokens", type=int, default=None,
                       help="Rows per page of captured state.")
    group.add_argument("--longstraw-checkpoint-layers", action=argparse.BooleanOptionalAction,
                       default=None, help="Whole-decoder-layer activation checkpointing in replay.")
    group.add_argument("--longstraw-kernels", choices=KERNELS, default=None,
                       help="Kernel backend (auto picks the fastest available and logs it).")
    group.add_argument("--longstraw-token-block", type=int, default=None,
                       help="Tokens per chunk for token-wise work in capture.")
    group.add_argument("--longstraw-query-block", type=int, default=None,
                       help="Queries per sparse-attention block.")
    group.add_argument("--longstraw-key-block", type=int, default=None,
                       help="Keys per indexer-score block (running top-k).")
    group.add_argument("--longstraw-dtype", choices=("fp32", "bf16", "fp64"), default=None,
                       help="Parameter dtype (default: bf16 with --bf16, else fp32).")
    return parser


def _add_data_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("longstraw: data and outputs")
    group.add_argument("--longstraw-data", type=str, default=None,
                       help="JSONL of GRPO groups (one per line; see examples/data/README.md).")
    group.add_argument("--longstraw-tokenizer", type=str, default=None,
                       help="Local tokenizer (tokenizer.json or a directory) for text prompts.")
    group.add_argument("--longstraw-synthetic-prompt-len", type=int, default=None,
                       help="Without --longstraw-data: synthetic long-context groups of this length.")
    group.add_argument("--longstraw-synthetic-response-len", type=int, default=64,
                       help="Longest synthetic response.")
    group.add_argument("--longstraw-run-name", type=str, default="longstraw",
                       help="Receipts go to <out-dir>/<run-name>/.")
    group.add_argument("--longstraw-out-dir", type=str, default="runs",
                       help="Folder for receipts.")
    return parser


def add_longstraw_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron `extra_args_provider`: every `--longstraw-*` flag."""
    parser = _add_schedule_args(parser)
    parser = _add_memory_args(parser)
    parser = _add_data_args(parser)
    return parser


_FLAG_TO_FIELD = {
    "longstraw_group_size": "group_size",
    "longstraw_max_response_len": "max_response_len",
    "longstraw_clip_eps_low": "clip_eps_low",
    "longstraw_clip_eps_high": "clip_eps_high",
    "longstraw_kl_coef": "kl_coef",
    "longstraw_offload_pages": "offload_pages",
    "longstraw_page_tokens": "page_tokens",
    "longstraw_checkpoint_layers": "checkpoint_layers",
    "longstraw_kernels": "kernels",
    "longstraw_token_block": "token_block",
    "longstraw_query_block": "query_block",
    "longstraw_key_block": "key_block",
    "longstraw_seed": "seed",
}


def load_yaml(path: str | None) -> dict:
    if path is None:
        return {}
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--longstraw-config {path}: no such file.")
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"--longstraw-config {path}: expected a mapping with `model:` and "
                         "`longstraw:` sections.")
    return data


def longstraw_config_from_args(args: argparse.Namespace) -> LongStrawConfig:
    """YAML `longstraw:` section, overridden by every `--longstraw-*` flag that was given."""
    values = dict(load_yaml(args.longstraw_config).get("longstraw", {}))
    if getattr(args, "seed", None) is not None and "seed" not in values:
        values["seed"] = args.seed
    for flag, field in _FLAG_TO_FIELD.items():
        value = getattr(args, flag, None)
        if value is not None:
            values[field] = value
    return LongStrawConfig.from_dict(values)


def explicit_flags(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """Destinations of the flags actually present in `argv` (defaults suppressed)."""
    probe = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        kwargs = {"dest": action.dest, "default": argparse.SUPPRESS}
        if action.nargs == 0:
            probe.add_argument(*action.option_strings, action="store_const", const=True, **kwargs)
        else:
            probe.add_argument(*action.option_strings, nargs=action.nargs, **kwargs)
    known, _ = probe.parse_known_args(argv)
    return set(vars(known))


def model_config_values(args: argparse.Namespace, given: set[str],
                        from_megatron: dict[str, tuple[str, Callable]]) -> dict:
    """The YAML `model:` section, overridden by the Megatron model flags that were given;
    `from_megatron` maps a flag's dest to (config field, conversion): the family's table in
    families.py (a Megatron default never overrides the YAML, only a flag on the command line)."""
    values = dict(load_yaml(args.longstraw_config).get("model", {}))
    for flag, (field, convert) in from_megatron.items():
        if flag in given and getattr(args, flag, None) is not None:
            values[field] = convert(getattr(args, flag))
    return values
