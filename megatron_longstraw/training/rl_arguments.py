"""The launcher's RL flags (arguments.py's `add_longstraw_args` adds them): loss options, guards,
dynamic sampling and environments, each a `LongStrawConfig` field and a YAML `longstraw:` key
(`RL_FLAG_TO_FIELD`); docs/design.md section 2 states what each does."""

from __future__ import annotations

import argparse

from megatron_longstraw.config.loss import LOSS_AGGREGATIONS

def add_rl_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(
        "longstraw: loss options, guards, dynamic sampling (YAML `longstraw:` keys "
        "loss_aggregation, loss_constant, dual_clip, log_ratio_clamp, kl_clamp, entropy_floor, "
        "stop_after_no_signal, dynamic_sampling, dynamic_sampling_rounds, env, env_max_turns, "
        "env_turn_tokens, env_timeout; docs/design.md section 2)")
    group.add_argument("--longstraw-loss-aggregation", choices=LOSS_AGGREGATIONS, default=None,
                       help="sequence_mean (default): each member's token mean, then the mean "
                            "over the group; token_mean (DAPO): the mean over all the group's "
                            "tokens; constant (Dr. GRPO): each member's token sum / C "
                            "(--longstraw-loss-constant), then the mean over the group.")
    group.add_argument("--longstraw-loss-constant", type=int, default=None, metavar="C",
                       help="C of --longstraw-loss-aggregation constant, in tokens (default: "
                            "--longstraw-max-new-tokens, else --longstraw-max-response-len).")
    group.add_argument("--longstraw-dual-clip", type=float, nargs="?", const=3.0, default=None,
                       metavar="C", help="Dual clip for negative advantages: a token's policy "
                                         "loss is at most C |A| (C > 1; the flag alone: 3).")
    group.add_argument("--longstraw-log-ratio-clamp", type=float, default=None, metavar="D",
                       help="Clamp logp - logp_old to [-D, D] before the exp of the PPO ratio "
                            "(default: off).")
    group.add_argument("--longstraw-kl-clamp", type=float, default=None, metavar="K",
                       help="Cap each token's k3 KL estimate at K (default: off).")
    group.add_argument("--longstraw-entropy-floor", type=float, default=None, metavar="NATS",
                       help="Warn once when the policy's mean entropy over a step's trained "
                            "tokens falls below NATS (entropy collapse; default 0.01; 0: off).")
    group.add_argument("--longstraw-stop-after-no-signal", type=int, default=None, metavar="N",
                       help="Stop (saving with --save) after N consecutive steps in which every "
                            "group's rewards were all equal (zero advantage; default 0: never).")
    group.add_argument("--longstraw-dynamic-sampling", action=argparse.BooleanOptionalAction,
                       default=None,
                       help="Online (DAPO): drop generated groups whose rewards are all equal and "
                            "generate more from the next prompts until the step's batch is full.")
    group.add_argument("--longstraw-dynamic-sampling-rounds", type=int, default=None, metavar="N",
                       help="The most extra generation rounds per step of dynamic sampling, each "
                            "over the next --global-batch-size prompts (default 4); past it the "
                            "batch is filled with dropped groups.")
    group.add_argument("--longstraw-env", type=str, default=None, metavar="MODULE:FACTORY",
                       help="Online: an environment per member, made by FACTORY(meta, prompt_ids, "
                            "tokenizer) (rollout/env.py): multi-turn trajectories, the tool "
                            "observations prefilled and masked out of the loss. Built-in "
                            "example: megatron_longstraw.rollout.example_env:lookup.")
    group.add_argument("--longstraw-env-max-turns", type=int, default=None, metavar="N",
                       help="Environment calls per member (default 8).")
    group.add_argument("--longstraw-env-turn-tokens", type=int, default=None, metavar="N",
                       help="A turn also ends after N policy tokens (default 0: only at the "
                            "environment's stop ids).")
    group.add_argument("--longstraw-env-timeout", type=float, default=None, metavar="SECONDS",
                       help="Seconds one environment call may take; past it the member ends "
                            "with a record (default 30).")
    return parser


RL_FLAG_TO_FIELD = {
    "longstraw_env": "env",
    "longstraw_env_max_turns": "env_max_turns",
    "longstraw_env_turn_tokens": "env_turn_tokens",
    "longstraw_env_timeout": "env_timeout",
    "longstraw_loss_aggregation": "loss_aggregation",
    "longstraw_loss_constant": "loss_constant",
    "longstraw_dual_clip": "dual_clip",
    "longstraw_log_ratio_clamp": "log_ratio_clamp",
    "longstraw_kl_clamp": "kl_clamp",
    "longstraw_entropy_floor": "entropy_floor",
    "longstraw_stop_after_no_signal": "stop_after_no_signal",
    "longstraw_dynamic_sampling": "dynamic_sampling",
    "longstraw_dynamic_sampling_rounds": "dynamic_sampling_rounds",
}
