"""--longstraw-trajectories (training/trajectories.py): what an online run trained on, written as
offline data lines that the data reader, tools/score.py and the offline launcher read back."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_longstraw.config.settings import LongStrawConfig
from megatron_longstraw.data.group import GRPOGroup
from megatron_longstraw.data.groups import read_records
from megatron_longstraw.training import trajectories
from test_env import _agent_flags, _agent_prompts
from test_score import load_score_tool

ROOT = Path(__file__).resolve().parents[1]
TINY_QWEN = str(ROOT / "examples" / "qwen36" / "tiny.yaml")


def _rollout(seed: int, prompt_len: int = 12):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 100, (prompt_len,), generator=gen)
    responses = [torch.randint(0, 100, (n,), generator=gen) for n in (5, 3)]
    masks = [torch.tensor([1, 1, 0, 0, 1], dtype=torch.bool), torch.ones(3, dtype=torch.bool)]
    logps = [-torch.rand(len(r), generator=gen, dtype=torch.float64) for r in responses]
    group = GRPOGroup(prompt_ids=prompt, response_ids=responses,
                      rewards=torch.tensor([1.0, 0.0], dtype=torch.float64), logps_old=logps,
                      loss_masks=masks)
    group.source = f"line {seed}"
    members = [{"end": "env done", "reward_from": "env",
                "turns": [{"policy_tokens": 2, "observation_tokens": 2, "reward": None}]},
               {"end": "max turns", "reward_from": "none", "turns": []}]
    return SimpleNamespace(group=group, trajectories=members, meta={"answer": seed})


def test_lines_read_back_as_the_groups_written(tmp_path):
    writer = trajectories.TrajectoryWriter(tmp_path / "t", 0, 0, max_bytes=2**20)
    rollouts = [_rollout(1), _rollout(2), _rollout(1)]   # the same prompt twice: one file
    writer.write(0, 1, rollouts)
    writer.close()
    assert len(list((tmp_path / "t" / "prompts").iterdir())) == 2
    records = list(read_records(tmp_path / "t" / "replica0.jsonl"))
    assert [r.id for r in records] == ["step 0 group 0", "step 0 group 1", "step 0 group 2"]
    for record, rollout in zip(records, rollouts):
        written, read = rollout.group, record.group
        assert torch.equal(read.prompt_ids, written.prompt_ids)
        assert all(torch.equal(a, b) for a, b in zip(read.response_ids, written.response_ids))
        assert torch.equal(read.rewards, written.rewards)
        assert record.meta == rollout.meta
        for a, b, mask in zip(read.loss_masks, written.loss_masks, written.loss_masks):
            assert torch.equal(a.bool(), b)
        for a, b, mask in zip(read.logps_old, written.logps_old, written.loss_masks):
            assert torch.equal(a[mask], b[mask])      # observation tokens: null, not trained
    line = json.loads((tmp_path / "t" / "replica0.jsonl").read_text().splitlines()[0])
    assert line["logprobs_old"][0][2:4] == [None, None]
    assert line["trajectory"]["members"][1]["end"] == "max turns"
    assert writer.summary()["groups"] == 3 and writer.summary()["stopped_at_step"] is None


def test_a_resumed_run_drops_what_a_failed_attempt_wrote(tmp_path):
    writer = trajectories.TrajectoryWriter(tmp_path, 0, 0, max_bytes=2**20)
    for step in range(4):
        writer.write(step, 1, [_rollout(step)])
    writer.close()
    resumed = trajectories.TrajectoryWriter(tmp_path, 0, 2, max_bytes=2**20)   # from step 2
    resumed.write(2, 1, [_rollout(7)])
    resumed.close()
    steps = [json.loads(line)["trajectory"]["step"]
             for line in (tmp_path / "replica0.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]
    assert json.loads((tmp_path / "replica0.jsonl").read_text().splitlines()[2])["meta"] == \
        {"answer": 7}


def test_the_size_bound_stops_the_writing_and_says_where(tmp_path, capsys):
    one = len(json.dumps(trajectories.group_line(0, 0, 1, _rollout(0), "prompts/x.bin")))
    writer = trajectories.TrajectoryWriter(tmp_path, 0, 0, max_bytes=2.5 * (one + 48))
    for step in range(5):
        writer.write(step, 1, [_rollout(step)])
    writer.close()
    lines = (tmp_path / "replica0.jsonl").read_text().splitlines()
    assert len(lines) == 2 and writer.summary()["stopped_at_step"] == 2
    assert writer.bytes <= writer.max_bytes
    assert "stops at step 2" in capsys.readouterr().out


def test_auto_writes_with_an_environment_only():
    def cfg(**rollout):
        env = rollout.pop("env", None)
        return LongStrawConfig.of(rollout="online", env=env, reward="m:f", **rollout)
    assert trajectories.wanted(cfg(env="m:f"))
    assert not trajectories.wanted(cfg())
    assert trajectories.wanted(cfg(trajectories="on"))
    assert not trajectories.wanted(cfg(env="m:f", trajectories="off"))
    assert not trajectories.wanted(LongStrawConfig.of(trajectories="on"))   # offline


@pytest.mark.usefixtures("single_process")
def test_an_agent_run_writes_what_it_trained_on(tmp_path):
    """Through the launcher, the lookup environment, fp64, 2 steps, a checkpoint after each.
    Every line is read back; it matches the history's trajectories; tools/score.py on the
    weights that sampled step 1 (the checkpoint after step 0) gives the line's logprobs_old at
    every trained token (temperature 1: the sampling log-probs are the model's), within 1e-9;
    and the offline launcher trains on the file as it is."""
    from megatron_longstraw.training import train

    ckpt = tmp_path / "ckpt"
    receipt = train.main(_agent_flags(tmp_path, "agent", _agent_prompts(tmp_path), "--save",
                                      str(ckpt), "--save-interval", "1"))
    folder = tmp_path / "agent" / "trajectories"
    file = folder / "replica0.jsonl"
    assert receipt["trajectories"]["file"] == str(file)
    records = list(read_records(file))
    assert [r.line for r in records] == [1, 2] and receipt["trajectories"]["groups"] == 2
    lines = [json.loads(line) for line in file.read_text().splitlines()]
    for line, record, history in zip(lines, records, receipt["history"]):
        assert line["trajectory"]["step"] == history["step"]
        members = history["env_trajectories"][0]
        assert [m["end"] for m in line["trajectory"]["members"]] == [m["end"] for m in members]
        assert record.group.rewards.tolist() == [m["reward"] for m in members]
        for mask, member in zip(record.group.loss_masks, members):   # observations masked
            assert int((~mask.bool()).sum()) == sum(t["observation_tokens"] for t in member["turns"])
        assert record.meta["answer_turn"] == 3

    (tmp_path / "step1.jsonl").write_text(file.read_text().splitlines()[1] + "\n")
    (tmp_path / "prompts").symlink_to(folder / "prompts")    # prompt_file is relative
    scored = load_score_tool().main([
        "--family", "qwen36", "--config", TINY_QWEN, "--checkpoint",
        str(ckpt / "step_00000001"), "--input", str(tmp_path / "step1.jsonl"),
        "--out", str(tmp_path / "s.jsonl"), "--dtype", "fp64"])
    step1 = records[1].group
    worst = 0.0
    for ours, old, mask in zip(scored["results"][0]["logprobs"], step1.logps_old,
                               step1.loss_masks):
        mask = mask.bool()
        worst = max(worst, (torch.tensor(ours, dtype=torch.float64)[mask] - old[mask])
                    .abs().max().item())
    print(f"score.py on the weights that sampled step 1 vs its logprobs_old: max |d| {worst:.1e}")
    assert worst <= 1e-9

    offline = train.main(["--longstraw", "--longstraw-family", "qwen36", "--longstraw-config",
                          TINY_QWEN, "--longstraw-data", str(file), "--longstraw-group-size",
                          "2", "--longstraw-dtype", "fp64", "--train-iters", "1",
                          "--longstraw-out-dir", str(tmp_path), "--longstraw-run-name",
                          "offline", "--no-longstraw-live-bytes"])
    assert offline["steps"] == 1 and not (tmp_path / "offline" / "trajectories").exists()
