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
    (offpolicy.py, --longstraw-tis)."""
    routed_experts: list[torch.Tensor] | None = None
    """Optional [R_i, num_moe_layers, moe_topk] int expert ids the engine routed each response
    token's branch row to, per MoE layer in order (the JSONL's `routed_experts`): scoring and
    replay route with them (routing_replay.py)."""
    dsa_topk: list[torch.Tensor] | None = None
    """Optional [R_i, num_full_indexer_layers, k] int global key positions (-1: none) the engine's
    DSA indexer selected for each response token's branch row, per full indexer layer in order
    (the JSONL's `dsa_topk`): scoring and replay attend with them (routing_replay.py)."""
