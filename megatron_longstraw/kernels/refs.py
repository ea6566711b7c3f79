"""Pure-PyTorch reference kernels. Every GPU backend in `kernels/` has a function of the same name and
signature here; this path is complete, runs anywhere, and is what the CPU tests exercise.

Nothing here allocates O(S^2): indexer scores are computed per block of keys with a running top-k, and
sparse attention reads only the selected rows.

Shapes use `s` for query tokens, `t` for key tokens (prompt pages and/or the current tokens).
"""

from __future__ import annotations

import math

import torch


def rope_angles(positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype,
                inv_freq: torch.Tensor | None = None, scale: float = 1.0) -> tuple:
    """cos/sin of RoPE for integer `positions` [s]: two tensors [s, dim/2] (computed in float64).
    `inv_freq` [dim/2] replaces the plain frequencies theta^(-2i/dim) (e.g. `yarn_inv_freq`);
    `scale` multiplies both (YaRN's attention factor, `yarn_attention_factor`)."""
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim))
    freqs = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    return (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """YaRN's cos/sin multiplier: mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both
    are set (DeepSeek-V3: 1.0), else mscale(factor) (transformers' `_compute_yarn_parameters`)."""
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def yarn_inv_freq(dim: int, theta: float, factor: float, original_max_position_embeddings: int,
                  beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True,
                  device=None) -> torch.Tensor:
    """YaRN ("NTK-by-parts") RoPE frequencies [dim/2], float64: the plain frequencies where a
    dimension turns more than `beta_fast` times over the original context, those divided by
    `factor` where it turns fewer than `beta_slow` times, a linear ramp between (transformers'
    `_compute_yarn_parameters`, Megatron's `YarnRotaryEmbedding`)."""
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as upstream: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64, device=device) - low) / (high - low)).clamp(0, 1)
    plain = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))
    return plain / factor * ramp + plain * (1 - ramp)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float, interleaved: bool,
               inv_freq: torch.Tensor | None = None, attention_factor: float = 1.0) -> torch.Tensor:
    """Rotary embedding on the last dim of `x` [s, ..., d] at integer `positions` [s].

    interleaved=True rotates pairs (x0, x1), (x2, x3), ... (DeepSeek/GLM MLA); False rotates
    (x_i, x_{i+d/2}) (half split). Both return the transformers layout `[rotated firsts; rotated
    seconds]`; q and k always go through the same function, so dot products are what the checkpoint
    expects. `inv_freq` [d/2] and `attention_factor` (cos and sin scaled by it): scaled RoPE such
    as YaRN (`yarn_inv_freq`, `yarn_attention_factor`); the defaults are plain RoPE.
    """
    d = x.shape[-1]
    cos, sin = rope_angles(positions, d, theta, x.dtype, inv_freq, attention_factor)
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
    num_keys = keys.shape[0]
    # Keys padded to a multiple of 16 rows (the padded scores are cut off): on CPU a GEMM whose
    # output rows are not 64-byte multiples is ~30% slower (4095 keys against 4096: the captured
    # prefix P - 1 of a power-of-two prompt).
    pad = -num_keys % 16
    if pad:
        keys = torch.cat([keys, keys.new_zeros((pad,) + keys.shape[1:])])
    logits = (q.to(acc).reshape(num_queries * num_heads, head_dim) @ keys.to(acc).T) * scale
    if relu:
        logits.relu_()
    scores = torch.bmm(weights.to(acc)[:, None, :], logits.view(num_queries, num_heads, -1))[:, 0]
    return scores[:, :num_keys] if pad else scores


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
    return indexer_topk_windows(q, weights, lambda start, end: (keys[start:end],
                                                                key_positions[start:end]),
                                keys.shape[0], query_positions, min(topk, keys.shape[0]), scale,
                                relu, key_block)


def indexer_topk_windows(q: torch.Tensor, weights: torch.Tensor, read, num_keys: int,
                         query_positions: torch.Tensor, k: int, scale: float, relu: bool,
                         key_block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """`indexer_topk` over keys that `read(start, end)` -> (keys [t, d_i], their positions [t])
    hands over one key window at a time (e.g. from the pages: streamed capture), `num_keys` in
    all; exactly `k` columns (padded with -1 / -inf). The same windows, so the same selection, as
    over keys held in one tensor."""
    num_queries = q.shape[0]
    acc = torch.promote_types(q.dtype, torch.float32)
    best_scores = torch.empty(num_queries, 0, dtype=acc, device=q.device)
    best_idx = torch.empty(num_queries, 0, dtype=torch.long, device=q.device)
    last_query = int(query_positions.max()) if num_queries else -1
    for start in range(0, num_keys, key_block):
        end = min(start + key_block, num_keys)
        keys, block_pos = read(start, end)
        if int(block_pos.min()) > last_query:
            continue  # entirely in the future of every query
        scores = indexer_scores(q, weights, keys, scale, relu)
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


def _sparse_mla_attention_autograd(query: torch.Tensor, latents: torch.Tensor, indices: torch.Tensor,
                                   scale: float, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain-autograd formula of `sparse_mla_attention` (the previous reference, kept to test
    the blocked one against). Under autograd it saves the gathered rows [s, k, d_qk], the logits
    and probabilities [s, h, k] of every query row, and its backward forms a gradient of latents'
    full shape through the gather: do not use it where memory matters."""
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


def _block_probs(query, latents, indices, scale, lse=None):
    """One query block, recomputed: query [b, h, d_qk] in the accumulation dtype, indices [b, k]
    -> (rows [b, k, d_qk] gathered in that dtype, p [b, h, k], lse [b, h]). p = exp(logit - lse)
    with logit = q.row * scale (0 where the index is -1; a row of only -1 gets lse -inf, p 0);
    `lse` given (the backward): that one, else computed. The logits become p in place."""
    rows = latents[indices.clamp(min=0)].to(query.dtype)
    logits = torch.bmm(query, rows.transpose(1, 2)).mul_(scale)
    logits.masked_fill_((indices < 0)[:, None, :], float("-inf"))
    if lse is None:
        lse = torch.logsumexp(logits, dim=-1)
    # lse_merge_weights(logits, lse), in place: exp(logit - lse), an empty row shifted by 0.
    return rows, logits.sub_(lse.nan_to_num(neginf=0.0)[..., None]).exp_(), lse


class _SparseMLAAttention(torch.autograd.Function):
    """`sparse_mla_attention` walked over query rows in blocks, with a backward that recomputes
    each block's gathered rows and probabilities (flash-attention style).

    Saved for backward: query [s, h, d_qk], latents [t, d_qk] (references to the inputs, no
    copies), indices [s, k] (`sparse_mla_attention` hands them over as int32 when autograd
    records the call and t fits), out [s, h, v_dim] and lse [s, h]: no [s, k, d_qk] gathered
    rows, no [s, h, k] logits. Scratch, in `acc` (float32 or wider): one query block's rows
    [query_block, k, d_qk] and its probabilities [query_block, h, k] (forward); in the backward
    also the block's logit cotangents [query_block, h, k] and row cotangents [query_block, k,
    d_qk], added (index_add_) into one buffer of latents' shape, formed only when latents needs a
    gradient.

    Results equal the plain formula (`_sparse_mla_attention_autograd`) up to summation order:
    each query row's softmax reads only its own k rows, so blocking the rows changes nothing, and
    the backward is the softmax gradient written out: with p = exp(logit - lse), g the cotangent
    of out and g_lse that of lse, d logit = p * (g . v_j - (g . out - g_lse)).
    """

    @staticmethod
    def forward(ctx, query, latents, indices, scale: float, v_dim: int, query_block: int,
                latent_grads=None):
        acc = torch.promote_types(torch.promote_types(query.dtype, latents.dtype), torch.float32)
        num_queries, num_heads = query.shape[:2]
        out = torch.empty(num_queries, num_heads, v_dim, dtype=latents.dtype, device=query.device)
        lse = torch.empty(num_queries, num_heads, dtype=acc, device=query.device)
        for start in range(0, num_queries, query_block):
            end = min(start + query_block, num_queries)
            rows, probs, lse[start:end] = _block_probs(query[start:end].to(acc), latents,
                                                       indices[start:end], scale)
            if out.dtype == acc:
                torch.bmm(probs, rows[..., :v_dim], out=out[start:end])
            else:
                out[start:end] = torch.bmm(probs, rows[..., :v_dim])
        ctx.save_for_backward(query, latents, indices, out, lse)
        ctx.scale, ctx.v_dim, ctx.query_block = scale, v_dim, query_block
        ctx.latent_grads = latent_grads
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        query, latents, indices, out, lse = ctx.saved_tensors
        need_query, need_latents = ctx.needs_input_grad[:2]
        sink = ctx.latent_grads
        acc, scale, v_dim = lse.dtype, ctx.scale, ctx.v_dim
        grad_query = torch.empty(query.shape, dtype=acc, device=query.device) if need_query else None
        grad_latents = (torch.zeros(latents.shape, dtype=acc, device=latents.device)
                        if need_latents else None)
        for start in range(0, query.shape[0], ctx.query_block):
            end = min(start + ctx.query_block, query.shape[0])
            block_idx = indices[start:end]
            q_blk = query[start:end].to(acc)
            g_out = grad_out[start:end].to(acc)
            # d lse / d logit = p, so the lse cotangent enters like -delta (flash backward); an
            # empty row (lse -inf) has p = 0 and takes none of it.
            delta = (g_out * out[start:end].to(acc)).sum(-1)               # [b, h]
            if grad_lse is not None:
                delta = delta - grad_lse[start:end].to(acc).nan_to_num(0.0)
            rows, probs, _ = _block_probs(q_blk, latents, block_idx, scale, lse[start:end])
            grad_logits = torch.bmm(g_out, rows[..., :v_dim].transpose(1, 2))  # [b, h, k]
            grad_logits.sub_(delta[..., None]).mul_(probs)
            if need_query:
                torch.bmm(grad_logits, rows, out=grad_query[start:end]).mul_(scale)
            if need_latents or sink is not None:
                grad_rows = torch.bmm(grad_logits.transpose(1, 2), q_blk).mul_(scale)
                grad_rows[..., :v_dim] += torch.bmm(probs.transpose(1, 2), g_out)
                # Skipped entries (-1) carry zero cotangent (p = 0): adding them at row 0 is a no-op.
                row_idx, grad_rows = block_idx.clamp(min=0).flatten(), grad_rows.flatten(0, 1)
                if sink is not None:
                    sink(row_idx, grad_rows)
                else:
                    grad_latents.index_add_(0, row_idx, grad_rows)
        return (None if grad_query is None else grad_query.to(query.dtype),
                None if grad_latents is None else grad_latents.to(latents.dtype),
                None, None, None, None, None)


SPARSE_QUERY_BLOCK = 256
"""`sparse_mla_attention`'s default query block: its scratch is [256, k, d_qk] rows and [256, h, k]
scores (float32 or wider), at most, whatever the caller's block (the planner charges it)."""


def sparse_mla_attention(query: torch.Tensor, latents: torch.Tensor, indices: torch.Tensor,
                         scale: float, v_dim: int, query_block: int = SPARSE_QUERY_BLOCK
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed-MLA attention over selected latent rows (the FlashMLA sparse-prefill contract).

    query: [s, h, d_qk] (d_qk = kv_lora_rank + rope dim; the nope part already absorbed W_UK),
    latents: [t, d_qk] rows `[c_kv; k_pe]`, indices: [s, k] into `latents` (-1 = skip),
    returns (out [s, h, v_dim] = softmax(q.latent * scale) @ c_kv in latents' dtype, lse [s, h] in
    float32 or wider), both differentiable w.r.t. query and latents. A query with no valid index
    gets out = 0 and lse = -inf (it merges as an empty partial).

    Computed `query_block` query rows at a time in float32 or wider (`_SparseMLAAttention`):
    under autograd it saves query, latents, indices, out and lse, never the gathered rows, so a
    replay's saved bytes grow with s x h x d, not with s x k x d_qk.
    """
    recorded = torch.is_grad_enabled() and (query.requires_grad or latents.requires_grad)
    if recorded and latents.shape[0] <= torch.iinfo(torch.int32).max:
        indices = indices.to(torch.int32)          # saved for backward: half the bytes of int64
    return _SparseMLAAttention.apply(query, latents, indices, scale, v_dim, query_block)


def sparse_mla_attention_to_sink(query: torch.Tensor, latents: torch.Tensor,
                                 indices: torch.Tensor, scale: float, v_dim: int, latent_grads,
                                 query_block: int = SPARSE_QUERY_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """`sparse_mla_attention` over latent rows held outside the graph (e.g. a layer's prompt
    pages, constant here), whose cotangents go to `latent_grads(row_idx [n], grad_rows [n, d_qk])`
    one query block at a time (rows may repeat: the sink adds with index_add_), so no gradient
    buffer of latents' shape is formed and no selected rows are kept for backward (the exact
    prompt gradient's page buffers: `models/partials.PageRows`). query [s, h, d_qk] must be the
    differentiable input. -> (out [s, h, v_dim], lse [s, h])"""
    if latents.shape[0] <= torch.iinfo(torch.int32).max:
        indices = indices.to(torch.int32)
    return _SparseMLAAttention.apply(query, latents.detach(), indices, scale, v_dim, query_block,
                                     latent_grads)


def lse_merge_weights(lse: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """The weight of a partial attention result in a log-sum-exp merge: exp(lse - total), where
    `total` is the merged log-sum-exp (or any per-row shift no smaller than it, e.g. the row max
    over partials: the merge divides it out). An empty partial (lse = -inf) weighs 0; a row that no
    partial sees (total = -inf) gets weights 0 (its merged output is 0). The one merge rule:
    `merge_partial_attention` (partials on one process, blockwise attention's key blocks) and
    `collectives.merge_partials_by_lse` (partials on the CP ranks, reduce-scattered) both use it."""
    return torch.exp(lse - total.nan_to_num(neginf=0.0))


def merge_partial_attention(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple:
    """Merge partial softmax-attention results over disjoint key sets by their log-sum-exp.

    outs: each [s, h, d], lses: each [s, h]. Returns (out [s, h, d], lse [s, h]).
    """
    lse_all = torch.stack(lses)                               # [n, s, h]
    lse = torch.logsumexp(lse_all, dim=0)
    weights = lse_merge_weights(lse_all, lse[None])
    out = sum(w[..., None].to(o.dtype) * o for w, o in zip(weights, outs))
    return out, lse


def _causal_scores(q, k, q_pos, k_pos, scale, acc):
    """q [s, g, r, d], k [t, g, d] -> causal scores [s, g, r, t] in `acc` (-inf where masked)."""
    scores = torch.einsum("sgrd,tgd->sgrt", q.to(acc), k.to(acc)) * scale
    if int(k_pos.max()) <= int(q_pos.min()):                            # all visible: no mask
        return scores
    future = k_pos[None, :] > q_pos[:, None]                            # [s, t]
    return scores.masked_fill(future[:, None, None, :], float("-inf"))


def _visible_key_blocks(q_pos, k_pos, key_block):
    """Key blocks [start, end) that at least one query can see (key i visible iff k_pos[i] <= q_pos)."""
    last = int(q_pos.max())
    for start in range(0, k_pos.numel(), key_block):
        end = min(start + key_block, k_pos.numel())
        if int(k_pos[start:end].min()) <= last:
            yield start, end


def _attention_forward(q, windows, q_pos, scale, key_block):
    """Flash-style forward over key windows: q grouped [s, g, r, d]; `windows(start, end)` ->
    (k [t, g, d], v [t, g, d_v], key positions [t]) of the key rows [start, end) that some query
    sees (`windows.blocks(q_pos, key_block)` lists them). -> (out in q's dtype, lse [s, g, r])"""
    acc = torch.promote_types(q.dtype, torch.float32)
    out = lse = None
    for start, end in windows.blocks(q_pos, key_block):
        k, v, k_pos = windows(start, end)
        scores = _causal_scores(q, k, q_pos, k_pos, scale, acc)
        block_lse = torch.logsumexp(scores, dim=-1)                # [s, g, r]
        probs = lse_merge_weights(scores, block_lse[..., None])
        block_out = torch.einsum("sgrt,tgd->sgrd", probs, v.to(acc))
        out, lse = ((block_out, block_lse) if out is None else
                    merge_partial_attention([out, block_out], [lse, block_lse]))
    if out is None:                                                  # no visible key
        out = torch.zeros(q.shape[:3] + (windows.value_dim,), dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    return out.to(q.dtype), lse


def _attention_backward(q, windows, q_pos, scale, key_block, out, lse, grad_out, grad_lse,
                        key_grads):
    """The backward of `_attention_forward`, recomputing each window's scores. `key_grads(start,
    end, grad_k, grad_v)` receives each window's key cotangents (None: not needed). -> grad_q"""
    acc = lse.dtype
    grad_out = grad_out.to(acc)
    q_acc = q.to(acc)
    # d lse / d score = prob, so a log-sum-exp gradient enters like -delta (flash backward).
    delta = (grad_out * out.to(acc)).sum(-1)                        # [s, g, r]
    if grad_lse is not None:
        delta = delta - grad_lse.to(acc).nan_to_num(0.0)
    grad_q = torch.zeros_like(q_acc)
    for start, end in windows.blocks(q_pos, key_block):
        k, v, k_pos = windows(start, end)
        k_blk, v_blk = k.to(acc), v.to(acc)
        probs = lse_merge_weights(_causal_scores(q_acc, k_blk, q_pos, k_pos, scale, acc),
                                  lse[..., None])                  # [s, g, r, t]
        grad_scores = probs * (torch.einsum("sgrd,tgd->sgrt", grad_out, v_blk) - delta[..., None])
        grad_q += torch.einsum("sgrt,tgd->sgrd", grad_scores, k_blk) * scale
        if key_grads is not None:
            key_grads(start, end, torch.einsum("sgrt,sgrd->tgd", grad_scores, q_acc) * scale,
                      torch.einsum("sgrt,sgrd->tgd", probs, grad_out))
    return grad_q.to(q.dtype)


class _HeldKeys:
    """Key windows of tensors held here (`_attention_forward`'s `windows`)."""

    def __init__(self, k, v, k_pos):
        self.k, self.v, self.k_pos, self.value_dim = k, v, k_pos, v.shape[-1]

    def __call__(self, start, end):
        return self.k[start:end], self.v[start:end], self.k_pos[start:end]

    def blocks(self, q_pos, key_block):
        return _visible_key_blocks(q_pos, self.k_pos, key_block)


class _BlockwiseAttention(torch.autograd.Function):
    """Causal GQA softmax attention over keys in blocks, each block's partial result merged into
    the running one by `merge_partial_attention`, with a backward that recomputes each block's
    scores (flash-attention style): saved tensors are the inputs, the output and the log-sum-exp,
    never a [s, heads, t] matrix. Shapes: see `blockwise_attention` (q grouped [s, g, r, d])."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, k_pos, scale: float, key_block: int):
        out, lse = _attention_forward(q, _HeldKeys(k, v, k_pos), q_pos, scale, key_block)
        ctx.save_for_backward(q, k, v, q_pos, k_pos, out, lse)
        ctx.scale, ctx.key_block = scale, key_block
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, q_pos, k_pos, out, lse = ctx.saved_tensors
        need_k, need_v = ctx.needs_input_grad[1:3]
        grad_k = torch.zeros(k.shape, dtype=lse.dtype, device=k.device) if need_k else None
        grad_v = torch.zeros(v.shape, dtype=lse.dtype, device=v.device) if need_v else None

        def key_grads(start, end, gk, gv):
            if grad_k is not None:
                grad_k[start:end] += gk
            if grad_v is not None:
                grad_v[start:end] += gv

        grad_q = _attention_backward(q, _HeldKeys(k, v, k_pos), q_pos, ctx.scale, ctx.key_block,
                                     out, lse, grad_out, grad_lse,
                                     key_grads if need_k or need_v else None)
        return (grad_q, None if grad_k is None else grad_k.to(k.dtype),
                None if grad_v is None else grad_v.to(v.dtype), None, None, None, None)


class _StreamedAttention(torch.autograd.Function):
    """`_BlockwiseAttention` over key rows held outside the graph (`streamed_attention`): each
    window is read again in the backward and its key cotangents go to the source's sink, so
    neither pass holds more than one window of keys or of their gradients."""

    @staticmethod
    def forward(ctx, q, q_pos, source, scale: float, key_block: int):
        out, lse = _attention_forward(q, source, q_pos, scale, key_block)
        ctx.save_for_backward(q, q_pos, out, lse)
        ctx.source, ctx.scale, ctx.key_block = source, scale, key_block
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, q_pos, out, lse = ctx.saved_tensors
        source = ctx.source
        grad_q = _attention_backward(q, source, q_pos, ctx.scale, ctx.key_block, out, lse,
                                     grad_out, grad_lse, source.key_grads)
        return grad_q, None, None, None, None


def streamed_attention(q: torch.Tensor, source, q_pos: torch.Tensor, scale: float,
                       key_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`blockwise_attention` over keys that a `source` reads window by window (e.g. from the
    prompt's pages) instead of tensors in the graph: `source(start, end)` -> (k [t, g, d], v [t, g,
    d_v], key positions [t]); `source.blocks(q_pos, key_block)` -> the windows (start, end) some
    query sees; `source.value_dim`; `source.key_grads(start, end, grad_k, grad_v)` or None: where
    each window's key cotangents go (the exact prompt gradient's page accumulators), so no
    gradient buffer of the keys' size is formed. q [s, heads, d] must be the differentiable input.
    -> (out [s, heads, d_v], lse [s, heads])"""
    groups = source.groups
    grouped = q.reshape(q.shape[0], groups, q.shape[1] // groups, q.shape[2])
    out, lse = _StreamedAttention.apply(grouped, q_pos, source, scale, key_block)
    return (out.reshape(q.shape[0], q.shape[1], source.value_dim),
            lse.reshape(q.shape[0], q.shape[1]))


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                        k_pos: torch.Tensor, scale: float, key_block: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal GQA softmax attention, blockwise over keys (no [s, heads, t] matrix, forward or
    backward).

    q: [s, heads, d_qk], k: [t, groups, d_qk], v: [t, groups, d_v] (heads / groups query heads per
    K/V group; groups = 1 is MQA, e.g. MLA over its latents), q_pos [s], k_pos [t] integer
    positions (key i is visible to query j iff k_pos[i] <= q_pos[j]; any order). Returns (out
    [s, heads, d_v] in q's dtype, lse [s, heads] in float32 or wider), both differentiable, so
    partial results over disjoint key sets merge exactly (`merge_partial_attention`). A query
    with no visible key gets out 0 and lse -inf.
    """
    groups = k.shape[1]
    grouped = q.reshape(q.shape[0], groups, q.shape[1] // groups, q.shape[2])
    out, lse = _BlockwiseAttention.apply(grouped, k, v, q_pos, k_pos, scale, key_block)
    return out.reshape(q.shape[0], q.shape[1], v.shape[-1]), lse.reshape(q.shape[0], q.shape[1])


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                               output_final_state: bool = False,
                               use_qk_l2norm_in_kernel: bool = False):
    """The gated delta rule token by token (transformers' `torch_recurrent_gated_delta_rule`),
    with the arguments and results of Megatron-Core's `torch_chunk_gated_delta_rule`: q, k [B, T,
    H, d_k], v [B, T, H, d_v], g (log decay), beta [B, T, H]; state [B, H, d_k, d_v]. Per token:

        S = exp(g_t) S;  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T (q_t / sqrt(d_k))

    The chunked form pads every call to a chunk of 64 tokens and solves a 64 x 64 triangular
    system token by token; for the few tokens of a decode step or a short branch this is the same
    rule without that work. Computed in float32, or float64 for float64 inputs (as the chunked
    form under `precision.use_dtype(float64)`). -> (out [B, T, H, d_v] in q's dtype, final state
    or None)"""
    if use_qk_l2norm_in_kernel:
        raise ValueError("recurrent_gated_delta_rule expects q and k l2-normalised already.")
    acc = torch.promote_types(q.dtype, torch.float32)
    query, key, value, beta, g = (x.transpose(1, 2).to(acc) for x in (q, k, v, beta, g))
    query = query * query.shape[-1] ** -0.5
    state = (torch.zeros(*key.shape[:2], key.shape[-1], value.shape[-1], dtype=acc,
                         device=q.device) if initial_state is None else initial_state.to(acc))
    outputs = []
    for t in range(key.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        delta = (value[:, :, t] - (state * key[:, :, t, :, None]).sum(-2)) * beta[:, :, t, None]
        state = state + key[:, :, t, :, None] * delta[:, :, None, :]
        outputs.append((state * query[:, :, t, :, None]).sum(-2))
    out = torch.stack(outputs, dim=2).transpose(1, 2).contiguous().to(q.dtype)
    return out, (state if output_final_state else None)
