"""The masked GRPO loss (agent trajectories, grpo/loss.py `loss_mask`): a token with mask 0 is
context only. Its formula against one written out here (fp64 autograd, every aggregation, split
into shares as CP and blocks split a member); LongStraw's update with loss masks against plain
full-sequence autograd of the same masked loss, every parameter (fp64; three families, CP 1 and
CP 2, exact prompt gradient; detached for the MLA families against the detached-prompt
reference); a masked token's log-prob does not move the loss."""

import pytest
import torch

from helpers import full_sequence_logprobs
from test_exact_gradient import _build, _longstraw, _worst
from megatron_longstraw.config.loss import GRPOLossConfig
from megatron_longstraw.data.group import GRPOGroup
from megatron_longstraw.grpo.loss import combine_shares, member_loss

pytestmark = pytest.mark.usefixtures("single_process")

LENS = (6, 17, 9)
# member 1's masked run crosses the block boundary at 8 (blocks of 8 below); member 2 starts masked
MASKS = [torch.tensor([1, 1, 0, 0, 1, 1], dtype=torch.bool),
         torch.tensor([1] * 5 + [0] * 7 + [1] * 5, dtype=torch.bool),
         torch.tensor([0, 0, 0, 1, 1, 0, 1, 1, 1], dtype=torch.bool)]
REWARDS = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)


def _masked_reference_loss(logps, olds, rewards, masks, aggregation="sequence_mean", C=64,
                           eps_lo=0.2, eps_hi=0.28):
    """The masked GRPO loss written out: sums over trained tokens; R_i and T count them."""
    r = rewards.double()
    adv = (r - r.mean()) / (r.std(correction=0) + 1e-6)
    G = len(logps)
    T = sum(int(m.sum()) for m in masks)
    total = 0.0
    for lp, old, a, m in zip(logps, olds, adv, masks):
        ratio = torch.exp(lp - old)
        s = torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps_lo, 1 + eps_hi) * a)
        summed = -(s * m.double()).sum()
        divisor = {"sequence_mean": G * int(m.sum()), "token_mean": T, "constant": G * C}
        total = total + summed / divisor[aggregation]
    return total


@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean", "constant"])
def test_member_loss_with_a_mask_equals_the_written_out_formula_also_in_shares(aggregation):
    gen = torch.Generator().manual_seed(3)
    logps = [(-torch.rand(n, generator=gen, dtype=torch.float64)).requires_grad_() for n in LENS]
    olds = [lp.detach() + 0.3 * torch.randn(lp.shape, generator=gen, dtype=torch.float64)
            for lp in logps]
    ref = _masked_reference_loss(logps, olds, REWARDS, MASKS, aggregation)
    ref_grads = torch.autograd.grad(ref, logps)
    cfg = GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.28, aggregation=aggregation,
                         norm_constant=64)
    r = REWARDS
    adv = (r - r.mean()) / (r.std(correction=0) + 1e-6)
    T = sum(int(m.sum()) for m in MASKS)
    total = 0.0
    for i, (lp, old, m) in enumerate(zip(logps, olds, MASKS)):
        # in shares of 4 rows (as CP ranks or blocks split a member), each with the member's R_i
        shares = []
        for start in range(0, lp.numel(), 4):
            rows = slice(start, start + 4)
            loss, stats = member_loss(lp[rows], old[rows], adv[i], len(LENS), cfg,
                                      num_tokens=int(m.sum()), group_tokens=T,
                                      loss_mask=m[rows])
            shares.append((loss, stats, lp[rows].numel()))
        loss, stats = combine_shares(shares)
        assert int(stats["trained"]) == int(m.sum())
        trained_ratio = torch.exp(lp.detach() - old)[m]
        assert torch.allclose(stats["ratio_mean"], trained_ratio.mean(), rtol=0, atol=1e-12)
        assert torch.allclose(stats["ratio_max"], trained_ratio.max(), rtol=0, atol=0)
        total = total + loss
    grads = torch.autograd.grad(total, logps)
    assert abs(float(total - ref)) <= 1e-12
    for g, rg, m in zip(grads, ref_grads, MASKS):
        assert torch.allclose(g, rg, rtol=0, atol=1e-12)
        assert bool((g[~m] == 0).all())
    assert bool((grads[0][MASKS[0]] != 0).any())   # member 2's advantage is 0 (its reward the mean)
    # a masked token's log-prob does not move the loss (it is context only)
    moved = [lp.detach().clone() for lp in logps]
    moved[0][2] -= 5.0
    again = sum(member_loss(moved[i], olds[i], adv[i], len(LENS), cfg, num_tokens=int(m.sum()),
                            group_tokens=T, loss_mask=m)[0] for i, m in enumerate(MASKS))
    assert abs(float(again - total)) <= 1e-12


def _group(vocab, prompt_len):
    gen = torch.Generator().manual_seed(11)
    return GRPOGroup(prompt_ids=torch.randint(0, vocab, (prompt_len,), generator=gen),
                     response_ids=[torch.randint(0, vocab, (n,), generator=gen) for n in LENS],
                     rewards=REWARDS.clone(), loss_masks=[m.clone() for m in MASKS])


def _reference(model, group, detach_prompt_state=False):
    model.zero_grad(set_to_none=True)
    logps = [full_sequence_logprobs(model, group.prompt_ids, r, detach_prompt_state)
             for r in group.response_ids]
    _masked_reference_loss(logps, [lp.detach() for lp in logps], group.rewards,
                           MASKS).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family,prompt_len,response_block", [
    ("glm52", 160, 8), ("qwen36", 64, 8192), ("deepseekv3", 64, 8192)])
def test_masked_update_equals_full_autograd_of_the_masked_loss(family, prompt_len,
                                                               response_block):
    cfg, model = _build(family)
    group = _group(cfg.vocab_size, prompt_len)
    worst = _worst(_longstraw(model, group, "exact", response_block=response_block),
                   _reference(model, group))
    line = f"{family} masked, exact: vs full autograd {worst:.2e}"
    assert worst <= 1e-9
    if family != "qwen36":     # the detached-prompt reference detaches MLA's latent rows
        detached = _worst(_longstraw(model, group, "detached", response_block=response_block),
                          _reference(model, group, detach_prompt_state=True))
        line += f"; detached vs detached-prompt autograd {detached:.2e}"
        assert detached <= 1e-9
    # the masks matter: the unmasked loss's update is measurably different
    group.loss_masks = None
    unmasked = _worst(_longstraw(model, group, "exact", response_block=response_block),
                      _reference(model, _group(cfg.vocab_size, prompt_len)))
    print(line + f"; unmasked vs the masked reference {unmasked:.2e}")
    assert unmasked > 1e-3


def test_masked_qwen36_detached_update_equals_full_autograd_after_the_mixers():
    """Qwen3.6 detached: the parameters after the last mixer (final norm, output layer) do not
    shape the prompt state, so their masked update equals full autograd's exactly."""
    cfg, model = _build("qwen36")
    trainable = {"decoder.final_norm.weight", "output_layer.weight"}
    for name, p in model.named_parameters():
        p.requires_grad_(name in trainable)
    group = _group(cfg.vocab_size, 64)
    worst = _worst(_longstraw(model, group, "detached", response_block=8),
                   _reference(model, group))
    print(f"qwen36 masked, detached (post-mixer parameters) vs full autograd {worst:.2e}")
    assert worst <= 1e-9


POST_MIXER = {"decoder.final_norm.weight", "output_layer.weight"}


def test_masked_update_under_cp_equals_full_autograd_of_the_masked_loss(tmp_path):
    """Real gloo ranks, CP 2 (x EP 2 for the MoE families; blocks of 8, so the 17-token member
    runs in 3 blocks): each rank's share of the masked loss, finalized, equals full autograd on
    one process: exact for the three families; detached for GLM-5.2 and DeepSeek-V3 against the
    detached-prompt reference, for Qwen3.6 on the post-mixer parameters (as above)."""
    import dist_workers
    from distributed import run_ranks

    cases = [("glm52", 2, 2, 160, "exact"), ("qwen36", 2, 1, 64, "exact"),
             ("deepseekv3", 2, 2, 64, "exact"), ("glm52", 2, 2, 160, "detached"),
             ("deepseekv3", 2, 2, 64, "detached"), ("qwen36", 2, 1, 64, "detached")]
    references, jobs = [], []
    for family, cp, ep, prompt_len, mode in cases:
        cfg, model = _build(family)
        path = tmp_path / f"{family}.pt"
        torch.save({k: v.clone() for k, v in model.state_dict().items()
                    if not k.endswith("_extra_state")}, path)
        reference = _reference(model, _group(cfg.vocab_size, prompt_len),
                               detach_prompt_state=mode == "detached" and family != "qwen36")
        if mode == "detached" and family == "qwen36":
            reference = {n: g for n, g in reference.items() if n in POST_MIXER}
        references.append(reference)
        jobs.append((family, cp, ep, str(path), prompt_len))
    outs = run_ranks(dist_workers.exact_gradient_worker, 2, cases=jobs, lens=LENS,
                     loss_masks=MASKS, settings=[{"response_block": 8, "prompt_grad": mode}
                                                 for *_, mode in cases])
    for case, (family, cp, ep, _, mode), reference in zip(range(len(cases)), cases, references):
        grads = [{n: g for n, g in out[case].items() if n in reference} for out in outs]
        assert set().union(*grads) == set(reference)
        worst = max(float((g[n] - reference[n]).norm() / reference[n].norm().clamp_min(1e-300))
                    for g in grads for n in g)
        print(f"{family} CP{cp}/EP{ep} masked, {mode}: vs full autograd {worst:.2e}")
        assert worst <= 1e-9, (family, mode, worst)
