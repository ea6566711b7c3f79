"""tools/reuse_reward.py's table: the clock to a target reward per K against K = 1's, from
demo_rl receipts written here by hand (the runs themselves are tools/demo_rl.py's, tested in
test_demo_rl.py)."""

import importlib.util
import json
import math

import pytest

from helpers import ROOT


def _tool():
    spec = importlib.util.spec_from_file_location("reuse_reward", ROOT / "tools" / "reuse_reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(curve, step_s, end=None):
    clock, elapsed = 0.0, []
    for s in step_s:
        clock += s
        elapsed.append(clock)
    return {"curve": curve, "elapsed_s": elapsed,
            "reward_end": end if end is not None else sum(curve[-2:]) / 2}


def _receipts():
    ramp = [0.0, 0.2, 0.4, 0.6, 0.8, 0.8, 0.8, 0.8]
    slow = [0.0, 0.0, 0.1, 0.2, 0.3, 0.3, 0.3, 0.3]
    flat = [0.25] * 8
    k1 = {"seeds": [{"seed": 1, "run": _run(ramp, [10.0] * 8), "control": _run(flat, [10.0] * 8)},
                    {"seed": 2, "run": _run(ramp, [10.0] * 8), "control": None}]}
    # K = 4: a capture every 4 updates (the first of each costs 10 s, the others 2 s)
    k4_steps = [10.0, 2.0, 2.0, 2.0] * 2
    k4 = {"seeds": [{"seed": 1, "run": _run(ramp, k4_steps), "control": _run(flat, k4_steps)},
                    {"seed": 2, "run": _run(slow, k4_steps), "control": None}]}
    return {1: k1, 4: k4}


def test_clock_to_the_target_against_k1():
    tool = _tool()
    summary = tool.summarise(_receipts(), target_fraction=0.9, window=1)
    assert summary["target"] == pytest.approx(0.72)            # 0.9 x the K = 1 runs' 0.8
    k1, k4 = summary["rows"]
    assert k1["time_to_target_s"] == [50.0, 50.0]              # update 4 (0.8) at 5 x 10 s
    assert k4["time_to_target_s"][0] == pytest.approx(10 + 2 + 2 + 2 + 10)
    assert math.isinf(k4["time_to_target_s"][1])               # seed 2 never reaches 0.72
    assert k4["time_to_target_vs_k1"][0] == pytest.approx(26 / 50)
    assert k4["clock_vs_k1"] == [pytest.approx(32 / 80)] * 2
    assert k1["control_end"] == [0.25] and k4["control_end"] == [0.25]
    text = tool.markdown(summary)
    assert "| 4 | 8 |" in text and "(1 not reached)" in text
    # the window: the reward averaged over the last 2 updates reaches 0.72 one update later
    assert tool.summarise(_receipts(), window=2)["rows"][0]["time_to_target_s"] == [60.0, 60.0]
    with pytest.raises(ValueError, match="no K = 1 receipt"):
        tool.summarise({4: _receipts()[4]})


def test_the_table_mode_reads_the_receipts_and_writes_json_md_png(tmp_path):
    tool = _tool()
    for k, receipt in _receipts().items():
        (tmp_path / f"K{k}").mkdir()
        (tmp_path / f"K{k}" / "receipt.json").write_text(json.dumps(receipt))
    summary = tool.main(["table", "--out", str(tmp_path), "--ks", "1,4"])
    assert [r["updates_per_capture"] for r in summary["rows"]] == [1, 4]
    for name in ("reuse_reward.json", "reuse_reward.md", "reuse_reward.png"):
        assert (tmp_path / name).stat().st_size > 0
    with pytest.raises(SystemExit, match="K8/receipt.json is missing"):
        tool.main(["table", "--out", str(tmp_path), "--ks", "1,8"])
    with pytest.raises(SystemExit):
        tool.parse_args(["table", "--ks", "4,8"])               # K = 1 is the baseline


def test_run_passes_each_k_and_the_demo_flags(monkeypatch, tmp_path):
    tool = _tool()
    calls = []
    monkeypatch.setattr(tool.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    tool.main(["run", "--ks", "4,1", "--seeds", "1,2", "--out", str(tmp_path), "--",
               "--prompt-len", "8192", "--steps", "96"])
    assert [c[c.index("--updates-per-capture") + 1] for c in calls] == ["1", "4"]
    for k, cmd in zip((1, 4), calls):
        assert cmd[1].endswith("tools/demo_rl.py")
        assert cmd[cmd.index("--out") + 1] == str(tmp_path / f"K{k}")
        assert cmd[-4:] == ["--prompt-len", "8192", "--steps", "96"]
        assert cmd[cmd.index("--seeds") + 1] == "1,2"
