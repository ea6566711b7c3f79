"""Prompt capture (DESIGN section 2, step 1): run the shared prompt once through every layer without
autograd and keep only the state that response tokens read, in a `PageStore`.

The captured prefix is `prompt[:-1]`. The last prompt token is replayed with every member instead:
its output scores the first response token, so replaying it keeps that token's own computation in
the member's autograd graph (only the state of the tokens before it is a constant).

Memory: the residual stream of the local prompt tokens `[P, h]`, the pages, and per-block scratch;
FFN/MoE intermediates live for one token chunk, indexer scores for one (query block, key block)
pair; the largest top-k selection kept is the latest full indexer layer's `[P, k]` (IndexShare
layers read it). Nothing is O(P^2).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from megatron_longstraw.config import LongStrawConfig
from megatron_longstraw.models.common import decoder_groups, embed, run_group
from megatron_longstraw.pages import PageStore
from megatron_longstraw.state import AttentionPass, attention_pass


@dataclass
class CapturedPrompt:
    pages: PageStore
    """Per-layer state of the captured prefix (host memory)."""
    prefix_len: int
    """Tokens captured: P - 1."""
    last_token: int
    """The prompt's last token id; it opens every replayed branch."""
    seconds: float
    """Wall time of the capture."""


def capture_prompt(model, prompt_ids: torch.Tensor, cfg: LongStrawConfig,
                   pages: PageStore | None = None) -> CapturedPrompt:
    """Capture `prompt_ids` [P] (P >= 1) into `pages` (a new store by default)."""
    start = time.perf_counter()
    prefix = prompt_ids[:-1]
    pages = pages if pages is not None else PageStore(page_tokens=cfg.page_tokens)
    if prefix.numel() > 0:
        state = AttentionPass(mode="capture", pages=pages,
                              positions=torch.arange(prefix.numel(), device=prefix.device),
                              query_block=cfg.query_block, key_block=cfg.key_block,
                              token_block=cfg.token_block)
        with torch.no_grad(), attention_pass(state):
            hidden = embed(model, prefix)                       # [P-1, 1, h]
            for group in decoder_groups(model):
                hidden = run_group(group, hidden, token_block=cfg.token_block)
        del hidden
        state.selections.clear()
    return CapturedPrompt(pages=pages, prefix_len=int(prefix.numel()),
                          last_token=int(prompt_ids[-1]), seconds=time.perf_counter() - start)
