"""The LongStraw training loop behind `examples/pretrain_gpt.py --longstraw`.

Parses Megatron's standard flags (megatron.training's parser from the pinned megatron-core) plus the
`--longstraw-*` flags (one `extra_args_provider`), resolves them with the YAML config
(`--longstraw-config`; flags win), starts CP x EP folded process groups, builds the model, and runs
`--train-iters` GRPO steps: capture, scoring, serial replay, corrected finalisation, one optimizer
step each. Logs to stdout (one line per step) and TensorBoard (`--tensorboard-dir`), saves with
`--save`/`--save-interval`, and writes a receipt for the last step (with every step's scalars,
`history`, phase and step wall times included) and the run's curves beside it (run_plot.py). `--load` takes either a
training-checkpoint folder (resume: weights, optimizer, RNG, step) or a model-format directory
written by tools/convert_hf.py (initial weights only; the run starts at step 0).
One writer per `--save` folder: rank 0 holds `<save>/longstraw.lock` for the run (a second run is
refused by name, a dead holder's lock taken over; checkpointing/save_lock.py), and a worker whose
torchrun died stops (runtime/parent_watch.py).
`--pretrained-checkpoint` (Megatron's fine-tuning flag) names the model-format initial weights
while `--load` names the run's own checkpoints: the first run (no checkpoint there yet; --load
must then also be --save) starts from the former, later runs resume from the latter. Any other
`--load` that holds no checkpoint is an error (model_setup.starting_points), not a silent start
from random weights.

`main` lists the launcher's steps, each a function below; the concerns that are not the loop have
their own modules: command_line.py (flags and YAML resolved into the run's settings),
group_sources.py (the data flags, the datasets, a step's groups: read, synthetic or online) and
model_setup.py (model, initial weights, adapters, optimizer, resume).

Megatron's operational flags: the LR / weight-decay schedule (lr_schedule.py: Megatron-Core's
OptimizerParamScheduler, stepped after each applied optimizer step, saved and restored with the
checkpoint); a NaN / inf loss or gradient (schedule.train_step skips the update; `nonfinite_step`
stops the run under --check-for-nan-in-loss-and-grad, else it is counted as skipped_steps); the
exit conditions (exit_conditions.py: signals, --exit-duration-in-mins, --exit-interval: save,
return, exit 0). The guards (guards.py) warn when a step has no learning signal or the policy's
entropy collapses, and optionally stop the run like an exit condition.

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

import contextlib
import dataclasses
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_longstraw.data.dataset import GroupSampler
from megatron_longstraw.models.registry import get_family
from megatron_longstraw.rollout import env_workers
from megatron_longstraw.rollout.env import load_env_factory
from megatron_longstraw.checkpointing import save_lock
from megatron_longstraw.runtime import errors, parent_watch
from megatron_longstraw.runtime.memory import LiveBytesMeter, SavedTensorMeter
from megatron_longstraw.training import lr_schedule, trajectories
from megatron_longstraw.training.arguments import LoRASettings
from megatron_longstraw.training.command_line import check_outputs, parse, resolve, resolve_lora
from megatron_longstraw.training.exit_conditions import ExitConditions
from megatron_longstraw.training.guards import SignalGuard
from megatron_longstraw.training.megatron_flags import refuse_unimplemented
from megatron_longstraw.training.group_sources import (
    check_data_flags,
    global_batch_size,
    load_reward_fn,
    online_groups,
    read_data,
    step_groups,
)
from megatron_longstraw.training.metrics import ProgressBar, StepLogger, configure_logging
from megatron_longstraw.training.model_setup import Setup, setup_model, starting_points
from megatron_longstraw.training.receipts import (
    parameter_counts,
    step_memory,
    step_receipt,
    step_summary,
    write_json_atomic,
)


def cli(argv: list[str] | None = None) -> dict:
    """`examples/pretrain_gpt.py`: `main`, with user errors (errors.py: bad flags, configs, data,
    missing inputs, checkpoints that do not fit) reported as one line by rank 0, exit code 2."""
    return errors.run_entry(main, argv)


def main(argv: list[str] | None = None) -> dict:
    """The launcher (module docstring), step by step; returns the last step's receipt ({} when no
    step ran)."""
    warnings.filterwarnings("ignore", module=r"megatron\..*")
    start = time.perf_counter()
    parent_watch.watch_parent()   # under torchrun: stop if torchrun dies, never write as an orphan
    launch = configure(argv)
    configure_logging()   # after Megatron's import-time logging setup: information on rank 0
    data, eval_data = read_inputs(launch)
    check_environment(launch, data)   # --longstraw-env: one made up front, before the model
    layout = start_process_groups(launch, eval_data)
    try:
        with save_lock.holding(launch.args.save, layout.rank) as took_over:   # one writer in --save
            run = setup_model(launch.args, launch.family, launch.model_cfg, launch.dtype,
                              launch.ls, launch.lora, layout.ep)
            params = parameter_counts(run.model)   # the receipt's figures (collective under EP)
            announce(([took_over] if took_over else []) + run.messages, layout)
            loop = start_loop(launch, layout, run, data, eval_data)
            train_steps(launch, layout, run, loop, start)
            loop.logger.close()
            if loop.trajectories is not None:
                loop.trajectories.close()
            save_merged(launch, layout, run, loop)
            return write_receipt(launch, layout, run, loop, params, start)
    finally:   # --longstraw-env: no environment worker outlives the run (hung ones were killed)
        env_workers.shutdown()


# ---- before the loop ----------------------------------------------------------------------------


@dataclasses.dataclass
class Launch:
    """The command line resolved (`configure`)."""

    args: Any
    given: set[str]
    """The flags given on the command line (they win over the YAML)."""
    family: str
    model_cfg: Any
    ls: Any
    """The LongStrawConfig (with LoRA, `dense=ref` where the kernels were `auto`)."""
    dtype: torch.dtype
    lora: LoRASettings | None
    reward_fn: Any
    total_iters: int


def configure(argv: list[str] | None) -> Launch:
    """Flags, YAML and model config parsed, resolved and checked before any work: every ValueError
    raised here is the user's (errors.configuration: a ConfigError)."""
    with errors.configuration():
        args, given = parse(argv)
        family, model_cfg, ls, dtype = resolve(args, given)
        lora, ls = resolve_lora(args, family, ls)
        check_outputs(args, lora)
        starting_points(args)   # --load / --pretrained-checkpoint: something there to start from
        check_data_flags(args, given)
        refuse_unimplemented(args, given, family)   # e.g. --optimizer sgd: never ignored
        reward_fn = load_reward_fn(args, ls)
        if ls.environment.env:   # a wrong module path or attribute: one line, before any work
            load_env_factory(ls.environment.env)
        total_iters = args.train_iters or 1
        check_updates_per_capture(args, ls, total_iters)
        lr_schedule.build_scheduler(args, torch.optim.SGD([torch.zeros(1, requires_grad=True)]),
                                    total_iters)   # the schedule's flags, checked before any work
    return Launch(args, given, family, model_cfg, ls, dtype, lora, reward_fn, total_iters)


def check_updates_per_capture(args, ls, total_iters: int) -> None:
    """With K updates per capture (E x K with --longstraw-epochs E), the counts of updates that
    end at a capture boundary (the run's length, saves, evaluations, exits) are multiples of it: a capture's updates are never
    cut (its members were generated or read for all K)."""
    per_capture = ls.steps_per_capture()
    if per_capture == 1:
        return
    what = (f"--longstraw-updates-per-capture {per_capture}" if ls.reuse.epochs == 1 else
            f"--longstraw-updates-per-capture {ls.reuse.updates_per_capture} x --longstraw-epochs "
            f"{ls.reuse.epochs} = {per_capture}")
    for flag, value in (("--train-iters", total_iters), ("--save-interval", args.save_interval),
                        ("--eval-interval", args.eval_interval if args.longstraw_eval_data
                         else None), ("--exit-interval", args.exit_interval)):
        if value and value % per_capture:
            raise ValueError(f"{flag} {value} is not a multiple of {what}: a capture serves "
                             f"{per_capture} updates, and saves, "
                             "evaluations and exits happen between captures; give a multiple "
                             f"(e.g. {max(per_capture, value // per_capture * per_capture)}).")


def read_inputs(launch: Launch) -> tuple:
    """(training groups of --longstraw-data, held-out groups of --longstraw-eval-data), each a
    dataset checked line by line before any process group starts, or None (synthetic groups / no
    evaluation)."""
    args, model_cfg, ls = launch.args, launch.model_cfg, launch.ls
    data = read_data(args, model_cfg, ls)
    eval_data = (read_data(args, model_cfg, ls, args.longstraw_eval_data, require_rewards=False)
                 if args.longstraw_eval_data else None)
    return data, eval_data


def check_environment(launch: Launch, data) -> None:
    """--longstraw-env: make one environment from the first prompt line, in a worker process
    as a rollout would (rollout/env_workers.py), before the model loads: a factory that raises
    or returns no environment, or an environment that would never be called (no stop_ids with
    --longstraw-env-turn-tokens 0), is a one-line error now, not after the model load and the
    first capture."""
    from megatron_longstraw.rollout.env_workers import probe_factory
    from megatron_longstraw.rollout.online import env_limits

    environment = launch.ls.environment
    if not environment.env or data is None or not len(data):
        return
    with errors.configuration():
        record = data.record(0)
        name = record.group.source + (f" (id {record.id!r})" if record.id != record.line else "")
        try:
            probe_factory(environment.env, record.meta, record.group.prompt_ids, data.tokenizer,
                          env_limits(environment))
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from exc


@dataclasses.dataclass
class Layout:
    """This rank's place in the run, and the group counts that depend on the data-parallel size."""

    rank: int
    world: int
    cp: int
    ep: int
    dp_rank: int
    dp_size: int
    batch: int
    """GRPO groups per optimizer step over all replicas (--global-batch-size)."""
    eval_count: int
    """Held-out groups scored per evaluation (0: no evaluation)."""


def start_process_groups(launch: Launch, eval_data) -> Layout:
    """Select the kernels (an explicit backend whose package is missing fails here, at start),
    start the CP x EP folded process groups (every collective bounded by
    --distributed-timeout-minutes, Megatron's default 10), set the dtype, and check the group counts against
    the data-parallel size."""
    from megatron.core import parallel_state as ps

    from megatron_longstraw.distributed import parallel
    from megatron_longstraw.kernels import select
    from megatron_longstraw.runtime import precision
    from megatron_longstraw.step.evaluate import eval_group_count

    args, ls = launch.args, launch.ls
    cp, ep = args.context_parallel_size, args.expert_model_parallel_size
    select.use(ls.run.kernels)
    parallel.initialize(context_parallel_size=cp, expert_parallel_size=ep, seed=ls.run.seed,
                        timeout_s=args.distributed_timeout_minutes * 60.0)
    precision.use_dtype(launch.dtype)  # float64: Megatron's float32 islands kept in float64
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    with errors.configuration():
        batch = global_batch_size(args, dp_size)
        eval_count = (eval_group_count(args.eval_iters, len(eval_data), dp_size)
                      if eval_data is not None else 0)
    return Layout(dist.get_rank(), dist.get_world_size(), cp, ep, dp_rank, dp_size, batch,
                  eval_count)


def announce(lines: list[str], layout: Layout) -> None:
    """Rank 0 prints what the setup did (weights loaded, adapters applied, checkpoint resumed)."""
    if layout.rank == 0 and lines:
        print("\n".join(lines), flush=True)


@dataclasses.dataclass
class Loop:
    """What the loop reads and updates: the data, its position and the counters a checkpoint
    records, the scheduler, the logger, and the last step's figures (for the receipt)."""

    data: Any
    eval_data: Any
    sampler: GroupSampler
    """Which groups each step of this replica takes."""
    consumed: int
    """Groups consumed by earlier steps (over all replicas), from the checkpoint."""
    scheduler: Any
    logger: StepLogger
    skipped: int
    """Steps the optimizer skipped (NaN / inf, without --check-for-nan-in-loss-and-grad)."""
    steps_done: int
    history: list = dataclasses.field(default_factory=list)
    """The step scalars, into the receipt (the run's curves)."""
    guard: SignalGuard | None = None
    """The no-signal and entropy guards (guards.py)."""
    stopped: str | None = None
    """Why an exit condition (exit_conditions.py) or the no-signal guard (guards.py) stopped the
    run, None otherwise."""
    result: Any = None
    """The last step's StepResult (None: no step ran), its replica mean, memory figures, groups."""
    report: Any = None
    memory: dict | None = None
    groups: list | None = None
    trajectories: Any = None
    """Online: this replica's TrajectoryWriter (trajectories.py) on its first CP rank, else None."""


def start_loop(launch: Launch, layout: Layout, run: Setup, data, eval_data) -> Loop:
    """The sampler, the data position and counters (from the resumed checkpoint, else from step
    0), the step logger, and the LR scheduler (restored when resuming)."""
    args = launch.args
    sampler = GroupSampler(len(data) if data is not None else None, layout.batch, layout.dp_rank,
                           layout.dp_size, launch.ls.run.seed, shuffle=args.longstraw_data_shuffle)
    consumed = int((run.resumed or {}).get("consumed_groups", run.first_step * layout.batch))
    logger = StepLogger(args.tensorboard_dir, enabled=layout.rank == 0)
    scheduler = lr_schedule.build_scheduler(args, run.optimizer, launch.total_iters)
    if run.resumed is not None:
        lr_schedule.restore(scheduler, run.resumed, run.first_step)
    per_capture = launch.ls.steps_per_capture()
    if run.first_step % per_capture:
        with errors.configuration():
            raise ValueError(f"The checkpoint resumed holds {run.first_step} steps, not a multiple "
                             f"of the {per_capture} updates a capture serves "
                             "(--longstraw-updates-per-capture x --longstraw-epochs): it was "
                             "saved by a run with other updates per capture. Resume with that run's value "
                             "(a capture's updates are never cut).")
    skipped = int((run.resumed or {}).get("skipped_steps", 0))
    guard = SignalGuard(launch.ls.guards.entropy_floor, launch.ls.guards.stop_after_no_signal,
                        enabled=layout.rank == 0)
    return Loop(data, eval_data, sampler, consumed, scheduler, logger, skipped,
                steps_done=run.first_step, guard=guard,
                trajectories=trajectory_writer(launch, layout, run.first_step))


def trajectory_writer(launch: Launch, layout: Layout, first_step: int):
    """--longstraw-trajectories: this replica's writer on its first context-parallel rank (the
    replica's ranks generate the same groups); None elsewhere and when off (trajectories.py)."""
    from megatron.core import parallel_state as ps

    if not trajectories.wanted(launch.ls) or ps.get_context_parallel_rank() != 0:
        return None
    args = launch.args
    folder = Path(args.longstraw_out_dir) / args.longstraw_run_name / trajectories.FOLDER
    return trajectories.TrajectoryWriter(folder, layout.dp_rank, first_step,
                                         launch.ls.rollout.trajectories_max_mb * 2**20)


# ---- the loop -----------------------------------------------------------------------------------


def train_steps(launch: Launch, layout: Layout, run: Setup, loop: Loop, start: float) -> None:
    """Steps first_step .. --train-iters - 1, a capture at a time (K updates each,
    --longstraw-updates-per-capture; 1 by default), each capture followed by the evaluation, the
    exit conditions (--exit-signal-handler, --exit-duration-in-mins, --exit-interval;
    exit_conditions.py) and the save when due: saves and exits happen at capture boundaries."""
    args = launch.args
    per_capture = launch.ls.steps_per_capture()
    with ExitConditions(args, start) as exits:
        for step in range(run.first_step, launch.total_iters, per_capture):
            # the guard reads each update's figures, the same on every rank: every rank stops
            no_signal = train_one_capture(launch, layout, run, loop, step)
            loop.steps_done = step + per_capture
            evaluate_if_due(launch, layout, run, loop)
            loop.stopped = (exits.check(loop.steps_done) if loop.steps_done < launch.total_iters
                            else None)
            if no_signal and loop.steps_done < launch.total_iters:
                loop.stopped = loop.stopped or no_signal
            saved = None
            interval = args.save_interval and loop.steps_done % args.save_interval == 0
            if args.save and (loop.stopped or interval):
                saved = save(launch, run, loop)
            if loop.stopped:
                if layout.rank == 0:
                    print(f"exiting after step {loop.steps_done - 1}: {loop.stopped}; "
                          + (f"checkpoint {saved}" if saved else "no checkpoint (no --save)"),
                          flush=True)
                break


def train_one_capture(launch: Launch, layout: Layout, run: Setup, loop: Loop,
                      step: int) -> str | None:
    """Steps `step` .. `step` + K - 1 over one capture of this replica's groups (read or
    synthetic, or generated online from the model; G x K members each): schedule.train_step
    (K = 1) or train_on_capture under the memory meters, and after each update its bookkeeping
    (`account_update`). -> the no-signal guard's reason to stop, or None."""
    from megatron_longstraw.step.schedule import train_on_capture, train_step   # tests replace them

    capture_start = time.perf_counter()
    args, ls, model = launch.args, launch.ls, run.model
    online = ls.rollout.mode == "online"
    groups = (None if online else step_groups(args, launch.model_cfg, ls, loop.sampler, loop.data,
                                              loop.consumed, launch.reward_fn))
    bar = ProgressBar(f"step {step} capture") if layout.rank == 0 else None
    live = LiveBytesMeter() if args.longstraw_live_bytes else contextlib.nullcontext()
    update = _UpdateAccount(launch, layout, run, loop, step, capture_start)
    with SavedTensorMeter(model) as meter, live:
        captures = None
        if online:
            sampled = online_groups(model, ls, loop.sampler, loop.data, loop.consumed,
                                    launch.reward_fn)
            rollouts = sampled.rollouts
            groups = [r.group for r in rollouts]
            captures = [r.captured for r in rollouts]
            update.online(sampled, groups)
            if loop.trajectories is not None:
                loop.trajectories.write(step, ls.steps_per_capture(), rollouts)
            del rollouts
        update.groups = groups
        # every round consumed a global batch of prompts (dynamic sampling: 1 + extra rounds)
        loop.consumed += layout.batch * (1 + (sampled.extra_rounds if online else 0))
        # 1/B: the update follows the mean over the step's B groups of each group's GRPO
        # loss; each replica accumulates its B / DP groups, finalize.py sums over DP.
        common = dict(ref_model=run.ref_model, max_grad_norm=args.clip_grad,
                      loss_scale=1.0 / layout.batch, progress=bar, captures=captures)
        if ls.steps_per_capture() == 1:
            update(0, train_step(model, run.optimizer, groups, ls, **common))
        else:
            train_on_capture(model, run.optimizer, groups, ls, after_update=update, **common)
        del captures
    update.log(meter, live)   # the meters' figures are read once they have stopped
    return update.no_signal


class _UpdateAccount:
    """The bookkeeping of a capture's updates. Between updates (`train_on_capture`'s
    `after_update`): a NaN / inf stops the run or counts as skipped, else the scheduler steps
    (the next update's learning rate). After the capture (`log`, once the memory meters have
    stopped: their figures cover the capture): each update's replica mean, log line, history
    and no-signal guard. The capture's own figures (rollout, environments, dynamic sampling) go
    with its first update."""

    def __init__(self, launch, layout, run, loop, step, start):
        self.launch, self.layout, self.run, self.loop = launch, layout, run, loop
        self.step, self.start = step, start
        self.groups = None
        self.lr = lr_schedule.current_lr(run.optimizer)
        self.updates: list[tuple] = []   # (result, its learning rate, skipped so far, seconds)
        self.first_extras: dict = {}
        self.trajectories = None
        self.rollout_seconds = None
        self.response_len_mean = None
        self.no_signal = None

    def online(self, sampled, groups) -> None:
        ls = self.launch.ls
        self.rollout_seconds = sum(r.seconds for r in sampled.rollouts)
        lengths = [r.numel() for g in groups for r in g.response_ids]
        self.response_len_mean = sum(lengths) / len(lengths)
        if ls.environment.env:   # this rank's groups' trajectories: per member its turns, end, reward
            self.trajectories = [r.trajectories for r in sampled.rollouts]
            self.first_extras.update(env_summary(self.trajectories))
        if ls.rollout.dynamic_sampling:   # every round consumed a global batch of prompts
            self.first_extras.update(dynamic_sampling_counts(sampled, self.layout.dp_size))

    def __call__(self, k: int, result) -> None:
        args, layout, loop = self.launch.args, self.layout, self.loop
        if self.rollout_seconds is not None:
            result.phase_seconds["rollout"] = self.rollout_seconds if k == 0 else 0.0
            result.stats["response_len_mean"] = self.response_len_mean
        if result.skipped:   # NaN / inf: no update (and no scheduler step, as in Megatron)
            nonfinite_step(args, self.step + k, result, self.groups, layout.dp_rank)
            loop.skipped += 1
        else:
            loop.scheduler.step(1)
        now = time.perf_counter()
        self.updates.append((result, self.lr, loop.skipped, now - self.start))
        self.start = now
        self.lr = lr_schedule.current_lr(self.run.optimizer)   # the next update's

    def log(self, meter, live) -> None:
        args, layout, loop = self.launch.args, self.layout, self.loop
        memory = step_memory(meter.peak_bytes, self.updates[-1][0].page_bytes,
                             {**live.phase_peaks, "step": live.peak_bytes}
                             if args.longstraw_live_bytes else None)
        for k, (result, lr, skipped, seconds) in enumerate(self.updates):
            step = self.step + k
            report = replica_mean(result, layout.dp_size)
            extras = {**memory, **(self.first_extras if k == 0 else {}), "optimizer/lr": lr,
                      "skipped_steps": skipped, "consumed_groups": loop.consumed,
                      # the whole step on this rank: groups, rollout, the update, the replica
                      # mean; with K updates per capture the first carries capture and rollout
                      "time/step_s": seconds}
            loop.logger.log(step, report, extras)
            loop.history.append({"step": step, **loop.logger.scalars(report, extras)})
            if self.trajectories is not None and k == 0:
                loop.history[-1]["env_trajectories"] = self.trajectories
            loop.result, loop.report, loop.memory, loop.groups = result, report, memory, self.groups
            # the guard reads each update's figures, the same on every rank: every rank stops
            self.no_signal = self.no_signal or loop.guard.check(step, report.stats)


END_KINDS = ("done", "env error", "timeout", "budget", "stop")
"""How a member with an environment ends (`end_kind`), in the step line's order."""


def end_kind(end_reason: str) -> str:
    """decode.Generation.end_reason -> one of END_KINDS: the env said done; an env error
    (raised, died, returned something bad); a call past --longstraw-env-timeout; the budget
    (--longstraw-env-max-turns or the tokens, an observation cut included); the policy's stop id."""
    if end_reason == "env done":
        return "done"
    if end_reason.startswith("env error"):
        return "timeout" if "did not return within" in end_reason else "env error"
    return "stop" if end_reason == "stop id" else "budget"


def env_summary(trajectories: list[list[dict]]) -> dict[str, float]:
    """The step's environment figures over this rank's members (online.Rollout.trajectories):
    turns, policy and observation tokens per member, members ended by an environment error
    (timeouts included), and the members per end kind (`end_kind`; the step line's "ends")."""
    members = [m for group in trajectories for m in group]
    turns = [t for m in members for t in m["turns"]]
    count = max(len(members), 1)
    kinds = [end_kind(m["end"]) for m in members]
    return {"env/turns_mean": len(turns) / count,
            "env/policy_tokens_mean": sum(m["trained_tokens"] for m in members) / count,
            "env/observation_tokens_mean": sum(t["observation_tokens"] for t in turns) / count,
            "env/errors": float(sum(m["end"].startswith("env error") for m in members)),
            **{f"env/ends_{kind.replace(' ', '_')}": float(kinds.count(kind))
               for kind in END_KINDS}}


def dynamic_sampling_counts(sampled, dp_size: int) -> dict[str, float]:
    """The step's dynamic-sampling counts (online.DynamicBatch), summed over the data-parallel
    replicas (collective over the data-parallel group), as history keys."""
    counts = (sampled.generated, sampled.dropped, sampled.resampled, sampled.short,
              sampled.reward_sum, sampled.reward_count)
    if dp_size > 1:
        from megatron.core import parallel_state as ps

        per_replica = [None] * dp_size
        dist.all_gather_object(per_replica, counts, group=ps.get_data_parallel_group())
        counts = tuple(sum(c) for c in zip(*per_replica))
    names = ("generated_groups", "dropped_groups", "resampled_groups", "short_groups")
    reward_sum, reward_count = counts[4:]
    # the mean over every generated member (all rounds, kept or dropped), not the trained groups'
    return {**{f"sampling/{name}": float(v) for name, v in zip(names, counts)},
            "sampling/extra_rounds": float(sampled.extra_rounds),
            "sampling/generated_reward_mean": reward_sum / max(reward_count, 1)}


def evaluate_if_due(launch: Launch, layout: Layout, run: Setup, loop: Loop) -> None:
    """Score the held-out groups after the last step and every --eval-interval steps."""
    args = launch.args
    if layout.eval_count and (loop.steps_done == launch.total_iters or (
            args.eval_interval and loop.steps_done % args.eval_interval == 0)):
        from megatron.core import parallel_state as ps

        from megatron_longstraw.step.evaluate import evaluate

        loop.logger.log_eval(loop.steps_done, evaluate(
            run.model, loop.eval_data, launch.ls, layout.eval_count, layout.dp_rank,
            layout.dp_size, ps.get_data_parallel_group()))


def save(launch: Launch, run: Setup, loop: Loop) -> Path:
    """A checkpoint of the steps done in --save (weights checked finite first), with what a
    resume needs: the scheduler, the counters, the data position. A save made because an exit
    condition stopped the run records why in meta.json ("stopped"; the SLURM scripts read it:
    torchrun exits 1 after forwarding a signal even when every worker saved and exited 0)."""
    from megatron_longstraw.checkpointing.checkpoint import save_checkpoint

    check_finite_weights(run.model, loop.steps_done - 1)
    meta = {**run.meta, **({"stopped": loop.stopped} if loop.stopped else {})}
    return save_checkpoint(launch.args.save, run.model, run.optimizer, loop.steps_done,
                           extra={"family": launch.family, "model": launch.model_cfg.to_dict(),
                                  lr_schedule.STATE_KEY: loop.scheduler.state_dict(),
                                  "skipped_steps": loop.skipped, "consumed_groups": loop.consumed},
                           meta_extra=meta)


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

    from megatron_longstraw.step.schedule import merge_stats

    per_replica = [None] * dp_size
    dist.all_gather_object(per_replica, (result.loss, result.stats),
                           group=ps.get_data_parallel_group())
    stats = merge_stats([s for _, s in per_replica])
    stats["grad_norm"] = result.stats["grad_norm"]   # of the summed gradient: the same everywhere
    return dataclasses.replace(result, loss=sum(loss for loss, _ in per_replica), stats=stats)


def check_finite_weights(model, step: int) -> None:
    """Refuse to save weights that are NaN / inf on any rank (never written to a checkpoint)."""
    from megatron_longstraw.runtime.errors import NonFiniteError
    from megatron_longstraw.distributed.agreement import any_rank

    local = any(not torch.isfinite(p).all() for p in model.parameters() if p.requires_grad)
    if any_rank([local])[0]:
        raise NonFiniteError(f"step {step}: the weights are not finite; no checkpoint was written "
                             "and the last one is intact.")


# ---- after the loop -----------------------------------------------------------------------------


def save_merged(launch: Launch, layout: Layout, run: Setup, loop: Loop) -> None:
    """--longstraw-save-merged: base + adapters merged, in model format, after the last step (not
    when an exit condition stopped the run)."""
    args = launch.args
    if args.longstraw_save_merged and not loop.stopped:
        from megatron_longstraw.checkpointing.model_format import save_model

        save_model(args.longstraw_save_merged, run.model, family=launch.family,
                   merge_adapters=True, source=f"LoRA run {args.longstraw_run_name} merged after "
                                               f"step {launch.total_iters}")
        if layout.rank == 0:
            print(f"merged weights written to {args.longstraw_save_merged}", flush=True)


def write_receipt(launch: Launch, layout: Layout, run: Setup, loop: Loop, params: dict,
                  start: float) -> dict:
    """The last step's receipt (every rank returns it; rank 0 writes it to
    --longstraw-out-dir/--longstraw-run-name/receipt.json and prints the summary); {} when no
    step ran."""
    if loop.result is None:
        return {}
    args = launch.args
    receipt = step_receipt(
        name=args.longstraw_run_name, family=launch.family, config=args.longstraw_config,
        group=max(loop.groups, key=lambda g: g.prompt_ids.numel()), result=loop.report,
        memory=loop.memory, params=params, meta=run.meta,
        sizes={"world_size": layout.world, "context_parallel_size": layout.cp,
               "expert_parallel_size": layout.ep, "data_parallel_size": layout.dp_size,
               "global_batch_size": layout.batch},
        dtype=launch.dtype, steps=loop.steps_done, start=start)
    receipt["settings"] = launch.ls.flat()   # the run's LongStraw settings, as YAML keys
    receipt["skipped_steps"] = loop.skipped
    if loop.stopped:
        receipt["stopped"] = loop.stopped
    receipt["history"] = loop.history
    if loop.trajectories is not None:   # rank 0: replica 0's file (the others beside it)
        receipt["trajectories"] = loop.trajectories.summary()
    if layout.rank != 0:
        return receipt
    folder = Path(args.longstraw_out_dir) / args.longstraw_run_name
    plot = write_plot(loop.history, folder, f"{args.longstraw_run_name}: {launch.family}, "
                                            f"{loop.steps_done} steps")
    if plot is not None:
        receipt["plot"] = plot.name
    path = write_json_atomic(folder / "receipt.json", receipt)
    print(step_summary(receipt, model=get_family(launch.family).describe(launch.model_cfg),
                       lora=run.lora, backend=dist.get_backend(), path=path), flush=True)
    print(f"curves: {plot}" if plot is not None else
          "curves: no PNG (matplotlib is not installed; pip install matplotlib)", flush=True)
    return receipt


def write_plot(history: list[dict], folder: Path, title: str) -> Path | None:
    """The run's curves (run_plot.py) as `folder`/run_curves.png, beside receipt.json; None
    when matplotlib is missing (the run's results do not depend on it)."""
    from megatron_longstraw.training.run_plot import write_run_png

    folder.mkdir(parents=True, exist_ok=True)
    try:
        return write_run_png(history, folder / "run_curves.png", title)
    except ImportError:
        return None
