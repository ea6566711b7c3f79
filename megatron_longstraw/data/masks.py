"""Loss masks of multi-turn members (agent trajectories: docs/design.md section 2): which response
tokens the policy produced (trained) and which the environment wrote (tool observations, turn
headers: context only). A group line gives them in one of three ways (examples/data/README.md):

    "response_ids" + "loss_masks"  [member][token] 0/1, one value per response id
    "response_segments"            [member][segment] {"ids": [..]} or {"text": ".."}, "train": bool;
                                   a member's response is its segments joined, in order
    "prompt_messages" + "messages" chat messages rendered once per member with the tokenizer's own
                                   chat template; trained = the tokens the template's
                                   {% generation %} blocks produce (the assistant's)

This module reads one member's value (or renders one conversation) and raises ValueError with the
member, segment, message or token; the JSONL reader (groups.py) adds file, line and field. A mask
is a bool tensor [R_i] (True: trained). Every member trains at least one token.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

SEGMENT_KEYS = ("ids", "text", "train")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def mask_tensor(value, member: int, num_tokens: int) -> torch.Tensor:
    """One member's `loss_masks` entry (a list of 0/1 or true/false, one per response token) ->
    bool [R]; ValueError naming the member and token."""
    if not isinstance(value, list):
        raise ValueError(f"item {member} must be a list of 0/1 values (one per response token), "
                         f"got {type(value).__name__}.")
    if len(value) != num_tokens:
        raise ValueError(f"item {member} has {len(value)} values but response {member} has "
                         f"{num_tokens} tokens; give one 0/1 per response token, in order (1: "
                         "the policy produced it, trained; 0: context only, e.g. a tool "
                         "observation).")
    for t, x in enumerate(value):
        if not (isinstance(x, (bool, int, float)) and x in (0, 1)):
            raise ValueError(f"item {member} token {t} is {x!r}; mask values are 0 or 1 (or "
                             "false / true).")
    return torch.tensor([bool(x) for x in value], dtype=torch.bool)


def check_trains(mask: torch.Tensor, member: int) -> None:
    """A member must train at least one token (else it only adds a zero to the group's loss
    while counting in its advantages: drop it upstream)."""
    if not bool(mask.any()):
        raise ValueError(f"item {member} trains no token (every mask value is 0); a member needs "
                         "at least one policy token: drop the member or fix its mask.")


def segments_member(value, member: int, ids_of: Callable[[object, str], list[int]]
                    ) -> tuple[list[int], torch.Tensor]:
    """One member's `response_segments` entry -> (response ids, bool mask [R]).

    `value`: a non-empty list of segments, each {"ids": [..]} or {"text": ".."} plus
    "train": true | false. `ids_of(value, kind)` turns a segment's "ids" or "text" into token ids
    (kind "ids" | "text"; ValueError on bad ids or a missing tokenizer). Text is tokenised per
    segment, as an environment tokenises its observation before appending it."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"item {member} must be a non-empty list of segments "
                         '({"ids": [..]} or {"text": ".."}, with "train": true | false).')
    ids, mask = [], []
    for s, segment in enumerate(value):
        where = f"item {member} segment {s}"
        if not isinstance(segment, dict):
            raise ValueError(f"{where} must be an object "
                             f'{{"ids": [..] or "text": "..", "train": true | false}}, got '
                             f"{type(segment).__name__}.")
        unknown = sorted(set(segment) - set(SEGMENT_KEYS))
        if unknown:
            raise ValueError(f"{where} has the unknown key {unknown[0]!r} (known: "
                             f"{', '.join(SEGMENT_KEYS)}).")
        kinds = [k for k in ("ids", "text") if k in segment]
        if len(kinds) != 1:
            raise ValueError(f"{where} needs exactly one of 'ids' and 'text', got "
                             f"{' and '.join(kinds) or 'neither'}.")
        train = segment.get("train")
        if not isinstance(train, bool):
            raise ValueError(f"{where} needs \"train\": true (the policy's tokens) or false "
                             f"(context: tool output, turn headers), got {train!r}.")
        try:
            part = ids_of(segment[kinds[0]], kinds[0])
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if not part:
            raise ValueError(f"{where} is empty (no tokens); drop it.")
        ids += part
        mask += [train] * len(part)
    return ids, torch.tensor(mask, dtype=torch.bool)


# ---- chat messages ------------------------------------------------------------------------------


def chat_backend(tokenizer):
    """The transformers tokenizer that renders chat messages (ValueError when there is none, or
    it has no chat template)."""
    if tokenizer is None:
        raise ValueError("holds chat messages but no tokenizer was given; pass a local tokenizer "
                         "directory with a chat template (--tokenizer DIR), or give token ids.")
    backend = getattr(tokenizer, "backend", tokenizer)
    if not getattr(backend, "chat_template", None) or not hasattr(backend,
                                                                    "apply_chat_template"):
        path = getattr(tokenizer, "path", None)
        raise ValueError(f"holds chat messages but the tokenizer{f' {path!r}' if path else ''} has "
                         "no chat template; pass the model's tokenizer directory (its "
                         "tokenizer_config.json or chat_template.jinja holds the template; a bare "
                         "tokenizer.json has none), or give token ids.")
    return backend


def _check_messages(value, where: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}must be a non-empty list of chat messages "
                         '({"role": .., "content": ..}).')
    for m, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"{where}message {m} must be an object with a string \"role\" (and "
                             "what the chat template reads: \"content\", ...).")
    return value


def _ids(rendered) -> list[int]:
    ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    return list(ids)


def render_prompt(tokenizer, messages) -> list[int]:
    """`prompt_messages` -> prompt ids: the chat template with the generation prompt (what the
    engine fed the model before the first policy token)."""
    _check_messages(messages, "")
    backend = chat_backend(tokenizer)
    return _ids(backend.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True))


def _template_name(tokenizer, backend) -> str:
    path = getattr(tokenizer, "path", None) or getattr(backend, "name_or_path", None)
    return f"the chat template of {str(path)!r}" if path else "the tokenizer's chat template"


def _first_difference(backend, ids: list[int], prefix: list[int]) -> str | None:
    """None when `prefix` is a prefix of `ids`; else where they part: 'position N: id A ('tok')
    where the prefix has id B ('tok')' (or the end of the rendering)."""
    if ids[:len(prefix)] == list(prefix):
        return None
    at = next((t for t, (a, b) in enumerate(zip(ids, prefix)) if a != b), len(ids))

    def token(i: int) -> str:
        return f"id {i} ({backend.convert_ids_to_tokens(i)!r})"
    got = token(ids[at]) if at < len(ids) else "the end of the rendering"
    return f"position {at}: {got} where it has {token(prefix[at])}"


def render_member(tokenizer, prompt_messages, messages, member: int,
                  prompt_ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """One member's `messages` -> (response ids, bool mask [R]): prompt_messages + messages
    rendered and tokenised once (no turn re-tokenised on its own); the response is what follows
    the prompt's ids; trained are the tokens of the template's {% generation %} blocks
    (transformers' `return_assistant_tokens_mask`).

    The rendering must be prefix-preserving: it starts with the prompt's ids, and before each
    later assistant message with the rendering of the conversation up to it plus the generation
    prompt (what an engine fed the policy before that turn). A template that renders earlier
    turns differently once later ones follow (one that drops earlier reasoning) would train the
    policy on a context it never sampled in: ValueError naming the template, the message and the
    first differing token. (The check renders the conversation once per assistant turn: with
    long prompts prefer ids.)"""
    where = f"item {member} "
    _check_messages(messages, where)
    backend = chat_backend(tokenizer)
    if not _GENERATION_TAG.search(backend.chat_template):
        raise ValueError("needs a chat template that marks the policy's tokens with "
                         "{% generation %} ... {% endgeneration %} (transformers' assistant "
                         "tokens mask); add the tags around the assistant content in the "
                         "template, or give 'response_segments' / 'response_ids' with "
                         "'loss_masks'.")
    rendered = backend.apply_chat_template(list(prompt_messages) + list(messages), tokenize=True,
                                           return_dict=True, return_assistant_tokens_mask=True)
    ids, trained = _ids(rendered), list(rendered["assistant_masks"])
    template = _template_name(tokenizer, backend)
    ids_instead = ("Give the engine's ids instead ('response_segments' or 'response_ids' with "
                   "'loss_masks': the token-in/token-out path, nothing re-rendered).")
    # What the engine fed the policy before each of its turns: the prompt (rendered alone, with
    # the generation prompt), then before each later assistant message the turns up to it.
    for j, message in enumerate(messages):
        if j and message["role"] != "assistant":
            continue
        before = prompt_ids if j == 0 else _ids(backend.apply_chat_template(
            list(prompt_messages) + list(messages[:j]), add_generation_prompt=True,
            tokenize=True, return_dict=True))
        differs = _first_difference(backend, ids, before)
        if differs and j == 0:
            raise ValueError(f"{where}does not continue the prompt: rendered after "
                             "'prompt_messages' its ids differ from the prompt's (rendered "
                             f"alone, with the generation prompt) at {differs}; {template} "
                             "renders the prompt differently once later turns follow (e.g. it "
                             f"drops earlier reasoning). {ids_instead}")
        if differs:
            raise ValueError(
                f"{where}message {j} (assistant) does not continue the turns before it: the "
                f"whole conversation's rendering differs from messages 0..{j - 1} rendered with "
                f"the generation prompt (what the engine fed the policy before this turn) at "
                f"{differs}; {template} re-renders earlier turns once later ones follow (e.g. "
                "it drops earlier reasoning), so the trained context would not be the one the "
                f"policy sampled in. {ids_instead}")
    num_prompt = len(prompt_ids)
    if any(trained[:num_prompt]):
        raise ValueError(f"{where}trains prompt tokens: the chat template puts part of the "
                         "prompt inside {% generation %}; only member messages may be trained.")
    return ids[num_prompt:], torch.tensor([bool(x) for x in trained[num_prompt:]],
                                          dtype=torch.bool)
