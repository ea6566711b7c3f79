"""refs.sparse_mla_attention (blocked over query rows, recomputing backward) against the plain
autograd formula it replaced, and the memory it holds under autograd."""

import pytest
import torch

from megatron_longstraw.kernels import refs
from megatron_longstraw.runtime.memory import LiveBytesMeter


def _case(s=11, h=3, d_qk=10, v_dim=6, t=9, k=7, seed=0):
    """fp64 inputs with skipped entries (-1), a row of only -1, and duplicate indices in a row."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(s, h, d_qk, generator=gen, dtype=torch.float64)
    latents = torch.randn(t, d_qk, generator=gen, dtype=torch.float64)
    indices = torch.randint(0, t, (s, k), generator=gen)
    indices[0, ::2] = -1
    indices[1] = -1                                   # no valid index: out 0, lse -inf
    indices[2, :3] = t // 2                           # the same row three times
    indices[3, 3:] = -1
    grad_out = torch.randn(s, h, v_dim, generator=gen, dtype=torch.float64)
    grad_lse = torch.randn(s, h, generator=gen, dtype=torch.float64)
    return query, latents, indices, v_dim, grad_out, grad_lse


def _run(fn, query, latents, indices, v_dim, grad_out, grad_lse, latents_grad=True):
    query = query.clone().requires_grad_()
    latents = latents.clone().requires_grad_(latents_grad)
    out, lse = fn(query, latents, indices, 0.37, v_dim)
    torch.autograd.backward([out, lse], [grad_out, grad_lse])
    return out.detach(), lse.detach(), query.grad, latents.grad


@pytest.mark.parametrize("query_block", [1, 4, 256])     # 4 does not divide s = 11
def test_blocked_equals_plain_autograd_in_values_and_gradients(query_block):
    query, latents, indices, v_dim, grad_out, grad_lse = _case()

    def blocked(*args):
        return refs.sparse_mla_attention(*args, query_block=query_block)

    got = _run(blocked, query, latents, indices, v_dim, grad_out, grad_lse)
    expected = _run(refs._sparse_mla_attention_autograd, query, latents, indices, v_dim,
                    grad_out, grad_lse)
    out, lse, grad_query, grad_latents = got
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(expected[1]))
    finite = torch.isfinite(expected[1])
    assert (lse[finite] - expected[1][finite]).abs().max() <= 1e-12
    for name, a, b in zip(("out", "grad_query", "grad_latents"), (out, grad_query, grad_latents),
                          (expected[0], expected[2], expected[3])):
        assert torch.isfinite(a).all(), name
        assert (a - b).abs().max() <= 1e-12, name
    # Not vacuous: the lse cotangent changes the gradients (it is used).
    no_lse = _run(blocked, query, latents, indices, v_dim, grad_out, torch.zeros_like(grad_lse))
    assert (no_lse[2] - grad_query).abs().max() > 1e-3


def test_constant_latents_get_no_gradient_and_the_same_query_gradient():
    query, latents, indices, v_dim, grad_out, grad_lse = _case(seed=1)
    got = _run(refs.sparse_mla_attention, query, latents, indices, v_dim, grad_out, grad_lse,
               latents_grad=False)
    expected = _run(refs._sparse_mla_attention_autograd, query, latents, indices, v_dim,
                    grad_out, grad_lse, latents_grad=False)
    assert got[3] is None
    assert (got[2] - expected[2]).abs().max() <= 1e-12


def test_gradcheck_tiny():
    query, latents, indices, v_dim, _, _ = _case(s=5, h=2, d_qk=4, v_dim=3, t=4, k=3, seed=2)

    def fn(q, lat):
        out, lse = refs.sparse_mla_attention(q, lat, indices, 0.6, v_dim, query_block=2)
        return out, torch.where(torch.isfinite(lse), lse, 0.0)  # row 1 is empty: lse -inf

    assert torch.autograd.gradcheck(fn, (query.requires_grad_(), latents.requires_grad_()))


H, D_QK, V_DIM, T, K, BLOCK = 4, 48, 32, 128, 64, 32


def _peak_bytes(fn, num_queries):
    """Peak live bytes of forward + backward, inputs and upstream gradients made outside."""
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(num_queries, H, D_QK, generator=gen).requires_grad_()
    latents = torch.randn(T, D_QK, generator=gen).requires_grad_()
    indices = torch.randint(0, T, (num_queries, K), generator=gen)
    indices[:, ::5] = -1
    grad_out = torch.randn(num_queries, H, V_DIM, generator=gen)
    grad_lse = torch.randn(num_queries, H, generator=gen)
    with LiveBytesMeter("cpu") as meter:
        out, lse = fn(query, latents, indices, D_QK ** -0.5, V_DIM)
        torch.autograd.backward([out, lse], [grad_out, grad_lse])
        del out, lse
    return meter.peak_bytes


def test_held_bytes_grow_with_rows_times_heads_not_with_the_gathered_rows():
    """From s to 4s query rows (fixed h, d, t, k), the blocked function's peak grows by at most
    the per-row tensors it makes: out [s, h, v] and lse [s, h] (saved), the query's gradient
    [s, h, d_qk], and the int32 copy of indices [s, k] it saves; its scratch is one query block's.
    The plain formula's peak grows by more than the gathered rows [3s, k, d_qk] it saves.
    fp32, so every figure is 4 bytes per value; the CPU meter is exact."""
    def blocked(*args):
        return refs.sparse_mla_attention(*args, query_block=BLOCK)

    s = 4 * BLOCK
    added_rows = 3 * s
    per_row = 4 * (H * V_DIM + H + H * D_QK + K)
    growth = _peak_bytes(blocked, 4 * s) - _peak_bytes(blocked, s)
    assert growth <= added_rows * per_row + 4096, growth
    gathered = added_rows * K * D_QK * 4
    assert growth < gathered / 3                       # the two bounds are far apart
    plain = (_peak_bytes(refs._sparse_mla_attention_autograd, 4 * s)
             - _peak_bytes(refs._sparse_mla_attention_autograd, s))
    assert plain > gathered, plain


def test_sink_receives_the_latents_gradient():
    """`sparse_mla_attention_to_sink` (the exact prompt gradient's page rows): the row cotangents
    the sink adds up equal the latents' gradient of the plain formula; latents get none."""
    query, latents, indices, v_dim, grad_out, grad_lse = _case(seed=4)
    buffer = torch.zeros_like(latents)

    def to_sink(q, lat, idx, scale, v):
        return refs.sparse_mla_attention_to_sink(
            q, lat, idx, scale, v, lambda rows, grad: buffer.index_add_(0, rows.long(), grad),
            query_block=4)

    got = _run(to_sink, query, latents, indices, v_dim, grad_out, grad_lse)
    expected = _run(refs._sparse_mla_attention_autograd, query, latents, indices, v_dim,
                    grad_out, grad_lse)
    assert got[3] is None
    assert (got[2] - expected[2]).abs().max() <= 1e-12
    assert (buffer - expected[3]).abs().max() <= 1e-12 and buffer.abs().max() > 0
