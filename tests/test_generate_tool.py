"""tools/generate.py end to end: prompt lines in, groups in the training format out; scoring the
output with tools/score.py (the same random-init model) finds the written `logprobs_old` equal to
its own log-probs (decode == scoring), and the output trains offline."""

import sys
from pathlib import Path

import pytest

from megatron_longstraw.rollout.rewards import make_marker_task

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
TINY = str(ROOT / "examples" / "qwen36" / "tiny.yaml")


@pytest.mark.usefixtures("single_process")
def test_generated_groups_score_to_their_own_logprobs_and_train(tmp_path):
    import generate
    import score
    from megatron_longstraw.training import train
    from megatron_longstraw.data.groups import read_records

    prompts = tmp_path / "prompts.jsonl"
    make_marker_task(2, 40, [5, 6, 7], 64, seed=1, majority_count=4, path=prompts)
    out = tmp_path / "groups.jsonl"
    common = ["--family", "qwen36", "--config", TINY, "--random-init", "--dtype", "fp64"]
    lines = generate.main(common + ["--input", str(prompts), "--out", str(out), "--group-size",
                                    "3", "--max-new-tokens", "3", "--reward",
                                    "longstraw:marker_majority", "--init-seed", "7"])
    assert len(lines) == 2 and all(len(row["response_ids"]) == 3 for row in lines)
    records = list(read_records(out))                 # the training format, every field checked
    assert [r.meta["answer"] for r in records] == [row["meta"]["answer"] for row in lines]
    assert all(r.has_rewards for r in records)
    scored = score.main(common + ["--seed", "7", "--input", str(out),
                                  "--out", str(tmp_path / "scores.jsonl")])
    assert scored["summary"]["overall"]["max_abs_diff"] < 1e-9
    receipt = train.main(["--longstraw", "--longstraw-family", "qwen36", "--longstraw-config",
                          TINY, "--longstraw-data", str(out), "--longstraw-group-size", "3",
                          "--longstraw-dtype", "fp64", "--lr", "1e-3", "--train-iters", "1",
                          "--longstraw-out-dir", str(tmp_path), "--longstraw-run-name", "g"])
    # the step trained on one of the written groups, with its written rewards
    means = [sum(row["rewards"]) / 3 for row in lines]
    assert any(receipt["history"][0]["grpo/reward_mean"] == pytest.approx(m) for m in means)


@pytest.mark.usefixtures("single_process")
def test_generated_trajectories_with_an_environment_carry_masks_score_and_train(tmp_path):
    """tools/generate.py --env: multi-turn lines with loss_masks (0 at the observations) and the
    environment's rewards; score.py finds the written log-probs its own at every token; the
    file trains offline."""
    import json

    import generate
    import score
    from megatron_longstraw.training import train
    from megatron_longstraw.data.groups import read_records

    prompts = tmp_path / "prompts.jsonl"
    with prompts.open("w") as f:
        for k in range(2):
            ids = list(range(20 + k, 60 + k))
            f.write(json.dumps({"id": f"p{k}", "prompt_ids": ids,
                                "meta": {"answer": ids[5], "answer_turn": 3}}) + "\n")
    out = tmp_path / "trajectories.jsonl"
    common = ["--family", "qwen36", "--config", TINY, "--random-init", "--dtype", "fp64"]
    lines = generate.main(common + ["--input", str(prompts), "--out", str(out), "--group-size",
                                    "2", "--max-new-tokens", "16", "--init-seed", "7",
                                    "--env", "megatron_longstraw.rollout.example_env:lookup",
                                    "--env-turn-tokens", "3"])
    for row in lines:
        assert row["loss_masks"] == [[1, 1, 1, 0, 0] * 2 + [1, 1, 1]] * 2
        assert all(r in (0.0, 1.0) for r in row["rewards"])
    records = list(read_records(out))                 # the training format, masks checked
    assert all(r.group.loss_masks is not None for r in records)
    scored = score.main(common + ["--seed", "7", "--input", str(out),
                                  "--out", str(tmp_path / "scores.jsonl")])
    assert scored["summary"]["overall"]["max_abs_diff"] < 1e-9
    train.main(["--longstraw", "--longstraw-family", "qwen36", "--longstraw-config", TINY,
                "--longstraw-data", str(out), "--longstraw-group-size", "2",
                "--longstraw-dtype", "fp64", "--lr", "1e-3", "--train-iters", "1",
                "--longstraw-out-dir", str(tmp_path), "--longstraw-run-name", "t"])
