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
