"""tools/gradient_bias.py on a tiny run: the detached-vs-exact comparison is zero where the prompt
has no state to differentiate (a one-token prompt captures nothing) and clearly not zero with a
real prompt; the outputs (JSON, table, TensorBoard, PNG) are written."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import gradient_bias  # noqa: E402


def test_parameter_groups_and_comparison_by_hand():
    assert gradient_bias.param_group("decoder.layers.0.self_attention.core_attention.indexer."
                                     "linear_wk.weight") == "indexer"
    assert gradient_bias.param_group("decoder.layers.3.mlp.experts.linear_fc1.weight0") == "experts"
    assert gradient_bias.param_group("embedding.word_embeddings.weight") == "embeddings"
    assert gradient_bias.param_group("decoder.layers.1.mlp.linear_fc2.weight") == "mlp"
    exact = {"embedding.w": torch.tensor([3.0, 4.0]), "output_layer.w": torch.tensor([1.0])}
    detached = {"output_layer.w": torch.tensor([1.0])}          # no embedding gradient at all
    out = gradient_bias.compare(detached, exact)
    # whole: d = [0, 0, 1], e = [3, 4, 1]: cosine 1 / sqrt(26), ||d - e|| / ||e|| = 5 / sqrt(26)
    assert out["all"]["cosine"] == pytest.approx(1 / 26 ** 0.5)
    assert out["all"]["rel_l2"] == pytest.approx(5 / 26 ** 0.5)
    assert out["groups"]["head"]["rel_l2"] == 0.0
    assert out["groups"]["embeddings"]["rel_l2"] == pytest.approx(1.0)


@pytest.mark.usefixtures("single_process")
def test_tiny_sweep_and_training_write_their_outputs(tmp_path):
    report = gradient_bias.main(["--prompt-lens", "1,96", "--group-sizes", "2",
                                 "--response-len", "6", "--train-steps", "2",
                                 "--train-prompt-len", "48", "--lora", "--lora-rank", "2",
                                 "--out", str(tmp_path)])
    rows = {(r["trainable"], r["prompt_len"]): r for r in report["sweep"]}
    # A one-token prompt captures nothing: detached and exact are the same gradient.
    assert rows[("full", 1)]["all"]["rel_l2"] == 0.0
    assert rows[("full", 1)]["all"]["cosine"] == pytest.approx(1.0)
    # A real prompt: the prompt's share is missing from the detached gradient.
    assert rows[("full", 96)]["all"]["rel_l2"] > 1e-3
    assert rows[("lora", 96)]["all"]["rel_l2"] > 1e-3
    assert rows[("full", 96)]["groups"]["embeddings"]["rel_l2"] > 1e-3
    assert json.loads((tmp_path / "gradient_bias.json").read_text())["sweep"] == report["sweep"]
    assert "| trainable | P | G | cosine" in (tmp_path / "gradient_bias.md").read_text()
    assert (tmp_path / "training.png").stat().st_size > 0
    assert set(report["training"]) == {"detached", "exact"}
    assert all(len(curve) == 2 for curve in report["training"].values())
    assert list((tmp_path / "tb").iterdir())
