"""The `--longstraw*` command-line flags, as Megatron's `extra_args_provider`, and their resolution
with a YAML config (`--longstraw-config`; command-line flags win).

    from megatron.training.arguments import parse_args
    args = parse_args(extra_args_provider=add_longstraw_args)
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from megatron_longstraw.adapters.lora import LoRAConfig
from megatron_longstraw.config.fields import add_flags
from megatron_longstraw.config.settings import (SECTIONS, AdapterSettings, LongStrawConfig,
                                                all_settings)
from megatron_longstraw.config.fields import section_settings
from megatron_longstraw.runtime.errors import ConfigError, FlagError, InputNotFound
from megatron_longstraw.models.registry import FAMILIES
from megatron_longstraw.kernels.select import KernelChoices

# Backend names; membership also accepts per-part specs ("sparse_mla=triton,indexer=ref"); see
# kernels/select.py.
KERNELS = KernelChoices(("auto", "ref", "flashmla", "triton", "deepgemm", "deepep", "te", "apex"))


def _add_launcher_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The launcher's own flags: what to run, its data and its outputs (command-line only; the
    YAML `longstraw:` keys are the settings' sections, added by `add_longstraw_args`)."""
    group = parser.add_argument_group("longstraw: launcher")
    group.add_argument("--longstraw", action="store_true",
                       help="Run the LongStraw GRPO schedule (capture once, replay each response).")
    group.add_argument("--longstraw-config", type=str, default=None,
                       help="YAML with `model:` and `longstraw:` sections; command-line flags win.")
    group.add_argument("--longstraw-family", choices=sorted(FAMILIES), default="glm52",
                       help="Model family (megatron_longstraw/models/registry.py; default: the "
                            "one whose config fields the --longstraw-config model: section has, "
                            "else glm52).")
    group.add_argument("--longstraw-dtype", choices=("fp32", "bf16", "fp64"), default=None,
                       help="Parameter dtype (default: bf16 with --bf16, else fp32).")
    group.add_argument("--longstraw-live-bytes", action=argparse.BooleanOptionalAction,
                       default=True,
                       help="Measure each phase's peak live tensor bytes every step (default on). "
                            "On CPU this reads the profiler's allocation events, seconds per step "
                            "on long prompts; on a GPU it reads the allocator's counters.")
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
    group.add_argument("--longstraw-save-merged", type=str, default=None, metavar="DIR",
                       help="After the last step, write base + scaling * B A merged into one "
                            "model-format directory (what --load and tools/convert_hf.py --to-hf "
                            "read). With QLoRA the base is the dequantised NF4 weight the run "
                            "trained against.")
    return parser


def add_longstraw_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron `extra_args_provider`: every `--longstraw-*` flag. The settings' flags are made
    from their fields (config/fields.py `add_flags`), one group per section of
    `LongStrawConfig`, titled with the section and described by its class docstring."""
    parser = _add_launcher_args(parser)
    for name, cls in SECTIONS.items():
        add_flags(parser, section_settings(cls, name), f"longstraw: {name} (YAML longstraw: keys)",
                  choices={"kernels": KERNELS}, description=cls.__doc__)
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


def longstraw_config_from_yaml(path: str) -> LongStrawConfig:
    """The LongStrawConfig of a YAML's `longstraw:` section, with the launcher's checks of the
    file (tools that read a training YAML: tools/score.py, tools/generate.py)."""
    return longstraw_config_from_args(argparse.Namespace(longstraw_config=path))


def longstraw_config_from_args(args: argparse.Namespace) -> LongStrawConfig:
    """YAML `longstraw:` section, overridden by every `--longstraw-*` setting flag that was given
    (a flag's default is None: config/fields.py); `--seed` seeds a run whose YAML has none."""
    values = dict(load_yaml(getattr(args, "longstraw_config", None)).get("longstraw", {}) or {})
    if getattr(args, "seed", None) is not None and "seed" not in values:
        values["seed"] = args.seed
    for s in all_settings():
        value = getattr(args, s.dest, None)
        if value is not None:
            values[s.key] = value
    try:
        return LongStrawConfig.from_dict(values)
    except ValueError as exc:
        if getattr(args, "longstraw_config", None) and str(exc).startswith("Unknown"):
            raise ValueError(f"--longstraw-config {args.longstraw_config}: {exc}") from None
        raise


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


def lora_settings(adapters: AdapterSettings, default_targets: tuple[str, ...],
                  seed: int) -> LoRASettings | None:
    """The run's LoRA / QLoRA request from its `adapters` section (YAML keys overridden by the
    flags given); None for a full-parameter run. ValueError, naming the flag, for settings that do
    not go together and for LoRA settings given while LoRA is off."""
    qlora, fp8_base = adapters.qlora, adapters.fp8_base
    if fp8_base and qlora:
        raise ValueError("--longstraw-fp8-base and --longstraw-qlora (YAML fp8_base, qlora) both "
                         "choose how the frozen base is stored (FP8 blocks, NF4); pass one of "
                         "them.")
    if fp8_base and not adapters.lora:
        raise ValueError("--longstraw-fp8-base (YAML longstraw.fp8_base) keeps the frozen base in "
                         "FP8 under LoRA adapters, but LoRA is off: a full-parameter run updates "
                         "the base, and FP8 blocks cannot be trained in place. Add "
                         "--longstraw-lora, or drop --longstraw-fp8-base (an FP8 checkpoint then "
                         "loads dequantised to the model's dtype).")
    if qlora and adapters.lora is False:
        raise ValueError("--longstraw-qlora trains LoRA adapters on an NF4 base, but LoRA is "
                         "switched off (--no-longstraw-lora or `lora: false`); drop one of them.")
    if not (adapters.lora or qlora):
        # Settings with LoRA switched off explicitly (`lora: false`, --no-longstraw-lora) are a
        # toggle; without any switch they are a forgotten --longstraw-lora.
        extra = sorted(k for k in adapters.given() if k not in ("lora", "qlora"))
        if extra and adapters.lora is not False:
            raise ValueError(f"{', '.join('--longstraw-' + k.replace('_', '-') for k in extra)} "
                             "given, but LoRA is off: add --longstraw-lora (or --longstraw-qlora "
                             "for an NF4 base), or drop the LoRA settings for a full-parameter "
                             "run.")
        return None
    where = "--longstraw-lora-targets (YAML longstraw.lora_targets)"
    targets_given = adapters.lora_targets is not None
    targets = (_patterns(adapters.lora_targets, where) if targets_given
               else tuple(default_targets))
    if not targets:
        raise ValueError(f"{where}: no module names given.")
    exclude = _patterns(adapters.lora_exclude, where.replace("targets", "exclude"))
    config = LoRAConfig(rank=adapters.lora_rank, alpha=float(adapters.lora_alpha),
                        dropout=float(adapters.lora_dropout), targets=targets, exclude=exclude,
                        seed=seed)
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
