"""Multi-turn members in the JSONL format (data/masks.py, examples/data/README.md "Agent
trajectories"): `loss_masks`, `response_segments` and chat `messages` give the same response ids
and masks (written out by hand from the toy vocabulary below), engine log-probs may be absent at
untrained tokens, and each bad input is a DataError naming file, line and field."""

import json

import pytest
import torch

from megatron_longstraw.data.dataset import GroupDataset
from megatron_longstraw.data.groups import DataError, read_groups, read_records, write_groups
from test_data import make_tokenizer, write_lines

SPECIAL = ["<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"]
WORDS = ["[UNK]", "the", "cat", "sat", "on", "mat", "a", "dog", "ran"] + SPECIAL   # id = index
USER, ASSISTANT, TOOL, END = 9, 10, 11, 12
# The assistant's content and its <|end|> are the policy's tokens ({% generation %}); role headers
# and every other message are context.
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|> "
            "{% generation %}{{ m['content'] }} <|end|>{% endgeneration %} "
            "{% else %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def make_chat_tokenizer(folder, template=TEMPLATE):
    """A saved transformers tokenizer directory over WORDS with `template` as its chat template
    (None: no template)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens(SPECIAL)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    if template is not None:
        hf.chat_template = template
    hf.save_pretrained(folder)
    return folder


# One trajectory three ways: the policy says "on the mat", the tool answers "a dog", the policy
# says "ran". Response after the prompt <|user|> the cat sat <|end|> <|assistant|>:
RESPONSE = [4, 1, 5, END, TOOL, 6, 7, END, ASSISTANT, 8, END]
MASK = [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1]
PROMPT = [USER, 1, 2, 3, END, ASSISTANT]
SEGMENTS = [{"ids": [4, 1, 5, END], "train": True},
            {"text": "<|tool|> a dog <|end|> <|assistant|>", "train": False},
            {"ids": [8, END], "train": True}]
MESSAGES = [{"role": "assistant", "content": "on the mat"}, {"role": "tool", "content": "a dog"},
            {"role": "assistant", "content": "ran"}]
SHORT = [2, 3, END]        # a second member, all trained
MASKED = {"prompt_ids": PROMPT, "response_ids": [RESPONSE, SHORT],
          "loss_masks": [MASK, [1, 1, 1]], "rewards": [1, 0]}


def test_loss_masks_segments_and_messages_give_the_same_member(tmp_path):
    tok = make_chat_tokenizer(tmp_path / "chat")
    path = write_lines(tmp_path / "g.jsonl", [
        MASKED,
        {"prompt_ids": PROMPT, "response_segments": [SEGMENTS, [{"ids": SHORT, "train": True}]],
         "rewards": [1, 0]},
        {"prompt_messages": [{"role": "user", "content": "the cat sat"}],
         "messages": [MESSAGES, [{"role": "assistant", "content": "cat sat"}]], "rewards": [1, 0]},
        {"prompt_ids": PROMPT, "response_ids": [RESPONSE, SHORT], "rewards": [1, 0]},
    ])
    records = list(read_records(path, tokenizer=tok))
    assert [r.response_field for r in records] == ["response_ids", "response_segments",
                                                   "messages", "response_ids"]
    for record in records[:3]:
        group = record.group
        assert group.prompt_ids.tolist() == PROMPT
        assert [r.tolist() for r in group.response_ids] == [RESPONSE, SHORT]
        assert all(m.dtype == torch.bool for m in group.loss_masks)
        assert [m.long().tolist() for m in group.loss_masks] == [MASK, [1, 1, 1]]
    assert records[3].group.loss_masks is None                    # no mask: every token trained
    assert records[2].response_texts is None                      # rewards decode the ids


def test_engine_logprobs_may_be_absent_at_untrained_tokens(tmp_path):
    old = [-0.5, -0.25, -1.0, -0.125, None, float("nan"), -3.0, None, None, -0.5, -0.75]
    path = write_lines(tmp_path / "g.jsonl", [
        {**MASKED, "logprobs_old": [old, [-1, -2, -3]]}])
    group = next(read_groups(path))
    lp = group.logps_old[0]
    assert torch.isnan(lp[[4, 5, 7, 8]]).all() and lp[6] == -3.0 and lp[9] == -0.5
    # written back: absent values as null, masks as 0/1; read again, the same group
    out = write_groups(tmp_path / "back.jsonl", [group])
    line = json.loads(out.read_text())
    assert line["loss_masks"] == [MASK, [1, 1, 1]]
    assert line["logprobs_old"][0][4] is None and line["logprobs_old"][0][6] == -3.0
    back = next(read_groups(out))
    assert torch.equal(back.loss_masks[0], group.loss_masks[0])
    assert torch.equal(back.logps_old[0].nan_to_num(7.0), lp.nan_to_num(7.0))


def test_the_dataset_checks_and_reads_masks(tmp_path):
    path = write_lines(tmp_path / "g.jsonl", [MASKED, {**MASKED, "loss_masks": [MASK, [0, 0, 0]]}])
    with pytest.raises(DataError, match=r"line 2: field 'loss_masks' item 1 trains no token"):
        GroupDataset(path, vocab_size=512)
    path = write_lines(tmp_path / "g.jsonl", [MASKED])
    assert GroupDataset(path, vocab_size=512)[0].loss_masks[0].long().tolist() == MASK


def test_chat_prompt_lines_for_the_online_loop(tmp_path):
    tok = make_chat_tokenizer(tmp_path / "chat")
    path = write_lines(tmp_path / "p.jsonl", [
        {"id": "c", "prompt_messages": [{"role": "user", "content": "the cat sat"}]}])
    prompts = GroupDataset(path, tokenizer=tok, require_rewards=False, prompt_only=True)
    assert prompts[0].prompt_ids.tolist() == PROMPT


CHAT_PROMPT = [{"role": "user", "content": "the cat sat"}]
# (line 3 of the file, field named, what the message must say); "chat" lines read with the chat
# tokenizer, the others without a tokenizer.
BAD_LINES = [
    ({**MASKED, "loss_masks": [MASK[:-1], [1, 1, 1]]}, "loss_masks",
     "item 0 has 10 values but response 0 has 11 tokens; give one 0/1 per response token"),
    ({**MASKED, "loss_masks": [MASK]}, "loss_masks", "has 1 entries but 'response_ids' has 2"),
    ({**MASKED, "loss_masks": [MASK, [1, 2, 1]]}, "loss_masks",
     "item 1 token 1 is 2; mask values are 0 or 1"),
    ({**MASKED, "loss_masks": [MASK, [1, 0.5, 1]]}, "loss_masks", "item 1 token 1 is 0.5"),
    ({**MASKED, "loss_masks": [MASK, "111"]}, "loss_masks", "item 1 must be a list of 0/1"),
    ({**MASKED, "loss_masks": [[0] * 11, [1, 1, 1]]}, "loss_masks",
     "item 0 trains no token (every mask value is 0)"),
    ({"prompt_ids": PROMPT, "responses": ["sat", "on the mat"], "loss_masks": [[1], [1, 0, 1]],
      "rewards": [1, 0]}, "loss_masks",
     "cannot be combined with 'responses': a mask is per token, and text responses are "
     "tokenised here"),
    ({"prompt_ids": PROMPT, "response_segments": [SEGMENTS, [{"ids": SHORT, "train": True}]],
      "loss_masks": [MASK, [1, 1, 1]], "rewards": [1, 0]}, "loss_masks",
     "cannot be combined with 'response_segments'"),
    ({**MASKED, "loss_mask": MASK}, "loss_mask", "is not a known field"),
    ({**MASKED, "logprobs_old": [[None] * 11, [-1, -2, -3]]}, "logprobs_old",
     "item 0 token 0 is None; log-probs must be finite numbers (null or NaN only at untrained "
     "tokens"),
    ({"prompt_ids": PROMPT, "response_ids": [SHORT, SHORT], "rewards": [1, 0],
      "logprobs_old": [[-1, None, -1], [-1, -2, -3]]}, "logprobs_old",
     "item 0 token 1 is None; log-probs must be finite numbers."),
    ({"prompt_ids": PROMPT, "response_segments": [[{"ids": SHORT, "train": False}],
                                                  [{"ids": SHORT, "train": True}]],
      "rewards": [1, 0]}, "response_segments", "item 0 trains no token"),
    ({"prompt_ids": PROMPT, "response_segments": [[{"ids": SHORT}], [{"ids": SHORT,
                                                                       "train": True}]],
      "rewards": [1, 0]}, "response_segments",
     'item 0 segment 0 needs "train": true (the policy\'s tokens) or false'),
    ({"prompt_ids": PROMPT, "response_segments": [[{"ids": SHORT, "text": "a", "train": True}],
                                                  [{"ids": SHORT, "train": True}]],
      "rewards": [1, 0]}, "response_segments",
     "item 0 segment 0 needs exactly one of 'ids' and 'text', got ids and text"),
    ({"prompt_ids": PROMPT, "response_segments": [[{"ids": SHORT, "train": True, "role": "x"}],
                                                  [{"ids": SHORT, "train": True}]],
      "rewards": [1, 0]}, "response_segments", "item 0 segment 0 has the unknown key 'role'"),
    ({"prompt_ids": PROMPT, "response_segments": [[{"ids": [1, -1], "train": True}],
                                                  [{"ids": SHORT, "train": True}]],
      "rewards": [1, 0]}, "response_segments",
     "item 0 segment 0: 'ids' position 1 is -1; token ids are integers"),
    ({"prompt_ids": PROMPT, "response_segments": [[{"text": "the cat", "train": True}],
                                                  [{"ids": SHORT, "train": True}]],
      "rewards": [1, 0]}, "response_segments",
     "item 0 segment 0: 'text' is text but no tokenizer was given"),
    ({"prompt_ids": PROMPT, "response_segments": [[{"ids": [], "train": True}],
                                                  [{"ids": SHORT, "train": True}]],
      "rewards": [1, 0]}, "response_segments", "item 0 segment 0 is empty"),
    ({"prompt_ids": PROMPT, "response_segments": [[{"ids": [600], "train": True}],
                                                  [{"ids": SHORT, "train": True}]],
      "rewards": [1, 0]}, "response_segments",
     "item 0 position 0 is token id 600, outside the model's vocabulary"),
    ({"prompt_ids": PROMPT, "messages": [MESSAGES, MESSAGES], "rewards": [1, 0]}, "messages",
     "needs the prompt as 'prompt_messages'"),
    ({"prompt_messages": CHAT_PROMPT, "response_ids": [SHORT, SHORT], "rewards": [1, 0]},
     "prompt_messages", "holds chat messages but no tokenizer was given"),
]
CHAT_BAD_LINES = [
    ({"prompt_messages": CHAT_PROMPT, "messages": [MESSAGES, [{"content": "a"}]],
      "rewards": [1, 0]}, "messages", "item 1 message 0 must be an object with a string \"role\""),
    ({"prompt_messages": CHAT_PROMPT, "messages": [MESSAGES, []], "rewards": [1, 0]}, "messages",
     "item 1 must be a non-empty list of chat messages"),
    ({"prompt_messages": CHAT_PROMPT, "messages": [MESSAGES, MESSAGES],
      "loss_masks": [MASK, MASK], "rewards": [1, 0]}, "loss_masks",
     "cannot be combined with 'messages': the chat template's {% generation %} blocks"),
    ({"prompt_messages": "the cat", "response_ids": [SHORT, SHORT], "rewards": [1, 0]},
     "prompt_messages", "must be a non-empty list of chat messages"),
]


def _check_bad_line(tmp_path, line, field, fragment, tokenizer):
    path = write_lines(tmp_path / "groups.jsonl", [MASKED, "", line, MASKED])
    with pytest.raises(DataError) as info:
        list(read_groups(path, tokenizer=tokenizer, vocab_size=512))
    message = str(info.value)
    assert message.startswith(f"{path} line 3: field '{field}' "), message
    assert fragment in message, message
    assert (info.value.line, info.value.field) == (3, field)


@pytest.mark.parametrize("line,field,fragment", BAD_LINES)
def test_each_mask_error_names_line_and_field(tmp_path, line, field, fragment):
    _check_bad_line(tmp_path, line, field, fragment, None)


@pytest.mark.parametrize("line,field,fragment", CHAT_BAD_LINES)
def test_each_chat_error_names_line_and_field(tmp_path, line, field, fragment):
    _check_bad_line(tmp_path, line, field, fragment, make_chat_tokenizer(tmp_path / "chat"))


def test_chat_templates_that_cannot_give_masks_are_refused(tmp_path):
    line = {"prompt_messages": CHAT_PROMPT, "messages": [MESSAGES, MESSAGES], "rewards": [1, 0]}
    plain = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    # A template that renders the prompt differently once an answer follows (the generation
    # prompt is "<|assistant|> the" alone, "<|assistant|>" in the conversation).
    drifting = TEMPLATE.replace("{% if add_generation_prompt %}<|assistant|> ",
                                "{% if add_generation_prompt %}<|assistant|> the ")
    cases = [(make_tokenizer(tmp_path / "plain_json"), "prompt_messages",
              "has no chat template; pass the model's tokenizer directory"),
             (make_chat_tokenizer(tmp_path / "none", template=None), "prompt_messages",
              "has no chat template"),
             (make_chat_tokenizer(tmp_path / "plain", template=plain), "messages",
              "needs a chat template that marks the policy's tokens with {% generation %}"),
             (make_chat_tokenizer(tmp_path / "drift", template=drifting), "messages",
              "item 0 does not continue the prompt: rendered after 'prompt_messages' its ids "
              "differ from the prompt's (rendered alone, with the generation prompt) at "
              "position 6")]
    for tokenizer, field, fragment in cases:
        path = write_lines(tmp_path / "g.jsonl", [line])
        with pytest.raises(DataError) as info:
            list(read_groups(path, tokenizer=tokenizer))
        assert str(info.value).startswith(f"{path} line 1: field '{field}' "), info.value
        assert fragment in str(info.value), info.value


# Keeps an assistant message's "reasoning" only on the conversation's last assistant message, as
# templates that strip earlier reasoning do (verl #6854, NeMo-RL #2821): prefix-preserving for the
# prompt, not for a later turn.
DROPS_REASONING = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|> {% generation %}"
    "{% if loop.index0 == ns.last and m.get('reasoning') %}{{ m['reasoning'] }} {% endif %}"
    "{{ m['content'] }} <|end|>{% endgeneration %} "
    "{% else %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def test_a_template_that_re_renders_an_earlier_turn_is_refused_at_that_turn(tmp_path):
    """The engine sampled turn 2 after turn 1 rendered with its reasoning; rendered whole, turn 1
    loses it. Refused, naming the member, the message, the template and the first differing
    token; the same conversation without reasoning (nothing re-rendered) is read."""
    tokenizer = make_chat_tokenizer(tmp_path / "drops", template=DROPS_REASONING)
    reasoning = [{**MESSAGES[0], "reasoning": "the cat"}, *MESSAGES[1:]]
    line = {"prompt_messages": CHAT_PROMPT, "messages": [MESSAGES, reasoning], "rewards": [1, 0]}
    path = write_lines(tmp_path / "g.jsonl", [line])
    with pytest.raises(DataError) as info:
        list(read_groups(path, tokenizer=tokenizer))
    message = str(info.value)
    # prompt "<|user|> the cat sat <|end|> <|assistant|>" is 6 ids; turn 1's reasoning at 6.
    assert message.startswith(f"{path} line 1: field 'messages' item 1 message 2 (assistant) "
                              "does not continue the turns before it"), message
    assert ("at position 6: id 4 ('on') where it has id 1 ('the'); the chat template of "
            f"{str(tmp_path / 'drops')!r} re-renders earlier turns") in message, message
    assert "'response_ids' with 'loss_masks'" in message
    group = next(iter(read_groups(write_lines(tmp_path / "ok.jsonl", [
        {**line, "messages": [MESSAGES, MESSAGES]}]), tokenizer=tokenizer)))
    assert len(group.response_ids) == 2


def test_the_example_trajectory_three_ways():
    """examples/data/agent.jsonl: one two-turn trajectory (a tool answers the policy's lookup)
    as response_ids + loss_masks, as response_segments and as chat messages rendered with
    examples/data/chat_tokenizer's template: the same prompt, responses and masks."""
    from pathlib import Path

    data = Path(__file__).resolve().parents[1] / "examples" / "data"
    records = list(read_records(data / "agent.jsonl", tokenizer=data / "chat_tokenizer",
                                vocab_size=512))
    assert [r.id for r in records] == ["masks-0", "segments-0", "chat-0"]
    first = records[0].group
    assert [m.long().tolist() for m in first.loss_masks] == [
        [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1]]
    assert torch.isnan(first.logps_old[0][4:10]).all()
    for record in records[1:]:
        group = record.group
        assert torch.equal(group.prompt_ids, first.prompt_ids)
        assert all(torch.equal(a, b) for a, b in zip(group.response_ids, first.response_ids))
        assert all(torch.equal(a, b) for a, b in zip(group.loss_masks, first.loss_masks))
