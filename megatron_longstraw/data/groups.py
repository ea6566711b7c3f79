"""GRPO groups: the JSONL reader (one group per line; examples/data/README.md documents the format),
local tokenizers, a writer for tests and examples, a synthetic long-context generator and random
groups of given lengths (`random_group`).

    {"id": "q17", "prompt": "text" | "prompt_ids": [..] | "prompt_file": "ids.npy|.bin|.txt"
                | "prompt_messages": [{"role": .., "content": ..}, ..],
     "responses": ["text", ..] | "response_ids": [[..], ..]
                | "response_segments": [[{"ids": [..] | "text": "..", "train": bool}, ..], ..]
                | "messages": [[{"role": .., "content": ..}, ..], ..],
     "loss_masks": [[0/1, ..], ..], "rewards": [..],
     "logprobs_old": [[..], ..], "routed_experts": [[[[..]]], ..], "dsa_topk": [[[[..]]], ..]}

Multi-turn members (masks.py): `loss_masks` (with `response_ids`), `response_segments` or chat
`messages` (with `prompt_messages`) say which response tokens are trained; `logprobs_old` may
be null at the untrained ones.

`routed_experts` / `dsa_topk` (routing replay, routing_replay.py) are per member, per response
token, per MoE / full indexer layer: the engine's expert ids / DSA key positions.

Every validation error is a `DataError` that names the file, the line and the field, and says what
to do. Text is tokenised only with a tokenizer loaded from a local path (no network), without
adding special tokens: the text must be exactly what the inference engine saw.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megatron_longstraw.data import masks as loss_mask
from megatron_longstraw.data.group import GRPOGroup
from megatron_longstraw.data.routing import FIELDS as ROUTING_FIELDS
from megatron_longstraw.data.routing import check_values, member_tensor
from megatron_longstraw.runtime.errors import InputNotFound, UserError

PROMPT_FIELDS = ("prompt", "prompt_ids", "prompt_file", "prompt_messages")
RESPONSE_FIELDS = ("responses", "response_ids", "response_segments", "messages")
KNOWN_FIELDS = (set(PROMPT_FIELDS + RESPONSE_FIELDS)
                | {"rewards", "logprobs_old", "loss_masks", "id", "meta", "trajectory"}
                | set(ROUTING_FIELDS))
"""`trajectory`: the online loop's record of how the group was generated (training/
trajectories.py); read back with the line, not used by training."""
MAX_TOKEN_ID = 2**31 - 1
LOGPROB_SLACK = 1e-4
"""Largest positive value accepted as a log-probability (engines round; a log-prob is <= 0)."""


class DataError(UserError, ValueError):
    """Invalid input data: `path`, `line` (1-based, or None for the file) and `field` name where
    (a user error: errors.py)."""

    def __init__(self, path, line: int | None, field: str | None, message: str):
        self.path, self.line, self.field = str(path), line, field
        where = str(path) + (f" line {line}" if line is not None else "")
        what = f"field '{field}' " if field else ""
        super().__init__(f"{where}: {what}{message}")


@dataclass
class GroupRecord:
    """One parsed line: the group plus where it came from."""

    group: GRPOGroup
    id: str | int
    """The line's "id", or its line number when it has none."""
    line: int
    """1-based line number in the file."""
    response_field: str = "response_ids"
    """The line's field that holds the responses ("responses" for text)."""
    meta: object = None
    """The line's "meta" as JSON gave it (None without one); a reward function reads it."""
    has_rewards: bool = True
    """The line gave "rewards" (else they are zeros until a reward function fills them in:
    rewards.fill_rewards)."""
    response_texts: list[str] | None = None
    """The response texts of a line with text "responses" (what a reward function reads)."""


# ---- tokenizers ---------------------------------------------------------------------------------


class LocalTokenizer:
    """A tokenizer loaded from a local path; `encode(text) -> list[int]` adds no special tokens."""

    def __init__(self, backend, kind: str, path: str):
        self.backend, self.kind, self.path = backend, kind, path

    def encode(self, text: str) -> list[int]:
        if self.kind == "tokenizers":
            return list(self.backend.encode(text, add_special_tokens=False).ids)
        return list(self.backend.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        if self.kind == "tokenizers":
            return self.backend.get_vocab_size(with_added_tokens=True)
        return len(self.backend)


def load_tokenizer(path: str | os.PathLike) -> LocalTokenizer:
    """A `tokenizer.json` file (Hugging Face `tokenizers`), or a local directory holding a saved
    transformers tokenizer (`AutoTokenizer`, `local_files_only=True`; a directory with only a
    `tokenizer.json` is read with `tokenizers`). Never downloads."""
    path = Path(path)
    if not path.exists():
        raise InputNotFound(f"tokenizer path {str(path)!r} does not exist; pass a local "
                                "tokenizer.json or a directory saved by save_pretrained "
                                "(nothing is downloaded).")
    if path.is_file():
        from tokenizers import Tokenizer

        return LocalTokenizer(Tokenizer.from_file(str(path)), "tokenizers", str(path))
    if not (path / "tokenizer_config.json").exists() and (path / "tokenizer.json").exists():
        return load_tokenizer(path / "tokenizer.json")
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - transformers is a test dependency
        raise ImportError(f"loading the tokenizer directory {str(path)!r} needs transformers "
                          "(pip install transformers), or pass its tokenizer.json.") from exc
    backend = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return LocalTokenizer(backend, "transformers", str(path))


def _as_tokenizer(tokenizer):
    """A path (str / PathLike) is loaded; anything else (None, a loaded tokenizer) passes."""
    if isinstance(tokenizer, (str, os.PathLike)):
        return load_tokenizer(tokenizer)
    return tokenizer


def _encode(tokenizer, text: str) -> list[int]:
    out = tokenizer.encode(text)
    return list(getattr(out, "ids", out))  # a raw `tokenizers.Tokenizer` returns an Encoding


# ---- reading ------------------------------------------------------------------------------------


def read_groups(path: str | os.PathLike, tokenizer=None, vocab_size: int | None = None,
                require_rewards: bool = True) -> Iterator[GRPOGroup]:
    """Yield one `GRPOGroup` per non-blank line of the JSONL file at `path` (lazily: a file of
    million-token prompts is never held at once). `tokenizer`: a path for `load_tokenizer` or a
    loaded tokenizer; needed only when lines carry text. `vocab_size`: reject ids >= it.
    `require_rewards=False` accepts lines without "rewards" (scoring only; rewards are 0)."""
    for record in read_records(path, tokenizer, vocab_size, require_rewards):
        yield record.group


def read_records(path: str | os.PathLike, tokenizer=None, vocab_size: int | None = None,
                 require_rewards: bool = True) -> Iterator[GroupRecord]:
    """Like `read_groups`, yielding `GroupRecord`s (group, id, line number)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(path, None, None, "no such file; pass the path of a JSONL file with one "
                                          "GRPO group per line.")
    tokenizer = _as_tokenizer(tokenizer)
    for line_no, _, raw in nonblank_lines(path):
        yield parse_line(path, line_no, raw, tokenizer, vocab_size, require_rewards)


def nonblank_lines(path: Path) -> Iterator[tuple[int, int, bytes]]:
    """(1-based line number, byte offset, bytes) of every non-blank line."""
    with path.open("rb") as lines:   # bytes: a line that is not UTF-8 is reported with its number
        offset = 0
        for line_no, raw in enumerate(lines, start=1):
            if raw.strip():
                yield line_no, offset, raw
            offset += len(raw)


def read_line(path: str | os.PathLike, offset: int) -> bytes:
    """The line that starts at byte `offset` of `path` (as `nonblank_lines` gives it)."""
    with Path(path).open("rb") as f:
        f.seek(offset)
        return f.readline()


def parse_line(path, line_no: int, raw: bytes, tokenizer=None, vocab_size: int | None = None,
               require_rewards: bool = True, load_prompt_file: bool = True,
               prompt_only: bool = False) -> GroupRecord:
    """One JSONL line (bytes) as a `GroupRecord`, every field checked (DataError). With
    `prompt_only` (the online loop's prompts: responses are generated) the line holds a prompt,
    optionally "id" and "meta", and nothing of responses: the record's group has no members. With
    `load_prompt_file=False` a `prompt_file` is checked from its header and size only (exists,
    format, at least one id: a cheap check of a dataset of million-token prompts) and the
    record's prompt is an empty placeholder; its ids are checked when the line is parsed again
    with the file loaded."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(path, line_no, None, f"not UTF-8 text (byte {exc.object[exc.start]:#04x} "
                        f"at column {exc.start + 1}: {exc.reason}); was the file cut off "
                        "or written in another encoding?") from None
    return _parse_line(Path(path), line_no, text, tokenizer, vocab_size, require_rewards,
                       load_prompt_file, prompt_only)


def _parse_line(path, line_no, text, tokenizer, vocab_size, require_rewards,
                load_prompt_file=True, prompt_only=False) -> GroupRecord:
    def fail(field, message):
        raise DataError(path, line_no, field, message)

    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        ends_early = exc.pos >= len(text.rstrip()) or exc.msg.startswith("Unterminated string")
        truncated = " (the line ends early: was the file cut off?)" if ends_early else ""
        at = "" if exc.msg.endswith(" at") else " at"   # "Unterminated string starting at"
        fail(None, f"not valid JSON ({exc.msg}{at} column {exc.colno}){truncated}; each line must "
                   "be one JSON object describing a group.")
    except (ValueError, RecursionError) as exc:   # e.g. an integer of more than 4300 digits
        fail(None, f"not valid JSON ({type(exc).__name__}: {exc}); each line must be one JSON "
                   "object describing a group.")
    if not isinstance(obj, dict):
        fail(None, f"a JSON {type(obj).__name__}, not an object; each line must be one JSON "
                   "object describing a group.")
    unknown = sorted(set(obj) - KNOWN_FIELDS)
    if unknown:
        fail(unknown[0], f"is not a known field (known: {', '.join(sorted(KNOWN_FIELDS))}); fix "
                         "the name, or put extra data under 'meta'.")
    group_id = obj.get("id", line_no)
    if not isinstance(group_id, (str, int)) or isinstance(group_id, bool):
        fail("id", f"must be a string or an integer, got {type(group_id).__name__}.")

    prompt = _prompt_ids(path, obj, fail, tokenizer, vocab_size, load_prompt_file)
    if prompt_only:
        given = sorted(set(obj) - set(PROMPT_FIELDS) - {"id", "meta"})
        if given:
            fail(given[0], "is not part of a prompt line: the online loop generates the responses "
                           "and rewards them (--longstraw-rollout online); give only a prompt, "
                           "'id' and 'meta'.")
        group = GRPOGroup(prompt_ids=prompt, response_ids=[],
                          rewards=torch.zeros(0, dtype=torch.float64))
        return GroupRecord(group=group, id=group_id, line=line_no, meta=obj.get("meta"),
                           has_rewards=False)
    responses, response_field, masks = _responses(obj, fail, tokenizer, vocab_size, prompt)
    masks = _loss_masks(obj, fail, responses, response_field, masks)
    num_members = len(responses)
    rewards = _rewards(obj, fail, num_members, response_field, require_rewards)
    logps_old = _logprobs_old(obj, fail, responses, response_field, masks)
    routing = {field: _routing(obj, fail, field, responses, response_field, prompt.numel())
               for field in ROUTING_FIELDS}
    group = GRPOGroup(prompt_ids=prompt, response_ids=responses, rewards=rewards,
                      logps_old=logps_old, loss_masks=masks, **routing)
    return GroupRecord(group=group, id=group_id, line=line_no, response_field=response_field,
                       meta=obj.get("meta"), has_rewards="rewards" in obj,
                       response_texts=list(obj["responses"]) if response_field == "responses"
                       else None)


def _one_of(obj, fields, fail, what) -> str:
    present = [f for f in fields if f in obj]
    if not present:
        fail(None, f"no {what}: give one of " + ", ".join(f"'{f}'" for f in fields) + ".")
    if len(present) > 1:
        fail(present[1], f"conflicts with '{present[0]}': give exactly one of "
                         + ", ".join(f"'{f}'" for f in fields) + ".")
    return present[0]


def _prompt_ids(path, obj, fail, tokenizer, vocab_size, load_prompt_file=True) -> torch.Tensor:
    field = _one_of(obj, PROMPT_FIELDS, fail, "prompt")
    value = obj[field]
    if field == "prompt":
        ids = _text_ids(value, fail, field, None, tokenizer)
    elif field == "prompt_messages":
        try:
            ids = torch.tensor(loss_mask.render_prompt(tokenizer, value), dtype=torch.long)
        except ValueError as exc:
            fail(field, str(exc))
    elif field == "prompt_ids":
        ids = _id_list(value, fail, field, None)
    else:
        if not isinstance(value, str) or not value:
            fail(field, "must be a file path (relative to the JSONL file's folder).")
        report = lambda msg: fail(field, msg)  # noqa: E731
        if not load_prompt_file:
            if prompt_file_length(path.parent / value, report) == 0:
                fail(field, "is empty; a group needs a prompt of at least one token.")
            return torch.empty(0, dtype=torch.long)
        ids = read_prompt_file(path.parent / value, report)
    if ids.numel() == 0:
        fail(field, "is empty; a group needs a prompt of at least one token.")
    _check_vocab(ids, fail, field, None, vocab_size)
    return ids


def _responses(obj, fail, tokenizer, vocab_size, prompt
               ) -> tuple[list[torch.Tensor], str, list[torch.Tensor] | None]:
    """(response ids per member, the field that gave them, the loss masks that field implies:
    `response_segments` and `messages` give one per member, the other forms none)."""
    field = _one_of(obj, RESPONSE_FIELDS, fail, "responses")
    value = obj[field]
    if not isinstance(value, list) or not value:
        fail(field, "must be a non-empty list with one entry per group member.")
    if "loss_masks" in obj and field != "response_ids":
        why = ("the segments already say which tokens are trained ('train')"
               if field == "response_segments" else
               "the chat template's {% generation %} blocks already say which tokens are "
               "trained" if field == "messages" else
               "a mask is per token, and text responses are tokenised here (the token count "
               "depends on the tokenizer): give 'response_ids' from the engine, or "
               "'response_segments' with text segments and \"train\"")
        fail("loss_masks", f"cannot be combined with '{field}': {why}.")
    if field == "messages" and "prompt_messages" not in obj:
        fail(field, "needs the prompt as 'prompt_messages': the chat template renders the "
                    "prompt and each member's messages together (or give 'response_segments').")
    responses, masks = [], []
    for i, item in enumerate(value):
        mask = None
        if field == "responses":
            ids = _text_ids(item, fail, field, i, tokenizer)
        elif field == "response_ids":
            ids = _id_list(item, fail, field, i)
        else:
            try:
                if field == "messages":
                    ids, mask = loss_mask.render_member(tokenizer, obj["prompt_messages"], item,
                                                        i, prompt.tolist())
                else:
                    ids, mask = loss_mask.segments_member(
                        item, i, lambda v, kind: _segment_ids(v, kind, tokenizer))
            except ValueError as exc:
                fail(field, str(exc))
            ids = torch.tensor(ids, dtype=torch.long)
        if ids.numel() == 0:
            fail(field, f"item {i} is empty (no tokens); every response needs at least one token "
                        "(e.g. the EOS token the engine produced): drop the member or fix it.")
        _check_vocab(ids, fail, field, i, vocab_size)
        responses.append(ids)
        masks.append(mask)
    return responses, field, (masks if field in ("response_segments", "messages") else None)


def _segment_ids(value, kind: str, tokenizer) -> list[int]:
    """A segment's "ids" or "text" -> token ids (ValueError: masks.segments_member adds where)."""
    def fail(_field, message):
        raise ValueError(f"'{kind}' {message}")
    if kind == "text" and not isinstance(value, str):
        fail(kind, f"must be a string, got {type(value).__name__}; token ids go in 'ids'.")
    ids = (_text_ids(value, fail, kind, None, tokenizer) if kind == "text"
           else _id_list(value, fail, kind, None))
    return ids.tolist()


def _loss_masks(obj, fail, responses, response_field, masks) -> list[torch.Tensor] | None:
    """The members' bool masks [R_i]: from `loss_masks` (with `response_ids` only: a mask is per
    token id) or from the response field; each member trains at least one token."""
    if "loss_masks" in obj:
        value = obj["loss_masks"]
        if not isinstance(value, list) or len(value) != len(responses):
            count = len(value) if isinstance(value, list) else type(value).__name__
            fail("loss_masks", f"has {count} entries but '{response_field}' has "
                               f"{len(responses)}; give one list of 0/1 per response.")
        masks = []
        for i, (item, ids) in enumerate(zip(value, responses)):
            try:
                masks.append(loss_mask.mask_tensor(item, i, int(ids.numel())))
            except ValueError as exc:
                fail("loss_masks", str(exc))
    if masks is None:
        return None
    field = "loss_masks" if "loss_masks" in obj else response_field
    for i, mask in enumerate(masks):
        try:
            loss_mask.check_trains(mask, i)
        except ValueError as exc:
            fail(field, str(exc))
    return masks


def _rewards(obj, fail, num_members, response_field, require_rewards) -> torch.Tensor:
    if "rewards" not in obj:
        if require_rewards:
            fail("rewards", "is missing; give one reward per response, or compute them with "
                            "a reward function (--longstraw-reward module:function, YAML "
                            "longstraw.reward).")
        return torch.zeros(num_members, dtype=torch.float64)
    value = obj["rewards"]
    if not isinstance(value, list):
        fail("rewards", f"must be a list of numbers, got {type(value).__name__}.")
    if len(value) != num_members:
        fail("rewards", f"has {len(value)} values but '{response_field}' has {num_members}; give "
                        "exactly one reward per response, in the same order.")
    for i, r in enumerate(value):
        if isinstance(r, bool) or not isinstance(r, (int, float)):
            fail("rewards", f"item {i} is {r!r}, not a number.")
        if not math.isfinite(r):
            fail("rewards", f"item {i} is {r}; rewards must be finite numbers (fix or drop that "
                            "member's reward upstream).")
    return torch.tensor(value, dtype=torch.float64)


def _logprobs_old(obj, fail, responses, response_field, masks=None) -> list[torch.Tensor] | None:
    """Per member float64 [R_i]; at an untrained token (mask 0) the value may be null or NaN
    (stored as NaN: nothing reads it) or any number."""
    if "logprobs_old" not in obj:
        return None
    value = obj["logprobs_old"]
    if not isinstance(value, list) or len(value) != len(responses):
        count = len(value) if isinstance(value, list) else type(value).__name__
        fail("logprobs_old", f"has {count} entries but '{response_field}' has {len(responses)}; "
                             "give one list of per-token log-probs per response.")
    out = []
    for i, (lps, ids) in enumerate(zip(value, responses)):
        if not isinstance(lps, list):
            fail("logprobs_old", f"item {i} must be a list of numbers.")
        if len(lps) != ids.numel():
            fail("logprobs_old", f"item {i} has {len(lps)} values but response {i} has "
                                 f"{ids.numel()} tokens; give one log-prob per response token, in "
                                 "order (include the EOS token if the response ids include it; "
                                 "with text responses, prefer 'response_ids' from the engine).")
        trained = masks[i].tolist() if masks is not None else [True] * len(lps)
        for t, lp in enumerate(lps):
            if not trained[t] and (lp is None or isinstance(lp, float) and math.isnan(lp)):
                continue   # an untrained token: its engine log-prob may be absent
            if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
                fail("logprobs_old", f"item {i} token {t} is {lp!r}; log-probs must be finite "
                                     "numbers" + (" (null or NaN only at untrained tokens, mask "
                                                  "0)." if masks is not None else "."))
            if lp > LOGPROB_SLACK:
                fail("logprobs_old", f"item {i} token {t} is {lp}, above 0; log-probs are <= 0 "
                                     "(were probabilities or logits passed?).")
        out.append(torch.tensor([math.nan if lp is None else lp for lp in lps],
                                dtype=torch.float64))
    return out


def _routing(obj, fail, field, responses, response_field, prompt_len) -> list[torch.Tensor] | None:
    """`routed_experts` / `dsa_topk`: per member an int32 [R_i, layers, k] (routing_replay.py);
    what needs the model (layer counts, widths, expert count) is checked by the step."""
    if field not in obj:
        return None
    value = obj[field]
    if not isinstance(value, list) or len(value) != len(responses):
        count = len(value) if isinstance(value, list) else type(value).__name__
        fail(field, f"has {count} entries but '{response_field}' has {len(responses)}; give one "
                    "entry per response, in the same order.")
    out = []
    for i, (item, ids) in enumerate(zip(value, responses)):
        try:
            t = member_tensor(field, item, i, int(ids.numel()))
            # Causality needs the prompt length (a cheap check's placeholder prompt: later).
            check_values(field, t, i, prompt_len or None)
        except ValueError as exc:
            fail(field, str(exc))
        if out and t.shape[1:] != out[0].shape[1:]:
            fail(field, f"item {i} has {t.shape[1]} layers of {t.shape[2]} per token but item 0 "
                        f"has {out[0].shape[1]} of {out[0].shape[2]}; every member comes from "
                        "the same model.")
        out.append(t)
    return out


def _where(field_item) -> str:
    return "" if field_item is None else f"item {field_item} "


def _text_ids(value, fail, field, item, tokenizer) -> torch.Tensor:
    if not isinstance(value, str):
        fail(field, f"{_where(item)}must be text (a JSON string), got {type(value).__name__}; "
                    f"token ids go in '{field.rstrip('s')}_ids'.")
    if tokenizer is None:
        fail(field, f"{_where(item)}is text but no tokenizer was given; pass a tokenizer "
                    "(the launcher's --longstraw-tokenizer PATH, or --tokenizer PATH of "
                    "tools/score.py and tools/generate.py) or give token ids instead.")
    return torch.tensor(_encode(tokenizer, value), dtype=torch.long)


def _id_list(value, fail, field, item) -> torch.Tensor:
    if not isinstance(value, list):
        fail(field, f"{_where(item)}must be a list of integer token ids, got "
                    f"{type(value).__name__}.")
    for t, x in enumerate(value):
        if type(x) is not int or not 0 <= x <= MAX_TOKEN_ID:
            fail(field, f"{_where(item)}position {t} is {x!r}; token ids are integers in "
                        f"[0, {MAX_TOKEN_ID}].")
    return torch.tensor(value, dtype=torch.long)


def _check_vocab(ids: torch.Tensor, fail, field, item, vocab_size) -> None:
    if vocab_size is None:
        return
    bad = ((ids < 0) | (ids >= vocab_size)).nonzero().flatten()
    if bad.numel():
        pos = int(bad[0])
        fail(field, f"{_where(item)}position {pos} is token id {int(ids[pos])}, outside the "
                    f"model's vocabulary [0, {vocab_size}) ({bad.numel()} such ids); check the "
                    "tokenizer matches the model.")


def _reporter(path: Path, fail):
    def report(message):
        if fail is not None:
            fail(message)
        raise ValueError(f"{path}: {message}")
    return report


def _check_suffix(path: Path, report) -> str:
    suffix = path.suffix.lower()
    if suffix not in (".npy", ".bin", ".txt"):
        report(f"'{path}' has an unsupported extension; use .npy (integer array), .bin (raw int32 "
               "little-endian) or .txt (whitespace-separated ids).")
    return suffix


def prompt_file_length(path: Path, fail=None) -> int:
    """The number of ids in a prompt file, from its header (`.npy`, memory-mapped, nothing read)
    or size (`.bin`); `.txt` is read. The checks of `read_prompt_file` that need no ids."""
    report = _reporter(path, fail)
    if _check_suffix(path, report) == ".txt":
        return int(read_prompt_file(path, fail).numel())
    try:
        if path.suffix.lower() == ".npy":
            array = np.load(path, mmap_mode="r", allow_pickle=False)
            if array.ndim != 1 or array.dtype.kind not in "iu":
                report(f"'{path}' holds a {array.ndim}-D {array.dtype} array; save a 1-D int32 or "
                       "int64 array of token ids.")
            return int(array.shape[0])
        size = path.stat().st_size
    except (OSError, ValueError) as exc:
        report(f"cannot read '{path}' ({type(exc).__name__}: {exc}); paths are relative to the "
               "JSONL file's folder.")
    if size % 4:
        report(f"'{path}' has {size} bytes, not a multiple of 4; .bin files are raw int32 "
               "little-endian ids (numpy: ids.astype('<i4').tofile(path)).")
    return size // 4


def read_prompt_file(path: Path, fail=None) -> torch.Tensor:
    """Token ids [P] (int64) from `.npy` (1-D integer array), `.bin` (raw int32 little-endian) or
    `.txt` (whitespace-separated integers). `fail(message)` reports a problem and must raise
    (default: ValueError naming the file)."""
    report = _reporter(path, fail)
    suffix = _check_suffix(path, report)
    try:
        if suffix == ".npy":
            array = np.load(path, allow_pickle=False)
        elif suffix == ".bin":
            size = path.stat().st_size
            array = np.fromfile(path, dtype="<i4") if size % 4 == 0 else None
        else:
            words = path.read_text(encoding="utf-8").split()
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        report(f"cannot read '{path}' ({type(exc).__name__}: {exc}); paths are relative to the "
               "JSONL file's folder.")
    if suffix == ".npy" and (array.ndim != 1 or array.dtype.kind not in "iu"):
        report(f"'{path}' holds a {array.ndim}-D {array.dtype} array; save a 1-D int32 or int64 "
               "array of token ids.")
    if suffix == ".bin" and array is None:
        report(f"'{path}' has {size} bytes, not a multiple of 4; .bin files are raw int32 "
               "little-endian ids (numpy: ids.astype('<i4').tofile(path)).")
    if suffix == ".txt":
        for t, word in enumerate(words):
            if not (word.isascii() and word.isdigit()):
                report(f"'{path}' word {t} is {word!r}, not a non-negative integer id.")
        array = np.array([int(w) for w in words], dtype=np.int64)
    ids = torch.from_numpy(array.astype(np.int64))
    bad = ((ids < 0) | (ids > MAX_TOKEN_ID)).nonzero().flatten()
    if bad.numel():
        pos = int(bad[0])
        report(f"'{path}' position {pos} is {int(ids[pos])}; token ids are integers in "
               f"[0, {MAX_TOKEN_ID}].")
    return ids


# ---- writing ------------------------------------------------------------------------------------


def write_groups(path: str | os.PathLike, groups: Iterable[GRPOGroup | dict],
                 ids: Iterable | None = None, prompt_file_min_len: int | None = None,
                 prompt_format: str = "npy") -> Path:
    """Write groups as JSONL (tests, examples). `GRPOGroup`s become `prompt_ids` / `response_ids` /
    `rewards` (/ `loss_masks`, `logprobs_old`, `routed_experts`, `dsa_topk`); dicts are written as they are. Prompts of at least
    `prompt_file_min_len` tokens go to `<stem>.prompts/<line>.<prompt_format>` (npy|bin|txt)
    beside the file, referenced by a relative `prompt_file`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = list(ids) if ids is not None else None
    with path.open("w", encoding="utf-8") as out:
        for idx, group in enumerate(groups):
            if not isinstance(group, dict):
                group = _group_dict(path, idx, group, prompt_file_min_len, prompt_format)
                if ids is not None:
                    group = {"id": ids[idx], **group}
            out.write(json.dumps(group) + "\n")
    return path


def _group_dict(path, idx, group, prompt_file_min_len, prompt_format) -> dict:
    prompt = group.prompt_ids.long().reshape(-1)
    row: dict = {}
    if prompt_file_min_len is not None and prompt.numel() >= prompt_file_min_len:
        rel = Path(f"{path.stem}.prompts") / f"{idx + 1}.{prompt_format}"
        write_prompt_file(path.parent / rel, prompt)
        row["prompt_file"] = rel.as_posix()
    else:
        row["prompt_ids"] = prompt.tolist()
    row["response_ids"] = [torch.as_tensor(r).long().tolist() for r in group.response_ids]
    row["rewards"] = [float(r) for r in group.rewards]
    if group.loss_masks is not None:
        row["loss_masks"] = [[int(x) for x in torch.as_tensor(m).bool()] for m in group.loss_masks]
    if group.logps_old is not None:   # NaN (an untrained token's absent value): null
        row["logprobs_old"] = [[None if math.isnan(x) else float(x) for x in lp]
                               for lp in group.logps_old]
    for field in ROUTING_FIELDS:
        if getattr(group, field, None) is not None:
            row[field] = [torch.as_tensor(t).long().tolist() for t in getattr(group, field)]
    return row


def write_prompt_file(path: str | os.PathLike, prompt_ids: torch.Tensor) -> Path:
    """Save token ids [P] as .npy (int32), .bin (int32 little-endian) or .txt (by extension)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    array = prompt_ids.long().numpy().astype("<i4")
    if path.suffix == ".npy":
        np.save(path, array)
    elif path.suffix == ".bin":
        array.tofile(path)
    elif path.suffix == ".txt":
        path.write_text(" ".join(map(str, array.tolist())) + "\n")
    else:
        raise ValueError(f"unsupported prompt file extension {path.suffix!r}; use .npy, .bin or .txt.")
    return path


# ---- synthetic data -----------------------------------------------------------------------------


def synthetic_group(vocab_size: int, prompt_len: int, group_size: int, response_len: int,
                    seed: int = 0) -> GRPOGroup:
    """A long "document + question" prompt and `group_size` responses of varied length.

    The prompt hides a key token sequence ("needle") early in a long random document and repeats
    its first token at the end as the question; a response's reward is the fraction of the needle
    it reproduces, so rewards differ across members without any model in the loop. Response
    lengths vary between response_len // 2 and response_len.
    """
    if prompt_len < 16:
        raise ValueError(f"synthetic prompts need at least 16 tokens, got {prompt_len}.")
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab_size, (prompt_len,), generator=gen)
    needle = torch.randint(0, vocab_size, (8,), generator=gen)
    at = min(prompt_len // 10, prompt_len - 9)
    prompt[at:at + 8] = needle
    prompt[-1] = needle[0]
    responses, rewards = [], []
    for i in range(group_size):
        length = int(torch.randint(max(1, response_len // 2), response_len + 1, (1,), generator=gen))
        response = torch.randint(0, vocab_size, (length,), generator=gen)
        copied = min(i, 8, length)              # member i copies i needle tokens
        response[:copied] = needle[:copied]
        responses.append(response)
        rewards.append(copied / 8)
    return GRPOGroup(prompt_ids=prompt, response_ids=responses,
                     rewards=torch.tensor(rewards, dtype=torch.float64))


def random_group(vocab_size: int, prompt_len: int, lens: list[int], seed: int) -> GRPOGroup:
    """Uniformly random prompt and responses of the given lengths `lens`, from `seed`, with rewards
    spread over [-1, 1] (linspace cubed, float64): the small-scale evidence tools' group
    (tools/evidence.py, tools/gradient_bias.py)."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab_size, (prompt_len,), generator=gen)
    responses = [torch.randint(0, vocab_size, (n,), generator=gen) for n in lens]
    rewards = torch.linspace(-1.0, 1.0, len(lens), dtype=torch.float64) ** 3
    return GRPOGroup(prompt_ids=prompt, response_ids=responses, rewards=rewards)

def synthetic_jsonl(path: str | os.PathLike, num_groups: int, vocab_size: int, prompt_len: int,
                    group_size: int, response_len: int, seed: int = 0,
                    prompt_file_min_len: int = 4096, prompt_format: str = "npy") -> Path:
    """Write `num_groups` synthetic groups (`synthetic_group` with seeds seed, seed + 1, ...) as
    JSONL; prompts of `prompt_file_min_len` tokens or more go to prompt files. Ids: "synthetic-<g>"."""
    groups = (synthetic_group(vocab_size, prompt_len, group_size, response_len, seed=seed + g)
              for g in range(num_groups))
    return write_groups(path, groups, ids=[f"synthetic-{g}" for g in range(num_groups)],
                        prompt_file_min_len=prompt_file_min_len, prompt_format=prompt_format)
