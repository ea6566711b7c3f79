"""The online loop (--longstraw-rollout online, rollout.py): each step generates the group from
its own capture, rewards it, and trains on that capture. A resume mid-run equals the
uninterrupted run bitwise (same seed, CPU); the generated responses are what the step trains
on (their decode log-probs equal the trainer's scoring: mismatch ~0); the control zeroes the
captured state; bad settings and failing rewards stop before any update."""

import json
from pathlib import Path

import pytest
import torch

from megatron_longstraw.training import train
from megatron_longstraw.rollout.rewards import make_marker_task
import processes

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "qwen36" / "tiny.yaml")
MARKERS = [5, 6, 7, 8]


def _prompts(tmp_path: Path) -> str:
    path = tmp_path / "prompts.jsonl"
    rows = make_marker_task(3, 48, MARKERS, 64, seed=2, majority_count=4)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def _flags(tmp_path, name, *extra):
    return ["--longstraw", "--longstraw-family", "qwen36", "--longstraw-config", TINY,
            "--longstraw-data", _prompts(tmp_path), "--longstraw-rollout", "online",
            "--longstraw-reward", "longstraw:marker_majority", "--longstraw-group-size", "3",
            "--longstraw-max-new-tokens", "2", "--longstraw-dtype", "fp64", "--lr", "1e-2",
            "--seed", "5", "--longstraw-out-dir", str(tmp_path), "--longstraw-run-name", name,
            "--no-longstraw-live-bytes", *extra]   # (the CPU meter's cost; nothing here reads it)


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def test_online_resume_equals_the_uninterrupted_run_and_trains_on_its_own_samples(tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    receipt = train.main(_flags(tmp_path, "full", "--train-iters", "3", "--save", str(full),
                                "--save-interval", "3"))
    history = receipt["history"]
    assert [h["step"] for h in history] == [0, 1, 2]
    for h in history:
        # decode's log-probs are the trainer's pre-step scoring of the same tokens
        assert h["grpo/mismatch_abs_max"] < 1e-9
        assert 1 <= h["grpo/response_len_mean"] <= 2 and h["time/rollout_s"] > 0
    train.main(_flags(tmp_path, "cut", "--train-iters", "3", "--save", str(cut),
                      "--save-interval", "1", "--exit-interval", "1"))
    resumed = train.main(_flags(tmp_path, "resume", "--train-iters", "3", "--save", str(cut),
                                "--save-interval", "3", "--load", str(cut)))
    assert [h["step"] for h in resumed["history"]] == [1, 2]
    for a, b in zip(history[1:], resumed["history"]):
        assert a["grpo/reward_mean"] == b["grpo/reward_mean"] and a["grpo/loss"] == b["grpo/loss"]
    want, got = _weights(full / "step_00000003"), _weights(cut / "step_00000003")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.usefixtures("single_process")
def test_the_control_zeroes_the_captured_state(tmp_path):
    from megatron_longstraw.context.capture import capture_prompt
    from megatron_longstraw.config.settings import LongStrawConfig
    from megatron_longstraw.data.groups import parse_line
    from megatron_longstraw.rollout.online import rollout_group
    from megatron_longstraw.rollout.rewards import marker_majority

    import helpers

    cfg, model = helpers.build_tiny_qwen(torch.float64)
    path = Path(_prompts(tmp_path))
    record = parse_line(path, 1, path.read_bytes().splitlines()[0], prompt_only=True)
    ls = LongStrawConfig.of(group_size=2, max_new_tokens=2, rollout="online",
                         reward="longstraw:marker_majority", control="zeros")
    out = rollout_group(model, record, ls, marker_majority, seed=1, control="zeros")
    pages = out.captured.pages
    assert all(float(pages.fetch(layer, kind).abs().sum()) == 0
               for layer in pages.layers() for kind in pages.kinds(layer))
    normal = capture_prompt(model, record.group.prompt_ids, ls).pages
    assert any(float(normal.fetch(layer, kind).abs().sum()) > 0
               for layer in normal.layers() for kind in normal.kinds(layer))
    assert len(out.group.response_ids) == 2 and out.group.rewards.shape == (2,)


@pytest.mark.parametrize("extra,message", [
    (["--longstraw-control", "zeros", "--longstraw-prompt-grad", "exact"], "detached"),
    (["--longstraw-max-new-tokens", "999"], "max_response_len"),
    (["--longstraw-temperature", "-1"], "temperature")])
def test_bad_online_settings_are_refused_at_start(tmp_path, extra, message):
    from megatron_longstraw.runtime.errors import UserError

    with pytest.raises(UserError, match=message):
        train.main(_flags(tmp_path, "bad", "--train-iters", "1", *extra))


def test_online_needs_a_reward_and_prompt_lines(tmp_path):
    from megatron_longstraw.runtime.errors import UserError

    flags = _flags(tmp_path, "bad", "--train-iters", "1")
    i = flags.index("--longstraw-reward")
    with pytest.raises(UserError, match="reward function"):
        train.main(flags[:i] + flags[i + 2:])
    groups = tmp_path / "groups.jsonl"
    groups.write_text(json.dumps({"prompt_ids": [1, 2, 3], "response_ids": [[1], [2], [3]],
                                  "rewards": [0, 1, 0]}) + "\n")
    flags[flags.index("--longstraw-data") + 1] = str(groups)
    with pytest.raises(UserError, match="not part of a prompt line"):
        train.main(flags)


def test_a_failing_reward_stops_before_any_update(tmp_path, monkeypatch):
    from megatron_longstraw.step import schedule
    from megatron_longstraw.rollout.rewards import RewardError

    module = tmp_path / "bad_reward.py"
    module.write_text("def reward(prompt, response, text, meta):\n    return float('nan')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    calls = []
    monkeypatch.setattr(schedule, "train_step", lambda *a, **k: calls.append(1))
    flags = _flags(tmp_path, "bad", "--train-iters", "1")
    flags[flags.index("--longstraw-reward") + 1] = "bad_reward:reward"
    with pytest.raises(RewardError, match=r"prompts.jsonl line \d \(id .marker-\d.\), member 0"):
        train.main(flags)
    assert not calls


@pytest.mark.usefixtures("single_process")
def test_online_under_cp2_ep2_equals_one_process(tmp_path, monkeypatch):
    """GLM-5.2 (DSA, MoE) on two gloo ranks, CP2/EP2 through torchrun, from the same initial
    weights as one process: the same samples (decode under CP), so the same rewards (a reward
    that varies with the sampled token) and loss, and decode equals scoring."""
    from megatron_longstraw.checkpointing import model_format
    from megatron_longstraw.runtime import precision
    from megatron_longstraw.models.registry import get_family

    glm = str(ROOT / "examples" / "glm52" / "tiny.yaml")
    (tmp_path / "token_reward.py").write_text(
        "def reward(prompt, response, text, meta):\n    return float(int(response[0]) % 5) / 4\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def flags(name):
        out = _flags(tmp_path, name, "--train-iters", "2", "--load", str(tmp_path / "init"))
        out[out.index("--longstraw-family") + 1] = "glm52"
        out[out.index("--longstraw-config") + 1] = glm
        out[out.index("--longstraw-reward") + 1] = "token_reward:reward"
        return out

    args, given = train.parse(flags("one"))
    family, model_cfg, _, dtype = train.resolve(args, given)
    precision.use_dtype(dtype)
    model_format.save_model(tmp_path / "init", get_family(family).build(model_cfg, dtype, 1),
                            family="glm52")
    one = train.main(flags("one"))
    run = processes.run(
        [str(ROOT / ".venv" / "bin" / "torchrun"), "--standalone", "--nproc-per-node", "2",
         str(ROOT / "examples" / "pretrain_gpt.py"), *flags("cp2"), "--context-parallel-size", "2",
         "--expert-model-parallel-size", "2"],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "TORCHDYNAMO_DISABLE": "1", "PYTHONWARNINGS": "ignore",
             "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path)})
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    cp2 = json.loads((tmp_path / "cp2" / "receipt.json").read_text())
    assert any(h["grpo/loss"] != 0 for h in one["history"])   # rewards differ within a group
    for a, b in zip(one["history"], cp2["history"], strict=True):
        assert a["grpo/reward_mean"] == b["grpo/reward_mean"]
        assert a["grpo/loss"] == pytest.approx(b["grpo/loss"], rel=1e-9, abs=1e-12)
        assert b["grpo/mismatch_abs_max"] < 1e-9
