"""Dynamic sampling (DAPO; --longstraw-dynamic-sampling, rollout/online.py): groups whose rewards
are all equal are dropped, extra rounds over the next prompts refill the step's batch, and the
history counts what was generated, dropped, resampled and left short."""

import json
from pathlib import Path

import pytest
import torch

from megatron_longstraw.data.group import GRPOGroup
from megatron_longstraw.rollout.online import Rollout, dynamic_sampling_batch, has_signal
from megatron_longstraw.training import train

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "qwen36" / "tiny.yaml")


def _rollout(name: str, rewards: list[float]) -> Rollout:
    group = GRPOGroup(prompt_ids=torch.tensor([1, 2]), response_ids=[torch.tensor([3])] * 2,
                      rewards=torch.tensor(rewards, dtype=torch.float64))
    group.source = name
    return Rollout(group, captured=None, seconds=0.0)


def test_the_batch_is_refilled_and_the_counts_say_what_was_dropped():
    rounds = [[_rollout("a", [1, 1]), _rollout("b", [1, 0]), _rollout("c", [0, 0])],
              [_rollout("d", [2, 2]), _rollout("e", [0, 1]), _rollout("f", [3, 1])]]
    calls = []

    def generate(round_idx):
        calls.append(round_idx)
        return rounds[round_idx]

    out = dynamic_sampling_batch(generate, need=3, max_extra_rounds=4)
    assert [r.group.source for r in out.rollouts] == ["b", "e", "f"]
    assert (out.generated, out.dropped, out.resampled, out.extra_rounds, out.short) == (6, 3, 3, 1, 0)
    assert calls == [0, 1]
    # the generated members' mean counts the dropped groups too (12 members, reward sum 12)
    assert (out.reward_sum, out.reward_count) == (12.0, 12)
    assert not has_signal(rounds[0][0].group) and has_signal(rounds[0][1].group)


def test_past_the_round_limit_the_batch_is_filled_with_dropped_groups():
    def generate(round_idx):
        return [_rollout(f"{round_idx}{k}", [1, 1]) for k in range(2)] + (
            [_rollout("signal", [0, 1])] if round_idx == 0 else [])

    out = dynamic_sampling_batch(generate, need=3, max_extra_rounds=2)
    assert [r.group.source for r in out.rollouts] == ["signal", "00", "01"]
    assert (out.generated, out.dropped, out.resampled, out.extra_rounds, out.short) == (7, 6, 4, 2, 2)
    # a rank that is full runs the rounds another rank needs (agreed), without generating
    calls = []
    out = dynamic_sampling_batch(lambda r: calls.append(r) or [_rollout("x", [0, 1])], need=1,
                                 max_extra_rounds=3, agree_short=lambda short: True)
    assert calls == [0] and out.extra_rounds == 3 and out.generated == 1


def _flags(tmp_path: Path, name: str, constant: list[bool], *extra) -> list[str]:
    """Online runs over prompt lines whose reward is the same for every member where `constant`,
    else the sampled first token (G = 3 samples of a 512-token vocabulary: not all equal)."""
    gen = torch.Generator().manual_seed(0)
    prompts = tmp_path / f"{name}.jsonl"
    with prompts.open("w") as f:
        for i, c in enumerate(constant):
            f.write(json.dumps({"id": f"p{i}", "prompt_ids": torch.randint(
                0, 512, (24,), generator=gen).tolist(), "meta": {"constant": c}}) + "\n")
    (tmp_path / "planted_reward.py").write_text(
        "def reward(prompt, response, text, meta):\n"
        "    return 1.0 if meta['constant'] else float(int(response[0]))\n")
    return ["--longstraw", "--longstraw-family", "qwen36", "--longstraw-config", TINY,
            "--longstraw-data", str(prompts), "--no-longstraw-data-shuffle",
            "--longstraw-rollout", "online", "--longstraw-reward", "planted_reward:reward",
            "--longstraw-group-size", "3", "--longstraw-max-new-tokens", "2",
            "--longstraw-dtype", "fp32", "--lr", "1e-3", "--global-batch-size", "2",
            "--seed", "5", "--longstraw-out-dir", str(tmp_path), "--longstraw-run-name", name,
            "--no-longstraw-live-bytes", *extra]


def test_the_online_loop_refills_the_step_and_the_history_counts_it(tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.syspath_prepend(str(tmp_path))
    # step 0: p0 (no signal) dropped, p1 kept; one extra round over p2, p3: p2 dropped, p3 kept.
    # step 1 starts after the 4 consumed prompts: p4, p5, both with signal.
    receipt = train.main(_flags(tmp_path, "refill", [True, False, True, False, False, False],
                                "--longstraw-dynamic-sampling", "--train-iters", "2"))
    first, second = receipt["history"]
    assert (first["sampling/generated_groups"], first["sampling/dropped_groups"],
            first["sampling/resampled_groups"], first["sampling/extra_rounds"],
            first["sampling/short_groups"]) == (4, 2, 2, 1, 0)
    # over all 12 members, the dropped p0 and p2 (reward 1.0, 6 members) included
    assert first["sampling/generated_reward_mean"] >= 6 / 12
    assert (second["sampling/dropped_groups"], second["sampling/extra_rounds"]) == (0, 0)
    assert first["consumed_groups"] == 4 and second["consumed_groups"] == 6
    assert first["grpo/zero_advantage_frac"] == second["grpo/zero_advantage_frac"] == 0.0
    assert "dropped 2 resampled 2 in 1 extra rounds" in capsys.readouterr().out

    # The round limit reached: the batch is filled with dropped groups, counted as short, and
    # the guard warns (every group without signal).
    receipt = train.main(_flags(tmp_path, "short", [True] * 4, "--longstraw-dynamic-sampling",
                                "--longstraw-dynamic-sampling-rounds", "1", "--train-iters", "1"))
    (only,) = receipt["history"]
    assert (only["sampling/generated_groups"], only["sampling/dropped_groups"],
            only["sampling/extra_rounds"], only["sampling/short_groups"]) == (4, 4, 1, 2)
    assert only["grpo/zero_advantage_frac"] == 1.0
    out = capsys.readouterr().out
    assert "short 2" in out and "every group's rewards are all equal" in out

    # Off (the default): nothing is dropped or counted.
    receipt = train.main(_flags(tmp_path, "off", [True, False], "--train-iters", "1"))
    assert receipt["history"][0]["grpo/zero_advantage_frac"] == 0.5
    assert not any(key.startswith("sampling/") for key in receipt["history"][0])


def test_dynamic_sampling_needs_the_online_loop():
    from megatron_longstraw.config.settings import LongStrawConfig

    with pytest.raises(ValueError, match="needs --longstraw-rollout online"):
        LongStrawConfig.of(dynamic_sampling=True)
    with pytest.raises(ValueError, match="dynamic_sampling_rounds"):
        LongStrawConfig.of(dynamic_sampling_rounds=-1)
