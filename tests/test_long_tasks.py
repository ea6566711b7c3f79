"""The demo sweep's long-range tasks (rollout/long_tasks.py) and their rewards (rewards.py
marker_copy / marker_missing / marker_first): the evidence sits where each task says, the
rewards read the answer from the prompt, bad settings are refused. Tiny prompts only."""

import pytest
import torch

from megatron_longstraw.rollout.long_tasks import make_long_task
from megatron_longstraw.rollout.rewards import BUILTINS, load_reward

MARKERS = [60, 61, 62, 63]


def _score(name, row, first_token):
    return load_reward(f"longstraw:{name}")(torch.tensor(row["prompt_ids"]),
                                             torch.tensor([first_token, 5]), None, row["meta"])


@pytest.mark.parametrize("task, reward", [("copy", "marker_copy"), ("missing", "marker_missing"),
                                          ("first", "marker_first")])
def test_each_task_puts_its_evidence_in_the_first_part_and_its_reward_reads_it(task, reward):
    rows = make_long_task(task, 24, 128, MARKERS, 60, seed=3, count=6)
    assert reward in BUILTINS
    answers = set()
    for row in rows:
        prompt, meta = torch.tensor(row["prompt_ids"]), row["meta"]
        answers.add(meta["answer"])
        assert meta["task"] == task and meta["markers"] == MARKERS and prompt.numel() == 128
        assert prompt[-1] == 0 and (prompt[:-1] != 0).all()        # the cue, only at the end
        is_marker = torch.isin(prompt, torch.tensor(MARKERS))
        assert not is_marker[64:].any()                            # evidence: first half only
        counts = [int((prompt == m).sum()) for m in MARKERS]
        assert counts == meta["counts"]
        present = [m for m, c in zip(MARKERS, counts) if c]
        if task == "copy":
            assert present == [meta["answer"]] and sum(counts) == 6
        elif task == "missing":
            assert meta["answer"] not in present and len(present) == 3 and set(counts) == {0, 6}
        else:   # every marker 6 times, each in its own 16-token segment, the answer's first
            assert counts == [6] * 4 and meta["order"][0] == meta["answer"]
            for slot, m in enumerate(meta["order"]):
                where = (prompt == m).nonzero().reshape(-1)
                assert slot * 16 <= int(where.min()) and int(where.max()) < (slot + 1) * 16
        assert _score(reward, row, meta["answer"]) == 1.0
        assert _score(reward, row, next(m for m in MARKERS if m != meta["answer"])) == 0.0
        assert _score(reward, row, 7) == 0.0
    assert answers == set(MARKERS)   # the answers vary over the markers


def test_the_rewards_compute_the_answer_from_the_prompt_not_the_meta():
    meta = {"markers": [5, 6, 7], "answer": 5}   # a wrong meta answer is not trusted
    prompt = torch.tensor([1, 7, 1, 6, 7, 1, 0])
    assert _score("marker_first", {"prompt_ids": prompt.tolist(), "meta": meta}, 7) == 1.0
    assert _score("marker_missing", {"prompt_ids": prompt.tolist(), "meta": meta}, 5) == 1.0
    copy = {"prompt_ids": [1, 6, 1, 6, 0], "meta": meta}
    assert _score("marker_copy", copy, 6) == 1.0
    with pytest.raises(ValueError, match="not exactly one"):
        _score("marker_copy", {"prompt_ids": [1, 6, 7, 0], "meta": meta}, 6)
    with pytest.raises(ValueError, match="'markers'"):
        _score("marker_first", {"prompt_ids": [1, 6, 0], "meta": {"answer": 6}}, 6)
    # an empty response earns nothing
    assert load_reward("longstraw:marker_first")(prompt, torch.tensor([], dtype=torch.long),
                                                  None, meta) == 0.0


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="expected one of"):
        make_long_task("last", 1, 64, MARKERS, 60)
    with pytest.raises(ValueError, match="do not fit a segment of 8 tokens"):
        make_long_task("first", 1, 64, MARKERS, 60, count=9)
    with pytest.raises(ValueError, match="question_id 60 is a marker"):
        make_long_task("copy", 1, 64, MARKERS, 64, question_id=60)
    assert len(make_long_task("missing", 2, 64, MARKERS, 60, count=10)) == 2   # 30 of 32 fit
