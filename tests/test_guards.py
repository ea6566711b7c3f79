"""The no-signal guards (training/guards.py, issue 32): the step's zero-advantage fraction and
policy entropy reach the history; the launcher warns once when every group's rewards are all
equal (a planted run) and not on a normal one; the entropy warning; the optional stop after N
steps with no signal."""

import json
from pathlib import Path

import pytest
import torch

from megatron_longstraw.training import train
from megatron_longstraw.training.guards import SignalGuard

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "glm52" / "tiny.yaml")
WARNING = "every group's rewards are all equal"


def _data(tmp_path: Path, rewards: list[list[float]]) -> str:
    """One group per rewards list: a 32-token prompt, G = 2 responses of 3 tokens."""
    gen = torch.Generator().manual_seed(0)
    path = tmp_path / "groups.jsonl"
    with path.open("w") as f:
        for r in rewards:
            f.write(json.dumps({"prompt_ids": torch.randint(0, 64, (32,), generator=gen).tolist(),
                                "response_ids": [torch.randint(0, 64, (3,), generator=gen).tolist()
                                                 for _ in r], "rewards": r}) + "\n")
    return str(path)


def _run(tmp_path, name, rewards, *extra):
    return train.main(["--longstraw", "--longstraw-config", TINY, "--longstraw-data",
                       _data(tmp_path, rewards), "--longstraw-group-size", "2",
                       "--longstraw-dtype", "fp32", "--lr", "1e-3", "--train-iters", "3",
                       "--longstraw-out-dir", str(tmp_path), "--longstraw-run-name", name,
                       "--no-longstraw-live-bytes", *extra])


def test_the_zero_advantage_warning_fires_on_a_planted_run_and_not_on_a_normal_one(tmp_path,
                                                                                    capsys):
    normal = _run(tmp_path, "normal", [[1.0, 0.0], [0.0, 1.0]])
    out = capsys.readouterr().out
    assert "warning:" not in out
    assert [h["grpo/zero_advantage_frac"] for h in normal["history"]] == [0.0, 0.0, 0.0]
    assert all(h["grpo/entropy"] > 1.0 for h in normal["history"])   # untrained: near log(V)
    assert "zero-adv groups 0.00 | entropy" in out

    planted = _run(tmp_path, "planted", [[1.0, 1.0], [0.5, 0.5]])
    out = capsys.readouterr().out
    assert out.count("warning:") == 1 and out.count(WARNING) == 1   # once, not every step
    assert "warning: step 0:" in out and "Likely cause" in out
    assert [h["grpo/zero_advantage_frac"] for h in planted["history"]] == [1.0, 1.0, 1.0]
    assert "stopped" not in planted

    # A mixed step (one group of two without signal) is no warning.
    _run(tmp_path, "mixed", [[1.0, 1.0], [1.0, 0.0]], "--global-batch-size", "2",
         "--train-iters", "1")
    assert "warning:" not in capsys.readouterr().out


def test_the_run_stops_after_n_steps_without_signal(tmp_path, capsys):
    receipt = _run(tmp_path, "stop", [[1.0, 1.0]], "--longstraw-stop-after-no-signal", "2")
    out = capsys.readouterr().out
    assert [h["step"] for h in receipt["history"]] == [0, 1]
    assert "no learning signal for 2 consecutive steps" in receipt["stopped"]
    assert "exiting after step 1: no learning signal" in out


def test_the_entropy_warning_fires_once_below_the_floor(tmp_path, capsys):
    _run(tmp_path, "entropy", [[1.0, 0.0]], "--longstraw-entropy-floor", "100")
    out = capsys.readouterr().out
    assert out.count("warning:") == 1 and "below --longstraw-entropy-floor 100" in out


def test_the_guard_by_hand(capsys):
    guard = SignalGuard(entropy_floor=0.1, stop_after_no_signal=3)
    collapsed = {"zero_advantage_frac": 1.0, "entropy": 0.01, "reward_mean": 0.0}
    assert guard.check(0, collapsed) is None
    out = capsys.readouterr().out
    # both warnings; the zero-advantage one names the collapse (entropy below the floor)
    assert out.count("warning:") == 2 and "the policy collapsed" in out
    assert guard.check(1, collapsed) is None and capsys.readouterr().out == ""
    assert guard.check(2, {"zero_advantage_frac": 0.5, "entropy": 1.0}) is None   # resets
    assert guard.check(3, collapsed) is None and guard.check(4, collapsed) is None
    assert "3 consecutive steps" in guard.check(5, collapsed)
    quiet = SignalGuard(entropy_floor=0.0, stop_after_no_signal=0, enabled=False)
    assert quiet.check(0, collapsed) is None and capsys.readouterr().out == ""


@pytest.mark.parametrize("settings,words", [({"entropy_floor": -1.0}, "entropy_floor"),
                                            ({"stop_after_no_signal": 1.5}, "stop_after")])
def test_bad_guard_settings_are_refused(settings, words):
    from megatron_longstraw.config.settings import LongStrawConfig

    with pytest.raises(ValueError, match=words):
        LongStrawConfig.of(**settings)
