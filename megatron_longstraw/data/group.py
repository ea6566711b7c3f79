"""`GRPOGroup`: one prompt and its group of responses, as every wing above data/ passes it around
(the reader makes it, the schedule trains on it, grpo/ validates it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GRPOGroup:
    """One prompt and its group of responses."""

    prompt_ids: torch.Tensor
    """[P] token ids of the shared prompt."""
    response_ids: list[torch.Tensor]
    """G tensors [R_i] of response token ids."""
    rewards: torch.Tensor
    """[G] scalar rewards."""
    logps_old: list[torch.Tensor] | None = None
    """Optional [R_i] log-probs from the inference engine that sampled the responses (the
    JSONL's `logprobs_old`). They are not the PPO ratio's denominator (the trainer's own pre-step
    scoring is): they give the engine-trainer importance weights and mismatch figures
    (offpolicy.py, --longstraw-tis). NaN at an untrained token (`loss_masks`): absent there."""
    routed_experts: list[torch.Tensor] | None = None
    """Optional [R_i, num_moe_layers, moe_topk] int expert ids the engine routed each response
    token's branch row to, per MoE layer in order (the JSONL's `routed_experts`): scoring and
    replay route with them (routing_replay.py)."""
    dsa_topk: list[torch.Tensor] | None = None
    """Optional [R_i, num_full_indexer_layers, k] int global key positions (-1: none) the engine's
    DSA indexer selected for each response token's branch row, per full indexer layer in order
    (the JSONL's `dsa_topk`): scoring and replay attend with them (routing_replay.py)."""
    loss_masks: list[torch.Tensor] | None = None
    """Optional G bool tensors [R_i]: True where response token t is trained (the policy produced
    it), False where it is context only (a tool observation, a turn header the environment
    wrote: it goes through the forward and its pages are written like any branch token, but it
    has no loss term). None: every token is trained. From the JSONL's `loss_masks`,
    `response_segments` or chat `messages` (data/masks.py); every member trains >= 1 token.
    Engine log-probs at untrained tokens may be absent (NaN in `logps_old`); the routing fields
    cover every token (untrained tokens are context the engine routed too)."""
