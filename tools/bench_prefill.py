"""Block prefill of environment observations against the token-by-token feed (issue 43): the
time to take one observation of `--observation` tokens into a member's state both ways, in one
process, with the trajectories checked equal.

    python tools/bench_prefill.py [--families glm52,qwen36,deepseekv3] [--observation 2048]
        [--prompt 1024] [--members 2] [--out-dir runs/bench]

Each family's tiny example model (fp32, random weights) captures a `--prompt`-token prompt once;
then `generate` runs `--members` members, each of which samples one policy token, calls an
environment that returns `--observation` ids, and samples one more token: once with
`prefill_block` 1 (one row per decode pass, as before issue 43) and once with a block of the
whole observation (the fastest of BLOCK_REPEATS runs). The two runs must give the same tokens
and log-probs (<= 1e-5 in fp32; the fp64 equality is tests/test_env.py); the table gives each
run's seconds and decode passes and their ratio. Writes <out-dir>/prefill.json and prefill.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402


class _Observation:
    """Returns `length` ids on every call (never done)."""

    stop_ids = ()

    def __init__(self, length: int, vocab_size: int, salt: int):
        self.length, self.vocab_size, self.salt = length, vocab_size, salt

    def step(self, turn_ids):
        from megatron_longstraw.rollout.env import EnvStep

        start = sum(turn_ids) + 11 * self.salt
        return EnvStep(observation=[(start + 7 * i) % self.vocab_size for i in range(self.length)])


BLOCK_REPEATS = 3
"""The block feed runs this many times (a second or two each) and its fastest is reported; the
row-per-pass feed (tens of seconds) once."""


def _counting_passes(model):
    """Counts decode passes: calls of the model's embedding (one per pass)."""
    count = [0]
    model.embedding.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return count


def run_family(family: str, prompt_len: int, observation: int, members: int, seed: int) -> dict:
    from megatron_longstraw.checkpointing.model_source import build_model
    from megatron_longstraw.config.sampling import SamplingParams
    from megatron_longstraw.config.settings import LongStrawConfig
    from megatron_longstraw.context.capture import capture_prompt
    from megatron_longstraw.models.registry import get_family
    from megatron_longstraw.rollout.decode import generate
    from megatron_longstraw.rollout.env import EnvLimits

    cfg, model, _ = build_model(family, ROOT / get_family(family).tiny_config, torch.float32)
    model.eval()
    prompt = torch.randint(0, cfg.vocab_size, (prompt_len,),
                           generator=torch.Generator().manual_seed(seed))
    ls = LongStrawConfig.of(group_size=members, max_response_len=observation + 2)
    captured = capture_prompt(model, prompt, ls)
    passes = _counting_passes(model)
    runs = {}
    for block, repeats in ((1, 1), (observation, BLOCK_REPEATS)):
        times = []
        for _ in range(repeats):      # the block feed's seconds vary run to run: the fastest
            envs = [_Observation(observation, cfg.vocab_size, m) for m in range(members)]
            passes[0] = 0
            start = time.perf_counter()
            gens = generate(model, captured, members,
                            SamplingParams(max_new_tokens=observation + 2, seed=seed), ls,
                            envs=envs, env_limits=EnvLimits(max_turns=2, turn_tokens=1,
                                                            prefill_block=block))
            times.append(time.perf_counter() - start)
        runs[block] = (min(times), passes[0], gens)
    (slow, slow_passes, by_token), (fast, fast_passes, by_block) = runs[1], runs[observation]
    for a, b in zip(by_token, by_block):
        if not (torch.equal(a.token_ids, b.token_ids) and torch.equal(a.loss_mask, b.loss_mask)):
            raise SystemExit(f"{family}: the block feed's trajectory differs from the token feed's")
    worst = max(float((a.logprobs - b.logprobs).abs().max()) for a, b in zip(by_token, by_block))
    if worst > 1e-5:
        raise SystemExit(f"{family}: block vs token feed max |d logp| {worst:.1e} > 1e-5")
    fed = int((~by_token[0].loss_mask).sum())
    return {"family": family, "prompt": prompt_len, "observation": fed, "members": members,
            "token_s": slow, "block_s": fast, "speedup": slow / fast, "token_passes": slow_passes,
            "block_passes": fast_passes, "max_abs_dlogp": worst}


def markdown(rows: list[dict]) -> str:
    lines = ["| family | prompt | observation tokens | members | one row per pass (s, passes) "
             "| one block (s, passes) | speed-up | max abs d logp |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['family']} | {r['prompt']} | {r['observation']} | {r['members']} | "
                     f"{r['token_s']:.2f}, {r['token_passes']} | {r['block_s']:.2f}, "
                     f"{r['block_passes']} | x{r['speedup']:.1f} | {r['max_abs_dlogp']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default="glm52,qwen36,deepseekv3")
    p.add_argument("--observation", type=int, default=2048)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--members", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=str(ROOT / "runs" / "bench"))
    args = p.parse_args(argv)
    if args.observation < 2 or args.prompt < 1 or args.members < 1:
        p.error("--observation must be >= 2, --prompt and --members >= 1")
    from megatron_longstraw.distributed import parallel

    parallel.initialize(context_parallel_size=1, expert_parallel_size=1, seed=args.seed)
    rows = []
    for family in args.families.split(","):
        rows.append(run_family(family, args.prompt, args.observation, args.members, args.seed))
        print(f"{family}: {rows[-1]['observation']}-token observation: one row per pass "
              f"{rows[-1]['token_s']:.2f} s, one block {rows[-1]['block_s']:.2f} s "
              f"(x{rows[-1]['speedup']:.1f})", flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "prefill.md").write_text(markdown(rows))
    print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
