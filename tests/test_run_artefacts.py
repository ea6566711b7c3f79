"""Every launcher run's artefacts (issue 32): run_curves.png beside receipt.json (run_plot.py),
the per-step wall time and phase times in the history, the within-group reward spread named as
such in the step line."""

import json
from pathlib import Path

import torch

from megatron_longstraw.training import train
from megatron_longstraw.training.run_plot import moving_average, write_run_png

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "glm52" / "tiny.yaml")
PNG = b"\x89PNG\r\n\x1a\n"


def test_a_launcher_run_writes_its_curves_and_times(tmp_path, capsys):
    gen = torch.Generator().manual_seed(0)
    data = tmp_path / "groups.jsonl"
    data.write_text("".join(json.dumps({
        "prompt_ids": torch.randint(0, 64, (32,), generator=gen).tolist(),
        "response_ids": [torch.randint(0, 64, (3,), generator=gen).tolist() for _ in range(2)],
        "rewards": [1.0, 0.0]}) + "\n" for _ in range(2)))
    receipt = train.main(["--longstraw", "--longstraw-config", TINY, "--longstraw-data", str(data),
                          "--longstraw-group-size", "2", "--longstraw-dtype", "fp32", "--lr",
                          "1e-3", "--train-iters", "2", "--longstraw-out-dir", str(tmp_path),
                          "--longstraw-run-name", "run", "--no-longstraw-live-bytes"])
    folder = tmp_path / "run"
    assert (folder / "run_curves.png").read_bytes()[:8] == PNG
    assert receipt["plot"] == "run_curves.png"
    assert json.loads((folder / "receipt.json").read_text())["plot"] == "run_curves.png"
    for h in receipt["history"]:
        phases = [h[f"time/{p}_s"] for p in ("capture", "scoring", "replay", "optimizer")]
        assert all(t > 0 for t in phases) and h["time/step_s"] >= sum(phases)
        assert h["grpo/reward_group_std"] == 0.5          # rewards [1, 0]: population std 0.5
    out = capsys.readouterr().out
    assert "reward 0.500 (within-group std 0.500)" in out and "+-" not in out
    assert f"curves: {folder / 'run_curves.png'}" in out


def test_the_png_draws_any_history_and_says_what_was_not_recorded(tmp_path):
    history = [{"step": i, "grpo/reward_mean": 0.1 * i, "grpo/reward_group_std": 0.1,
                "grpo/loss": -0.01 * i, "grpo/grad_norm": 1.0, "grpo/zero_advantage_frac": 0.0,
                "time/step_s": 2.0, "time/capture_s": 1.0} for i in range(5)]   # no entropy
    path = write_run_png(history, tmp_path / "curves.png", "synthetic")
    assert path.read_bytes()[:8] == PNG
    assert moving_average([1.0, 3.0, 5.0], 2) == [1.0, 2.0, 4.0]
