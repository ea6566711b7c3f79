"""transformers' DeepSeek-V3-style layers in float64: its eager attention and sigmoid top-k router
compute in float32 whatever the model dtype (softmax `dtype=torch.float32`, router `.float()`);
for fp64 parity tests (<= 1e-9) these are the same computations without the casts, bound onto the
modules by the tests (GLM-5.2 and DeepSeek-V3 share them)."""

import torch


def eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.softmax(weights, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def sigmoid_router(self, hidden_states):  # the TopkRouter forward without the float32 casts
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, self.weight)
    scores = router_logits.sigmoid()
    choice = scores + self.e_score_correction_bias
    group_scores = choice.view(-1, self.num_group, self.num_experts // self.num_group).topk(
        2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(
        -1, self.num_group, self.num_experts // self.num_group).reshape(-1, self.num_experts)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if self.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return router_logits, topk_weights * self.routed_scaling_factor, topk_indices


boundary_ties: list[int] = []
"""Per dsa_indexer call, the rows whose k-th and (k+1)-th best scores are equal (both visible): the
ties whose breaking decides the selection (a test clears and reads it)."""


def dsa_indexer(self, hidden_states, q_resid, position_embeddings, attention_mask,
                position_ids=None, cache=None):
    """GlmMoeDsaIndexer.forward without its float32 casts of q, k and the head weights, and with
    ties broken toward the lower key position, as ours (`kernels/refs.py` `indexer_topk`):
    torch.topk leaves the order among equal scores unspecified, and with ReLU scores exact ties
    are common: a key whose every head scores below zero scores exactly 0 (probability 2^-heads
    per key; the tiny configs with 4 index heads tie in most rows of a 40-token sequence, and one
    tied key chosen differently gave 3e-3 relative log-prob differences). Same formula (ReLU
    scores, interleaved RoPE, weighted head sum, causal mask, top-k)."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
        apply_rotary_pos_emb_interleave,
    )

    batch, seq, _ = hidden_states.shape
    cos, sin = position_embeddings
    q = self.wq_b(q_resid).view(batch, seq, self.n_heads, self.head_dim)
    rope, rest = self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim
    q_rot, q_pass = torch.split(q, [rope, rest], dim=-1)
    k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [rope, rest], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q, k = torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    if cache is not None:
        k = cache.update_indexer(k, self.layer_idx)
    scores = torch.relu(torch.matmul(q, k.transpose(-1, -2).unsqueeze(1)) * self.softmax_scale)
    weights = self.weights_proj(hidden_states) * (self.n_heads ** -0.5)
    index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    if attention_mask.dtype == torch.bool:
        index = index.masked_fill(~attention_mask, float("-inf"))
    else:
        index = index + attention_mask
    k = min(self.index_topk, index.shape[-1])
    ranked, order = torch.sort(index, dim=-1, descending=True, stable=True)
    if k < index.shape[-1]:
        kth, next_best = ranked[..., k - 1], ranked[..., k]
        visible = next_best > torch.finfo(index.dtype).min / 2   # the mask adds -inf or finfo.min
        boundary_ties.append(int(((kth == next_best) & visible).sum()))
    return order[..., :k].to(torch.int32)
