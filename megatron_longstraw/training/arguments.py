"""The `--longstraw*` command-line flags, as Megatron's `extra_args_provider`, and their resolution
with a YAML config (`--longstraw-config`; command-line flags win).

    from megatron.training.arguments import parse_args
    args = parse_args(extra_args_provider=add_longstraw_args)
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from megatron_longstraw.adapters.lora import LoRAConfig
from megatron_longstraw.config.settings import ADAPTER_KEYS, LongStrawConfig
from megatron_longstraw.state.attention_pass import PromptGrad
from megatron_longstraw.runtime.errors import ConfigError, FlagError, InputNotFound
from megatron_longstraw.models.registry import FAMILIES
from megatron_longstraw.kernels.select import KernelChoices
from megatron_longstraw.config.loss import TIS_MODES
from megatron_longstraw.state.pages import PAGE_FORMATS
from megatron_longstraw.training.rl_arguments import RL_FLAG_TO_FIELD, add_rl_args

# Backend names; membership also accepts per-part specs ("sparse_mla=triton,indexer=ref"); see
# kernels/select.py.
KERNELS = KernelChoices(("auto", "ref", "flashmla", "triton", "deepgemm", "deepep", "te", "apex"))


def _add_schedule_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("longstraw: schedule")
    group.add_argument("--longstraw", action="store_true",
                       help="Run the LongStraw GRPO schedule (capture once, replay each response).")
    group.add_argument("--longstraw-config", type=str, default=None,
                       help="YAML with `model:` and `longstraw:` sections; command-line flags win.")
    group.add_argument("--longstraw-family", choices=sorted(FAMILIES), default="glm52",
                       help="Model family (megatron_longstraw/models/registry.py; default: the "
                            "one whose config fields the --longstraw-config model: section has, "
                            "else glm52).")
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
    group.add_argument("--longstraw-adv-eps", type=float, default=None,
                       help="Added to the group's reward std in the advantage denominator, "
                            "A_i = (r_i - mean(r)) / (std(r) + eps) (> 0; default 1e-6).")
    group.add_argument("--longstraw-std-unbiased", action=argparse.BooleanOptionalAction,
                       default=None, help="Advantages divide by the sample std of the group's "
                                          "rewards (G - 1) instead of the population std (G; the "
                                          "default).")
    group.add_argument("--longstraw-seed", type=int, default=None,
                       help="Seed for initialisation and synthetic data (defaults to --seed).")
    group.add_argument("--longstraw-tis", choices=TIS_MODES, default=None,
                       help="Engine-trainer correction when the data carries the engine's "
                            "logprobs_old: truncate (default) weights each token's policy term "
                            "by min(pi_old / pi_engine, C), mask by the ratio inside [1/C, C] "
                            "and 0 outside, off by 1. The PPO ratio's denominator is always the "
                            "trainer's own pi_old; the mismatch is logged either way.")
    group.add_argument("--longstraw-tis-cap", type=float, default=None, metavar="C",
                       help="C of --longstraw-tis (>= 1; default 2.0).")
    group.add_argument("--longstraw-rollout", choices=("offline", "online"), default=None,
                       help="offline (default): train on the groups of --longstraw-data; online: "
                            "--longstraw-data holds prompts, each step generates the group's "
                            "responses from its own capture and rewards them with "
                            "--longstraw-reward (docs/usage.md \"Generation and the online "
                            "loop\").")
    group.add_argument("--longstraw-max-new-tokens", type=int, default=None,
                       help="Online: most tokens per generated response (default: "
                            "--longstraw-max-response-len).")
    group.add_argument("--longstraw-temperature", type=float, default=None,
                       help="Online sampling temperature (default 1; 0: greedy).")
    group.add_argument("--longstraw-top-p", type=float, default=None,
                       help="Online nucleus sampling (default 1: off).")
    group.add_argument("--longstraw-top-k", type=int, default=None,
                       help="Online top-k sampling (default 0: off).")
    group.add_argument("--longstraw-stop-ids", type=int, nargs="*", default=None,
                       help="Online: token ids that end a response (kept in it).")
    group.add_argument("--longstraw-control", choices=("none", "zeros"), default=None,
                       help="Online control run: zeros replaces the captured prompt state by "
                            "zeros (the policy sees nothing of the prompt but its last token).")
    group.add_argument("--longstraw-reward", type=str, default=None, metavar="MODULE:FUNCTION",
                       help="Reward function fn(prompt_ids, response_ids, response_text, meta) "
                            "-> float for records without 'rewards' (built-ins: "
                            "longstraw:exact_match, longstraw:marker_majority, marker_copy, "
                            "marker_missing, marker_first; docs/usage.md "
                            "\"Rewards\").")
    return parser


def _add_memory_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("longstraw: memory and kernels")
    group.add_argument("--longstraw-offload-pages", action=argparse.BooleanOptionalAction,
                       default=None, help="Keep prompt pages in host memory and stream them.")
    group.add_argument("--longstraw-page-tokens", type=int, default=None,
                       help="Rows per page of captured state.")
    group.add_argument("--longstraw-index-key-pages", choices=PAGE_FORMATS, default=None,
                       help="DSA index-key pages (GLM-5.2): model (the model's dtype; default) "
                            "or fp8 (e4m3 + one fp32 scale per token, 132 B at index_head_dim "
                            "128: changes only which keys the top-k selects).")
    group.add_argument("--longstraw-checkpoint-layers", action=argparse.BooleanOptionalAction,
                       default=None, help="Whole-decoder-layer activation checkpointing in replay.")
    group.add_argument("--longstraw-prompt-grad", choices=[g.value for g in PromptGrad],
                       default=None,
                       help="detached: the gradient at fixed prompt state (default); exact: "
                            "also back-propagate through the prompt (standard GRPO's update; "
                            "keeps every layer's prompt input in host memory).")
    group.add_argument("--longstraw-kernels", choices=KERNELS, default=None,
                       help="Kernel backend (auto picks the fastest available and logs it).")
    group.add_argument("--longstraw-token-block", type=int, default=None,
                       help="Tokens per chunk for token-wise work in capture.")
    group.add_argument("--longstraw-response-block", type=int, default=None,
                       help="Tokens per block of a response in scoring and replay: longer "
                            "responses run block by block (device memory bounded by a block; "
                            "the same update).")
    group.add_argument("--longstraw-reuse-branch-pages", action=argparse.BooleanOptionalAction,
                       default=None,
                       help="Blockwise responses: scoring keeps every member's branch pages "
                            "(host memory) so replay skips one forward of the branch.")
    group.add_argument("--longstraw-capture", choices=("streamed", "whole"), default=None,
                       help="Streamed capture (token blocks, the residual stream in host "
                            "memory, under CP the layer's rows exchanged through host memory; "
                            "default) or whole (each layer over the rank's whole shard on the "
                            "device: the reference).")
    group.add_argument("--longstraw-query-block", type=int, default=None,
                       help="Queries per sparse-attention block.")
    group.add_argument("--longstraw-key-block", type=int, default=None,
                       help="Keys per indexer-score block (running top-k).")
    group.add_argument("--longstraw-dtype", choices=("fp32", "bf16", "fp64"), default=None,
                       help="Parameter dtype (default: bf16 with --bf16, else fp32).")
    group.add_argument("--longstraw-live-bytes", action=argparse.BooleanOptionalAction,
                       default=True,
                       help="Measure each phase's peak live tensor bytes every step (default on). "
                            "On CPU this reads the profiler's allocation events, seconds per step "
                            "on long prompts; on a GPU it reads the allocator's counters.")
    return parser


def _add_data_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("longstraw: data and outputs")
    group.add_argument("--longstraw-data", type=str, default=None,
                       help="JSONL of GRPO groups (one per line; see examples/data/README.md).")
    group.add_argument("--longstraw-data-shuffle", action=argparse.BooleanOptionalAction,
                       default=True, help="Visit --longstraw-data in a new seeded order each "
                                          "epoch (--seed); --no-longstraw-data-shuffle keeps "
                                          "the file's order.")
    group.add_argument("--longstraw-eval-data", type=str, default=None,
                       help="JSONL of held-out groups, scored every --eval-interval steps and "
                            "after the last one with the first --eval-iters groups (log-probs of "
                            "their responses; rewards optional).")
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


def _add_lora_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(
        "longstraw: LoRA / QLoRA / FP8 base (YAML `longstraw:` keys lora, qlora, fp8_base, "
        "lora_rank, lora_alpha, lora_dropout, lora_targets, lora_exclude)")
    group.add_argument("--longstraw-lora", action=argparse.BooleanOptionalAction, default=None,
                       help="Train LoRA adapters on a frozen base instead of every parameter.")
    group.add_argument("--longstraw-qlora", action=argparse.BooleanOptionalAction, default=None,
                       help="LoRA with the frozen base in NF4 (bitsandbytes, block size 64, double "
                            "quantisation); implies --longstraw-lora.")
    group.add_argument("--longstraw-fp8-base", action=argparse.BooleanOptionalAction, default=None,
                       help="With --longstraw-lora: keep the frozen base's linears in FP8 e4m3 "
                            "with one fp32 scale per 128 x 128 block (megatron_longstraw/kernels/fp8.py): "
                            "the FP8 weights of a converted FP8 checkpoint as they ship, or, for a "
                            "bf16 / fp32 base, the family's FP8 linears quantised at load. Not "
                            "with --longstraw-qlora; not for full-parameter training.")
    group.add_argument("--longstraw-lora-rank", type=int, default=None,
                       help=f"Adapter rank r (default {LORA_DEFAULTS['lora_rank']}).")
    group.add_argument("--longstraw-lora-alpha", type=float, default=None,
                       help="The update is scaled by alpha / rank (default "
                            f"{LORA_DEFAULTS['lora_alpha']:g}).")
    group.add_argument("--longstraw-lora-dropout", type=float, default=None,
                       help="Dropout on the adapters' input, in [0, 1) (default 0); applied "
                            "in replay only (capture and scoring run without it).")
    group.add_argument("--longstraw-lora-targets", nargs="+", default=None, metavar="PATTERN",
                       help="Linear layers that get adapters: names or fnmatch patterns matched "
                            "against a module's last name component or its full name (default: "
                            "the family's: Family.lora_targets, models/<family>/family.py). Each "
                            "must match a linear layer of the model.")
    group.add_argument("--longstraw-lora-exclude", nargs="+", default=None, metavar="PATTERN",
                       help="Modules to leave without adapters, e.g. '*.experts.*'.")
    group.add_argument("--longstraw-save-merged", type=str, default=None, metavar="DIR",
                       help="After the last step, write base + scaling * B A merged into one "
                            "model-format directory (what --load and tools/convert_hf.py --to-hf "
                            "read). With QLoRA the base is the dequantised NF4 weight the run "
                            "trained against.")
    return parser


def add_longstraw_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron `extra_args_provider`: every `--longstraw-*` flag."""
    parser = _add_schedule_args(parser)
    parser = _add_memory_args(parser)
    parser = _add_data_args(parser)
    parser = _add_lora_args(parser)
    parser = add_rl_args(parser)
    return parser


class LauncherParser(argparse.ArgumentParser):
    """argparse whose errors (unknown flag, bad value, missing value) raise a one-line `FlagError`
    (errors.py: reported once by rank 0, exit code 2) instead of printing the usage text on every
    rank: Megatron's usage line alone lists several hundred flags."""

    def error(self, message):
        raise FlagError(f"{message} ({self.prog} --help lists the flags).")


def build_parser(description: str = "Megatron-LM arguments + LongStraw") -> argparse.ArgumentParser:
    """Megatron's parser (as `megatron.training.arguments.parse_args` builds it) + ours, with
    Megatron's help strings made printable (`escape_help_percents`)."""
    from megatron.training.arguments import add_megatron_arguments

    parser = LauncherParser(description=description, allow_abbrev=False)
    parser = add_longstraw_args(add_megatron_arguments(parser))
    escape_help_percents(parser)
    fractional_timeout(parser)
    return parser


# ---- Megatron adaptation: --distributed-timeout-minutes in fractions of a minute ------------------
# Covers: megatron.training.arguments (megatron-core 0.19.2) declares --distributed-timeout-minutes
# with type int (default 10). Why: a hung-rank test must end in seconds, and a user may want a bound
# under a minute. Unchanged results: every integer Megatron accepts parses to the same value (an
# int-valued float); the value only sets the process groups' timeout (parallel.initialize).


def positive_minutes(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text}: must be > 0 minutes (fractions allowed: 0.5 = "
                                         "30 s)")
    return value


def fractional_timeout(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if action.dest == "distributed_timeout_minutes":
            action.type = positive_minutes
            action.help = ("Timeout of every collective on every process group, in minutes "
                           "(fractions allowed: 0.5 = 30 s; default 10, Megatron's): a rank whose "
                           "peer hangs or died fails within it.")


# ---- Megatron adaptation: printable help strings ------------------------------------------------
# Covers: megatron.training.arguments.add_megatron_arguments (megatron-core 0.19.2). Its
# ArgumentGroupFactory copies TransformerConfig field docstrings into help strings verbatim, and the
# docstring of `moe_paged_stash_buffer_size_factor_cuda` ends "(e.g. 1.10 = 10%)": argparse's help
# formatter reads every help string as a %-format, so `--help` raised "ValueError: unsupported
# format character ')'" before printing anything.
# Why: `examples/pretrain_gpt.py --help` must list the flags (ours included).
# Unchanged results: only the help text of actions whose help does not format is touched (a bare %
# becomes %%, which prints as %); option names, types, defaults and destinations stay as Megatron
# defines them, so every command line parses to the same arguments. Megatron itself is not patched.
_PERCENT_TOKEN = re.compile(r"%%|%\([^)]*\)[#0 +-]*\d*(?:\.\d+)?[diouxXeEfFgGcrsa]|%")


def escape_help_percents(parser: argparse.ArgumentParser) -> list[str]:
    """Escape the bare % of every help string argparse cannot format (see above); returns the
    options changed."""
    formatter = parser._get_formatter()
    changed = []
    for action in parser._actions:
        if not isinstance(action.help, str) or "%" not in action.help:
            continue
        try:
            formatter._expand_help(action)
            continue
        except (ValueError, TypeError, KeyError):
            pass
        original = action.help
        action.help = _PERCENT_TOKEN.sub(lambda m: "%%" if m.group(0) == "%" else m.group(0),
                                         original)
        try:
            formatter._expand_help(action)
        except (ValueError, TypeError, KeyError):   # e.g. %(unknown)s: print it literally
            action.help = original.replace("%", "%%")
        changed.append(action.option_strings[0] if action.option_strings else action.dest)
    return changed


_FLAG_TO_FIELD = {
    "longstraw_group_size": "group_size",
    "longstraw_max_response_len": "max_response_len",
    "longstraw_clip_eps_low": "clip_eps_low",
    "longstraw_clip_eps_high": "clip_eps_high",
    "longstraw_kl_coef": "kl_coef",
    "longstraw_adv_eps": "adv_eps",
    "longstraw_std_unbiased": "std_unbiased",
    "longstraw_offload_pages": "offload_pages",
    "longstraw_page_tokens": "page_tokens",
    "longstraw_index_key_pages": "index_key_pages",
    "longstraw_checkpoint_layers": "checkpoint_layers",
    "longstraw_prompt_grad": "prompt_grad",
    "longstraw_kernels": "kernels",
    "longstraw_token_block": "token_block",
    "longstraw_response_block": "response_block",
    "longstraw_reuse_branch_pages": "reuse_branch_pages",
    "longstraw_capture": "capture",
    "longstraw_query_block": "query_block",
    "longstraw_key_block": "key_block",
    "longstraw_seed": "seed",
    "longstraw_tis": "tis",
    "longstraw_tis_cap": "tis_cap",
    "longstraw_reward": "reward",
    "longstraw_rollout": "rollout",
    "longstraw_max_new_tokens": "max_new_tokens",
    "longstraw_temperature": "temperature",
    "longstraw_top_p": "top_p",
    "longstraw_top_k": "top_k",
    "longstraw_stop_ids": "stop_ids",
    "longstraw_control": "control",
}


_FLAG_TO_FIELD.update(RL_FLAG_TO_FIELD)


def load_yaml(path: str | None) -> dict:
    if path is None:
        return {}
    p = Path(path)
    if not p.is_file():
        raise InputNotFound(f"--longstraw-config {path}: no such file.")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        context, start = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        if context and start is not None and start is not mark:
            problem += f"; {context} from line {start.line + 1} column {start.column + 1}"
        raise ConfigError(f"--longstraw-config {path}{where}: not valid YAML ({problem}).") \
            from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--longstraw-config {path}: not UTF-8 text ({exc.reason} at byte "
                          f"{exc.start}).") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--longstraw-config {path}: expected a mapping with `model:` and "
                          "`longstraw:` sections.")
    for section in ("model", "longstraw"):
        if data.get(section) is not None and not isinstance(data[section], dict):
            raise ConfigError(f"--longstraw-config {path}: `{section}:` must be a mapping of "
                              f"settings, got {type(data[section]).__name__}.")
    return data


def _yaml_longstraw_section(args: argparse.Namespace) -> dict:
    values = dict(load_yaml(args.longstraw_config).get("longstraw", {}) or {})
    known = {f.name for f in dataclasses.fields(LongStrawConfig)} | set(LORA_DEFAULTS)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"--longstraw-config {args.longstraw_config}: unknown longstraw settings "
                         f"{unknown}; known: {sorted(known)}.")
    return values


def longstraw_config_from_yaml(path: str) -> LongStrawConfig:
    """The LongStrawConfig of a YAML's `longstraw:` section with the launcher's LoRA keys set
    aside: for tools that read a training YAML but train nothing (tools/score.py)."""
    return longstraw_config_from_args(argparse.Namespace(longstraw_config=path))


def longstraw_config_from_args(args: argparse.Namespace) -> LongStrawConfig:
    """YAML `longstraw:` section, overridden by every `--longstraw-*` flag that was given (the
    LoRA keys go to `lora_settings_from_args`)."""
    values = {k: v for k, v in _yaml_longstraw_section(args).items() if k not in LORA_DEFAULTS}
    if getattr(args, "seed", None) is not None and "seed" not in values:
        values["seed"] = args.seed
    for flag, field in _FLAG_TO_FIELD.items():
        value = getattr(args, flag, None)
        if value is not None:
            values[field] = value
    return LongStrawConfig.from_dict(values)


LORA_DEFAULTS = dict(zip(ADAPTER_KEYS, (False, False, 64, 16.0, 0.0, None, (), False)))
"""YAML `longstraw:` LoRA keys and their defaults (rank and alpha: adapters.LoRAConfig's, the QLoRA
paper's r = 64, alpha = 16; targets None: the family's)."""
_LORA_FLAGS = {key: "--longstraw-" + key.replace("_", "-") for key in LORA_DEFAULTS}


@dataclass(frozen=True)
class LoRASettings:
    """The resolved LoRA / QLoRA request of a launcher run."""

    config: LoRAConfig
    """Rank, alpha, dropout, targets, exclude, seed: what `adapters.apply_lora` takes."""
    quantize_base: bool
    """QLoRA: the frozen base weights of the wrapped linears in NF4."""
    targets_given: bool
    """The targets came from the flag or YAML (each must match a linear layer); else the family's
    defaults (those the model lacks, e.g. GLM-5.2's q projections at q_lora_rank None, are
    dropped)."""
    fp8_base: bool = False
    """The frozen base's linears in FP8 blocks (fp8_base.apply_fp8_base), adapters on top."""

    def record(self) -> dict:
        """What a checkpoint stores to check a resumed run asks for the same adapters."""
        cfg = self.config
        return {"rank": cfg.rank, "alpha": cfg.alpha, "dropout": cfg.dropout,
                "targets": list(cfg.targets), "exclude": list(cfg.exclude),
                "quantize_base": self.quantize_base,
                **({"fp8_base": True} if self.fp8_base else {})}

    def describe(self) -> str:
        cfg = self.config
        kind = ("QLoRA (NF4 base)" if self.quantize_base
                else "LoRA on an FP8 base" if self.fp8_base else "LoRA")
        return (f"{kind} rank {cfg.rank}, alpha "
                f"{cfg.alpha:g}, dropout {cfg.dropout:g}, targets {', '.join(cfg.targets)}"
                + (f", exclude {', '.join(cfg.exclude)}" if cfg.exclude else ""))


def _patterns(value, where: str) -> tuple[str, ...]:
    """Flag words or a YAML string / list -> patterns; commas also separate."""
    items = [value] if isinstance(value, str) else list(value)
    if not all(isinstance(item, str) for item in items):
        raise ValueError(f"{where}: expected module names or patterns, got {value!r}.")
    return tuple(p.strip() for item in items for p in item.split(",") if p.strip())


def lora_settings_from_args(args: argparse.Namespace, default_targets: tuple[str, ...],
                            seed: int) -> LoRASettings | None:
    """The YAML `longstraw:` LoRA keys overridden by the `--longstraw-lora*` / `--longstraw-qlora`
    flags that were given; None for a full-parameter run. ValueError, naming the flag, for values
    out of range and for LoRA settings given while LoRA is off."""
    values = {k: v for k, v in _yaml_longstraw_section(args).items() if k in LORA_DEFAULTS}
    for key in LORA_DEFAULTS:
        flag_value = getattr(args, "longstraw_" + key, None)
        if flag_value is not None:
            values[key] = flag_value
    def where(key: str) -> str:
        return f"{_LORA_FLAGS[key]} (YAML longstraw.{key})"
    for key in ("lora", "qlora", "fp8_base"):
        if not isinstance(values.get(key, False), bool):
            raise ValueError(f"{where(key)}: expected true or false, got {values[key]!r}.")
    qlora, fp8_base = values.get("qlora", False), values.pop("fp8_base", False)
    if fp8_base and qlora:
        raise ValueError("--longstraw-fp8-base and --longstraw-qlora (YAML fp8_base, qlora) both "
                         "choose how the frozen base is stored (FP8 blocks, NF4); pass one of "
                         "them.")
    if fp8_base and not values.get("lora", False):
        raise ValueError("--longstraw-fp8-base (YAML longstraw.fp8_base) keeps the frozen base in "
                         "FP8 under LoRA adapters, but LoRA is off: a full-parameter run updates "
                         "the base, and FP8 blocks cannot be trained in place. Add "
                         "--longstraw-lora, or drop --longstraw-fp8-base (an FP8 checkpoint then "
                         "loads dequantised to the model's dtype).")
    if qlora and values.get("lora") is False:
        raise ValueError("--longstraw-qlora trains LoRA adapters on an NF4 base, but LoRA is "
                         "switched off (--no-longstraw-lora or `lora: false`); drop one of them.")
    if not (values.get("lora", False) or qlora):
        # Settings with LoRA switched off explicitly (`lora: false`, --no-longstraw-lora) are a
        # toggle; without any switch they are a forgotten --longstraw-lora.
        extra = sorted(k for k in values if k not in ("lora", "qlora"))
        if extra and values.get("lora") is not False:
            raise ValueError(f"{', '.join(_LORA_FLAGS[k] for k in extra)} given, but LoRA is off: "
                             "add --longstraw-lora (or --longstraw-qlora for an NF4 base), or drop "
                             "the LoRA settings for a full-parameter run.")
        return None
    settings = {**LORA_DEFAULTS, **values}
    rank, alpha, dropout = settings["lora_rank"], settings["lora_alpha"], settings["lora_dropout"]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where('lora_rank')} must be a positive integer, got {rank!r}.")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(f"{where('lora_alpha')} must be > 0, got {alpha!r}.")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) \
            or not 0.0 <= dropout < 1.0:
        raise ValueError(f"{where('lora_dropout')} must be in [0, 1), got {dropout!r}.")
    targets_given = settings["lora_targets"] is not None
    targets = (_patterns(settings["lora_targets"], where("lora_targets")) if targets_given
               else tuple(default_targets))
    if not targets:
        raise ValueError(f"{where('lora_targets')}: no module names given.")
    exclude = _patterns(settings["lora_exclude"], where("lora_exclude"))
    config = LoRAConfig(rank=rank, alpha=float(alpha), dropout=float(dropout), targets=targets,
                        exclude=exclude, seed=seed)
    return LoRASettings(config, quantize_base=qlora, targets_given=targets_given,
                        fp8_base=fp8_base)


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
                        from_megatron: dict[str, tuple[str, Callable]],
                        base: dict | None = None) -> dict:
    """The YAML `model:` section (or `base`, the model config a converted folder or checkpoint
    records, when there is no YAML), overridden by the Megatron model flags that were given;
    `from_megatron` maps a flag's dest to (config field, conversion): the family record's
    (models/<family>/family.py; a Megatron default never overrides the YAML, only a flag on the
    command line)."""
    values = dict(base if base is not None else load_yaml(args.longstraw_config).get("model", {}))
    for flag, (field, convert) in from_megatron.items():
        if flag in given and getattr(args, flag, None) is not None:
            values[field] = convert(getattr(args, flag))
    return values
