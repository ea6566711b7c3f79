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
    from megatron_longstraw.training.schedule import forward_backward_longstraw

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
        ls = LongStrawConfig(group_size=3, max_response_len=8, **settings)
        result = forward_backward_longstraw(model, group, ls, forward_only=True)
        assert abs(result.stats["advantage_abs_mean"] - expected) <= TOL, settings
    # The same settings from flags and from the YAML `longstraw:` section (flags win).
    args, given = train.parse(["--longstraw", "--longstraw-config", str(TINY_GLM),
                               "--longstraw-adv-eps", "0.5", "--longstraw-std-unbiased"])
    ls = train.resolve(args, given)[2]
    assert (ls.adv_eps, ls.std_unbiased) == (0.5, True)
    assert (ls.loss_config().adv_eps, ls.loss_config().std_unbiased) == (0.5, True)
    config = yaml.safe_load(TINY_GLM.read_text())
    config["longstraw"].update(adv_eps=0.25, std_unbiased=True)
    (tmp_path / "adv.yaml").write_text(yaml.safe_dump(config))
    args, given = train.parse(["--longstraw", "--longstraw-config", str(tmp_path / "adv.yaml"),
                               "--no-longstraw-std-unbiased"])
    ls = train.resolve(args, given)[2]
    assert (ls.adv_eps, ls.std_unbiased) == (0.25, False)
    # YAML reads 1e-6 (no dot) as text: named, with the fix.
    (tmp_path / "text.yaml").write_text("longstraw:\n  adv_eps: 1e-6\n")
    with pytest.raises(ValueError, match=r"adv_eps must be a number, got '1e-6' .*write 1\.0e-6"):
        LongStrawConfig.from_yaml(tmp_path / "text.yaml")
