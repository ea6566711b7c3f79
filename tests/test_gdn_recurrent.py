"""The gated delta rule token by token (kernels/refs.recurrent_gated_delta_rule, used on CPU for
calls of a few tokens: decode steps, short branches) against Megatron-Core's chunked PyTorch form
(`torch_chunk_gated_delta_rule`, and its float64 twin `precision.chunk_gated_delta_rule_fp64`):
the same outputs, final state and gradients, from zero and from a carried state."""

import pytest
import torch
from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule

from megatron_longstraw.kernels.refs import recurrent_gated_delta_rule
from megatron_longstraw.runtime.precision import chunk_gated_delta_rule_fp64


def _inputs(dtype, tokens, carried, seed=0):
    gen = torch.Generator().manual_seed(seed)
    B, H, dk, dv = 1, 3, 8, 6

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    q = torch.nn.functional.normalize(rand(B, tokens, H, dk), dim=-1)
    k = torch.nn.functional.normalize(rand(B, tokens, H, dk), dim=-1)
    v = rand(B, tokens, H, dv)
    g = -torch.rand(B, tokens, H, generator=gen, dtype=torch.float64).to(dtype) * 2   # log decay
    beta = torch.rand(B, tokens, H, generator=gen, dtype=torch.float64).to(dtype)
    state = rand(B, H, dk, dv) if carried else None
    return [q, k, v, g, beta, state]


@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("carried", [False, True], ids=["zero", "carried"])
def test_recurrent_equals_chunked_fp64_values_and_gradients(tokens, carried):
    inputs = _inputs(torch.float64, tokens, carried)
    results = []
    for rule in (chunk_gated_delta_rule_fp64, recurrent_gated_delta_rule):
        leaves = [x.clone().requires_grad_(True) if x is not None else None for x in inputs]
        out, state = rule(*leaves[:5], initial_state=leaves[5], output_final_state=True)
        (out.square().sum() + (state * 0.5).sum()).backward()
        results.append((out, state, [x.grad for x in leaves if x is not None]))
    (out_c, state_c, grads_c), (out_r, state_r, grads_r) = results
    assert out_r.dtype == out_c.dtype == torch.float64
    assert torch.allclose(out_r, out_c, rtol=0, atol=1e-12)
    assert torch.allclose(state_r, state_c, rtol=0, atol=1e-12)
    for a, b in zip(grads_r, grads_c, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-11)


def test_recurrent_equals_megatron_chunked_fp32():
    """fp32 and bf16 inputs compute in float32, as Megatron's chunked form does (within its
    float32 rounding)."""
    for dtype, atol in ((torch.float32, 2e-6), (torch.bfloat16, 1e-2)):
        q, k, v, g, beta, state = _inputs(dtype, 5, carried=True)
        out_c, state_c = torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                                      output_final_state=True)
        out_r, state_r = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                                    output_final_state=True)
        assert out_r.dtype == out_c.dtype == dtype and state_r.dtype == torch.float32
        assert torch.allclose(out_r.float(), out_c.float(), rtol=0, atol=atol)
        assert torch.allclose(state_r, state_c.float(), rtol=0, atol=2e-6)
