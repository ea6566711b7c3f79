"""Reward plug-ins (rewards.py): loading errors, failing reward functions stop the step naming the
record and the member, the built-in verifiers' values by hand, the marker task's answers counted
by hand and its markers far from the prompt's end, and rewards computed for JSONL lines without
them (through the launcher)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_longstraw.rollout import rewards
from megatron_longstraw.runtime.errors import ConfigError, is_user_error
from megatron_longstraw.rollout.rewards import (
    RewardError,
    compute_rewards,
    exact_match,
    load_reward,
    make_marker_task,
    marker_majority,
)

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "examples" / "data" / "tokenizer.json"


def _ids(xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.long)


# ----------------------------------------------------------------------------- loading


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "LIMIT = 3\n"
        "def length(prompt_ids, response_ids, response_text, meta):\n"
        "    return float(len(response_ids)) / meta.get('scale', 1)\n"
        "class Scorer:\n"
        "    @staticmethod\n"
        "    def score(prompt_ids, response_ids, response_text, meta):\n"
        "        return 0.25\n")
    (tmp_path / "broken_rewards.py").write_text("import not_a_module_anywhere_xyz\n")
    (tmp_path / "raising_rewards.py").write_text("1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_load_reward(user_module) -> None:
    assert load_reward("my_rewards:length")(_ids([1]), _ids([4, 5]), None, {"scale": 4}) == 0.5
    assert load_reward("my_rewards:Scorer.score")(None, None, None, None) == 0.25
    assert load_reward("longstraw:exact_match") is exact_match
    assert load_reward("longstraw:marker_majority") is marker_majority
    assert load_reward("megatron_longstraw.rollout.rewards:marker_majority") is marker_majority


@pytest.mark.parametrize("spec,message", [
    ("my_rewards.length", r"expected 'module:function' \(e\.g\. my_rewards:score\) or "
                          r"'longstraw:<name>' \(built-ins: exact_match, marker_copy, "
                          r"marker_first, marker_majority, marker_missing\)"),
    ("my_rewards:", "both the module and the function must be named"),
    ("no_such_module_xyz:f", r"module 'no_such_module_xyz' not found; put its folder on "
                             "PYTHONPATH"),
    ("broken_rewards:f", r"importing 'broken_rewards' failed: ModuleNotFoundError: No module "
                         r"named 'not_a_module_anywhere_xyz' \(at .*broken_rewards.py line 1\)"),
    ("raising_rewards:f", r"importing 'raising_rewards' failed: ZeroDivisionError"),
    ("my_rewards:missing", r"module 'my_rewards' \(.*my_rewards.py\) has no attribute "
                           r"'missing'; check the function's name"),
    ("my_rewards:LIMIT", r"'LIMIT' is a int, not a function"),
    ("longstraw:majority", r"no built-in reward 'majority'; built-ins: exact_match, "
                           "marker_copy, marker_first, marker_majority, marker_missing"),
])
def test_load_reward_errors(user_module, spec, message) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        load_reward(spec)
    assert is_user_error(info.value)
    assert f"--longstraw-reward {spec!r}" in str(info.value)


# ----------------------------------------------------------------------------- calling


def test_compute_rewards_values_and_arguments() -> None:
    seen = []

    def fn(prompt_ids, response_ids, response_text, meta):
        seen.append((prompt_ids, response_ids, response_text, meta))
        return [1, 0.5, True, torch.tensor(2.0), np.float32(0.25)][len(seen) - 1]

    got = compute_rewards(fn, [7, 8, 9], [[1], [2, 3], [4], [5], [6]], meta={"k": 1},
                          response_texts=["a", "b", "c", "d", "e"], record="r")
    assert got.dtype == torch.float64 and got.tolist() == [1.0, 0.5, 1.0, 2.0, 0.25]
    prompt, response, text, meta = seen[1]
    assert prompt.dtype == torch.long and prompt.tolist() == [7, 8, 9]
    assert response.tolist() == [2, 3] and text == "b" and meta == {"k": 1}
    assert all(s[0] is seen[0][0] for s in seen)      # the prompt is one tensor, never copied
    # No texts: decoded by the tokenizer (special tokens skipped), or None without one.
    from megatron_longstraw.data.groups import load_tokenizer

    tok = load_tokenizer(TOKENIZER)
    texts = []
    compute_rewards(lambda p, r, t, m: texts.append(t) or 0.0, [1], [tok.encode("the company"),
                                                                     [1]], tokenizer=tok)
    compute_rewards(lambda p, r, t, m: texts.append(t) or 0.0, [1], [[1]])
    assert texts == ["the company", "the", None]


@pytest.mark.parametrize("returned,message", [
    (float("nan"), r"member 1: the reward function .*fn returned nan; rewards must be finite"),
    (float("inf"), "returned inf"),
    (None, "returned NoneType None, not a number"),
    ("0.5", "returned str '0.5', not a number"),
    ([1.0], r"returned list \[1\.0\], not a number"),
    (torch.tensor([1.0, 2.0]), "returned Tensor"),
])
def test_non_numbers_and_non_finite_values_stop(returned, message) -> None:
    def fn(prompt_ids, response_ids, response_text, meta):
        return 1.0 if int(response_ids[0]) == 0 else returned

    with pytest.raises(RewardError, match=message) as info:
        compute_rewards(fn, [1], [[0], [1]], record="groups.jsonl line 4 (id 'q2')")
    assert str(info.value).startswith("groups.jsonl line 4 (id 'q2'), member 1: ")
    assert is_user_error(info.value)


def test_a_raising_reward_names_record_member_and_where() -> None:
    def fn(prompt_ids, response_ids, response_text, meta):
        return 1.0 / (len(response_ids) - 2)

    with pytest.raises(RewardError) as info:
        compute_rewards(fn, [1], [[5], [5, 6], [7]], record="g.jsonl line 3")
    message = str(info.value)
    assert message.startswith("g.jsonl line 3, member 1: the reward function ")
    assert "raised ZeroDivisionError: float division by zero (at " in message
    assert "test_rewards.py line" in message and "No update was made." in message
    assert isinstance(info.value.__cause__, ZeroDivisionError)


# ----------------------------------------------------------------------------- built-ins


def test_exact_match_by_hand() -> None:
    assert exact_match(None, _ids([1]), "  42\n", {"answer": "42 "}) == 1.0
    assert exact_match(None, _ids([1]), "42.", {"answer": "42"}) == 0.0
    assert exact_match(None, _ids([3, 4]), None, {"answer": [3, 4]}) == 1.0
    assert exact_match(None, _ids([3, 4, 2, 2]), None, {"answer": [3, 4], "stop_ids": [2]}) == 1.0
    assert exact_match(None, _ids([3, 4, 2]), None, {"answer": [3, 4]}) == 0.0   # no stop ids
    assert exact_match(None, _ids([3, 2, 4]), None, {"answer": [3, 4], "stop_ids": [2]}) == 0.0
    assert exact_match(None, _ids([9]), None, {"answer": 9}) == 1.0
    with pytest.raises(ValueError, match="needs the response text: pass --longstraw-tokenizer"):
        exact_match(None, _ids([1]), None, {"answer": "42"})
    with pytest.raises(ValueError, match=r"needs the record's meta to be an object with an "
                                         r"'answer' \(got dict with keys \['markers'\]\)"):
        exact_match(None, _ids([1]), "x", {"markers": [1]})
    with pytest.raises(ValueError, match="must be text, a token id or a list of token ids"):
        exact_match(None, _ids([1]), "x", {"answer": 1.5})


def test_marker_majority_by_hand() -> None:
    meta = {"markers": [5, 6, 7], "answer": 6}
    assert marker_majority(None, _ids([6]), None, meta) == 1.0
    assert marker_majority(None, _ids([6, 5, 5]), None, meta) == 1.0    # the first token decides
    assert marker_majority(None, _ids([5, 6]), None, meta) == 0.0
    with pytest.raises(ValueError, match=r"answer'\] 9 is not one of meta\['markers'\]"):
        marker_majority(None, _ids([9]), None, {"markers": [5, 6], "answer": 9})
    with pytest.raises(ValueError, match="needs the record's meta"):
        marker_majority(None, _ids([9]), None, None)


# ----------------------------------------------------------------------------- the marker task


def test_marker_task_answers_counted_by_hand_and_far_from_the_end() -> None:
    markers = [500, 501, 502, 503]
    rows = make_marker_task(12, 256, markers, 64, seed=3, group_size=4)
    answers = set()
    for row in rows:
        prompt = row["prompt_ids"]
        assert len(prompt) == 256 and prompt[-1] == 0      # the question cue: first filler id
        count = Counter(t for t in prompt if t in markers)
        top, top_count = count.most_common(1)[0]
        assert top == row["meta"]["answer"] and top_count == 6
        assert all(c <= 3 for m, c in count.items() if m != top)            # a clear margin
        assert [count[m] for m in markers] == row["meta"]["counts"]
        assert sum(count.values()) == sum(row["meta"]["counts"])
        positions = [i for i, t in enumerate(prompt) if t in markers]
        assert max(positions) < 128                        # only in the first half
        assert all(0 < t < 64 for t in prompt[:-1] if t not in markers)     # fillers 1..63
        assert all(len(r) == 1 and r[0] in markers for r in row["response_ids"])
        answers.add(top)
    assert len(answers) > 1                                # the answer varies between prompts
    assert make_marker_task(12, 256, markers, 64, seed=3, group_size=4) == rows
    assert make_marker_task(12, 256, markers, 64, seed=4, group_size=4) != rows
    # Another evidence fraction: the markers stay within it.
    row, = make_marker_task(1, 1000, markers, range(10, 30), seed=0, evidence_fraction=0.1,
                            majority_count=8, question_id=7)
    assert max(i for i, t in enumerate(row["prompt_ids"]) if t in markers) < 100
    assert row["prompt_ids"][-1] == 7 and 7 not in row["prompt_ids"][:-1]
    assert set(row["prompt_ids"][:-1]) <= set(range(10, 30)) | set(markers)


@pytest.mark.parametrize("kwargs,message", [
    ({"markers": [5]}, "at least two distinct token ids"),
    ({"majority_count": 3, "minority_max": 3}, r"1 <= minority_max \(3\) < majority_count \(3\)"),
    ({"prompt_len": 20}, r"up to 12 marker occurrences \(6 \+ 2 x 3\) do not fit the first 10 "
                         "tokens"),
    ({"question_id": 500}, "question_id 500 is a marker"),
    ({"evidence_fraction": 1.0}, r"evidence_fraction must be in \(0, 1\)"),
])
def test_marker_task_errors(kwargs, message) -> None:
    settings = dict(num_prompts=1, prompt_len=64, markers=[500, 501, 502], filler_vocab=64)
    with pytest.raises(ValueError, match=message):
        make_marker_task(**{**settings, **kwargs})


def test_marker_task_file_reads_back_and_scores(tmp_path) -> None:
    from megatron_longstraw.data.groups import read_records

    path = tmp_path / "marker.jsonl"
    rows = make_marker_task(3, 64, [100, 101], 50, seed=1, group_size=4, path=path,
                            prompt_file_min_len=64)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert all("prompt_file" in line and "rewards" not in line for line in lines)
    records = list(read_records(path, require_rewards=False))
    for record, row in zip(records, rows):
        assert record.group.prompt_ids.tolist() == row["prompt_ids"]
        assert record.meta == row["meta"] and not record.has_rewards and record.id == row["id"]
        group = rewards.fill_rewards(record, marker_majority)
        expected = [float(r[0] == row["meta"]["answer"]) for r in row["response_ids"]]
        assert group.rewards.tolist() == expected


# ----------------------------------------------------------------------------- the launcher


def _flags(tmp_path, data, *extra):
    return ["--longstraw", "--longstraw-config", str(ROOT / "examples" / "glm52" / "tiny.yaml"),
            "--longstraw-group-size", "4", "--longstraw-dtype", "fp64", "--lr", "1e-3",
            "--train-iters", "1", "--seed", "1", "--longstraw-out-dir", str(tmp_path),
            "--longstraw-data", str(data), "--no-longstraw-data-shuffle", *extra]


def _lines(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.usefixtures("single_process")
def test_launcher_computes_missing_rewards_and_stops_on_a_bad_one(tmp_path, monkeypatch) -> None:
    from megatron_longstraw.step import schedule
    from megatron_longstraw.training import train
    from megatron_longstraw.data.groups import DataError

    rows = make_marker_task(2, 48, [300, 301, 302], 200, seed=5, group_size=4)
    rows[0]["rewards"] = [0.0, 1.0, 0.0, 1.0]                  # supplied rewards are kept
    data = _lines(tmp_path / "g.jsonl", rows)
    seen, real = [], schedule.train_step

    def spy(model, optimizer, groups, *args, **kwargs):
        seen.append([g.rewards.tolist() for g in groups])
        return real(model, optimizer, groups, *args, **kwargs)

    monkeypatch.setattr(schedule, "train_step", spy)
    train.main(_flags(tmp_path, data, "--global-batch-size", "2",
                      "--longstraw-reward", "longstraw:marker_majority"))
    answer = rows[1]["meta"]["answer"]
    assert seen == [[[0.0, 1.0, 0.0, 1.0],
                     [float(r[0] == answer) for r in rows[1]["response_ids"]]]]

    # Without a reward function, a line without rewards is refused at start, with the fix.
    with pytest.raises(DataError, match=r"line 2: field 'rewards' is missing; give one reward "
                                        r"per response, or compute them with a reward function "
                                        r"\(--longstraw-reward module:function"):
        train.main(_flags(tmp_path, data))
    # A reward function that fails stops before any update, naming the line, id and member.
    bad = _lines(tmp_path / "bad.jsonl", [{**rows[1], "id": "q2", "meta": {"markers": [300]}}])
    seen.clear()
    with pytest.raises(RewardError, match=r"bad\.jsonl line 1 \(id 'q2'\), member 0: the reward "
                                          r"function marker_majority raised ValueError: "
                                          "marker_majority needs the record's meta"):
        train.main(_flags(tmp_path, bad, "--longstraw-reward", "longstraw:marker_majority"))
    assert seen == []                                          # train_step never ran
    with pytest.raises(ConfigError, match="--longstraw-reward longstraw:exact_match scores the "
                                          "responses of --longstraw-data lines"):
        train.main([f for f in _flags(tmp_path, data) if f not in ("--longstraw-data", str(data))]
                   + ["--longstraw-reward", "longstraw:exact_match"])
