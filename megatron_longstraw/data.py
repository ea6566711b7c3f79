"""GRPO groups: a synthetic long-context generator for demos and tests (the JSONL reader lives
beside it once a tokenizer is involved)."""

from __future__ import annotations

import torch

from megatron_longstraw.schedule import GRPOGroup


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
