"""tools/generate.py and tools/score.py with multi-turn data: generate samples from chat
`prompt_messages` rendered with the tokenizer's template; score reads members with loss masks and
engine log-probs absent at the untrained tokens, marks those tokens (`loss_masks`) and compares
with the engine over the trained tokens only. Tiny Qwen3.6, random init, fp64."""

import json
import math
import sys
from pathlib import Path

import pytest

from test_loss_masks import make_chat_tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
TINY = str(ROOT / "examples" / "qwen36" / "tiny.yaml")


@pytest.mark.usefixtures("single_process")
def test_generate_from_chat_prompts_then_score_masked_members(tmp_path):
    import generate
    import score

    tok = str(make_chat_tokenizer(tmp_path / "chat"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "c0", "prompt_messages": [
        {"role": "user", "content": "the cat sat on the mat"}]}) + "\n")
    common = ["--family", "qwen36", "--config", TINY, "--random-init", "--dtype", "fp64",
              "--tokenizer", tok]
    out = tmp_path / "groups.jsonl"
    (row,) = generate.main(common + ["--input", str(prompts), "--out", str(out), "--group-size",
                                     "2", "--max-new-tokens", "4", "--init-seed", "7"])
    assert row["prompt_messages"][0]["content"] == "the cat sat on the mat"
    assert [len(r) for r in row["response_ids"]] == [4, 4]
    # Member 0's tokens 1 and 2 become context (as if a tool had written them): masked, with
    # their engine log-probs dropped; member 1's token 0 is off by 0.25.
    row["loss_masks"] = [[1, 0, 0, 1], [1, 1, 1, 1]]
    row["logprobs_old"][0][1:3] = [None, None]
    row["logprobs_old"][1][0] -= 0.25
    masked = tmp_path / "masked.jsonl"
    masked.write_text(json.dumps(row) + "\n")
    scored = score.main(common + ["--seed", "7", "--input", str(masked),
                                  "--out", str(tmp_path / "scores.jsonl")])
    (line,) = scored["results"]
    assert line["loss_masks"] == row["loss_masks"]
    assert len(line["logprobs"][0]) == 4                    # every token is scored
    assert line["trained_logprob_sum"][0] == pytest.approx(
        line["logprobs"][0][0] + line["logprobs"][0][3], abs=1e-12)
    overall = scored["summary"]["overall"]
    assert overall["num_tokens"] == 6                        # the trained tokens
    assert overall["max_abs_diff"] == pytest.approx(0.25, abs=1e-9)
    assert (overall["worst"][0]["member_idx"], overall["worst"][0]["token_idx"]) == (1, 0)
    assert all(not math.isnan(w["logprob_old"]) for w in overall["worst"])
