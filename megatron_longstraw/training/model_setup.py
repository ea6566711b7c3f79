"""The model a run trains: built, its initial weights loaded (a model-format directory of
--load / --pretrained-checkpoint, or the seeded initialisation), the LoRA / QLoRA adapters applied
(on an FP8 base with --longstraw-fp8-base), the optimizer created over the trainable parameters,
and the latest checkpoint of --load resumed (train.py's module docstring: which weights come from
where).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_longstraw.models.registry import get_family
from megatron_longstraw.runtime import errors
from megatron_longstraw.runtime.errors import CheckpointError, ConfigError
from megatron_longstraw.training import lr_schedule
from megatron_longstraw.training.arguments import LoRASettings


@dataclasses.dataclass
class Setup:
    """What `setup_model` prepared."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    ref_model: torch.nn.Module | None
    """The KL reference (kl_coef > 0, LoRA runs): adapters.reference_view(model)."""
    first_step: int
    """0, or the step of the resumed checkpoint."""
    lora: LoRASettings | None
    """The adapters applied (targets resolved against the model), None for full-parameter."""
    meta: dict
    """What every checkpoint of this run records in meta.json: family, initial weights, LoRA."""
    messages: list[str]
    """What happened (printed by rank 0)."""
    resumed: dict | None = None
    """The resumed checkpoint's `extra` (this rank's: the LR scheduler state), None at step 0."""


def starting_points(args) -> tuple[str | None, Path | None]:
    """(model-format directory of the initial weights or None, training checkpoint to resume or
    None) from --load / --pretrained-checkpoint. A --load that holds no checkpoint is refused
    (`_check_no_checkpoint`): Megatron would start from random weights there, silently, which
    turns a typo in a resubmitted job's path into a new run. train.configure calls it before any
    work; setup_model again."""
    from megatron_longstraw.checkpointing import checkpoint, model_format

    init, resume = args.pretrained_checkpoint, None
    if init is not None and not model_format.is_model_format(init):
        raise ConfigError(f"--pretrained-checkpoint {init}: not a model-format directory (no "
                          f"{model_format.MODEL_META}); pass a tools/convert_hf.py output.")
    if args.load:
        if model_format.is_model_format(args.load):
            if init is not None and Path(init).resolve() != Path(args.load).resolve():
                raise ConfigError(f"--load {args.load} and --pretrained-checkpoint {init} are "
                                  "both model-format directories of initial weights; pass one "
                                  "(with --pretrained-checkpoint, --load names the run's "
                                  "checkpoints).")
            init = args.load
        else:
            resume = checkpoint.latest_checkpoint(args.load)
            if resume is None:
                _check_no_checkpoint(args)
    return init, resume


def first_run_of_fine_tuning(args) -> bool:
    """Megatron's fine-tuning convention: with --pretrained-checkpoint, a --load folder that holds
    no checkpoint yet starts from the pretrained weights. Accepted only where --load is also
    --save (the run's own folder, empty on its first run), and not under
    --exit-on-missing-checkpoint."""
    return (args.pretrained_checkpoint is not None and not args.exit_on_missing_checkpoint
            and args.save is not None
            and Path(args.save).resolve() == Path(args.load).resolve())


def _check_no_checkpoint(args) -> None:
    """--load names a folder without a complete checkpoint: an error naming the folder and what
    to do, except on the first run of a fine-tuning job (`first_run_of_fine_tuning`)."""
    if first_run_of_fine_tuning(args):
        return
    folder = Path(args.load)
    if not folder.exists():
        what = "does not exist"
    elif not folder.is_dir():
        what = "is not a folder"
    else:
        leftovers = sorted(p.name for p in folder.iterdir())
        what = ("is empty" if not leftovers else
                f"holds no complete checkpoint (found {', '.join(leftovers[:4])}"
                + (", ..." if len(leftovers) > 4 else "") + ")")
    raise CheckpointError(
        f"--load {args.load} {what}: nothing to resume or initialise from (no `latest`, no "
        "step_* checkpoint, no tools/convert_hf.py output). Fix the path; on a first run drop "
        "--load (pass --pretrained-checkpoint DIR to start from converted weights).")


def setup_model(args, family: str, model_cfg, dtype, ls, lora: LoRASettings | None,
                expert_parallel_size: int) -> Setup:
    """Build the model, load its initial weights (or keep the seeded initialisation), apply the
    LoRA adapters, create the optimizer over the trainable parameters, resume from the latest
    checkpoint of --load. Collective (every rank)."""
    from megatron_longstraw.adapters import lora as adapters
    from megatron_longstraw.checkpointing import checkpoint, model_format
    from megatron_longstraw.kernels import select

    init, resume = starting_points(args)
    saved = checkpoint.read_checkpoint_meta(resume) if resume is not None else None
    if saved is not None and saved.get("family", family) != family:
        raise CheckpointError(f"{resume} holds a {saved['family']!r} run, not --longstraw-family "
                              f"{family}.")
    model = get_family(family).build(model_cfg, dtype, expert_parallel_size)
    if lora is not None:
        with errors.configuration():   # --longstraw-lora-targets against the model's layers
            lora = dataclasses.replace(lora, config=adapters.resolve_targets(
                model, lora.config, strict=lora.targets_given))
    if saved is not None:
        checkpoint.check_lora_resume(resume, saved.get("lora"),
                                     lora.record() if lora is not None else None)
        if lora is not None and init is None:   # the base the adapters were trained on
            init = saved["lora"]["base"].get("source")
            if init is not None and not model_format.is_model_format(init):
                raise CheckpointError(f"{resume} trained adapters on the base model in {init}, "
                                      "which is no longer a model-format directory; pass the same "
                                      "weights with --pretrained-checkpoint DIR.")
    messages = []
    if getattr(args, "longstraw_model_source", None):   # command_line.saved_model
        messages.append(f"model config from {args.longstraw_model_source} (no --longstraw-config;"
                        " step settings: the --longstraw-* flags and their defaults)")
    fp8_sources = {} if lora is not None and lora.fp8_base else None
    # A resumed full-parameter run takes every weight from its checkpoint; a LoRA run needs its
    # base first (the checkpoint holds only the adapters).
    if init is not None and (resume is None or lora is not None):
        model_format.load_model(init, model, family=family, fp8_sources=fp8_sources)
        messages.append(f"initialised from model-format weights {init}")
        if resume is None and args.load and init != args.load:
            messages.append(f"no checkpoint in --load {args.load} yet: the first run of this "
                            "fine-tuning job (later runs resume from it)")
    meta = {"family": family, "initial_weights": str(Path(init).resolve()) if init else None,
            "lora": None, "dtype": model_format.DTYPE_NAMES[dtype]}   # dtype: checkpointing/export.py
    if lora is not None:
        base = {"source": meta["initial_weights"], "seed": None if init else ls.run.seed}
        fingerprint = checkpoint.model_fingerprint(model)
        if saved is not None:
            checkpoint.check_lora_base(resume, saved["lora"]["base"], fingerprint, base)
        fingerprints = [None] * dist.get_world_size()
        dist.all_gather_object(fingerprints, fingerprint)
        if lora.fp8_base:
            from megatron_longstraw.adapters import fp8_base

            with errors.configuration():   # a family without FP8 linears, a stray FP8 tensor
                summary = fp8_base.apply_fp8_base(model, get_family(family).fp8_linears,
                                                  fp8_sources)
            messages.append(summary.describe())
        adapters.apply_lora(model, lora.config, quantize_base=lora.quantize_base)
        meta["lora"] = {**lora.record(), "base": {**base, "fingerprints": fingerprints}}
        messages.append(f"{lora.describe()} on {meta['lora']['base']['source'] or 'the random init'}")
    params = [p for p in model.parameters() if p.requires_grad]
    with errors.configuration():
        params = lr_schedule.param_groups(params, args)   # --decoupled-lr: its own group
    optimizer = select.optimizer_class()(
        params, lr=args.lr if args.lr is not None else 1e-6,
        betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
        weight_decay=args.weight_decay)
    first_step, resumed = 0, None
    if resume is not None:
        first_step, resumed = checkpoint.load_checkpoint(resume, model, optimizer)
        messages.append(f"resumed from {resume} at step {first_step}")
    ref_model = adapters.reference_view(model) if lora is not None and ls.loss.kl_coef > 0 else None
    return Setup(model, optimizer, ref_model, first_step, lora, meta, messages,
                 resumed=resumed if resume is not None else None)
