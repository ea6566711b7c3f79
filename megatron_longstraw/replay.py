"""Pre-step scoring and serial replay (DESIGN section 2, steps 2 and 3).

A member's branch is `[x_P, y_1 .. y_{R-1}]` at positions `P-1 .. P+R-2` over the captured prefix;
its outputs score `y_1 .. y_R`. Scoring runs the branch without autograd and records each full DSA
indexer layer's top-k ("indexer replay"); replay runs it again under autograd with those selections,
every decoder layer wrapped in activation checkpointing, and backpropagates the member's loss before
the next member starts. Live autograd memory is one branch, whatever P and G.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from megatron_longstraw.capture import CapturedPrompt
from megatron_longstraw.config import LongStrawConfig
from megatron_longstraw.models.common import decoder_groups, embed, head_logprobs, run_group
from megatron_longstraw.state import AttentionPass, attention_pass


def _branch(captured: CapturedPrompt, response_ids: torch.Tensor):
    """Input ids, targets and positions of a member's branch (each [R])."""
    first = torch.tensor([captured.last_token], dtype=response_ids.dtype, device=response_ids.device)
    input_ids = torch.cat([first, response_ids[:-1]])
    positions = torch.arange(captured.prefix_len, captured.prefix_len + response_ids.numel(),
                             device=response_ids.device)
    return input_ids, response_ids, positions


def _run_branch(model, captured: CapturedPrompt, response_ids: torch.Tensor, state: AttentionPass,
                checkpoint_layers: bool) -> torch.Tensor:
    input_ids, targets, _ = _branch(captured, response_ids)
    hidden = embed(model, input_ids)                                  # [R, 1, h]
    groups = decoder_groups(model)
    device = hidden.device
    for layer_idx, group in enumerate(groups):
        if captured.prefix_len and layer_idx + 1 < len(groups):
            captured.pages.prefetch(layer_idx + 1, device)           # one layer ahead
        if checkpoint_layers and torch.is_grad_enabled():
            hidden = checkpoint(run_group, group, hidden, use_reentrant=False)
        else:
            hidden = run_group(group, hidden)
        captured.pages.release(layer_idx)
    return head_logprobs(model, hidden, targets)                      # [R]


def _pass(captured: CapturedPrompt, response_ids: torch.Tensor, cfg: LongStrawConfig,
          selections: dict | None) -> AttentionPass:
    _, _, positions = _branch(captured, response_ids)
    return AttentionPass(mode="replay", positions=positions, pages=captured.pages,
                         prefix_len=captured.prefix_len, selections=dict(selections or {}),
                         reuse_selections=selections is not None, query_block=cfg.query_block,
                         key_block=cfg.key_block, token_block=cfg.token_block)


def score_member(model, captured: CapturedPrompt, response_ids: torch.Tensor,
                 cfg: LongStrawConfig) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Per-token log-probs [R] of one response (no autograd) and the DSA selections it used."""
    state = _pass(captured, response_ids, cfg, selections=None)
    with torch.no_grad(), attention_pass(state):
        logp = _run_branch(model, captured, response_ids, state, checkpoint_layers=False)
    return logp, state.selections


def replay_member(model, captured: CapturedPrompt, response_ids: torch.Tensor,
                  selections: dict[int, torch.Tensor] | None, cfg: LongStrawConfig,
                  loss_fn: Callable[[torch.Tensor], tuple[torch.Tensor, dict]]):
    """Rebuild one member's graph, backpropagate `loss_fn(logp)`, free the graph.

    Gradients accumulate into `.grad` of the trainable parameters (plain sums across members: the
    loss already carries the member's 1/(G R_i) share). Returns (logp [R] detached, loss, stats).
    """
    state = _pass(captured, response_ids, cfg, selections=selections)
    with attention_pass(state):  # backward recomputes checkpointed layers: keep the pass installed
        logp = _run_branch(model, captured, response_ids, state, cfg.checkpoint_layers)
        loss, stats = loss_fn(logp)
        loss.backward()
    return logp.detach(), loss.detach(), stats
