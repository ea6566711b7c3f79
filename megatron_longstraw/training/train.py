"""The LongStraw training loop behind `examples/pretrain_gpt.py --longstraw`.

Parses Megatron's standard flags (megatron.training's parser from the pinned megatron-core) plus the
`--longstraw-*` flags (one `extra_args_provider`), resolves them with the YAML config
(`--longstraw-config`; flags win), starts CP x EP folded process groups, builds the model, and runs
`--train-iters` GRPO steps: capture, scoring, serial replay, corrected finalisation, one optimizer
step each. Logs to stdout (one line per step) and TensorBoard (`--tensorboard-dir`), saves with
`--save`/`--save-interval`, and writes a receipt for the last step. `--load` takes either a
training-checkpoint folder (resume: weights, optimizer, RNG, step) or a model-format directory
written by tools/convert_hf.py (initial weights only; the run starts at step 0).
`--pretrained-checkpoint` (Megatron's fine-tuning flag) names the model-format initial weights
while `--load` names the run's own checkpoints: the first run (no checkpoint there yet) starts
from the former, later runs resume from the latter.

Megatron's operational flags: the LR / weight-decay schedule (lr_schedule.py: Megatron-Core's
OptimizerParamScheduler, stepped after each applied optimizer step, saved and restored with the
checkpoint); a NaN / inf loss or gradient (schedule.train_step skips the update; `nonfinite_step`
stops the run under --check-for-nan-in-loss-and-grad, else it is counted as skipped_steps); the
exit conditions (exit_conditions.py: signals, --exit-duration-in-mins, --exit-interval: save,
return, exit 0).

LoRA / QLoRA (`--longstraw-lora`, `--longstraw-qlora`, `--longstraw-lora-*`; adapters.py): the
model is built, its initial weights loaded, then the targeted linears are wrapped (base frozen,
in NF4 with QLoRA) before the optimizer exists, so the optimizer holds the adapters only; the
KL reference (kl_coef > 0) is `adapters.reference_view`: the same tensors with adapters off, no
second copy. A checkpoint holds the adapters and their optimizer state, not the frozen base; it
records where the base came from and its fingerprint, and a resume reloads the base and refuses
another one (checkpoint.py explains why the base is not saved). `--longstraw-save-merged DIR`
writes base + adapters merged in model format after the last step.

FP8 base (`--longstraw-fp8-base`, with LoRA; fp8_base.py): after the initial weights are loaded
(an FP8 checkpoint's weights are recorded as they are stored, and load dequantised into the
built layers meanwhile), the checkpoint's FP8 linears, or the family's FP8 linears quantised
when the base has none, are swapped for frozen FP8 layers, then the adapters are applied on top.
The fingerprint a checkpoint records is taken before that swap.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_longstraw.training import arguments, lr_schedule
from megatron_longstraw.runtime import errors
from megatron_longstraw.training.arguments import (
    LoRASettings,
    explicit_flags,
    longstraw_config_from_args,
    lora_settings_from_args,
    model_config_values,
)
from megatron_longstraw.config.settings import PromptGrad
from megatron_longstraw.runtime.errors import CheckpointError, ConfigError, FlagError
from megatron_longstraw.training.exit_conditions import ExitConditions
from megatron_longstraw.models.registry import check_parallel_sizes, get_family

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def build_parser() -> argparse.ArgumentParser:
    """Megatron's parser (as `megatron.training.arguments.parse_args` builds it) + ours
    (arguments.build_parser: printable help, one-line flag errors)."""
    return arguments.build_parser()


def parse(argv: list[str] | None = None):
    """(args, names of the flags given on the command line)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    return args, explicit_flags(parser, argv)


def resolve(args, given: set[str]):
    """(family, model config, LongStrawConfig, dtype) from YAML + flags, validated."""
    from megatron_longstraw.distributed import parallel

    if not args.longstraw:
        raise FlagError("This launcher runs the LongStraw GRPO schedule: pass --longstraw (for "
                        "standard Megatron pre-training use Megatron-LM's pretrain_gpt.py).")
    parallel.check_model_parallel_sizes(args.tensor_model_parallel_size,
                                        args.pipeline_model_parallel_size,
                                        args.expert_tensor_parallel_size)
    family = get_family(args.longstraw_family)
    check_parallel_sizes(family, args.expert_model_parallel_size)
    ls = longstraw_config_from_args(args)
    values = model_config_values(args, given, family.from_megatron)
    if not values:
        raise FlagError(f"No model configuration: pass --longstraw-config {family.tiny_config} "
                        "(or full.yaml beside it) and/or Megatron's model flags.")
    model_cfg = family.config_class.from_dict(values)
    dtype_name = args.longstraw_dtype or ("bf16" if args.bf16 else "fp32")
    return family.name, model_cfg, ls, DTYPES[dtype_name]


def resolve_lora(args, family: str, ls):
    """(LoRASettings or None, LongStrawConfig) for this run, validated before any process group
    starts. LoRA wraps Megatron's local linears: under `--longstraw-kernels auto` the dense layers
    are then built with the local spec (`dense=ref`, logged) instead of TransformerEngine's; an
    explicit `dense=te` is refused. A KL penalty needs a reference policy, which the launcher has
    for LoRA runs only (the base with adapters off)."""
    from megatron_longstraw.kernels import select

    lora = lora_settings_from_args(args, get_family(family).lora_targets, ls.seed)
    if lora is None:
        if ls.kl_coef > 0:
            raise ValueError(
                f"--longstraw-kl-coef {ls.kl_coef:g} needs a reference policy. The launcher "
                "provides it for LoRA / QLoRA runs (--longstraw-lora / --longstraw-qlora: the "
                "frozen base with adapters off, no second copy of the model); a full-parameter "
                "run would need a frozen copy of the initial model, which the launcher does not "
                "build. Set --longstraw-kl-coef 0 or train adapters.")
        return None, ls
    if ls.prompt_grad is PromptGrad.EXACT and lora.config.dropout > 0:
        raise ValueError(f"--longstraw-lora-dropout {lora.config.dropout:g} with "
                         "--longstraw-prompt-grad exact: the prompt backward recomputes the "
                         "prompt's forward, which capture ran without dropout; a dropout sample "
                         "there would differentiate another function. Set the dropout to 0 or "
                         "use the detached prompt gradient.")
    dense = select.parse_spec(ls.kernels)["dense"]
    if dense == "te":
        raise ValueError(f"--longstraw-kernels {ls.kernels}: LoRA wraps Megatron's local linear "
                         "layers (ColumnParallelLinear / RowParallelLinear), not "
                         "TransformerEngine's; add dense=ref (e.g. --longstraw-kernels "
                         "auto,dense=ref).")
    if dense == "auto":
        ls = dataclasses.replace(ls, kernels=f"{ls.kernels},dense=ref")
    return lora, ls


def check_outputs(args, lora: LoRASettings | None) -> None:
    """Refuse, before any work, outputs that could only fail after training."""
    merged = args.longstraw_save_merged
    if merged is None:
        return
    if lora is None:
        raise ValueError("--longstraw-save-merged writes base + LoRA adapters merged; this run "
                         "trains every parameter (use --save: its checkpoints hold the weights).")
    if Path(merged).exists() and (not Path(merged).is_dir() or any(Path(merged).iterdir())):
        raise ValueError(f"--longstraw-save-merged {merged} exists and is not an empty directory; "
                         "choose a new one (nothing is overwritten).")


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


def _starting_points(args) -> tuple[str | None, Path | None]:
    """(model-format directory of the initial weights or None, training checkpoint to resume or
    None) from --load / --pretrained-checkpoint."""
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
    return init, resume


def setup_model(args, family: str, model_cfg, dtype, ls, lora: LoRASettings | None,
                expert_parallel_size: int) -> Setup:
    """Build the model, load its initial weights (or keep the seeded initialisation), apply the
    LoRA adapters, create the optimizer over the trainable parameters, resume from the latest
    checkpoint of --load. Collective (every rank)."""
    from megatron_longstraw.adapters import lora as adapters
    from megatron_longstraw.checkpointing import checkpoint, model_format
    from megatron_longstraw.kernels import select

    init, resume = _starting_points(args)
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
    fp8_sources = {} if lora is not None and lora.fp8_base else None
    # A resumed full-parameter run takes every weight from its checkpoint; a LoRA run needs its
    # base first (the checkpoint holds only the adapters).
    if init is not None and (resume is None or lora is not None):
        model_format.load_model(init, model, family=family, fp8_sources=fp8_sources)
        messages.append(f"initialised from model-format weights {init}")
    meta = {"family": family, "initial_weights": str(Path(init).resolve()) if init else None,
            "lora": None}
    if lora is not None:
        base = {"source": meta["initial_weights"], "seed": None if init else ls.seed}
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
    ref_model = adapters.reference_view(model) if lora is not None and ls.kl_coef > 0 else None
    return Setup(model, optimizer, ref_model, first_step, lora, meta, messages,
                 resumed=resumed if resume is not None else None)


MEGATRON_DATA_FLAGS = {
    "data_path": "--data-path", "train_data_path": "--train-data-path",
    "valid_data_path": "--valid-data-path", "test_data_path": "--test-data-path",
    "split": "--split", "mock_data": "--mock-data", "data_args_path": "--data-args-path",
    "dataloader_type": "--dataloader-type", "train_samples": "--train-samples",
    "rampup_batch_size": "--rampup-batch-size"}
"""Megatron's pre-training data and sample-count flags: the launcher reads GRPO groups instead
(refused when given, never ignored)."""


def check_data_flags(args, given: set[str]) -> None:
    """Refuse Megatron data flags this launcher does not read, and settings that do not fit."""
    used = [flag for dest, flag in MEGATRON_DATA_FLAGS.items() if dest in given]
    if used:
        raise FlagError(f"{', '.join(used)}: Megatron's pre-training data flags are not read by "
                        "the LongStraw launcher; pass GRPO groups with --longstraw-data JSONL "
                        "(held-out ones with --longstraw-eval-data), count steps with "
                        "--train-iters and groups per step with --global-batch-size.")
    if args.micro_batch_size not in (None, 1):
        raise FlagError(f"--micro-batch-size {args.micro_batch_size}: a LongStraw micro-batch is "
                        "one GRPO group (its --longstraw-group-size responses share one captured "
                        "prompt); pass --micro-batch-size 1 or leave it out, and set the groups "
                        "per optimizer step with --global-batch-size.")
    if args.global_batch_size is not None and args.global_batch_size < 1:
        raise FlagError(f"--global-batch-size {args.global_batch_size}: give the number of GRPO "
                        "groups per optimizer step (>= 1).")
    if ls_rollout(args) == "online":
        if not args.longstraw_data:
            raise FlagError("--longstraw-rollout online generates responses for the prompts of "
                            "--longstraw-data (a JSONL of prompt lines: a prompt, 'id' and "
                            "'meta'); pass it.")
    if args.longstraw_eval_data is None:
        unused = [flag for dest, flag in (("eval_interval", "--eval-interval"),
                                          ("eval_iters", "--eval-iters")) if dest in given]
        if unused:
            raise FlagError(f"{', '.join(unused)} given without held-out data: pass "
                            "--longstraw-eval-data JSONL (groups scored, not trained on).")
    elif args.eval_iters < 1 or (args.eval_interval is not None and args.eval_interval < 1):
        raise FlagError(f"--eval-iters {args.eval_iters} / --eval-interval {args.eval_interval}: "
                        "both count (groups scored, steps between evaluations) and must be >= 1.")


def ls_rollout(args) -> str:
    """--longstraw-rollout, or the YAML's `rollout` (checks that run before the config exists)."""
    if getattr(args, "longstraw_rollout", None):
        return args.longstraw_rollout
    if getattr(args, "longstraw_config", None):
        from megatron_longstraw.training.arguments import longstraw_config_from_yaml

        return longstraw_config_from_yaml(args.longstraw_config).rollout
    return "offline"


def global_batch_size(args, dp_size: int) -> int:
    """GRPO groups per optimizer step, summed over the data-parallel replicas (Megatron's
    --global-batch-size; default one per replica); each replica accumulates B / DP of them."""
    size = args.global_batch_size or dp_size
    if size % dp_size:
        raise FlagError(f"--global-batch-size {size} counts GRPO groups per optimizer step over "
                        f"all {dp_size} data-parallel replicas (world size / "
                        "--context-parallel-size); it must be a multiple of "
                        f"{dp_size}, e.g. {max(dp_size, size // dp_size * dp_size)}.")
    return size


def _group_check(path, ls):
    """The step settings every group of `path` must fit (dataset.GroupDataset's `check`)."""
    from megatron_longstraw.data.groups import DataError

    def check(record) -> None:
        group, field = record.group, record.response_field
        if len(group.response_ids) != ls.group_size:
            raise DataError(path, record.line, field,
                            f"has {len(group.response_ids)} responses but the group size is "
                            f"{ls.group_size} (--longstraw-group-size, YAML longstraw.group_size);"
                            " give every member of the group or change the group size.")
        for i, response in enumerate(group.response_ids):
            if response.numel() > ls.max_response_len:
                raise DataError(path, record.line, field,
                                f"item {i} has {response.numel()} tokens, more than "
                                f"--longstraw-max-response-len {ls.max_response_len} (YAML "
                                "longstraw.max_response_len); raise the limit or drop the "
                                "member.")
    return check


def read_data(args, model_cfg, ls, path: str | None = None, require_rewards: bool | None = None):
    """The GRPO groups of `path` (default --longstraw-data) as a lazily read
    dataset.GroupDataset, every line checked against the model and the step settings before any
    process group starts (a bad line is a DataError naming file, line and field); None without
    a path (synthetic data). Lines must carry "rewards" unless a reward function computes them
    (`require_rewards` None: ls.reward is None)."""
    if require_rewards is None:
        require_rewards = ls.reward is None
    path = args.longstraw_data if path is None else path
    if not path:
        return None
    from megatron_longstraw.data.groups import load_tokenizer
    from megatron_longstraw.data.dataset import GroupDataset

    tokenizer = load_tokenizer(args.longstraw_tokenizer) if args.longstraw_tokenizer else None
    if ls.rollout == "online" and path == args.longstraw_data:   # prompt lines (rollout.py)
        return GroupDataset(path, tokenizer=tokenizer, vocab_size=model_cfg.vocab_size,
                            require_rewards=False, prompt_only=True)
    return GroupDataset(path, tokenizer=tokenizer, vocab_size=model_cfg.vocab_size,
                        check=_group_check(path, ls), require_rewards=require_rewards)


def load_reward_fn(args, ls):
    """The reward function of --longstraw-reward (YAML longstraw.reward; rewards.py), or None.
    It scores the --longstraw-data lines that carry no "rewards", so it is refused without
    --longstraw-data (the synthetic groups carry their own)."""
    if ls.reward is None:
        return None
    if not args.longstraw_data:
        raise ConfigError(f"--longstraw-reward {ls.reward} scores the responses of "
                          "--longstraw-data lines without 'rewards'; pass --longstraw-data (the "
                          "synthetic groups carry their own rewards) or drop the reward.")
    from megatron_longstraw.rollout.rewards import load_reward

    return load_reward(ls.reward)


def step_groups(args, model_cfg, ls, sampler, data, consumed_groups: int,
                reward_fn=None) -> list:
    """This replica's groups of the step that starts at `consumed_groups` (dataset.py): read
    from `data`, or synthetic (group g from seed + g). With `reward_fn`, a line without
    "rewards" gets them from it (rewards.fill_rewards), before any work of the step: a reward
    function that fails stops the run with a RewardError naming the line and the member."""
    indices = sampler.step_indices(consumed_groups)
    if data is not None and reward_fn is not None:
        from megatron_longstraw.rollout.rewards import fill_rewards

        return [fill_rewards(data.record(i), reward_fn, data.tokenizer) for i in indices]
    if data is not None:
        return [data[i] for i in indices]
    from megatron_longstraw.data.groups import synthetic_group

    prompt_len = args.longstraw_synthetic_prompt_len or 4096
    return [synthetic_group(model_cfg.vocab_size, prompt_len, ls.group_size,
                            min(args.longstraw_synthetic_response_len, ls.max_response_len),
                            seed=ls.seed + g) for g in indices]


def online_groups(model, ls, sampler, data, consumed_groups: int, reward_fn) -> list:
    """The online loop: this replica's groups of the step, each generated from its own capture
    of the prompt and rewarded (rollout.py); sample g generates with seed + g, so a resumed run
    generates what the uninterrupted one did."""
    from megatron_longstraw.runtime import memory
    from megatron_longstraw.rollout.online import rollout_group

    with memory.phase("rollout"):
        return [rollout_group(model, data.record(index), ls, reward_fn, seed=ls.seed + g,
                              tokenizer=data.tokenizer, control=ls.control)
                for index, g in zip(sampler.step_indices(consumed_groups),
                                    sampler.global_indices(consumed_groups))]


def _group_name(group, step: int, dp_rank: int) -> str:
    source = getattr(group, "source", None) or f"the synthetic group of step {step}"
    return (f"{source} (data-parallel replica {dp_rank}, prompt {int(group.prompt_ids.numel())} "
            f"tokens, rewards {[round(float(r), 4) for r in group.rewards]})")


def nonfinite_step(args, step: int, result, groups: list, dp_rank: int) -> None:
    """A step the optimizer skipped (schedule.train_step: NaN / inf loss or gradient). With
    --check-for-nan-in-loss-and-grad (Megatron's default) the run stops: a NonFiniteError naming
    the step and the group(s), on every rank; without it the caller counts the skipped step.
    Collective (every rank, same step)."""
    from megatron_longstraw.runtime.errors import NonFiniteError

    if not args.check_for_nan_in_loss_and_grad:
        return
    bad = result.nonfinite_groups or range(len(groups))   # a gradient: every group of the step
    local = [_group_name(groups[i], step, dp_rank) for i in bad]
    names = [local]
    if dist.is_initialized() and dist.get_world_size() > 1:
        names = [None] * dist.get_world_size()
        dist.all_gather_object(names, local)
    if result.nonfinite_loss_ranks:
        what = f"the loss is {result.loss} for " + "; ".join(
            dict.fromkeys(n for r in result.nonfinite_loss_ranks for n in names[r]))
    else:
        what = (f"the gradient norm is {result.stats['grad_norm']} (the loss is finite) for "
                + "; ".join(dict.fromkeys(n for rank in names for n in rank)))
    last = (f"the last checkpoint in {args.save} is intact" if args.save
            else "nothing was saved (no --save)")
    raise NonFiniteError(
        f"step {step}: {what}; the optimizer did not step and {last}. Check the group's rewards "
        "and the learning rate, or pass --no-check-for-nan-in-loss-and-grad to skip such steps "
        "(counted as skipped_steps).")


def replica_mean(result, dp_size: int):
    """The step's figures over all its groups, for the log and the receipt: the loss summed over
    the data-parallel replicas (each already carries 1 / B: the mean GRPO loss of the B groups),
    statistics averaged (extremes: max / min; schedule.merge_stats). Collective over the
    data-parallel group."""
    if dp_size == 1:
        return result
    from megatron.core import parallel_state as ps

    from megatron_longstraw.training.schedule import merge_stats

    per_replica = [None] * dp_size
    dist.all_gather_object(per_replica, (result.loss, result.stats),
                           group=ps.get_data_parallel_group())
    stats = merge_stats([s for _, s in per_replica])
    stats["grad_norm"] = result.stats["grad_norm"]   # of the summed gradient: the same everywhere
    return dataclasses.replace(result, loss=sum(loss for loss, _ in per_replica), stats=stats)


def check_finite_weights(model, step: int) -> None:
    """Refuse to save weights that are NaN / inf on any rank (never written to a checkpoint)."""
    from megatron_longstraw.runtime.errors import NonFiniteError
    from megatron_longstraw.distributed.parallel import any_rank

    local = any(not torch.isfinite(p).all() for p in model.parameters() if p.requires_grad)
    if any_rank([local])[0]:
        raise NonFiniteError(f"step {step}: the weights are not finite; no checkpoint was written "
                             "and the last one is intact.")


def cli(argv: list[str] | None = None) -> dict:
    """`examples/pretrain_gpt.py`: `main`, with user errors (errors.py: bad flags, configs, data,
    missing inputs, checkpoints that do not fit) reported as one line by rank 0, exit code 2."""
    return errors.run_entry(main, argv)


def main(argv: list[str] | None = None) -> dict:
    warnings.filterwarnings("ignore", module=r"megatron\..*")
    start = time.perf_counter()
    with errors.configuration():   # flags, YAML and model config: every ValueError is the user's
        args, given = parse(argv)
        family, model_cfg, ls, dtype = resolve(args, given)
        lora, ls = resolve_lora(args, family, ls)
        check_outputs(args, lora)
        check_data_flags(args, given)
        reward_fn = load_reward_fn(args, ls)
        total_iters = args.train_iters or 1
        lr_schedule.build_scheduler(args, torch.optim.SGD([torch.zeros(1, requires_grad=True)]),
                                    total_iters)   # the schedule's flags, checked before any work

    from megatron_longstraw.training.metrics import ProgressBar, StepLogger, configure_logging

    configure_logging()   # after Megatron's import-time logging setup: information on rank 0
    data = read_data(args, model_cfg, ls)
    eval_data = (read_data(args, model_cfg, ls, args.longstraw_eval_data, require_rewards=False)
                 if args.longstraw_eval_data else None)

    from megatron.core import parallel_state as ps

    from megatron_longstraw.distributed import parallel
    from megatron_longstraw.runtime import precision
    from megatron_longstraw.data.dataset import GroupSampler
    from megatron_longstraw.training.evaluate import eval_group_count, evaluate
    from megatron_longstraw.kernels import select
    from megatron_longstraw.runtime.memory import LiveBytesMeter, SavedTensorMeter
    from megatron_longstraw.training.receipts import (
        parameter_counts,
        step_memory,
        step_receipt,
        step_summary,
        write_json_atomic,
    )
    from megatron_longstraw.training.schedule import train_step

    cp, ep = args.context_parallel_size, args.expert_model_parallel_size
    select.use(ls.kernels)  # an explicit backend whose package is missing fails here, at start
    parallel.initialize(context_parallel_size=cp, expert_parallel_size=ep, seed=ls.seed)
    precision.use_dtype(dtype)  # float64: Megatron's float32 islands kept in float64
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    with errors.configuration():
        batch = global_batch_size(args, dp_size)
        eval_count = (eval_group_count(args.eval_iters, len(eval_data), dp_size)
                      if eval_data is not None else 0)
    run = setup_model(args, family, model_cfg, dtype, ls, lora, ep)
    model, optimizer, first_step, lora = run.model, run.optimizer, run.first_step, run.lora
    params = parameter_counts(model)
    if rank == 0 and run.messages:
        print("\n".join(run.messages), flush=True)
    sampler = GroupSampler(len(data) if data is not None else None, batch, dp_rank, dp_size,
                           ls.seed, shuffle=args.longstraw_data_shuffle)
    # The data position: groups consumed by earlier steps (over all replicas), from the checkpoint.
    consumed = int((run.resumed or {}).get("consumed_groups", first_step * batch))
    logger = StepLogger(args.tensorboard_dir, enabled=rank == 0)
    scheduler = lr_schedule.build_scheduler(args, optimizer, total_iters)
    if run.resumed is not None:
        lr_schedule.restore(scheduler, run.resumed, first_step)
    result, meter, stopped = None, None, None
    skipped = int((run.resumed or {}).get("skipped_steps", 0))

    def save(steps_done: int) -> Path:
        from megatron_longstraw.checkpointing.checkpoint import save_checkpoint

        check_finite_weights(model, steps_done - 1)
        return save_checkpoint(args.save, model, optimizer, steps_done,
                               extra={"family": family, "model": model_cfg.to_dict(),
                                      lr_schedule.STATE_KEY: scheduler.state_dict(),
                                      "skipped_steps": skipped, "consumed_groups": consumed},
                               meta_extra=run.meta)

    steps_done = first_step
    history = []   # the step scalars, into the receipt (the run's curves)
    # --exit-signal-handler, --exit-duration-in-mins, --exit-interval (exit_conditions.py)
    with ExitConditions(args, start) as exits:
        for step in range(first_step, total_iters):
            online = ls.rollout == "online"
            groups = (None if online else
                      step_groups(args, model_cfg, ls, sampler, data, consumed, reward_fn))
            bar = ProgressBar(f"step {step} capture") if rank == 0 else None
            lr = lr_schedule.current_lr(optimizer)
            live = LiveBytesMeter() if args.longstraw_live_bytes else contextlib.nullcontext()
            with SavedTensorMeter(model) as meter, live:
                captures = None
                if online:
                    rollouts = online_groups(model, ls, sampler, data, consumed, reward_fn)
                    groups = [r.group for r in rollouts]
                    captures = [r.captured for r in rollouts]
                # 1/B: the update follows the mean over the step's B groups of each group's GRPO
                # loss; each replica accumulates its B / DP groups, finalize.py sums over DP.
                result = train_step(model, optimizer, groups, ls, ref_model=run.ref_model,
                                    max_grad_norm=args.clip_grad, loss_scale=1.0 / batch,
                                    progress=bar, captures=captures)
                del captures
            if online:
                result.phase_seconds["rollout"] = sum(r.seconds for r in rollouts)
                lengths = [r.numel() for g in groups for r in g.response_ids]
                result.stats["response_len_mean"] = sum(lengths) / len(lengths)
                del rollouts
            consumed += batch
            if result.skipped:   # NaN / inf: no update (and no scheduler step, as in Megatron)
                nonfinite_step(args, step, result, groups, dp_rank)
                skipped += 1
            else:
                scheduler.step(1)
            report = replica_mean(result, dp_size)
            memory = step_memory(meter.peak_bytes, result.page_bytes,
                                 {**live.phase_peaks, "step": live.peak_bytes}
                                 if args.longstraw_live_bytes else None)
            extras = {**memory, "optimizer/lr": lr, "skipped_steps": skipped,
                      "consumed_groups": consumed}
            logger.log(step, report, extras)
            history.append({"step": step, **logger.scalars(report, extras)})
            steps_done = step + 1
            if eval_count and (steps_done == total_iters or (
                    args.eval_interval and steps_done % args.eval_interval == 0)):
                logger.log_eval(steps_done, evaluate(model, eval_data, ls, eval_count, dp_rank,
                                                     dp_size, ps.get_data_parallel_group()))
            stopped = exits.check(steps_done) if steps_done < total_iters else None
            saved = None
            interval = args.save_interval and steps_done % args.save_interval == 0
            if args.save and (stopped or interval):
                saved = save(steps_done)
            if stopped:
                if rank == 0:
                    print(f"exiting after step {step}: {stopped}; "
                          + (f"checkpoint {saved}" if saved else "no checkpoint (no --save)"),
                          flush=True)
                break
    logger.close()
    if args.longstraw_save_merged and not stopped:
        from megatron_longstraw.checkpointing.model_format import save_model

        save_model(args.longstraw_save_merged, model, family=family, merge_adapters=True,
                   source=f"LoRA run {args.longstraw_run_name} merged after step {total_iters}")
        if rank == 0:
            print(f"merged weights written to {args.longstraw_save_merged}", flush=True)
    if result is None:
        return {}
    receipt = step_receipt(
        name=args.longstraw_run_name, family=family, config=args.longstraw_config,
        group=max(groups, key=lambda g: g.prompt_ids.numel()), result=report, memory=memory,
        params=params, meta=run.meta,
        sizes={"world_size": world, "context_parallel_size": cp, "expert_parallel_size": ep,
               "data_parallel_size": dp_size, "global_batch_size": batch},
        dtype=dtype, steps=steps_done, start=start)
    receipt["skipped_steps"] = skipped
    receipt["history"] = history
    if rank != 0:
        return receipt
    path = write_json_atomic(Path(args.longstraw_out_dir) / args.longstraw_run_name / "receipt.json",
                             receipt)
    print(step_summary(receipt, model=get_family(family).describe(model_cfg), lora=lora,
                       backend=dist.get_backend(), path=path), flush=True)
    return receipt
