"""Reward plug-ins: `--longstraw-reward module:function`, built-in verifiers, and the synthetic
long-context marker task.

The contract. A reward function is called once per group member:

    fn(prompt_ids, response_ids, response_text, meta) -> float

    prompt_ids     [P] int64 CPU tensor, the group's prompt (shared by the members: not copied
                   into a Python list, which for a million-token prompt would cost ~36 MB a call;
                   `.tolist()` it if you need one). Do not modify it.
    response_ids   [R_i] int64 CPU tensor, member i's response tokens (EOS included when the
                   engine produced it).
    response_text  the response as text: the record's own text when it gave `responses`, else
                   the ids decoded by the tokenizer (--longstraw-tokenizer; special tokens
                   skipped), else None.
    meta           the record's `meta` value as the JSONL holds it ({} when it has none).

It returns a finite number (int, float, bool as 0 / 1, or a one-element tensor / array).
Raising, or returning anything else (NaN, inf, None, a string, a list), stops the step before any
work with a `RewardError` naming the record (its `id` and line) and the member.

Specs (`load_reward`): "package.module:function" (imported with importlib from sys.path: the
working directory or PYTHONPATH; a dotted attribute such as "mod:Scorer.score" works) or
"longstraw:<name>" for the built-ins of `BUILTINS` (the same as
"megatron_longstraw.rollout.rewards:<name>").

The marker task (`make_marker_task`): each prompt is filler tokens with a few marker tokens
scattered through its first part only (by default the first half); one marker occurs more often
than any other, and it is the answer. `marker_majority` gives 1.0 when the response's first token
is that marker. The answer depends only on tokens far from the prompt's end, and the response
vocabulary is the few markers, so chance is 1 / len(markers). The other long-range tasks of the
demo sweep (copy, missing, first occurrence) are made by long_tasks.make_long_task and scored by
`marker_copy`, `marker_missing` and `marker_first`, which read the answer from the prompt itself.
"""

from __future__ import annotations

import importlib
import math
import numbers
import os
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from megatron_longstraw.runtime.errors import ConfigError, UserError

RewardFn = Callable[[torch.Tensor, torch.Tensor, "str | None", object], float]


class RewardError(UserError, ValueError):
    """A reward function raised or returned something that is not a finite number (a user
    error: errors.py); the message names the record and the member."""


# ---- loading ------------------------------------------------------------------------------------


def load_reward(spec: str, flag: str = "--longstraw-reward") -> RewardFn:
    """The callable named by `spec` (module docstring). ConfigError, naming `flag` (the caller's:
    the launcher's --longstraw-reward, tools/generate.py's --reward), the spec and what to do,
    when it has no colon, the module is not found or fails to import, the attribute is missing,
    or it is not callable."""
    where = f"{flag} {spec!r}"
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(f"{where}: expected 'module:function' (e.g. my_rewards:score) or "
                          f"'longstraw:<name>' (built-ins: {', '.join(sorted(BUILTINS))}).")
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{where}: both the module and the function must be named, as in "
                          "'my_rewards:score'.")
    if module_name == "longstraw":
        if attr not in BUILTINS:
            raise ConfigError(f"{where}: no built-in reward {attr!r}; built-ins: "
                              f"{', '.join(sorted(BUILTINS))}.")
        return BUILTINS[attr]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise ConfigError(f"{where}: module {module_name!r} not found; put its folder on "
                              f"PYTHONPATH or run from it (working directory {os.getcwd()}), or "
                              "install it.") from exc
        raise ConfigError(f"{where}: importing {module_name!r} failed: {_describe(exc)}.") \
            from exc
    except Exception as exc:   # noqa: BLE001 - the user's module: report it, whatever it raised
        raise ConfigError(f"{where}: importing {module_name!r} failed: {_describe(exc)}.") \
            from exc
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ConfigError(f"{where}: module {module_name!r} ({getattr(module, '__file__', '?')}"
                              f") has no attribute {attr!r}; check the function's name.")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ConfigError(f"{where}: {attr!r} is a {type(fn).__name__}, not a function; name a "
                          "callable fn(prompt_ids, response_ids, response_text, meta) -> float.")
    return fn


def _describe(exc: BaseException) -> str:
    """`Type: message (at file line N)`: where in the user's code it was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    at = f" (at {frames[-1].filename} line {frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{at}"


# ---- calling ------------------------------------------------------------------------------------


def compute_rewards(fn: RewardFn, prompt_ids: torch.Tensor, response_ids: Sequence,
                    meta=None, response_texts: Sequence[str] | None = None, tokenizer=None,
                    record: str = "the group") -> torch.Tensor:
    """[G] float64 rewards: `fn` called for each member (module docstring). `response_texts`
    (the record's text responses) win over decoding with `tokenizer`; `record` names the group
    in errors (e.g. "groups.jsonl line 5 (id 'q17')"). RewardError when `fn` raises or returns
    anything but a finite number."""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    prompt = torch.as_tensor(prompt_ids).long().reshape(-1)
    meta = {} if meta is None else meta
    rewards = []
    for i, response in enumerate(response_ids):
        response = torch.as_tensor(response).long().reshape(-1)
        text = (response_texts[i] if response_texts is not None
                else _decode(tokenizer, response) if tokenizer is not None else None)
        try:
            value = fn(prompt, response, text, meta)
        except Exception as exc:   # noqa: BLE001 - the user's function: any failure stops the step
            raise RewardError(f"{record}, member {i}: the reward function {name} raised "
                              f"{_describe(exc)}; fix it or the record's meta. No update was "
                              "made.") from exc
        rewards.append(_as_reward(value, f"{record}, member {i}: the reward function {name}"))
    return torch.tensor(rewards, dtype=torch.float64)


def _as_reward(value, where: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1 \
            or isinstance(value, np.ndarray) and value.size == 1:
        value = value.reshape(-1)[0].item()
    if not isinstance(value, numbers.Real):
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise RewardError(f"{where} returned {type(value).__name__} {shown}, not a number; return "
                          "a float. No update was made.")
    value = float(value)
    if not math.isfinite(value):
        raise RewardError(f"{where} returned {value}; rewards must be finite numbers. No update "
                          "was made.")
    return value


def _decode(tokenizer, ids: torch.Tensor) -> str:
    """Text of `ids`, special tokens skipped: data.LocalTokenizer, a `tokenizers.Tokenizer` or a
    transformers tokenizer."""
    return tokenizer.decode(ids.tolist(), skip_special_tokens=True)


def fill_rewards(record, fn: RewardFn, tokenizer=None):
    """The record's group (data.GroupRecord) with its rewards computed by `fn` when the line gave
    none; a line's own `rewards` are kept."""
    group = record.group
    if record.has_rewards:
        return group
    source = getattr(group, "source", None) or f"line {record.line}"
    name = source + (f" (id {record.id!r})" if record.id != record.line else "")
    group.rewards = compute_rewards(fn, group.prompt_ids, group.response_ids, record.meta,
                                    record.response_texts, tokenizer, record=name)
    return group


# ---- built-in verifiers -------------------------------------------------------------------------


def _meta_dict(meta, verifier: str) -> dict:
    if not isinstance(meta, dict) or "answer" not in meta:
        raise ValueError(f"{verifier} needs the record's meta to be an object with an 'answer' "
                         f"(got {type(meta).__name__}"
                         + (f" with keys {sorted(meta)}" if isinstance(meta, dict) else "") + ")")
    return meta


def exact_match(prompt_ids, response_ids, response_text, meta) -> float:
    """1.0 when the response equals meta["answer"], else 0.0.

    A text answer is compared with the response text, both `str.strip()`ped (needs the text: a
    text `responses` record or --longstraw-tokenizer). An integer or a list of integers is
    compared with the response ids after dropping trailing ids listed in meta["stop_ids"] (e.g.
    the EOS id; default none): the ids' strip."""
    meta = _meta_dict(meta, "exact_match")
    answer = meta["answer"]
    if isinstance(answer, str):
        if response_text is None:
            raise ValueError("exact_match with a text answer needs the response text: pass "
                             "--longstraw-tokenizer, give text 'responses', or give the answer as "
                             "token ids")
        return float(response_text.strip() == answer.strip())
    ids = answer if isinstance(answer, list) else [answer]
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
        raise ValueError(f"exact_match: meta['answer'] must be text, a token id or a list of "
                         f"token ids, got {answer!r}")
    stop = set(meta.get("stop_ids", []))
    response = torch.as_tensor(response_ids).reshape(-1).tolist()
    while response and response[-1] in stop:
        response.pop()
    return float(response == ids)


def marker_majority(prompt_ids, response_ids, response_text, meta) -> float:
    """The marker task (`make_marker_task`): 1.0 when the response's first token is
    meta["answer"], the marker that occurs most often in the prompt; else 0.0."""
    meta = _meta_dict(meta, "marker_majority")
    answer = meta["answer"]
    if isinstance(answer, bool) or not isinstance(answer, int):
        raise ValueError(f"marker_majority: meta['answer'] must be a token id, got {answer!r}")
    if "markers" in meta and answer not in meta["markers"]:
        raise ValueError(f"marker_majority: meta['answer'] {answer} is not one of meta['markers'] "
                         f"{meta['markers']}")
    response = torch.as_tensor(response_ids).reshape(-1)
    return float(response.numel() > 0 and int(response[0]) == answer)


def _task_markers(meta, verifier: str) -> torch.Tensor:
    if not isinstance(meta, dict) or not isinstance(meta.get("markers"), list) \
            or len(meta["markers"]) < 2:
        raise ValueError(f"{verifier} needs the record's meta to be an object with 'markers', a "
                         f"list of at least two token ids (long_tasks.make_long_task writes it)")
    return torch.as_tensor(meta["markers"], dtype=torch.long)


def _first_token_is(response_ids, answer: int) -> float:
    response = torch.as_tensor(response_ids).reshape(-1)
    return float(response.numel() > 0 and int(response[0]) == answer)


def marker_copy(prompt_ids, response_ids, response_text, meta) -> float:
    """The copy task (long_tasks.make_long_task "copy"): 1.0 when the response's first token is
    the one marker of meta["markers"] that occurs in the prompt (computed from the prompt)."""
    markers = _task_markers(meta, "marker_copy")
    present = markers[torch.isin(markers, torch.as_tensor(prompt_ids).reshape(-1))]
    if present.numel() != 1:
        raise ValueError(f"marker_copy: the prompt holds {present.tolist()} of the markers "
                         f"{markers.tolist()}, not exactly one")
    return _first_token_is(response_ids, int(present[0]))


def marker_missing(prompt_ids, response_ids, response_text, meta) -> float:
    """The missing task ("missing"): 1.0 when the response's first token is the one marker of
    meta["markers"] that does not occur in the prompt (computed from the prompt)."""
    markers = _task_markers(meta, "marker_missing")
    absent = markers[~torch.isin(markers, torch.as_tensor(prompt_ids).reshape(-1))]
    if absent.numel() != 1:
        raise ValueError(f"marker_missing: the prompt lacks {absent.tolist()} of the markers "
                         f"{markers.tolist()}, not exactly one")
    return _first_token_is(response_ids, int(absent[0]))


def marker_first(prompt_ids, response_ids, response_text, meta) -> float:
    """The first-occurrence task ("first"): 1.0 when the response's first token is the marker
    of meta["markers"] that occurs earliest in the prompt (computed from the prompt)."""
    markers = _task_markers(meta, "marker_first")
    prompt = torch.as_tensor(prompt_ids).reshape(-1)
    hits = torch.isin(prompt, markers).nonzero()
    if hits.numel() == 0:
        raise ValueError(f"marker_first: no marker of {markers.tolist()} occurs in the prompt")
    return _first_token_is(response_ids, int(prompt[hits[0, 0]]))


BUILTINS: dict[str, RewardFn] = {"exact_match": exact_match, "marker_majority": marker_majority,
                                 "marker_copy": marker_copy, "marker_missing": marker_missing,
                                 "marker_first": marker_first}
"""The verifiers of `longstraw:<name>`."""


# ---- the synthetic marker task ------------------------------------------------------------------


def filler_pool(filler_vocab, markers, question_id=None) -> tuple[list[int], int]:
    """The synthetic tasks' filler ids (`filler_vocab`: a count or the ids) without the markers
    and the question id (default: the first filler id) -> (filler ids, question id)."""
    pool = list(range(filler_vocab)) if isinstance(filler_vocab, int) else [int(x) for x in
                                                                            filler_vocab]
    pool = [x for x in dict.fromkeys(pool) if x not in set(markers)]
    if question_id is None:
        if not pool:
            raise ValueError("filler_vocab has no id besides the markers.")
        question_id = pool[0]
    if question_id in markers:
        raise ValueError(f"question_id {question_id} is a marker; choose another id.")
    pool = [x for x in pool if x != question_id]
    if not pool:
        raise ValueError("filler_vocab has no id besides the markers and the question id.")
    return pool, question_id


def make_marker_task(num_prompts: int, prompt_len: int, markers: Sequence[int],
                     filler_vocab: int | Sequence[int], seed: int = 0, *,
                     evidence_fraction: float = 0.5, majority_count: int = 6,
                     minority_max: int | None = None, question_id: int | None = None,
                     group_size: int | None = None, response_len: int = 1,
                     path: str | os.PathLike | None = None,
                     prompt_file_min_len: int = 4096) -> list[dict]:
    """Records of the marker task (JSONL rows, examples/data/README.md), written to `path` when
    given.

    Prompt k (its own generator, seeded by (seed, k)): `prompt_len` filler tokens drawn uniformly
    from `filler_vocab` (an int n: ids 0..n-1; or the ids themselves), markers and the question
    id removed from it; the answer, a marker drawn uniformly, occurs `majority_count` times, every
    other marker 1..`minority_max` times (default majority_count // 2: a clear margin); all
    occurrences sit at distinct positions drawn uniformly from the first
    `evidence_fraction * prompt_len` tokens, so nothing near the end tells the answer; the last
    token is `question_id` (default: the first filler id, then left out of the filler), the same
    cue at the end of every prompt.

    A row is {"id": "marker-<k>", "prompt_ids" | "prompt_file", "meta": {"markers", "answer",
    "counts"}} (counts: occurrences per marker, in `markers` order), plus, with `group_size`,
    "response_ids": G responses of `response_len` tokens drawn uniformly from the markers
    (training groups without "rewards": `--longstraw-reward longstraw:marker_majority` scores
    them). With `path`, prompts of `prompt_file_min_len` tokens or more go to
    `<stem>.prompts/<k + 1>.npy` beside it.

    Learnability: the response vocabulary is the markers (chance 1 / len(markers)), and the answer
    needs only a count. With DSA, the indexer's top-k (not trained by the GRPO loss) must reach
    the markers: keep the total occurrences, majority_count + the others, within it.
    """
    markers = [int(m) for m in markers]
    if len(markers) < 2 or len(set(markers)) != len(markers) or min(markers) < 0:
        raise ValueError(f"markers must be at least two distinct token ids, got {markers}.")
    if num_prompts < 1 or prompt_len < 2:
        raise ValueError(f"num_prompts ({num_prompts}) must be >= 1 and prompt_len ({prompt_len}) "
                         ">= 2.")
    minority_max = majority_count // 2 if minority_max is None else minority_max
    if not 1 <= minority_max < majority_count:
        raise ValueError(f"every other marker occurs 1..minority_max times, fewer than the "
                         f"answer's majority_count: need 1 <= minority_max ({minority_max}) < "
                         f"majority_count ({majority_count}).")
    if not 0.0 < evidence_fraction < 1.0:
        raise ValueError(f"evidence_fraction must be in (0, 1) (the markers' share of the prompt, "
                         f"from its start), got {evidence_fraction}.")
    pool, question_id = filler_pool(filler_vocab, markers, question_id)
    evidence_len = int(evidence_fraction * prompt_len)
    most = majority_count + minority_max * (len(markers) - 1)
    if most > evidence_len:
        raise ValueError(f"up to {most} marker occurrences ({majority_count} + "
                         f"{len(markers) - 1} x {minority_max}) do not fit the first {evidence_len} "
                         f"tokens (evidence_fraction {evidence_fraction} of prompt_len "
                         f"{prompt_len}); lengthen the prompt or lower the counts.")
    if group_size is not None and (group_size < 2 or response_len < 1):
        raise ValueError(f"group_size ({group_size}) must be >= 2 and response_len "
                         f"({response_len}) >= 1.")

    fillers = np.asarray(pool, dtype=np.int64)
    rows = []
    for k in range(num_prompts):
        rng = np.random.default_rng([seed, k])
        answer_idx = int(rng.integers(len(markers)))
        counts = [majority_count if j == answer_idx else int(rng.integers(1, minority_max + 1))
                  for j in range(len(markers))]
        prompt = fillers[rng.integers(len(fillers), size=prompt_len)]
        positions = rng.choice(evidence_len, size=sum(counts), replace=False)
        prompt[positions] = np.repeat(np.asarray(markers, dtype=np.int64), counts)
        prompt[-1] = question_id
        row = {"id": f"marker-{k}", "prompt_ids": prompt.tolist(),
               "meta": {"markers": markers, "answer": markers[answer_idx], "counts": counts}}
        if group_size is not None:
            row["response_ids"] = rng.choice(markers, size=(group_size, response_len)).tolist()
        rows.append(row)
    if path is not None:
        _write_rows(Path(path), rows, prompt_file_min_len)
    return rows


def _write_rows(path: Path, rows: list[dict], prompt_file_min_len: int) -> None:
    import json

    from megatron_longstraw.data.groups import write_prompt_file

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for k, row in enumerate(rows):
            if len(row["prompt_ids"]) >= prompt_file_min_len:
                rel = Path(f"{path.stem}.prompts") / f"{k + 1}.npy"
                write_prompt_file(path.parent / rel, torch.tensor(row["prompt_ids"]))
                row = {"id": row["id"], "prompt_file": rel.as_posix(),
                       **{key: v for key, v in row.items() if key not in ("id", "prompt_ids")}}
            out.write(json.dumps(row) + "\n")
