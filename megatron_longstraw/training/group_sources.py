"""Where each step's GRPO groups come from, and the flags that say so: Megatron's pre-training
data flags refused, --global-batch-size checked against the data-parallel size, --longstraw-data
(and --longstraw-eval-data) read as a dataset checked line by line before any work, the reward
function of --longstraw-reward, and a step's groups: read from the data (rewards filled in by the
reward function where a line has none), synthetic, or generated online from the model
(rollout/online.py).
"""

from __future__ import annotations

from megatron_longstraw.runtime.errors import ConfigError, FlagError


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

        return longstraw_config_from_yaml(args.longstraw_config).rollout.mode
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
        if len(group.response_ids) != ls.members_per_group():
            k = ls.reuse.updates_per_capture
            size = (f"{ls.group.group_size} (--longstraw-group-size, YAML longstraw.group_size)"
                    if k == 1 else
                    f"{ls.members_per_group()}: one capture serves {k} updates "
                    f"(--longstraw-updates-per-capture) of {ls.group.group_size} members "
                    "(--longstraw-group-size)")
            raise DataError(path, record.line, field,
                            f"has {len(group.response_ids)} responses but the group size is "
                            f"{size}; give every member of the group or change the group size.")
        for i, response in enumerate(group.response_ids):
            if response.numel() > ls.group.max_response_len:
                raise DataError(path, record.line, field,
                                f"item {i} has {response.numel()} tokens, more than "
                                f"--longstraw-max-response-len {ls.group.max_response_len} (YAML "
                                "longstraw.max_response_len); raise the limit or drop the "
                                "member.")
    return check


def read_data(args, model_cfg, ls, path: str | None = None, require_rewards: bool | None = None):
    """The GRPO groups of `path` (default --longstraw-data) as a lazily read
    dataset.GroupDataset, every line checked against the model and the step settings before any
    process group starts (a bad line is a DataError naming file, line and field); None without
    a path (synthetic data). Lines must carry "rewards" unless a reward function computes them
    (`require_rewards` None: ls.group.reward is None)."""
    if require_rewards is None:
        require_rewards = ls.group.reward is None
    path = args.longstraw_data if path is None else path
    if not path:
        return None
    from megatron_longstraw.data.groups import load_tokenizer
    from megatron_longstraw.data.dataset import GroupDataset

    tokenizer = load_tokenizer(args.longstraw_tokenizer) if args.longstraw_tokenizer else None
    if ls.rollout.mode == "online" and path == args.longstraw_data:   # prompt lines (rollout.py)
        return GroupDataset(path, tokenizer=tokenizer, vocab_size=model_cfg.vocab_size,
                            require_rewards=False, prompt_only=True)
    return GroupDataset(path, tokenizer=tokenizer, vocab_size=model_cfg.vocab_size,
                        check=_group_check(path, ls), require_rewards=require_rewards)


def load_reward_fn(args, ls):
    """The reward function of --longstraw-reward (YAML longstraw.reward; rewards.py), or None.
    It scores the --longstraw-data lines that carry no "rewards", so it is refused without
    --longstraw-data (the synthetic groups carry their own)."""
    if ls.group.reward is None:
        return None
    if not args.longstraw_data:
        raise ConfigError(f"--longstraw-reward {ls.group.reward} scores the responses of "
                          "--longstraw-data lines without 'rewards'; pass --longstraw-data (the "
                          "synthetic groups carry their own rewards) or drop the reward.")
    from megatron_longstraw.rollout.rewards import load_reward

    return load_reward(ls.group.reward)


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
    return [synthetic_group(model_cfg.vocab_size, prompt_len, ls.members_per_group(),
                            min(args.longstraw_synthetic_response_len, ls.group.max_response_len),
                            seed=ls.run.seed + g) for g in indices]


def online_groups(model, ls, sampler, data, consumed_groups: int, reward_fn):
    """The online loop: this replica's groups of the step, each generated from its own capture
    of the prompt and rewarded (rollout.py); sample g generates with seed + g, so a resumed run
    generates what the uninterrupted one did. -> `online.DynamicBatch`: with
    `ls.rollout.dynamic_sampling` the groups whose rewards are all equal are dropped and extra rounds
    take the next batches of prompts (B = `sampler`'s global batch each, so the step consumes
    B x (1 + extra_rounds) groups; rounds agreed over the world); without it, the step's
    groups as generated (counts: nothing dropped)."""
    from megatron_longstraw.distributed.agreement import any_rank
    from megatron_longstraw.runtime import memory
    from megatron_longstraw.rollout.online import DynamicBatch, dynamic_sampling_batch, rollout_group

    batch = sampler.global_batch_size   # B: prompts per round over all replicas

    def generate_round(round_idx: int) -> list:
        start = consumed_groups + round_idx * batch
        return [rollout_group(model, data.record(index), ls, reward_fn, seed=ls.run.seed + g,
                              tokenizer=data.tokenizer, control=ls.rollout.control)
                for index, g in zip(sampler.step_indices(start), sampler.global_indices(start))]

    with memory.phase("rollout"):
        if not ls.rollout.dynamic_sampling:
            rollouts = generate_round(0)
            return DynamicBatch(rollouts, len(rollouts), 0, 0, 0, 0)
        return dynamic_sampling_batch(generate_round, sampler.micro_batches,
                                      ls.rollout.dynamic_sampling_rounds,
                                      agree_short=lambda short: any_rank([short])[0])
