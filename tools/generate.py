"""Generate GRPO groups from the captured prompt state (decode.py) and write them in the training
format, so they also feed the offline path (`--longstraw-data`).

    python tools/generate.py --family qwen36 --config examples/qwen36/tiny.yaml --checkpoint DIR \
        --input prompts.jsonl --out groups.jsonl --group-size 8 --max-new-tokens 256 \
        [--temperature 1.0 --top-p 1.0 --top-k 0 --stop-ids 2 --seed 0] \
        [--reward longstraw:marker_majority] [--tokenizer PATH] [--dtype fp32|fp64] \
        [--env megatron_longstraw.rollout.example_env:lookup --env-turn-tokens 3]
    python tools/generate.py --checkpoint CONVERTED --input prompts.jsonl --out groups.jsonl ...

The input holds prompt lines (a prompt as "prompt" text, "prompt_ids", "prompt_file" or chat
"prompt_messages" rendered with the --tokenizer directory's chat template, plus optional "id" and
"meta": what `--longstraw-rollout online` reads). Each prompt is captured once
and `--group-size` responses are sampled from the capture, batched over the members (one
process; the model as tools/score.py builds it). Each output line carries the prompt as given,
"response_ids", "logprobs_old" (the sampling distribution's log-probs of the sampled tokens:
with temperature 1 and no truncation, the model's, equal to what training's scoring computes),
the "meta", and, with `--reward` (rewards.py), "rewards"; without, train on it with
`--longstraw-reward`. Prompt lines are written back with the same prompt field (a prompt_file
keeps its path, relative to the output's folder when the input's folder differs).

With `--env module:factory` (rollout/env.py, as `--longstraw-env`): multi-turn trajectories, the
environments' observations prefilled; each line then also carries "loss_masks" (0 at the
observations' tokens) and the rewards the environments gave (else `--reward`'s, else 0), so the
file trains offline on the policy's own tokens only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

from megatron_longstraw.checkpointing.model_source import (
    DTYPES, build_model, load_weights, model_config, resolve_model_source,
)
from megatron_longstraw.models.registry import FAMILIES


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(FAMILIES), default=None,
                   help="Model family; default: the --checkpoint model-format directory's.")
    p.add_argument("--config", default=None, help="Model YAML (`model:` and `longstraw:`).")
    weights = p.add_mutually_exclusive_group(required=True)
    weights.add_argument("--checkpoint", help="Checkpoint directory with model.safetensors.")
    weights.add_argument("--random-init", action="store_true",
                         help="Random weights from --init-seed (smoke tests; tools/score.py "
                              "--random-init --seed builds the same).")
    p.add_argument("--init-seed", type=int, default=1234)
    p.add_argument("--input", required=True, help="JSONL of prompt lines.")
    p.add_argument("--out", required=True, help="Output JSONL of groups (training format).")
    p.add_argument("--group-size", type=int, required=True, help="Responses per prompt (G).")
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--stop-ids", type=int, nargs="*", default=())
    p.add_argument("--seed", type=int, default=0,
                   help="Sampling seed; prompt k of the file samples with seed + k.")
    p.add_argument("--reward", default=None, metavar="MODULE:FUNCTION",
                   help="Reward function (rewards.py) that fills in 'rewards'.")
    p.add_argument("--tokenizer", help="Local tokenizer (text prompts; decoded text for rewards).")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--env", default=None, metavar="MODULE:FACTORY",
                   help="An environment per member (rollout/env.py; --longstraw-env).")
    p.add_argument("--env-max-turns", type=int, default=8)
    p.add_argument("--env-turn-tokens", type=int, default=0)
    p.add_argument("--env-timeout", type=float, default=30.0)
    p.add_argument("--env-prefill-block", type=int, default=2048,
                   help="Observation tokens fed in one pass (as --longstraw-env-prefill-block).")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    """The tool (module docstring). -> the written lines."""
    args = parse_args(argv)
    warnings.filterwarnings("ignore", module=r"megatron\..*")
    from megatron_longstraw.runtime import errors
    from megatron_longstraw.distributed import parallel
    from megatron_longstraw.training.arguments import longstraw_config_from_yaml
    from megatron_longstraw.config.settings import EnvironmentSettings, LongStrawConfig
    from megatron_longstraw.data.groups import load_tokenizer, read_line
    from megatron_longstraw.data.dataset import GroupDataset
    from megatron_longstraw.rollout.decode import generate
    from megatron_longstraw.config.sampling import SamplingParams
    from megatron_longstraw.context.capture import capture_prompt
    from megatron_longstraw.rollout.env import load_env_factory
    from megatron_longstraw.rollout.online import env_limits, env_rewards, make_envs
    from megatron_longstraw.rollout.rewards import compute_rewards, load_reward

    with errors.configuration():
        family, source = resolve_model_source(args.family, args.config, args.checkpoint)
        cfg = model_config(family, source)
        ls = longstraw_config_from_yaml(args.config) if args.config else LongStrawConfig()
        base = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, stop_ids=tuple(args.stop_ids))
        if args.group_size < 1:
            raise ValueError(f"--group-size {args.group_size}: generate at least one response.")
        reward_fn = load_reward(args.reward, "--reward") if args.reward else None
        if args.env:
            ls.environment = EnvironmentSettings(env=args.env, env_max_turns=args.env_max_turns,
                                                 env_turn_tokens=args.env_turn_tokens,
                                                 env_timeout=args.env_timeout,
                                                 env_prefill_block=args.env_prefill_block)
            load_env_factory(args.env)
            env_limits(ls.environment)         # their checks name the bad value
    parallel.initialize(context_parallel_size=1, expert_parallel_size=1, seed=args.init_seed)
    model_cfg, model, num_experts = build_model(family, cfg, DTYPES[args.dtype], 1)
    if args.checkpoint:
        load_weights(model, args.checkpoint, num_experts)
    model.eval()
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    prompts = GroupDataset(args.input, tokenizer=tokenizer, vocab_size=model_cfg.vocab_size,
                           require_rewards=False, prompt_only=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    lines = []
    try:
        with tmp.open("w", encoding="utf-8") as f:
            for k in range(len(prompts)):
                record = prompts.record(k)
                prompt = record.group.prompt_ids
                captured = capture_prompt(model, prompt, ls)
                params = SamplingParams(**{**base.__dict__, "seed": args.seed + k})
                name = f"{args.input} line {record.line}"
                envs = (make_envs(ls.environment, record, prompt, tokenizer, name, args.group_size)
                        if args.env else None)
                gens = generate(model, captured, args.group_size, params, ls, envs=envs,
                                env_limits=env_limits(ls.environment) if envs else None, tokenizer=tokenizer)
                given = json.loads(read_line(prompts.path, int(prompts.offsets[k])))
                row = {key: value for key, value in given.items()
                       if key in ("id", "prompt", "prompt_ids", "prompt_file",
                                   "prompt_messages", "meta")}
                if "prompt_file" in row:
                    row["prompt_file"] = os.path.relpath(
                        Path(args.input).parent / row["prompt_file"], out.parent)
                row["response_ids"] = [g.token_ids.tolist() for g in gens]
                row["logprobs_old"] = [g.sample_logprobs.tolist() for g in gens]
                if envs is not None:
                    row["loss_masks"] = [g.loss_mask.int().tolist() for g in gens]
                    rewards, _ = env_rewards(gens, reward_fn, prompt, record, tokenizer, name)
                    row["rewards"] = rewards.tolist()
                elif reward_fn is not None:
                    row["rewards"] = compute_rewards(
                        reward_fn, prompt, [g.token_ids for g in gens], record.meta, None,
                        tokenizer, record=name).tolist()
                f.write(json.dumps(row) + "\n")
                lines.append(row)
                print(f"[generate] {row.get('id', record.line)}: {args.group_size} responses, "
                      f"{sum(g.token_ids.numel() for g in gens)} tokens"
                      + (f", mean reward {sum(row['rewards']) / len(gens):.3f}"
                         if "rewards" in row else ""), file=sys.stderr, flush=True)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return lines


if __name__ == "__main__":
    from megatron_longstraw.runtime.errors import run_entry

    run_entry(main)
