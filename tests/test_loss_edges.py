"""The GRPO member loss at extreme values (grpo/loss.py `member_loss`): where the loss is flat in a
token (masked, clipped, dual-clipped, zero advantage, clamped KL) its gradient there is exactly
zero and finite whatever the log-ratio or reference gap, also past exp's overflow (about 88 in
float32, 709 in float64). Reusing a capture for several updates moves ratios far from 1, so these
values happen.

The expected loss is the same member's loss without the flat tokens' extreme values: each flat
token's term is a constant (0, or the clip bound times A), so replacing its log-ratio by a modest
one on the same side of the bound gives the same loss and gradient."""

from __future__ import annotations

import pytest
import torch

from megatron_longstraw.config.loss import GRPOLossConfig
from megatron_longstraw.grpo.loss import member_loss

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float64, id="fp64")]


def huge(dtype) -> float:
    """A log-ratio whose exp overflows in `dtype`."""
    return 100.0 if dtype is torch.float32 else 800.0


def _loss_and_grad(logp, logp_old, advantage, cfg, **kw):
    logp = logp.clone().requires_grad_(True)
    loss, stats = member_loss(logp, logp_old, advantage, num_members=2, cfg=cfg, **kw)
    loss.backward()
    return loss.detach(), logp.grad, stats


def _check(extreme, modest, flat_tokens, advantage, cfg, **kw):
    """`extreme` and `modest` (logp, logp_old) differ only at `flat_tokens`: the same loss, the same
    gradient, zero and finite at the flat tokens."""
    loss, grad, stats = _loss_and_grad(*extreme, advantage, cfg, **kw)
    ref_loss, ref_grad, _ = _loss_and_grad(*modest, advantage, cfg, **kw)
    assert torch.isfinite(loss) and torch.isfinite(grad).all(), (loss, grad)
    assert torch.equal(grad[flat_tokens], torch.zeros_like(grad[flat_tokens]))
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0) and torch.allclose(grad, ref_grad)
    return stats


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_tokens_take_no_gradient_at_any_log_ratio(dtype):
    logp = torch.tensor([-1.0, -2.0, -0.5, -1.5], dtype=dtype)
    old = logp - 0.1
    far = old.clone()
    far[1] = logp[1] - huge(dtype)       # ratio e^100 / e^800: overflows
    far[2] = logp[2] + huge(dtype)       # ratio e^-100: underflows
    mask = torch.tensor([True, False, False, True])
    for advantage in (0.7, -0.7):
        _check((logp, far), (logp, old), ~mask, advantage, GRPOLossConfig(), loss_mask=mask)


@pytest.mark.parametrize("dtype", DTYPES)
def test_clipped_tokens_take_no_gradient_at_any_log_ratio(dtype):
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=dtype)
    old = logp.clone()
    far, modest = old.clone(), old.clone()
    # A > 0: ratio above 1 + eps_high is clipped (flat)
    far[1], modest[1] = logp[1] - huge(dtype), logp[1] - 1.0
    stats = _check((logp, far), (logp, modest), torch.tensor([False, True, False]), 0.5,
                   GRPOLossConfig())
    assert stats["ratio_max"] == float("inf")      # the statistics keep the true ratio
    # A < 0: ratio below 1 - eps_low is clipped (flat)
    far, modest = old.clone(), old.clone()
    far[0], modest[0] = logp[0] + huge(dtype), logp[0] + 1.0
    _check((logp, far), (logp, modest), torch.tensor([True, False, False]), -0.5,
           GRPOLossConfig())


@pytest.mark.parametrize("dtype", DTYPES)
def test_dual_clipped_and_zero_advantage_tokens_take_no_gradient(dtype):
    logp = torch.tensor([-1.0, -2.0], dtype=dtype)
    old, far, modest = logp.clone(), logp.clone(), logp.clone()
    # A < 0, ratio above c = 3: the dual clip holds the term at c A (flat)
    far[1], modest[1] = logp[1] - huge(dtype), logp[1] - 2.0
    _check((logp, far), (logp, modest), torch.tensor([False, True]), -0.5,
           GRPOLossConfig(dual_clip=3.0))
    # A = 0: every term is 0 whatever the ratio
    _check((logp, far), (logp, old), torch.tensor([True, True]), 0.0, GRPOLossConfig())


@pytest.mark.parametrize("dtype", DTYPES)
def test_clamped_and_masked_kl_takes_no_gradient_at_any_reference_gap(dtype):
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=dtype)
    old = logp.clone()
    ref, modest = logp.clone(), logp.clone()
    ref[1], modest[1] = logp[1] + huge(dtype), logp[1] + 5.0    # k3 = e^d - d - 1: above K = 2
    cfg = GRPOLossConfig(kl_coef=0.1, kl_clamp=2.0)
    loss, grad, _ = _loss_and_grad(logp, old, 0.5, cfg, logp_ref=ref)
    ref_loss, ref_grad, _ = _loss_and_grad(logp, old, 0.5, cfg, logp_ref=modest)
    # token 1's gradient is its policy term's alone (-A / (G R)): the clamped KL adds nothing
    assert torch.isfinite(grad).all() and grad[1] == ref_grad[1] == -0.5 / (2 * 3)
    assert torch.allclose(loss, ref_loss) and torch.allclose(grad, ref_grad)
    # a masked token's reference gap does not matter either (no clamp)
    mask = torch.tensor([True, False, True])
    cfg = GRPOLossConfig(kl_coef=0.1)
    loss, grad, _ = _loss_and_grad(logp, old, 0.5, cfg, logp_ref=ref, loss_mask=mask)
    ref_loss, ref_grad, _ = _loss_and_grad(logp, old, 0.5, cfg, logp_ref=logp, loss_mask=mask)
    assert torch.isfinite(grad).all() and grad[1] == 0
    assert torch.allclose(loss, ref_loss) and torch.allclose(grad, ref_grad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_active_token_past_overflow_still_makes_the_loss_infinite(dtype):
    """Where the loss is not flat (A < 0, no dual clip, ratio past overflow) it is not finite,
    and train_step skips the update: the fix hides nothing."""
    logp = torch.tensor([-1.0, -2.0], dtype=dtype)
    far = logp.clone()
    far[1] = logp[1] - huge(dtype)
    loss, _, _ = _loss_and_grad(logp, far, -0.5, GRPOLossConfig())
    assert not torch.isfinite(loss)
