"""The learning-rate and weight-decay schedule: Megatron-Core's `OptimizerParamScheduler`, built
from Megatron's flags the way megatron/training/training.py `get_optimizer_param_scheduler` builds
it for iteration-based training (`--train-iters`):

    --lr (max), --min-lr, --lr-warmup-init, --lr-decay-style (constant, linear, cosine,
    inverse-square-root, WSD with --lr-wsd-decay-iters / --lr-wsd-decay-style),
    --lr-warmup-iters or --lr-warmup-fraction (of the decay iterations), --lr-decay-iters
    (default --train-iters), --start-weight-decay / --end-weight-decay / --weight-decay-incr-style
    (constant: --weight-decay throughout, as Megatron's validate_args sets it),
    --use-checkpoint-opt_param-scheduler / --override-opt_param-scheduler on resume.

`--decoupled-lr` / `--decoupled-min-lr` (Megatron's "separate learning rate for the input and output
layer"): the trainable parameters Megatron marks `is_embedding_or_output_parameter` (the word
embeddings and the output layer, LanguageModule.setup_embeddings_and_output_layer) form their own
optimizer group whose `max_lr` / `min_lr` the scheduler follows (megatron/core/optimizer
`_get_param_groups` does the same), on the same warm-up and decay.

One LongStraw step is one optimizer step (Megatron counts samples, iterations x global batch;
the schedule's shape is the same). The LR of step k is the scheduler's value after k increments:
`step()` is called once after every optimizer step that was applied (a skipped step does not
advance it, as in Megatron's train_step). Its `state_dict()` travels in the training checkpoint
(the launcher's per-rank `extra`, key "opt_param_scheduler") and `restore` loads it on resume.
"""

from __future__ import annotations

from megatron_longstraw.runtime.errors import CheckpointError, ConfigError

DEFAULT_LR = 1e-6
STATE_KEY = "opt_param_scheduler"


def param_groups(params: list, args) -> list:
    """The optimizer's parameter groups: one, or with `--decoupled-lr` two, the second the
    embedding and output-layer parameters with their own `max_lr` (and `min_lr` from
    `--decoupled-min-lr`, else `--min-lr`)."""
    decoupled = getattr(args, "decoupled_lr", None)
    if decoupled is None:
        if getattr(args, "decoupled_min_lr", None) is not None:
            raise ConfigError("--decoupled-min-lr needs --decoupled-lr.")
        return params
    io = [p for p in params if getattr(p, "is_embedding_or_output_parameter", False)]
    if not io:
        raise ConfigError("--decoupled-lr sets the learning rate of the embedding and output "
                          "layer, and neither is trained here (LoRA trains adapters only): drop "
                          "the flag.")
    min_lr = args.decoupled_min_lr if args.decoupled_min_lr is not None else args.min_lr
    if not 0.0 <= min_lr <= decoupled:
        raise ConfigError(f"--decoupled-min-lr {min_lr:g} must lie in [0, --decoupled-lr "
                          f"{decoupled:g}].")
    ids = {id(p) for p in io}
    return [{"params": [p for p in params if id(p) not in ids]},
            {"params": io, "max_lr": decoupled, "min_lr": min_lr}]


def build_scheduler(args, optimizer, train_iters: int):
    """OptimizerParamScheduler for `optimizer` from Megatron's flags in `args` (training.py's
    get_optimizer_param_scheduler, iterations as steps); sets the optimizer's step-0 LR and weight
    decay. Bad combinations are ConfigErrors naming the flags."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    lr = args.lr if args.lr is not None else DEFAULT_LR
    decay_iters = args.lr_decay_iters if args.lr_decay_iters is not None else train_iters
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay_iters
    else:
        warmup = args.lr_warmup_iters
    start_wd, end_wd = args.start_weight_decay, args.end_weight_decay
    if args.weight_decay_incr_style == "constant":
        if (start_wd is not None and start_wd != args.weight_decay) or (
                end_wd is not None and end_wd != args.weight_decay):
            raise ConfigError("--start-weight-decay / --end-weight-decay need "
                              "--weight-decay-incr-style linear or cosine (constant uses "
                              "--weight-decay throughout).")
        start_wd = end_wd = args.weight_decay
    elif start_wd is None or end_wd is None:
        raise ConfigError(f"--weight-decay-incr-style {args.weight_decay_incr_style} needs both "
                          "--start-weight-decay and --end-weight-decay.")
    wsd_iters = getattr(args, "lr_wsd_decay_iters", None)
    problems = []
    if decay_iters <= 0:
        problems.append(f"--lr-decay-iters {decay_iters} must be positive")
    if not warmup < decay_iters:
        problems.append(f"the warm-up ({warmup:g} iterations, --lr-warmup-iters / "
                        f"--lr-warmup-fraction) must be shorter than the decay ({decay_iters} "
                        "iterations, --lr-decay-iters, default --train-iters)")
    if not 0.0 <= args.min_lr <= lr:
        problems.append(f"--min-lr {args.min_lr:g} must lie in [0, --lr {lr:g}]")
    if args.lr_warmup_init > lr:
        problems.append(f"--lr-warmup-init {args.lr_warmup_init:g} exceeds --lr {lr:g}")
    if not 0.0 <= start_wd <= end_wd:
        problems.append(f"--start-weight-decay {start_wd:g} must lie in [0, --end-weight-decay "
                        f"{end_wd:g}]")
    if args.lr_decay_style == "WSD" and wsd_iters is None:
        problems.append("--lr-decay-style WSD needs --lr-wsd-decay-iters")
    if args.use_checkpoint_opt_param_scheduler and args.override_opt_param_scheduler:
        problems.append("--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler "
                        "exclude each other")
    if problems:
        raise ConfigError("LR schedule: " + "; ".join(problems) + ".")
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=lr, min_lr=args.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=decay_iters, lr_decay_style=args.lr_decay_style,
        start_wd=start_wd, end_wd=end_wd, wd_incr_steps=train_iters,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        wsd_decay_steps=wsd_iters, lr_wsd_decay_style=getattr(args, "lr_wsd_decay_style", None))


def restore(scheduler, extra: dict | None, step: int, path=None) -> None:
    """On resume: the scheduler state saved with the checkpoint (`extra[STATE_KEY]`); a checkpoint
    written before the schedule was saved continues at `step` increments. A schedule that differs
    from the saved one is refused unless --override-opt_param-scheduler (take the flags) or
    --use-checkpoint-opt_param-scheduler (take the checkpoint's) says which wins."""
    state = (extra or {}).get(STATE_KEY)
    if state is None:
        scheduler.step(step)
        return
    try:
        scheduler.load_state_dict(state)
    except AssertionError as exc:
        raise CheckpointError(
            f"{path or 'the checkpoint'} was trained with another LR / weight-decay schedule "
            f"({exc}); pass --override-opt_param-scheduler to use this run's flags or "
            "--use-checkpoint-opt_param-scheduler to continue the saved schedule.") from None


def current_lr(optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])
