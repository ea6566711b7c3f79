"""Which of Megatron's flags the launcher honours; every other one given with a value other than
its default is refused by name (`refuse_unimplemented`), never silently ignored.

The launcher parses all of Megatron's flags (one parser, arguments.py: a Megatron command line
parses as it would for pretrain_gpt.py), but implements only those in `HONOURED` plus the model
flags of the run's family (`Family.from_megatron`: `--num-layers`, `--hidden-size`, ...). Anything
else would do nothing here: `--optimizer sgd` would train with Adam, `--fp16` in fp32, `--data-path`
read no data. A flag given with its default value changes nothing and is accepted (a Megatron
script's `--micro-batch-size 1`, `--optimizer adam`). docs/design.md ("Megatron flags") lists
`HONOURED`; tests/test_operations_flags.py keeps the two equal.
"""

from __future__ import annotations

import argparse

from megatron_longstraw.models.registry import get_family
from megatron_longstraw.runtime.errors import ConfigError
from megatron_longstraw.training.arguments import build_parser

HONOURED: dict[str, tuple[str, ...]] = {
    "parallel layout (TP, PP, expert-TP: size 1 only)": (
        "tensor_model_parallel_size", "pipeline_model_parallel_size",
        "expert_tensor_parallel_size", "context_parallel_size", "expert_model_parallel_size",
        "distributed_timeout_minutes"),
    "steps and batches (micro-batch: 1 only)": (
        "train_iters", "micro_batch_size", "global_batch_size", "seed", "bf16", "clip_grad",
        "check_for_nan_in_loss_and_grad"),
    "optimizer (Adam with decoupled weight decay) and LR schedule": (
        "lr", "min_lr", "lr_decay_style", "lr_decay_iters", "lr_warmup_iters",
        "lr_warmup_fraction", "lr_warmup_init", "lr_wsd_decay_iters", "lr_wsd_decay_style",
        "decoupled_lr", "decoupled_min_lr", "weight_decay", "start_weight_decay",
        "end_weight_decay", "weight_decay_incr_style", "adam_beta1", "adam_beta2", "adam_eps",
        "override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"),
    "checkpoints": ("save", "save_interval", "load", "pretrained_checkpoint",
                    "exit_on_missing_checkpoint"),
    "exit conditions": ("exit_signal_handler", "exit_signal", "exit_duration_in_mins",
                        "exit_interval"),
    "evaluation and logging": ("eval_interval", "eval_iters", "tensorboard_dir"),
}
"""Megatron flag destinations the launcher implements (besides the family's model flags), by
concern."""

HINTS = {
    "optimizer": "the launcher's optimizer is Adam with decoupled weight decay (AdamW)",
    "fp16": "use --bf16 or --longstraw-dtype",
    "data_path": "use --longstraw-data",
    "tokenizer_model": "use --longstraw-tokenizer",
    "tokenizer_type": "use --longstraw-tokenizer",
    "transformer_impl": "--longstraw-kernels selects the backends",
    "distributed_backend": "NCCL on GPUs and gloo on CPU are chosen for you",
    "finetune": "pass the initial weights with --pretrained-checkpoint",
    "log_interval": "every step is logged",
    "seq_length": "the prompt and response lengths come from the data",
}
"""What to do instead, for the unimplemented flags a Megatron user passes most."""


def honoured(from_megatron) -> set[str]:
    return {dest for dests in HONOURED.values() for dest in dests} | set(from_megatron)


def refuse_unimplemented(args: argparse.Namespace, given: set[str], family: str) -> None:
    """ConfigError naming every Megatron flag in `given` that the launcher does not implement
    (module docstring) and whose value differs from Megatron's default. Megatron's data flags
    are refused before, with their own message (group_sources.check_data_flags)."""
    parser = build_parser()   # the defaults (0.1 s: Megatron is imported by then)
    from_megatron = get_family(family).from_megatron
    keep = honoured(from_megatron)
    refused = []
    for action in parser._actions:
        dest = action.dest
        if (dest not in given or dest in keep or dest.startswith("longstraw")
                or not action.option_strings):
            continue
        value = getattr(args, dest, None)
        if value == action.default:
            continue
        flag = next((o for o in action.option_strings if o.lstrip("-").replace("-", "_")
                     in (dest, "no_" + dest)), action.option_strings[0])
        shown = flag if action.nargs == 0 else f"{flag} {_show(value)}"
        refused.append(shown + (f" ({HINTS[dest]})" if dest in HINTS else ""))
    if refused:
        raise ConfigError(
            f"Megatron flag{'s' if len(refused) > 1 else ''} not implemented by the LongStraw "
            f"launcher (it would be ignored): {'; '.join(refused)}. Drop "
            f"{'them' if len(refused) > 1 else 'it'}; docs/design.md \"Megatron flags\" lists "
            "the ones honoured.")


def _show(value) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)
