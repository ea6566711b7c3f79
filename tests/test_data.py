"""The JSONL group format (examples/data/README.md): every prompt and response form, prompt files,
local tokenizers, and a validation error naming file, line and field for each kind of bad input.
Expected ids are written out by hand from the toy vocabulary below."""

import json
import math

import numpy as np
import pytest
import torch

from megatron_longstraw.data.groups import (DataError, load_tokenizer, read_groups, read_records,
                                     synthetic_group, synthetic_jsonl, write_groups)
from megatron_longstraw.data.group import GRPOGroup

WORDS = ["[UNK]", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "[BOS]"]   # id = index


def make_tokenizer(folder):
    """A word-level tokenizer over WORDS with a whitespace pre-tokenizer and a post-processor that
    prepends [BOS] (which the reader must not add: the text is exactly what the engine saw)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from tokenizers.processors import TemplateProcessing

    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens(["[BOS]"])
    tok.post_processor = TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 9)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def write_lines(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n"
                            for line in lines))
    return path


def test_prompt_and_response_forms(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    np.save(tmp_path / "p.npy", np.array([8, 7, 6], dtype=np.int32))
    path = write_lines(tmp_path / "groups.jsonl", [
        {"id": "ids", "prompt_ids": [1, 2, 3], "response_ids": [[4], [5, 6]], "rewards": [1, 0]},
        "",                                                        # blank lines are skipped
        {"prompt": "the cat sat", "responses": ["on the mat", "a dog ran ran"],
         "rewards": [0.5, -1.0], "logprobs_old": [[-1.0, -2.0, -0.5], [-0.1, -0.2, -0.3, 0.0]]},
        {"id": 7, "prompt_file": "p.npy", "response_ids": [[1, 1], [2]], "rewards": [2, 3],
         "meta": {"anything": True}},
    ])
    records = list(read_records(path, tokenizer=tok))
    assert [r.line for r in records] == [1, 3, 4]
    assert [r.id for r in records] == ["ids", 3, 7]               # no "id": the line number
    a, b, c = (r.group for r in records)
    assert a.prompt_ids.tolist() == [1, 2, 3]
    assert [x.tolist() for x in a.response_ids] == [[4], [5, 6]]
    assert a.rewards.dtype == torch.float64 and a.rewards.tolist() == [1.0, 0.0]
    assert a.logps_old is None
    # "the cat sat" -> 1 2 3; "on the mat" -> 4 1 5; "a dog ran ran" -> 6 7 8 8
    assert b.prompt_ids.tolist() == [1, 2, 3]
    assert [x.tolist() for x in b.response_ids] == [[4, 1, 5], [6, 7, 8, 8]]
    assert [x.tolist() for x in b.logps_old] == [[-1.0, -2.0, -0.5], [-0.1, -0.2, -0.3, 0.0]]
    assert c.prompt_ids.tolist() == [8, 7, 6] and c.prompt_ids.dtype == torch.long
    # read_groups yields the same groups
    assert [g.prompt_ids.tolist() for g in read_groups(path, tokenizer=str(tok))] == \
        [[1, 2, 3], [1, 2, 3], [8, 7, 6]]


def test_prompt_files_npy_bin_txt(tmp_path):
    ids = [7, 0, 511, 3, 70000]
    np.save(tmp_path / "a32.npy", np.array(ids, dtype=np.int32))
    np.save(tmp_path / "a64.npy", np.array(ids, dtype=np.int64))
    np.array(ids, dtype="<i4").tofile(tmp_path / "a.bin")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("7 0\n511\t3   70000\n")
    path = write_lines(tmp_path / "g.jsonl", [
        {"prompt_file": name, "response_ids": [[1]], "rewards": [0]}
        for name in ("a32.npy", "a64.npy", "a.bin", "sub/a.txt", str(tmp_path / "a.bin"))])
    prompts = [g.prompt_ids.tolist() for g in read_groups(path)]
    assert prompts == [ids] * 5
    # .bin is little-endian int32: 70000 = 0x00011170 -> bytes 70 11 01 00
    assert (tmp_path / "a.bin").read_bytes()[-4:] == bytes([0x70, 0x11, 0x01, 0x00])


BAD_PROMPT_FILES = [
    ("f.npy", lambda p: np.save(p, np.array([1.0, 2.0])), "1-D int32 or int64"),
    ("f.npy", lambda p: np.save(p, np.ones((2, 2), dtype=np.int32)), "2-D"),
    ("f.bin", lambda p: p.write_bytes(b"\x01\x00\x00\x00\x02"), "not a multiple of 4"),
    ("f.txt", lambda p: p.write_text("1 2 x3"), "word 2 is 'x3'"),
    ("f.txt", lambda p: p.write_text("1 -2"), "word 1 is '-2'"),
    ("f.npy", lambda p: p.write_text("not numpy"), "cannot read"),
    ("f.csv", lambda p: p.write_text("1,2"), "unsupported extension"),
    ("missing.npy", lambda p: None, "cannot read"),
]


@pytest.mark.parametrize("name,make,fragment", BAD_PROMPT_FILES)
def test_bad_prompt_file_names_line_and_field(tmp_path, name, make, fragment):
    make(tmp_path / name)
    path = write_lines(tmp_path / "g.jsonl", [
        {"prompt_ids": [1], "response_ids": [[1]], "rewards": [0]},
        {"prompt_file": name, "response_ids": [[1]], "rewards": [0]}])
    with pytest.raises(DataError) as info:
        list(read_groups(path))
    assert str(info.value).startswith(f"{path} line 2: field 'prompt_file' ")
    assert fragment in str(info.value) and name in str(info.value)
    assert (info.value.line, info.value.field) == (2, "prompt_file")


GOOD = {"prompt_ids": [1, 2], "response_ids": [[1], [2], [3], [4]], "rewards": [0, 1, 0, 1]}

# (line 3 of the file, field named, what the message must say)
BAD_LINES = [
    ({**GOOD, "rewards": [0, 1, 0]}, "rewards",
     "field 'rewards' has 3 values but 'response_ids' has 4; give exactly one reward per response"),
    ('{"prompt_ids": [1], "response_ids": [[1], [2]], "rewards": [0, NaN]}', "rewards",
     "item 1 is nan; rewards must be finite"),
    ('{"prompt_ids": [1], "response_ids": [[1], [2]], "rewards": [-Infinity, 0]}', "rewards",
     "item 0 is -inf; rewards must be finite"),
    ({**GOOD, "rewards": [0, 1, "2", 1]}, "rewards", "item 2 is '2', not a number"),
    ({k: v for k, v in GOOD.items() if k != "rewards"}, "rewards", "is missing"),
    ({**GOOD, "response_ids": [[1], [], [3], [4]]}, "response_ids", "item 1 is empty"),
    ({**GOOD, "response_ids": []}, "response_ids", "non-empty list"),
    ({"prompt": "the", "prompt_ids": [1], **{k: GOOD[k] for k in ("response_ids", "rewards")}},
     "prompt_ids", "conflicts with 'prompt': give exactly one of 'prompt', 'prompt_ids', 'prompt_file'"),
    ({"responses": ["a"], "rewards": [0]}, None, "no prompt: give one of 'prompt'"),
    ({"prompt_ids": [1], "rewards": [0]}, None, "no responses: give one of 'responses'"),
    ({**GOOD, "prompt_ids": []}, "prompt_ids", "is empty"),
    ({**GOOD, "prompt_ids": [1, 600, 700]}, "prompt_ids",
     "position 1 is token id 600, outside the model's vocabulary [0, 512) (2 such ids); check the "
     "tokenizer"),
    ({**GOOD, "response_ids": [[1], [2], [3, 512], [4]]}, "response_ids",
     "item 2 position 1 is token id 512, outside"),
    ({**GOOD, "prompt_ids": [1, -3]}, "prompt_ids", "position 1 is -3; token ids are integers"),
    ({**GOOD, "prompt_ids": [1, 2.5]}, "prompt_ids", "position 1 is 2.5"),
    ({**GOOD, "logprobs_old": [[-1], [-1], [-1]]}, "logprobs_old",
     "has 3 entries but 'response_ids' has 4"),
    ({**GOOD, "logprobs_old": [[-1], [-1, -2], [-1], [-1]]}, "logprobs_old",
     "item 1 has 2 values but response 1 has 1 tokens; give one log-prob per response token"),
    ({**GOOD, "logprobs_old": [[-1], [-1], [0.5], [-1]]}, "logprobs_old",
     "item 2 token 0 is 0.5, above 0"),
    ('{"prompt_ids": [1], "response_ids": [[1]], "rewards": [0], "logprobs_old": [[NaN]]}',
     "logprobs_old", "item 0 token 0 is nan; log-probs must be finite"),
    ({**GOOD, "reward": 1}, "reward", "is not a known field"),
    ({**GOOD, "id": [1]}, "id", "must be a string or an integer"),
    ({"prompt": "the cat", **{k: GOOD[k] for k in ("response_ids", "rewards")}}, "prompt",
     "is text but no tokenizer was given; pass a tokenizer"),
    ({"prompt": [1, 2], **{k: GOOD[k] for k in ("response_ids", "rewards")}}, "prompt",
     "must be text (a JSON string), got list; token ids go in 'prompt_ids'"),
    ('{"prompt_ids": [1], "response_ids": [[1]] "rewards": [0]}', None, "not valid JSON"),
    ("[1, 2]", None, "a JSON list, not an object"),
]


@pytest.mark.parametrize("line,field,fragment", BAD_LINES)
def test_each_validation_error_names_line_and_field(tmp_path, line, field, fragment):
    path = write_lines(tmp_path / "groups.jsonl", [GOOD, "", line, GOOD])
    with pytest.raises(DataError) as info:
        list(read_groups(path, vocab_size=512))
    message = str(info.value)
    prefix = f"{path} line 3: " + (f"field '{field}' " if field else "")
    assert message.startswith(prefix), message
    assert fragment in message, message
    assert (info.value.line, info.value.field) == (3, field)


def test_empty_text_response_and_missing_file(tmp_path):
    tok = make_tokenizer(tmp_path)
    path = write_lines(tmp_path / "g.jsonl", [{"prompt": "the", "responses": ["cat", " "],
                                               "rewards": [0, 1]}])
    with pytest.raises(DataError, match=r"line 1: field 'responses' item 1 is empty"):
        list(read_groups(path, tokenizer=tok))
    with pytest.raises(DataError, match="no such file"):
        list(read_groups(tmp_path / "absent.jsonl"))


def test_tokenizer_file_and_directories(tmp_path):
    from transformers import PreTrainedTokenizerFast

    file = make_tokenizer(tmp_path / "json_only")
    hf_dir = tmp_path / "hf"
    PreTrainedTokenizerFast(tokenizer_file=str(file), unk_token="[UNK]").save_pretrained(hf_dir)
    for source, kind in [(file, "tokenizers"), (tmp_path / "json_only", "tokenizers"),
                         (hf_dir, "transformers")]:
        tok = load_tokenizer(source)
        assert tok.kind == kind
        assert tok.encode("the cat sat on a mat") == [1, 2, 3, 4, 6, 5]
        assert tok.encode("the zebra") == [1, 0]            # unknown word -> [UNK] = 0
        assert tok.encode("[BOS] the") == [9, 1]            # special tokens in the text are kept
        assert tok.vocab_size == len(WORDS)
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        load_tokenizer(tmp_path / "org/some-model")


def test_write_groups_round_trip_and_synthetic_jsonl(tmp_path):
    group = GRPOGroup(prompt_ids=torch.tensor([5, 4, 3, 2, 1]),
                      response_ids=[torch.tensor([9]), torch.tensor([8, 7])],
                      rewards=torch.tensor([0.25, -1.0], dtype=torch.float64),
                      logps_old=[torch.tensor([-0.1], dtype=torch.float64),
                                 torch.tensor([-1 / 3, -2.0], dtype=torch.float64)])
    for fmt in ("npy", "bin", "txt"):
        path = write_groups(tmp_path / f"rt_{fmt}.jsonl", [group, group], ids=["x", "y"],
                            prompt_file_min_len=5, prompt_format=fmt)
        first = json.loads(path.read_text().splitlines()[0])
        assert first["prompt_file"] == f"rt_{fmt}.prompts/1.{fmt}" and "prompt_ids" not in first
        records = list(read_records(path))
        assert [r.id for r in records] == ["x", "y"]
        back = records[1].group
        assert back.prompt_ids.tolist() == [5, 4, 3, 2, 1]
        assert [r.tolist() for r in back.response_ids] == [[9], [8, 7]]
        assert back.rewards.tolist() == [0.25, -1.0]
        assert back.logps_old[1][0].item() == -1 / 3               # exact through JSON
    inline = write_groups(tmp_path / "inline.jsonl", [group], prompt_file_min_len=6)
    assert json.loads(inline.read_text())["prompt_ids"] == [5, 4, 3, 2, 1]

    path = synthetic_jsonl(tmp_path / "syn.jsonl", num_groups=2, vocab_size=512, prompt_len=64,
                           group_size=3, response_len=8, seed=11, prompt_file_min_len=32)
    assert (tmp_path / "syn.prompts" / "2.npy").is_file()
    records = list(read_records(path, vocab_size=512))
    for g, record in enumerate(records):
        expected = synthetic_group(512, 64, 3, 8, seed=11 + g)
        assert record.id == f"synthetic-{g}"
        assert torch.equal(record.group.prompt_ids, expected.prompt_ids)
        assert all(torch.equal(a, b) for a, b in zip(record.group.response_ids,
                                                     expected.response_ids))
        assert torch.equal(record.group.rewards, expected.rewards)
        assert math.isclose(float(record.group.rewards[2]), 2 / 8)  # member 2 copies 2 of 8


@pytest.mark.parametrize("tail,fragment", [
    # A file cut off mid-line (the last line, no newline), mid-string and mid-character.
    (b'{"prompt_ids": [1, 2]', "not valid JSON (Expecting ',' delimiter at column 22) (the "
                               "line ends early: was the file cut off?)"),
    (b'{"prompt_ids": [1], "resp', "not valid JSON (Unterminated string starting at column 21) "
                                  "(the line ends early"),
    ('{"prompt": "caf\u00e9'.encode()[:-1], "not UTF-8 text (byte 0xc3 at column 16: unexpected "
                                            "end of data); was the file cut off"),
    (b'{"prompt_ids": [' + b"1" * 5000 + b"]}", "not valid JSON (ValueError: Exceeds the limit"),
])
def test_truncated_or_undecodable_lines_are_data_errors(tmp_path, tail, fragment):
    path = tmp_path / "g.jsonl"
    path.write_bytes((json.dumps(GOOD) + "\n\n").encode() + tail)
    with pytest.raises(DataError) as info:
        list(read_groups(path))
    assert str(info.value).startswith(f"{path} line 3: "), info.value
    assert fragment in str(info.value), info.value
    assert (info.value.line, info.value.field) == (3, None)
