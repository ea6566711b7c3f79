"""tools/drift_table.py end to end on the tiny GLM-5.2: one launcher run of one capture serving K
updates, the table's rows equal to the run's own per-update drift figures; bad rows refused."""

import json
import os
import subprocess
import sys

from helpers import ROOT

TOOL = ROOT / "tools" / "drift_table.py"


def _run(*args):
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1")
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)


def test_the_table_is_the_runs_drift(tmp_path):
    out = _run("--out", str(tmp_path), "--updates", "3", "--rows", "1,2", "--",
               "--longstraw-config", "examples/glm52/tiny.yaml",
               "--longstraw-synthetic-prompt-len", "96", "--longstraw-group-size", "2",
               "--lr", "3e-3", "--no-longstraw-live-bytes")
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "drift.json").read_text())
    history = json.loads((tmp_path / "drift" / "receipt.json").read_text())["history"]
    assert [h["grpo/update_in_capture"] for h in history] == [0, 1, 2]
    assert "grpo/drift/logp_abs_mean" not in history[0]       # update 0: the capture's weights
    assert [r["updates_since_capture"] for r in result["rows"]] == [1, 2]
    for row, h in zip(result["rows"], history[1:]):
        assert row["drift/logp_abs_mean"] == h["grpo/drift/logp_abs_mean"] > 0
        assert row["drift/grad_cosine"] == h["grpo/drift/grad_cosine"]
        assert row["clip_frac"] == h["grpo/clip_frac"]
    lines = out.stdout.splitlines()          # the run's own output, then the table
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("| updates since")):]
    assert lines[0].startswith("| updates since capture | mean abs dlogp |")
    assert lines[2].startswith("| 1 | ") and lines[3].startswith("| 2 | ")
    assert "clip range: ratio in [0.80, 1.28]" in out.stdout      # tiny.yaml's clip range


def test_rows_past_the_updates_are_refused(tmp_path):
    out = _run("--out", str(tmp_path), "--updates", "3", "--rows", "1,4", "--preset",
               "bench-lora")
    assert out.returncode == 2
    assert "--rows [1, 4]: each must be between 1 and --updates - 1 = 2" in out.stderr
