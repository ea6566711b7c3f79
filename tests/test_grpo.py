"""Tests for megatron_longstraw.grpo.loss. Expected values are worked by hand in comments.

Float64 throughout; tolerance 1e-12 (hand values involve exp(log(x)) round trips,
which are exact to ~1e-16, so 1e-12 is generous yet far below any real error).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_longstraw.grpo.loss import (combine_shares, group_advantages, grpo_loss, member_loss,
                                          validate_group)
from megatron_longstraw.config.loss import GRPOLossConfig

TOL = 1e-12
F64 = torch.float64


def _t(xs: list[float]) -> torch.Tensor:
    return torch.tensor(xs, dtype=F64)


def _close(actual: torch.Tensor | float, expected: float | list[float]) -> None:
    a = torch.as_tensor(actual, dtype=F64)
    e = torch.as_tensor(expected, dtype=F64)
    assert a.shape == e.shape, (a.shape, e.shape)
    assert torch.allclose(a, e, rtol=0.0, atol=TOL), (a, e)


# ----------------------------------------------------------------------------- advantages


def test_advantages_1001() -> None:
    # r = [1,0,0,1]: mean 0.5, deviations [+.5,-.5,-.5,+.5],
    # population var = (4 * 0.25)/4 = 0.25 -> std 0.5; A = +-0.5 / (0.5 + 1e-6)
    a = 0.5 / (0.5 + 1e-6)
    _close(group_advantages(_t([1, 0, 0, 1])), [a, -a, -a, a])


def test_advantages_312_population_and_unbiased() -> None:
    # r = [3,1,2]: mean 2, deviations [1,-1,0]; sum sq = 2.
    # population: var = 2/3, std = sqrt(2/3); A = [1,-1,0] / (sqrt(2/3) + 1e-6)
    a = 1.0 / (math.sqrt(2.0 / 3.0) + 1e-6)
    _close(group_advantages(_t([3, 1, 2])), [a, -a, 0.0])
    # unbiased: var = 2/(3-1) = 1, std = 1; A = [1,-1,0] / (1 + 1e-6)
    b = 1.0 / (1.0 + 1e-6)
    _close(group_advantages(_t([3, 1, 2]), std_unbiased=True), [b, -b, 0.0])
    # custom eps: population std + 0.5
    c = 1.0 / (math.sqrt(2.0 / 3.0) + 0.5)
    _close(group_advantages(_t([3, 1, 2]), eps=0.5), [c, -c, 0.0])


def test_advantages_equal_rewards_exact_zero_and_dtype() -> None:
    for r in ([0.1, 0.1, 0.1], [7.0, 7.0]):
        adv = group_advantages(_t(r))
        assert torch.isfinite(adv).all()
        assert torch.equal(adv, torch.zeros(len(r), dtype=F64))
    adv32 = group_advantages(torch.tensor([1.0, 0.0], dtype=torch.float32))
    assert adv32.dtype == torch.float32
    # [1,0]: mean .5, pop std .5 -> +-0.5/(0.5+1e-6), float32-rounded
    assert torch.allclose(adv32, torch.tensor([1.0, -1.0]), atol=1e-5)


def test_advantages_errors() -> None:
    with pytest.raises(ValueError, match="group of one"):
        group_advantages(_t([1.0]))
    with pytest.raises(ValueError, match=r"\[1, 3\]"):
        group_advantages(_t([0.0, float("nan"), 1.0, float("inf")]))


# ----------------------------------------------------------------------------- member_loss

# Clip range [1-0.2, 1+0.3] = [0.8, 1.3] (asymmetric on purpose).
CFG = GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.3)


def _logp_for_ratios(ratios: list[float], old: list[float]) -> torch.Tensor:
    """logp such that exp(logp - old) == ratio."""
    return torch.tensor([o + math.log(r) for r, o in zip(ratios, old)], dtype=F64, requires_grad=True)


def test_member_loss_positive_advantage() -> None:
    # A = +1, G = 2, R = 4, rho = [1.0, 1.5, 0.5, 1.1]
    #   t0: min(1.0, 1.0)            = 1.0
    #   t1: min(1.5, clip->1.3)      = 1.3  <- clipped branch active (1.3 < 1.5)
    #   t2: min(0.5, clip->0.8)      = 0.5  (unclipped active)
    #   t3: min(1.1, 1.1)            = 1.1
    # sum = 3.9; loss = -3.9 / (G*R = 8) = -0.4875; policy_loss = -3.9/4 = -0.975
    old = [-1.0, -2.0, -0.5, -3.0]
    logp = _logp_for_ratios([1.0, 1.5, 0.5, 1.1], old)
    loss, st = member_loss(logp, _t(old), 1.0, 2, CFG)
    _close(loss, -0.4875)
    _close(st["policy_loss"], -0.975)
    _close(st["clip_frac"], 0.25)
    _close(st["ratio_mean"], (1.0 + 1.5 + 0.5 + 1.1) / 4)
    _close(st["ratio_max"], 1.5)
    _close(st["ratio_min"], 0.5)
    _close(st["kl"], 0.0)
    assert all(not v.requires_grad for v in st.values())
    # d loss / d logp_t = -rho_t*A/(G R) where unclipped active, 0 where clipped:
    #   [-1/8, 0, -0.5/8, -1.1/8]
    loss.backward()
    _close(logp.grad, [-0.125, 0.0, -0.0625, -0.1375])


def test_member_loss_negative_advantage() -> None:
    # A = -2, G = 3, R = 4, rho = [0.5, 1.5, 0.9, 1.0]
    #   t0: min(-1.0, 0.8*-2 = -1.6) = -1.6  <- clipped branch active
    #   t1: min(-3.0, 1.3*-2 = -2.6) = -3.0  (unclipped; no clip on this side)
    #   t2: -1.8 ; t3: -2.0
    # sum = -8.4; loss = 8.4 / (G*R = 12) = 0.7; policy_loss = 8.4/4 = 2.1
    old = [0.0, -1.0, -4.0, -0.25]
    logp = _logp_for_ratios([0.5, 1.5, 0.9, 1.0], old)
    loss, st = member_loss(logp, _t(old), torch.tensor(-2.0, dtype=F64), 3, CFG)
    _close(loss, 0.7)
    _close(st["policy_loss"], 2.1)
    _close(st["clip_frac"], 0.25)
    _close(st["ratio_mean"], 0.975)
    # grad = -rho*A/(G R) on unclipped tokens = [0, 3/12, 1.8/12, 2/12]
    loss.backward()
    _close(logp.grad, [0.0, 0.25, 0.15, 2.0 / 12.0])


def test_member_loss_k3_kl() -> None:
    # kl_coef 0.1, G = 2, R = 3, rho = 1 everywhere, A = 0.5.
    # d = ref - logp = [0, ln2, -ln2]; k3 = e^d - d - 1 = [0, 1 - ln2, ln2 - 0.5]; sum = 0.5; mean = 1/6
    # policy: -(0.5*3)/3 = -0.5 ; loss = (-0.5 + 0.1 * 1/6) / 2
    cfg = GRPOLossConfig(kl_coef=0.1)
    base = [-1.0, -2.0, -0.5]
    logp = torch.tensor(base, dtype=F64, requires_grad=True)
    ref = _t([base[0], base[1] + math.log(2.0), base[2] - math.log(2.0)])
    loss, st = member_loss(logp, _t(base), 0.5, 2, cfg, logp_ref=ref)
    _close(st["kl"], 1.0 / 6.0)
    _close(st["policy_loss"], -0.5)
    _close(loss, (-0.5 + 0.1 / 6.0) / 2.0)
    # d/dlogp: (1/(G R)) * (-A*rho + beta*(1 - e^d)) with e^d = [1, 2, 0.5]
    #   = [-0.5, -0.6, -0.45] / 6
    loss.backward()
    _close(logp.grad, [-0.5 / 6, -0.6 / 6, -0.45 / 6])


def test_member_loss_kl_disabled_reports_zero_even_with_ref() -> None:
    logp = _t([-1.0, -2.0])
    _, st = member_loss(logp, logp, 1.0, 2, GRPOLossConfig(), logp_ref=logp - 1.0)
    _close(st["kl"], 0.0)


def test_member_loss_errors() -> None:
    x = _t([-1.0, -2.0])
    with pytest.raises(ValueError, match="logp_ref"):
        member_loss(x, x, 1.0, 2, GRPOLossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="shape"):
        member_loss(x, _t([-1.0]), 1.0, 2, CFG)
    with pytest.raises(ValueError, match="shape"):
        member_loss(x, x, 1.0, 2, GRPOLossConfig(kl_coef=0.1), logp_ref=_t([0.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="non-empty"):
        member_loss(_t([]), _t([]), 1.0, 2, CFG)


# ----------------------------------------------------------------------------- grpo_loss


def test_grpo_loss_is_sum_of_member_losses_and_matches_formula() -> None:
    gen = torch.Generator().manual_seed(0)
    lens = [3, 5, 7]
    rewards = _t([1.0, 0.0, 2.0])
    # mean 1, deviations [0,-1,1], population std sqrt(2/3)
    a = 1.0 / (math.sqrt(2.0 / 3.0) + 1e-6)
    adv = [0.0, -a, a]
    cfg = GRPOLossConfig(clip_eps_low=0.1, clip_eps_high=0.25, kl_coef=0.05)
    old = [-torch.rand(n, generator=gen, dtype=F64) * 3 for n in lens]
    ref = [o + 0.3 * torch.randn(n, generator=gen, dtype=F64) for o, n in zip(old, lens)]
    new = [(o + 0.4 * torch.randn(n, generator=gen, dtype=F64)).requires_grad_() for o, n in zip(old, lens)]

    total = grpo_loss(new, old, rewards, cfg, logps_ref=ref)
    g_total = torch.autograd.grad(total, new)

    parts = [member_loss(new[i], old[i], adv[i], 3, cfg, ref[i])[0] for i in range(3)]
    summed = sum(parts)
    g_sum = torch.autograd.grad(summed, new)
    _close(total.detach(), summed.detach())
    for x, y in zip(g_total, g_sum):
        assert torch.allclose(x, y, rtol=0, atol=TOL)

    # independent formula from the design doc
    expect = 0.0
    for i in range(3):
        rho = torch.exp(new[i].detach() - old[i])
        surr = torch.minimum(rho * adv[i], torch.clamp(rho, 0.9, 1.25) * adv[i])
        d = ref[i] - new[i].detach()
        k3 = torch.exp(d) - d - 1
        expect += float((-surr.sum() + 0.05 * k3.sum()) / (3 * lens[i]))
    _close(total, expect)


def test_combined_shares_are_the_whole_members_loss_and_stats() -> None:
    """Context parallelism: member_loss over each rank's rows (num_tokens = R), combined, is
    member_loss over the whole member up to summation order (fp64: TOL); a share holding only
    padding (no rows) changes nothing."""
    gen = torch.Generator().manual_seed(2)
    num_tokens = 11
    new = -torch.rand(num_tokens, generator=gen, dtype=F64) * 3
    old = new + 0.6 * (torch.rand(num_tokens, generator=gen, dtype=F64) - 0.5)  # both clip sides
    ref = new - 0.2 * torch.rand(num_tokens, generator=gen, dtype=F64)
    weight = 2 * torch.rand(num_tokens, generator=gen, dtype=F64)
    kw = dict(advantage=0.7, num_members=4, num_tokens=num_tokens, loss_scale=0.5,
              cfg=GRPOLossConfig(clip_eps_low=0.1, clip_eps_high=0.15, kl_coef=0.05))
    whole_loss, whole = member_loss(new, old, logp_ref=ref, token_weight=weight, **kw)
    shares = [(*member_loss(new[a:b], old[a:b], logp_ref=ref[a:b], token_weight=weight[a:b], **kw),
               b - a) for a, b in ((0, 6), (6, 11), (11, 11))]
    loss, stats = combine_shares(shares)
    _close(loss, float(whole_loss))
    assert stats.keys() == whole.keys()
    for key in whole:
        _close(stats[key], float(whole[key]))
    assert 0 < float(whole["clip_frac"]) < 1 and float(whole["kl"]) > 0


def test_grpo_loss_size_mismatch() -> None:
    x = _t([-1.0])
    with pytest.raises(ValueError, match="mismatch"):
        grpo_loss([x, x], [x, x], _t([1.0, 0.0, 2.0]), CFG)


# ----------------------------------------------------------------------------- loss options

OPTIONS = {"plain": {}, "dual_clip": {"dual_clip": 3.0}, "log_ratio_clamp": {"log_ratio_clamp": 1.5},
           "kl_clamp": {"kl_clamp": 1.0},
           "all": {"dual_clip": 3.0, "log_ratio_clamp": 1.5, "kl_clamp": 1.0}}


def _formula(new, old, ref, weight, rewards, aggregation, C, beta, lo, hi, dual_clip=None,
             log_ratio_clamp=None, kl_clamp=None):
    """The GRPO loss of grpo/loss.py's module docstring, written here from the formulas (not from
    the code under test): advantages with the population std + 1e-6, PPO clip, dual clip for
    A < 0, the log-ratio clamp, k3 capped at kl_clamp, and the three aggregations."""
    g = len(new)
    r = rewards
    adv = (r - r.mean()) / (((r - r.mean()) ** 2).mean().sqrt() + 1e-6)
    sums = []
    for i in range(g):
        log_ratio = new[i] - old[i]
        if log_ratio_clamp is not None:
            log_ratio = torch.clamp(log_ratio, -log_ratio_clamp, log_ratio_clamp)
        rho = torch.exp(log_ratio)
        s = torch.minimum(rho * adv[i], torch.clamp(rho, 1 - lo, 1 + hi) * adv[i])
        if dual_clip is not None and adv[i] < 0:
            s = torch.maximum(s, dual_clip * adv[i] * torch.ones_like(s))
        d = ref[i] - new[i]
        k3 = torch.exp(d) - d - 1
        if kl_clamp is not None:
            k3 = torch.minimum(k3, torch.full_like(k3, kl_clamp))
        sums.append((-weight[i] * s + beta * k3).sum())
    lens = [x.numel() for x in new]
    if aggregation == "sequence_mean":
        return sum(t / (g * n) for t, n in zip(sums, lens))
    if aggregation == "token_mean":
        return sum(sums) / sum(lens)
    return sum(sums) / (g * C)


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean", "constant"])
def test_each_aggregation_and_option_equals_its_formula_by_autograd(aggregation, options) -> None:
    """fp64: grpo_loss, and member_loss member by member over two shares per member (CP ranks or
    response blocks: num_tokens = R_i, group_tokens = T), equal `_formula`, the loss and its
    gradient by plain autograd (TOL). The data reach every branch: both clip sides, ratios past
    the dual clip's c = 3 with A < 0, log-ratios past the clamp, k3 past its cap."""
    gen = torch.Generator().manual_seed(7)
    lens, C, beta, lo, hi = [3, 5, 7, 2], 9, 0.05, 0.2, 0.28
    rewards = _t([1.0, 0.0, 2.0, 0.5])
    old = [-torch.rand(n, generator=gen, dtype=F64) * 3 for n in lens]
    new = [(o + 4 * (torch.rand(n, generator=gen, dtype=F64) - 0.5)).requires_grad_()
           for o, n in zip(old, lens)]
    ref = [nw.detach() + 4 * (torch.rand(n, generator=gen, dtype=F64) - 0.5)
           for nw, n in zip(new, lens)]
    weight = [0.5 + torch.rand(n, generator=gen, dtype=F64) for n in lens]
    opts = OPTIONS[options]
    cfg = GRPOLossConfig(clip_eps_low=lo, clip_eps_high=hi, kl_coef=beta, aggregation=aggregation,
                         norm_constant=C, **opts)

    expect = _formula(new, old, ref, weight, rewards, aggregation, C, beta, lo, hi, **opts)
    g_expect = torch.autograd.grad(expect, new)
    total = grpo_loss(new, old, rewards, cfg, logps_ref=ref, token_weights=weight)
    g_total = torch.autograd.grad(total, new)
    _close(total.detach(), float(expect))
    for x, y in zip(g_total, g_expect):
        assert torch.allclose(x, y, rtol=0, atol=TOL)

    adv = group_advantages(rewards)
    shares = []
    for i, n in enumerate(lens):
        for a, b in ((0, n // 2), (n // 2, n)):
            shares.append(member_loss(new[i][a:b], old[i][a:b], adv[i], len(lens), cfg,
                                      logp_ref=ref[i][a:b], num_tokens=n, token_weight=weight[i][a:b],
                                      group_tokens=sum(lens))[0])
    by_member = torch.stack(shares).sum()
    _close(by_member.detach(), float(expect))
    for x, y in zip(torch.autograd.grad(by_member, new), g_expect):
        assert torch.allclose(x, y, rtol=0, atol=TOL)

    # every option is active somewhere on these data (so each changes the loss)
    if opts:
        plain = _formula(new, old, ref, weight, rewards, aggregation, C, beta, lo, hi)
        assert abs(float(plain) - float(expect)) > 1e-3
    log_ratios = torch.cat([(nw - o).detach() for nw, o in zip(new, old)])
    assert log_ratios.max() > 1.5 and log_ratios.min() < -1.5
    assert any(adv[i] < 0 and (new[i] - old[i]).max() > math.log(3.0) for i in range(len(lens)))


def test_the_aggregations_divisors_by_hand() -> None:
    """One member of R = 2 tokens in a group of G = 2 whose other member has 6 tokens (T = 8),
    A = 1, ratio 1: the member's token sum is -2; sequence_mean divides by G R = 4, token_mean
    by T = 8, constant by G C = 2 * 10."""
    logp = _t([-1.0, -2.0])
    for aggregation, expected in (("sequence_mean", -0.5), ("token_mean", -0.25),
                                  ("constant", -0.1)):
        cfg = GRPOLossConfig(aggregation=aggregation, norm_constant=10)
        loss, stats = member_loss(logp, logp, 1.0, 2, cfg, group_tokens=8)
        _close(loss, expected)
        _close(stats["policy_loss"], -1.0)   # statistics: token means whatever the aggregation
    with pytest.raises(ValueError, match="group_tokens"):
        member_loss(logp, logp, 1.0, 2, GRPOLossConfig(aggregation="token_mean"))


def test_dual_clip_caps_a_negative_advantage_tokens_loss_by_hand() -> None:
    # A = -1, G = 1 share of 2 (num_members 2), R = 1, rho = 5 (above 1 + eps_hi and above c = 3):
    # PPO: min(-5, 1.2 * -1) = -5 -> loss 5 / 2; dual clip c = 3: max(-5, -3) = -3 -> loss 3 / 2,
    # and no gradient (the cap is a constant). A = +1 is untouched by the dual clip.
    old = [-2.0]
    for dual, a, loss_expected, grad_expected in ((None, -1.0, 2.5, 2.5), (3.0, -1.0, 1.5, 0.0),
                                                  (3.0, 1.0, -0.6, 0.0)):
        logp = _logp_for_ratios([5.0], old)
        loss, _ = member_loss(logp, _t(old), a, 2, GRPOLossConfig(dual_clip=dual))
        loss.backward()
        _close(loss, loss_expected)
        _close(logp.grad, [grad_expected])


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"aggregation": "mean"}, "loss_aggregation"),
    ({"aggregation": "constant"}, "norm_constant"),
    ({"norm_constant": 0}, "loss_constant"),
    ({"dual_clip": 1.0}, "dual_clip"),
    ({"dual_clip": "3"}, "dual_clip"),
    ({"log_ratio_clamp": 0.0}, "log_ratio_clamp"),
    ({"kl_clamp": -1.0}, "kl_clamp"),
    ({"kl_clamp": float("inf")}, "kl_clamp"),
])
def test_loss_options_reject_bad_values(kwargs, words) -> None:
    with pytest.raises(ValueError, match=words):
        GRPOLossConfig(**kwargs)


def test_loss_options_from_flags_and_yaml(tmp_path) -> None:
    """The launcher flags and the YAML `longstraw:` keys reach the step's GRPOLossConfig; the
    constant normaliser defaults to the longest response the run can have."""
    import yaml

    from helpers import TINY_GLM
    from megatron_longstraw.config.settings import LongStrawConfig
    from megatron_longstraw.training import train

    base = ["--longstraw", "--longstraw-config", str(TINY_GLM)]
    args, given = train.parse(base + ["--longstraw-loss-aggregation", "token_mean",
                                      "--longstraw-dual-clip", "--longstraw-log-ratio-clamp",
                                      "20", "--longstraw-kl-clamp", "10"])
    loss = train.resolve(args, given)[2].loss_config()
    assert (loss.aggregation, loss.dual_clip, loss.log_ratio_clamp, loss.kl_clamp) == \
        ("token_mean", 3.0, 20.0, 10.0)
    args, given = train.parse(base + ["--longstraw-loss-aggregation", "constant",
                                      "--longstraw-dual-clip", "5", "--longstraw-loss-constant",
                                      "100"])
    loss = train.resolve(args, given)[2].loss_config()
    assert (loss.aggregation, loss.norm_constant, loss.dual_clip) == ("constant", 100, 5.0)
    config = yaml.safe_load(TINY_GLM.read_text())
    config["longstraw"].update(loss_aggregation="constant", kl_clamp=2.0, max_new_tokens=16)
    (tmp_path / "loss.yaml").write_text(yaml.safe_dump(config))
    args, given = train.parse(["--longstraw", "--longstraw-config", str(tmp_path / "loss.yaml")])
    loss = train.resolve(args, given)[2].loss_config()
    assert (loss.aggregation, loss.norm_constant, loss.kl_clamp, loss.dual_clip) == \
        ("constant", 16, 2.0, None)
    assert LongStrawConfig.of(max_response_len=64).loss_config().norm_constant == 64
    assert LongStrawConfig().loss_config().aggregation == "sequence_mean"   # today's loss
    with pytest.raises(ValueError, match=r"--longstraw-dual-clip"):
        LongStrawConfig.of(dual_clip=0.5)


# ----------------------------------------------------------------------------- validate_group


def test_validate_group_ok() -> None:
    validate_group([1, 5, 8], [0.0, 1.0, 0.5], 8)
    validate_group([2, 2], torch.tensor([1.0, 0.0]), 2)


@pytest.mark.parametrize(
    ("lens", "rewards", "limit", "words"),
    [
        ([], [], 8, ["empty group"]),
        ([3], [1.0], 8, ["group of one"]),
        ([3, 0, 2], [1.0, 0.0, 2.0], 8, ["member 1", "length 0"]),
        ([3, 4, 9], [1.0, 0.0, 2.0], 8, ["member 2", "9", "limit 8", "--longstraw-max-response-len"]),
        ([3, 4, 5], [1.0, float("nan"), 2.0], 8, ["NaN", "[1]"]),
        ([3, 4, 5], [float("inf"), 0.0, 2.0], 8, ["inf", "[0]"]),
        ([3, 4, 5], [1.0, 0.0], 8, ["len(rewards)=2", "responses=3"]),
    ],
)
def test_validate_group_errors(lens: list[int], rewards: list[float], limit: int, words: list[str]) -> None:
    with pytest.raises(ValueError) as ei:
        validate_group(lens, rewards, limit)
    msg = str(ei.value)
    for w in words:
        assert w in msg, (w, msg)


# ----------------------------------------------------------------------------- config


def test_config_defaults() -> None:
    c = GRPOLossConfig()
    assert (c.clip_eps_low, c.clip_eps_high, c.kl_coef, c.adv_eps, c.std_unbiased) == (0.2, 0.2, 0.0, 1e-6, False)
    with pytest.raises(Exception):
        c.kl_coef = 1.0  # type: ignore[misc]  # frozen


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"clip_eps_low": -0.1}, "clip_eps_low"),
        ({"clip_eps_low": 1.0}, "clip_eps_low"),
        ({"clip_eps_high": 1.5}, "clip_eps_high"),
        ({"kl_coef": -0.01}, "kl_coef"),
        ({"kl_coef": float("nan")}, "kl_coef"),
        ({"adv_eps": 0.0}, "adv_eps"),
        ({"adv_eps": -1e-6}, "adv_eps"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        GRPOLossConfig(**kwargs)


# ----------------------------------------------------------------------------- the step's settings


@pytest.mark.usefixtures("single_process")
def test_step_advantages_follow_adv_eps_and_std_unbiased(tmp_path) -> None:
    """LongStrawConfig's adv_eps / std_unbiased (YAML keys, --longstraw-adv-eps,
    --longstraw-std-unbiased) reach the step's advantages. Rewards [3, 1, 2]: deviations
    [1, -1, 0]; mean |A| = (2/3) / (std + eps) with std = sqrt(2/3) (population) or 1 (sample)."""
    import yaml

    from helpers import TINY_GLM, build_tiny_glm
    from megatron_longstraw.training import train
    from megatron_longstraw.config.settings import LongStrawConfig
    from megatron_longstraw.data.group import GRPOGroup
    from megatron_longstraw.step.schedule import forward_backward_longstraw

    cfg, model = build_tiny_glm(torch.float64)
    gen = torch.Generator().manual_seed(3)
    group = GRPOGroup(torch.randint(0, cfg.vocab_size, (24,), generator=gen),
                      [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in (2, 3, 1)],
                      _t([3, 1, 2]))
    cases = [({}, (2 / 3) / (math.sqrt(2 / 3) + 1e-6)),
             ({"std_unbiased": True}, (2 / 3) / (1 + 1e-6)),
             ({"adv_eps": 0.5}, (2 / 3) / (math.sqrt(2 / 3) + 0.5)),
             ({"adv_eps": 0.5, "std_unbiased": True}, (2 / 3) / 1.5)]
    for settings, expected in cases:
        ls = LongStrawConfig.of(group_size=3, max_response_len=8, **settings)
        result = forward_backward_longstraw(model, group, ls, forward_only=True)
        assert abs(result.stats["advantage_abs_mean"] - expected) <= TOL, settings
    # The same settings from flags and from the YAML `longstraw:` section (flags win).
    args, given = train.parse(["--longstraw", "--longstraw-config", str(TINY_GLM),
                               "--longstraw-adv-eps", "0.5", "--longstraw-std-unbiased"])
    ls = train.resolve(args, given)[2]
    assert (ls.loss.adv_eps, ls.loss.std_unbiased) == (0.5, True)
    assert (ls.loss_config().adv_eps, ls.loss_config().std_unbiased) == (0.5, True)
    config = yaml.safe_load(TINY_GLM.read_text())
    config["longstraw"].update(adv_eps=0.25, std_unbiased=True)
    (tmp_path / "adv.yaml").write_text(yaml.safe_dump(config))
    args, given = train.parse(["--longstraw", "--longstraw-config", str(tmp_path / "adv.yaml"),
                               "--no-longstraw-std-unbiased"])
    ls = train.resolve(args, given)[2]
    assert (ls.loss.adv_eps, ls.loss.std_unbiased) == (0.25, False)
    # YAML reads 1e-6 (no dot) as text: named, with the fix.
    (tmp_path / "text.yaml").write_text("longstraw:\n  adv_eps: 1e-6\n")
    with pytest.raises(ValueError, match=r"adv_eps must be a number, got '1e-6' .*write 1\.0e-6"):
        LongStrawConfig.from_yaml(tmp_path / "text.yaml")
