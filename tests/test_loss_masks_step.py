"""Loss masks through the step (step/schedule.py): the schedule hands each member's mask to
grpo.loss.member_loss as `loss_mask`, the slice of the tokens whose log-probs it gets (per block
of a blockwise branch, bool, logp's shape); engine log-probs may be NaN at untrained tokens, whose
importance weight is then 1 and which the mismatch figures leave out; a mask of all ones is no
mask. The masked loss formula itself is grpo/loss.py's (issue 31, Build 2): until member_loss
takes `loss_mask`, a group that leaves tokens untrained is refused. Tiny fp64 GLM-5.2."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_longstraw.config.settings import LongStrawConfig
from megatron_longstraw.data.group import GRPOGroup
from megatron_longstraw.grpo import loss as grpo_loss
from megatron_longstraw.step import schedule

LENS = (7, 3, 5)
MASKS = [[1, 1, 0, 0, 0, 1, 1], [0, 1, 1], [1, 0, 1, 0, 1]]


@pytest.fixture(scope="module")
def tiny(single_process):
    from helpers import build_tiny_glm

    cfg, model = build_tiny_glm(torch.float64)
    gen = torch.Generator().manual_seed(3)
    group = GRPOGroup(torch.randint(0, cfg.vocab_size, (24,), generator=gen),
                      [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in LENS],
                      torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64))
    return model, group


def _masked(group, masks=MASKS, logps_old=None):
    return GRPOGroup(group.prompt_ids, group.response_ids, group.rewards, logps_old=logps_old,
                     loss_masks=[torch.tensor(m, dtype=torch.bool) for m in masks])


def _grads(model, group, ls):
    model.zero_grad(set_to_none=True)
    result = schedule.forward_backward_longstraw(model, group, ls)
    return result, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def recording_loss(monkeypatch):
    """grpo.loss.member_loss, recording (num_tokens: the member's trained tokens, logp's shape,
    the mask) of each call."""
    calls = []
    real = grpo_loss.member_loss

    def member_loss(logp, logp_old, *args, loss_mask=None, **kwargs):
        calls.append((kwargs["num_tokens"], tuple(logp.shape), loss_mask))
        return real(logp, logp_old, *args, loss_mask=loss_mask, **kwargs)

    monkeypatch.setattr(schedule, "member_loss", member_loss)
    return calls


@pytest.mark.parametrize("block", [8192, 2])
def test_each_block_gets_the_mask_of_its_tokens(tiny, recording_loss, block):
    model, group = tiny
    ls = LongStrawConfig.of(group_size=3, max_response_len=8, response_block=block)
    plain, plain_grads = _grads(model, group, ls)
    assert not any(mask is not None for *_, mask in recording_loss)   # no mask: no loss_mask
    recording_loss.clear()
    result, grads = _grads(model, _masked(group), ls)
    for n, mask in zip(LENS, MASKS):
        # the members have distinct trained-token counts (4, 2, 3): num_tokens is that count
        calls = [c for c in recording_loss if c[0] == sum(mask)]
        assert len(calls) == math.ceil(n / block)
        for _, shape, loss_mask in calls:
            assert loss_mask.dtype == torch.bool and tuple(loss_mask.shape) == shape
        # replay walks the blocks in reverse
        joined = torch.cat([loss_mask for *_, loss_mask in calls[::-1]])
        assert joined.long().tolist() == mask
    # (the masked update itself against full autograd: tests/test_masked_loss.py)
    assert any(not torch.allclose(grads[n], plain_grads[n]) for n in plain_grads)


def test_engine_logprobs_at_untrained_tokens_are_not_read(tiny, recording_loss):
    """Engine log-probs log 3 below the trainer's at the trained tokens, NaN at the others: with
    truncation at C = 2 the trained tokens weigh 2, the untrained 1; the mismatch is log 3 over
    the trained tokens only."""
    model, group = tiny
    ls = LongStrawConfig.of(group_size=3, max_response_len=8)
    olds = schedule.forward_backward_longstraw(model, group, ls, forward_only=True).logps_old
    masks = [torch.tensor(m, dtype=torch.bool) for m in MASKS]
    engine = [torch.where(m, o.detach() - math.log(3), torch.full_like(o, math.nan))
              for o, m in zip(olds, masks)]
    result, _ = _grads(model, _masked(group, logps_old=engine), ls)
    for w, m in zip(result.token_weights, masks):
        assert w.tolist() == [2.0 if t else 1.0 for t in m.tolist()]
    assert result.stats["tis_frac"] == 1.0
    assert result.stats["mismatch_abs_mean"] == pytest.approx(math.log(3), abs=1e-12)
    assert result.stats["mismatch_abs_max"] == pytest.approx(math.log(3), abs=1e-12)
    assert math.isfinite(result.loss)
    bad = [e.clone() for e in engine]
    bad[1][1] = math.nan                                      # a trained token: refused
    with pytest.raises(ValueError, match="response 1: old log-probs must be finite at the trained"):
        schedule.forward_backward_longstraw(model, _masked(group, logps_old=bad), ls)


def test_a_mask_of_all_ones_is_no_mask(tiny):
    """Runs with the real loss: nothing is masked, so nothing needs the masked loss."""
    model, group = tiny
    ls = LongStrawConfig.of(group_size=3, max_response_len=8)
    plain, plain_grads = _grads(model, group, ls)
    result, grads = _grads(model, _masked(group, masks=[[1] * n for n in LENS]), ls)
    assert result.loss == plain.loss
    assert all(torch.equal(grads[n], plain_grads[n]) for n in plain_grads)


def test_a_mask_of_the_wrong_shape_is_refused(tiny):
    model, group = tiny
    ls = LongStrawConfig.of(group_size=3, max_response_len=8)
    with pytest.raises(ValueError, match="response 0: the loss mask must have shape"):
        schedule.forward_backward_longstraw(model, _masked(group, masks=[[1]] * 3), ls)


def test_evaluation_counts_the_trained_tokens(tiny, recording_loss):
    """Held-out figures (step/evaluate.py) over the trained tokens: the untrained ones'
    absent engine log-probs are not read."""
    from megatron_longstraw.step.evaluate import evaluate

    model, group = tiny
    ls = LongStrawConfig.of(group_size=3, max_response_len=8)
    olds = schedule.forward_backward_longstraw(model, group, ls, forward_only=True).logps_old
    masks = [torch.tensor(m, dtype=torch.bool) for m in MASKS]
    engine = [torch.where(m, o.detach() - 0.5, torch.full_like(o, math.nan))
              for o, m in zip(olds, masks)]
    got = evaluate(model, [_masked(group, logps_old=engine)], ls, 1, 0, 1)
    trained = torch.cat([o.detach().double()[m] for o, m in zip(olds, masks)])
    assert got["eval/logprob_token_mean"] == pytest.approx(float(trained.mean()), abs=1e-12)
    assert got["eval/logprob_abs_diff_to_old"] == pytest.approx(0.5, abs=1e-12)
    assert got["eval/kl_to_old"] == pytest.approx(math.exp(-0.5) - 1 + 0.5, abs=1e-12)
