"""Pure-PyTorch reference kernels. Every GPU backend in `kernels/` has a function of the same name and
signature here; this path is complete, runs anywhere, and is what the CPU tests exercise.

Nothing here allocates O(S^2): indexer scores are computed per block of keys with a running top-k, and
sparse attention reads only the selected rows.

Shapes use `s` for query tokens, `t` for key tokens (prompt pages and/or the current tokens).
"""

from __future__ import annotations

import torch


def rope_angles(positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype) -> tuple:
    """cos/sin of RoPE for integer `positions` [s]: two tensors [s, dim/2] (computed in float64)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim))
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float, interleaved: bool) -> torch.Tensor:
    """Rotary embedding on the last dim of `x` [s, ..., d] at integer `positions` [s].

    interleaved=True rotates pairs (x0, x1), (x2, x3), ... (DeepSeek/GLM MLA); False rotates
    (x_i, x_{i+d/2}) (half split). Both return the transformers layout `[rotated firsts; rotated
    seconds]`; q and k always go through the same function, so dot products are what the checkpoint
    expects.
    """
    d = x.shape[-1]
    cos, sin = rope_angles(positions, d, theta, x.dtype)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    cos, sin = cos.view(shape), sin.view(shape)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float,
                   relu: bool) -> torch.Tensor:
    """DSA lightning-indexer scores, float32 or wider.

    q: [s, h_i, d_i], weights: [s, h_i], keys: [t, d_i] -> [s, t] = sum_h w[s,h] * act(q[s,h].k[t] * scale)
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    num_queries, num_heads, head_dim = q.shape
    logits = (q.to(acc).reshape(num_queries * num_heads, head_dim) @ keys.to(acc).T) * scale
    if relu:
        logits.relu_()
    return torch.bmm(weights.to(acc)[:, None, :], logits.view(num_queries, num_heads, -1))[:, 0]


def _top_k_stable(scores: torch.Tensor, idx: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k entries of each row with the largest score, ties broken toward the lower index.

    scores/idx: [s, n] with idx ascending along each row (n > k). Returns (scores, idx) [s, k],
    index-ascending. Rows whose k-th and (k+1)-th largest values differ have a unique top-k set
    (torch.topk's); rows with a tie at that boundary take everything above the k-th value plus the
    first tied entries in index order (what a stable descending sort would keep).
    """
    values, pos = scores.topk(k + 1, dim=1)
    pos = pos[:, :k].sort(dim=1).values
    out_scores, out_idx = scores.gather(1, pos), idx.gather(1, pos)
    tied_rows = (values[:, k - 1] == values[:, k]).nonzero().flatten()
    if tied_rows.numel():
        sub = scores[tied_rows]
        kth = values[tied_rows, k - 1:k]
        above, tied = sub > kth, sub == kth
        take = above | (tied & (tied.cumsum(dim=1) <= k - above.sum(dim=1, keepdim=True)))
        out_scores[tied_rows] = sub[take].view(-1, k)
        out_idx[tied_rows] = idx[tied_rows][take].view(-1, k)
    return out_scores, out_idx


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                 query_positions: torch.Tensor, key_positions: torch.Tensor, topk: int,
                 scale: float, relu: bool, key_block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal top-k over keys, one block of keys at a time (running top-k; no [s, t] matrix).

    q: [s, h_i, d_i], weights: [s, h_i], keys: [t, d_i], query_positions: [s], key_positions: [t]
    (global token positions; key j is visible to query i iff key_positions[j] <= query_positions[i]).
    Returns (indices [s, k] int64 into the key axis, ascending, -1 where fewer than k keys are
    visible; scores [s, k]) with k = min(topk, t). The selected set is the top k by score with ties
    broken toward the lower key index, whatever the block size.
    """
    num_queries, num_keys = q.shape[0], keys.shape[0]
    k = min(topk, num_keys)
    acc = torch.promote_types(q.dtype, torch.float32)
    best_scores = torch.empty(num_queries, 0, dtype=acc, device=q.device)
    best_idx = torch.empty(num_queries, 0, dtype=torch.long, device=q.device)
    last_query = int(query_positions.max()) if num_queries else -1
    for start in range(0, num_keys, key_block):
        end = min(start + key_block, num_keys)
        block_pos = key_positions[start:end]
        if int(block_pos.min()) > last_query:
            continue  # entirely in the future of every query
        scores = indexer_scores(q, weights, keys[start:end], scale, relu)
        scores.masked_fill_(block_pos[None, :] > query_positions[:, None], float("-inf"))
        idx = torch.arange(start, end, device=q.device).expand(num_queries, -1)
        if end - start > k:
            scores, idx = _top_k_stable(scores, idx, k)
        scores = torch.cat([best_scores, scores], dim=1)
        idx = torch.cat([best_idx, idx], dim=1)
        best_scores, best_idx = _top_k_stable(scores, idx, k) if scores.shape[1] > k else (scores, idx)
    if best_idx.shape[1] < k:  # every key block was in the future
        pad = k - best_idx.shape[1]
        best_scores = torch.cat([best_scores, best_scores.new_full((num_queries, pad), float("-inf"))], 1)
        best_idx = torch.cat([best_idx, best_idx.new_full((num_queries, pad), -1)], 1)
    best_idx = best_idx.masked_fill(torch.isneginf(best_scores), -1)
    return best_idx, best_scores


def sparse_mla_attention(query: torch.Tensor, latents: torch.Tensor, indices: torch.Tensor,
                         scale: float, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed-MLA attention over selected latent rows (the FlashMLA sparse-prefill contract).

    query: [s, h, d_qk] (d_qk = kv_lora_rank + rope dim; the nope part already absorbed W_UK),
    latents: [t, d_qk] rows `[c_kv; k_pe]`, indices: [s, k] into `latents` (-1 = skip),
    returns (out [s, h, v_dim] = softmax(q.latent * scale) @ c_kv, lse [s, h] in float32 or wider).
    A query with no valid index gets out = 0 and lse = -inf (it merges as an empty partial).
    """
    valid = indices >= 0
    rows = latents[indices.clamp(min=0)]                      # [s, k, d_qk]
    logits = torch.einsum("shd,skd->shk", query, rows) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    acc = torch.promote_types(logits.dtype, torch.float32)
    lse = torch.logsumexp(logits.to(acc), dim=-1)             # [s, h]
    probs = torch.exp(logits.to(acc) - lse.nan_to_num(neginf=0.0)[..., None])
    probs = probs.masked_fill(~valid[:, None, :], 0.0).to(rows.dtype)
    out = torch.einsum("shk,skr->shr", probs, rows[..., :v_dim])
    return out, lse


def merge_partial_attention(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple:
    """Merge partial softmax-attention results over disjoint key sets by their log-sum-exp.

    outs: each [s, h, d], lses: each [s, h]. Returns (out [s, h, d], lse [s, h]).
    """
    lse_all = torch.stack(lses)                               # [n, s, h]
    lse = torch.logsumexp(lse_all, dim=0)
    weights = torch.exp(lse_all - lse.nan_to_num(neginf=0.0)[None]).nan_to_num(0.0)
    out = sum(w[..., None].to(o.dtype) * o for w, o in zip(weights, outs))
    return out, lse
