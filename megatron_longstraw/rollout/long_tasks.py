"""Synthetic long-range tasks beside the marker majority (rewards.make_marker_task): the suite of
the demo recipe's sweep (tools/demo_rl_sweep.py, docs/demo_rl_sweep.md).

Every task has the marker task's frame: `prompt_len` filler tokens drawn uniformly from the filler
ids, the evidence (marker tokens) only in the first `evidence_fraction` of the prompt, and the same
question cue as the last token, so nothing near the end tells the answer. The answer is one marker
(drawn uniformly per prompt), given as the response's first token. What differs is what the
answer depends on:

    copy     one marker occurs (`count` times, scattered), no other does: copy it (presence).
    missing  every marker but one occurs (`count` times each): the one that does not (absence).
    first    every marker occurs `count` times, each inside its own segment of the evidence
             span, in a random order: the marker whose occurrences come first (order); the counts
             are equal, so counting tells nothing.

Each task's reward (`rewards.marker_copy`, `marker_missing`, `marker_first`) computes the answer
from the prompt itself and compares it with the response's first token. Chance is
1 / len(markers) for a policy blind to the prompt (the answers are uniform).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from megatron_longstraw.rollout.rewards import filler_pool

TASKS = ("copy", "missing", "first")


def make_long_task(task: str, num_prompts: int, prompt_len: int, markers: Sequence[int],
                   filler_vocab: int | Sequence[int], seed: int = 0, *, count: int = 64,
                   evidence_fraction: float = 0.5, question_id: int | None = None,
                   path: str | os.PathLike | None = None,
                   prompt_file_min_len: int = 4096) -> list[dict]:
    """Records of `task` (one of TASKS; module docstring), written to `path` when given (as
    make_marker_task: prompts of `prompt_file_min_len` tokens or more to `<stem>.prompts/`).

    Prompt k has its own generator, seeded by (seed, k). `count`: occurrences per present marker.
    The question id defaults to the first filler id (then left out of the filler). A row is
    {"id": "<task>-<k>", "prompt_ids", "meta": {"task", "markers", "answer", "counts"}}
    (counts per marker, in `markers` order; for `first` also "order", the markers in the order
    of their segments)."""
    if task not in TASKS:
        raise ValueError(f"task {task!r}: expected one of {', '.join(TASKS)}.")
    markers = [int(m) for m in markers]
    if len(markers) < 2 or len(set(markers)) != len(markers) or min(markers) < 0:
        raise ValueError(f"markers must be at least two distinct token ids, got {markers}.")
    if num_prompts < 1 or prompt_len < 2 or count < 1:
        raise ValueError(f"num_prompts ({num_prompts}), count ({count}) must be >= 1 and "
                         f"prompt_len ({prompt_len}) >= 2.")
    if not 0.0 < evidence_fraction < 1.0:
        raise ValueError(f"evidence_fraction must be in (0, 1), got {evidence_fraction}.")
    pool, question_id = filler_pool(filler_vocab, markers, question_id)
    evidence_len = int(evidence_fraction * prompt_len)
    present = {"copy": 1, "missing": len(markers) - 1, "first": len(markers)}[task]
    # `first` puts each marker in its own segment of evidence_len // len(markers) tokens
    room = evidence_len // len(markers) if task == "first" else evidence_len // present
    if count > room:
        raise ValueError(f"{task}: {count} occurrences per marker do not fit "
                         f"{'a segment of ' if task == 'first' else ''}{room} tokens "
                         f"(evidence_fraction {evidence_fraction} of prompt_len {prompt_len}"
                         f"{f' over {len(markers)} markers' if task != 'copy' else ''}); "
                         "lengthen the prompt or lower count.")

    fillers = np.asarray(pool, dtype=np.int64)
    rows = []
    for k in range(num_prompts):
        rng = np.random.default_rng([seed, k])
        answer_idx = int(rng.integers(len(markers)))
        prompt = fillers[rng.integers(len(fillers), size=prompt_len)]
        meta = {"task": task, "markers": markers, "answer": markers[answer_idx]}
        if task == "first":
            order = [answer_idx] + [int(j) for j in rng.permutation(
                [j for j in range(len(markers)) if j != answer_idx])]
            segment = evidence_len // len(markers)
            for slot, j in enumerate(order):
                positions = slot * segment + rng.choice(segment, size=count, replace=False)
                prompt[positions] = markers[j]
            counts = [count] * len(markers)
            meta["order"] = [markers[j] for j in order]
        else:
            chosen = ([answer_idx] if task == "copy"
                      else [j for j in range(len(markers)) if j != answer_idx])
            positions = rng.choice(evidence_len, size=count * len(chosen), replace=False)
            prompt[positions] = np.repeat(np.asarray([markers[j] for j in chosen]), count)
            counts = [count if j in chosen else 0 for j in range(len(markers))]
        prompt[-1] = question_id
        meta["counts"] = counts
        rows.append({"id": f"{task}-{k}", "prompt_ids": prompt.tolist(), "meta": meta})
    if path is not None:
        from megatron_longstraw.rollout.rewards import _write_rows

        _write_rows(Path(path), rows, prompt_file_min_len)
    return rows

