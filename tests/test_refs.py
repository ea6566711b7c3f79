"""Reference kernels against naive dense computations written out in the test."""

import pytest
import torch

from megatron_longstraw.kernels import refs


def _naive_topk_sets(scores: torch.Tensor, k: int) -> list[set]:
    # A stable descending sort of the whole row: ties go to the lower index.
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    return [set(row.tolist()) for row in order]


@pytest.mark.parametrize("key_block", [1, 7, 16, 1000])
def test_indexer_topk_equals_one_shot_selection_with_ties(key_block):
    gen = torch.Generator().manual_seed(0)
    s, t, h, d, k = 23, 61, 3, 8, 9
    q = torch.randn(s, h, d, generator=gen, dtype=torch.float64)
    # Mostly zero keys: their scores are exactly 0 whatever the summation order, so the k-th
    # boundary falls inside a run of exact ties that spans blocks (ties must go to lower indices).
    keys = torch.zeros(t, d, dtype=torch.float64)
    for j in (3, 17, 33, 50):
        keys[j] = torch.randn(d, generator=gen, dtype=torch.float64)
    w = torch.rand(s, h, generator=gen, dtype=torch.float64) + 0.1
    qpos = torch.arange(t - s, t)  # queries are the last s tokens
    kpos = torch.arange(t)
    scale = d ** -0.5
    idx, vals = refs.indexer_topk(q, w, keys, qpos, kpos, k, scale, relu=True, key_block=key_block)
    # Dense reference, written out: sum_h w * relu(q.k * scale), causal -inf.
    dense = torch.einsum("sh,sht->st", w, torch.relu(torch.einsum("shd,td->sht", q, keys) * scale))
    dense = dense.masked_fill(kpos[None] > qpos[:, None], float("-inf"))
    expected = _naive_topk_sets(dense, k)
    assert [set(r.tolist()) for r in idx] == expected
    assert any((dense[i] == 0).sum() > k for i in range(s))  # the tie case really occurs
    assert torch.allclose(vals, dense.gather(1, idx), rtol=1e-12, atol=1e-12)


def test_indexer_topk_marks_invisible_keys():
    q = torch.randn(3, 2, 4, dtype=torch.float64)
    keys = torch.randn(5, 4, dtype=torch.float64)
    idx, _ = refs.indexer_topk(q, torch.ones(3, 2, dtype=torch.float64), keys,
                               torch.tensor([0, 1, 4]), torch.arange(5), 4, 1.0, relu=False)
    # Query at position 0 sees one key, at 1 two keys, at 4 all five (top 4).
    assert (idx[0] >= 0).sum() == 1 and (idx[1] >= 0).sum() == 2 and (idx[2] >= 0).all()
    assert set(idx[0][idx[0] >= 0].tolist()) == {0}


def test_sparse_mla_attention_equals_dense_masked_softmax():
    gen = torch.Generator().manual_seed(1)
    s, h, t, r, rope, k = 5, 3, 12, 6, 2, 4
    query = torch.randn(s, h, r + rope, generator=gen, dtype=torch.float64)
    latents = torch.randn(t, r + rope, generator=gen, dtype=torch.float64)
    indices = torch.stack([torch.randperm(t, generator=gen)[:k] for _ in range(s)])
    indices[0, 2:] = -1
    out, lse = refs.sparse_mla_attention(query, latents, indices, 0.7, r)
    for i in range(s):
        sel = indices[i][indices[i] >= 0]
        logits = (query[i] @ latents[sel].T) * 0.7              # [h, n]
        expected = torch.softmax(logits, -1) @ latents[sel, :r]
        assert torch.allclose(out[i], expected, atol=1e-13)
        assert torch.allclose(lse[i], torch.logsumexp(logits, -1), atol=1e-13)


def test_merge_partial_attention_equals_attention_over_union():
    gen = torch.Generator().manual_seed(2)
    query = torch.randn(4, 2, 6, generator=gen, dtype=torch.float64)
    latents = torch.randn(10, 6, generator=gen, dtype=torch.float64)
    all_idx = torch.arange(10).expand(4, -1)
    full, full_lse = refs.sparse_mla_attention(query, latents, all_idx, 0.5, 4)
    parts = [refs.sparse_mla_attention(query, latents, all_idx[:, a:b], 0.5, 4)
             for a, b in ((0, 3), (3, 10))]
    empty = refs.sparse_mla_attention(query, latents, torch.full((4, 2), -1), 0.5, 4)
    out, lse = refs.merge_partial_attention([p[0] for p in parts] + [empty[0]],
                                            [p[1] for p in parts] + [empty[1]])
    assert torch.allclose(out, full, atol=1e-13) and torch.allclose(lse, full_lse, atol=1e-13)


def test_apply_rope_matches_transformers_interleaved_and_half_split():
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(3)
    s, h, d, theta = 7, 2, 8, 10000.0
    x = torch.randn(s, h, d, generator=gen, dtype=torch.float64)
    pos = torch.arange(100, 100 + s)
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = pos[:, None].double() * inv
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos()[None], emb.sin()[None]          # [1, s, d] (batch 1)
    xt = x.transpose(0, 1)[None]                          # [1, h, s, d]
    ref_i, _ = apply_rotary_pos_emb_interleave(xt, xt, cos, sin)
    ref_h, _ = apply_rotary_pos_emb(xt, xt, cos, sin)
    got_i = refs.apply_rope(x, pos, theta, interleaved=True)
    got_h = refs.apply_rope(x, pos, theta, interleaved=False)
    assert torch.allclose(got_i, ref_i[0].transpose(0, 1), atol=1e-12)
    assert torch.allclose(got_h, ref_h[0].transpose(0, 1), atol=1e-12)
    # Rotation keeps norms, and relative position is all that matters for q.k.
    assert torch.allclose(got_i.norm(dim=-1), x.norm(dim=-1))


def test_blockwise_attention_equals_dense_softmax_attention():
    """Forward and backward of the blockwise GQA attention (key blocks that do not divide the
    keys, queries after a prefix, one block entirely in the queries' future) against dense
    softmax attention under autograd (fp64, 1e-12)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(7, 6, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(40, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(40, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    q_pos = torch.arange(20, 27)
    k_pos = torch.cat([torch.arange(0, 20), torch.arange(20, 27), torch.arange(100, 113)])
    out, _ = refs.blockwise_attention(q, k, v, q_pos, k_pos, 0.3, key_block=9)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), grad_out)

    k_rep, v_rep = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
    scores = torch.einsum("shd,thd->hst", q, k_rep) * 0.3
    scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    dense = torch.einsum("hst,thd->shd", scores.softmax(-1), v_rep)
    want = torch.autograd.grad(dense, (q, k, v), grad_out)
    assert (out - dense).abs().max() <= 1e-12
    for g, w in zip(got, want):
        assert (g - w).abs().max() <= 1e-12
    assert got[1][27:].abs().max() == 0  # future keys get no gradient
