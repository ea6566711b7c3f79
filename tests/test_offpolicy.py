"""Off-policy correction (offpolicy.py, grpo.member_loss's token_weight, the step): the PPO ratio's
denominator is the trainer's own pre-step log-prob; the engine's log-probs give truncated or
masked importance weights and the mismatch figures. Expected values are worked by hand.

Float64 throughout; tolerance 1e-12 for hand formulas (exp / log round trips are exact to ~1e-16).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_longstraw.config.settings import LongStrawConfig
from megatron_longstraw.grpo.loss import grpo_loss, member_loss
from megatron_longstraw.config.loss import GRPOLossConfig
from megatron_longstraw.grpo.offpolicy import importance_weights, mismatch_stats
from megatron_longstraw.step.schedule import merge_stats

TOL = 1e-12
F64 = torch.float64


def _t(xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=F64)


# ----------------------------------------------------------------------------- the loss


def test_member_loss_token_weight_by_hand() -> None:
    # logp = [-1.0, -2.0], logp_old = [-1.2, -1.5], A = 0.8, G = 2, clip [0.8, 1.2].
    # token 0: rho = e^0.2 = 1.2214 > 1.2: min(1.2214 * 0.8, 1.2 * 0.8) = 0.96 (clipped, no grad)
    # token 1: rho = e^-0.5 = 0.6065: min(0.6065 * 0.8, 0.8 * 0.8) = 0.6065 * 0.8
    # weights [0.5, 2.0]: loss = -(0.5 * 0.96 + 2.0 * 0.8 e^-0.5) / R(=2) / G(=2)
    cfg = GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.2)
    logp = _t([-1.0, -2.0]).requires_grad_()
    loss, stats = member_loss(logp, _t([-1.2, -1.5]), 0.8, 2, cfg, token_weight=_t([0.5, 2.0]))
    expected = -(0.5 * 0.96 + 2.0 * 0.8 * math.exp(-0.5)) / 2 / 2
    assert abs(float(loss) - expected) <= TOL
    assert abs(float(stats["policy_loss"]) - expected * 2) <= TOL   # unscaled by 1/G
    loss.backward()
    # d/d logp_1 of -w A rho / (R G) = -2.0 * 0.8 * e^-0.5 / 4; token 0 is clipped: 0.
    assert torch.allclose(logp.grad, _t([0.0, -2.0 * 0.8 * math.exp(-0.5) / 4]), rtol=0, atol=TOL)
    # The weight is a constant: a weight with a graph gets no gradient.
    w = _t([0.5, 2.0]).requires_grad_()
    member_loss(_t([-1.0, -2.0]).requires_grad_(), _t([-1.2, -1.5]), 0.8, 2, cfg,
                token_weight=w)[0].backward()
    assert w.grad is None
    with pytest.raises(ValueError, match="token_weight shape"):
        member_loss(logp, _t([-1.2, -1.5]), 0.8, 2, cfg, token_weight=_t([1.0]))


def test_grpo_loss_token_weights_by_hand() -> None:
    # On-policy (logp == logp_old: rho = 1, nothing clipped), rewards [1, 0]: A = +-1/(0.5+1e-6)*0.5
    # loss = -(1/G) sum_i (1/R_i) sum_t w_it A_i = -(1/2) [A (w00 + w01)/2 + (-A) w10 / 1]
    cfg = GRPOLossConfig()
    a = 0.5 / (0.5 + 1e-6)
    logps = [_t([-0.3, -0.7]), _t([-1.1])]
    weights = [_t([2.0, 0.0]), _t([0.25])]
    got = grpo_loss(logps, logps, _t([1.0, 0.0]), cfg, token_weights=weights)
    assert abs(float(got) - (-(a * (2.0 + 0.0) / 2 - a * 0.25) / 2)) <= TOL
    unweighted = grpo_loss(logps, logps, _t([1.0, 0.0]), cfg)
    assert abs(float(unweighted) - (-(a * 2 / 2 - a) / 2)) <= TOL   # = 0 here
    with pytest.raises(ValueError, match="1 token_weights"):
        grpo_loss(logps, logps, _t([1.0, 0.0]), cfg, token_weights=weights[:1])


# ----------------------------------------------------------------------------- weights, figures


def test_truncated_and_masked_weights_by_hand() -> None:
    # d = logp_old - logp_engine = [log 3, 0.1, -log 3, 0]: r = [3, e^0.1, 1/3, 1], C = 2.
    old = _t([-1.0, -2.0, -3.0, -0.5])
    engine = old - _t([math.log(3), 0.1, -math.log(3), 0.0])
    w, corrected = importance_weights(old, engine, "truncate", 2.0)
    assert torch.allclose(w, _t([2.0, math.exp(0.1), 1 / 3, 1.0]), rtol=0, atol=TOL)
    assert corrected.tolist() == [True, False, False, False]        # only r > C is truncated
    w, corrected = importance_weights(old, engine, "mask", 2.0)
    assert torch.allclose(w, _t([0.0, math.exp(0.1), 0.0, 1.0]), rtol=0, atol=TOL)
    assert corrected.tolist() == [True, False, True, False]         # r outside [1/2, 2]
    w, corrected = importance_weights(old, engine, "off", 2.0)
    assert w.tolist() == [1.0] * 4 and not corrected.any()
    # A larger cap keeps more: C = 4 truncates nothing here, and masks nothing.
    assert torch.allclose(importance_weights(old, engine, "mask", 4.0)[0],
                          _t([3.0, math.exp(0.1), 1 / 3, 1.0]), rtol=0, atol=TOL)
    # An overflowing ratio is capped (truncate) or masked, never inf / NaN.
    w, _ = importance_weights(_t([-0.1]), _t([-800.0]), "truncate", 2.0)
    assert w.tolist() == [2.0]
    assert importance_weights(_t([-0.1]), _t([-800.0]), "mask", 2.0)[0].tolist() == [0.0]
    with pytest.raises(ValueError, match="one engine log-prob per response token"):
        importance_weights(old, engine[:3], "truncate", 2.0)


def test_mismatch_figures_by_hand() -> None:
    # Two members, d = [log 3, 0.1] and [-log 3]: |d| mean = (2 log 3 + 0.1) / 3, max log 3;
    # k3 = mean(e^d - 1 - d) = [(3 - 1 - log 3) + (e^0.1 - 1.1) + (1/3 - 1 + log 3)] / 3.
    olds = [_t([-1.0, -2.0]), _t([-3.0])]
    engines = [olds[0] - _t([math.log(3), 0.1]), olds[1] + math.log(3)]
    corrected = [importance_weights(o, e, "truncate", 2.0)[1] for o, e in zip(olds, engines)]
    stats = mismatch_stats(olds, engines, corrected)
    assert stats.keys() == {"mismatch_abs_mean", "mismatch_abs_max", "mismatch_kl", "tis_frac"}
    assert abs(stats["mismatch_abs_mean"] - (2 * math.log(3) + 0.1) / 3) <= TOL
    assert abs(stats["mismatch_abs_max"] - math.log(3)) <= TOL
    k3 = ((3 - 1 - math.log(3)) + (math.exp(0.1) - 1.1) + (1 / 3 - 1 + math.log(3))) / 3
    assert abs(stats["mismatch_kl"] - k3) <= TOL
    assert abs(stats["tis_frac"] - 1 / 3) <= TOL                     # the r = 3 token
    assert "tis_frac" not in mismatch_stats(olds, engines, None)     # mode off


def test_merge_stats_means_over_groups_that_report_a_key() -> None:
    merged = merge_stats([{"kl": 1.0, "ratio_max": 2.0, "ratio_min": 0.5},
                          {"kl": 3.0, "ratio_max": 1.5, "ratio_min": 0.25,
                           "mismatch_abs_mean": 0.2, "mismatch_abs_max": 0.7}])
    assert merged == {"kl": 2.0, "ratio_max": 2.0, "ratio_min": 0.25,
                      "mismatch_abs_mean": 0.2, "mismatch_abs_max": 0.7}


# ----------------------------------------------------------------------------- flags


@pytest.mark.parametrize("settings,message", [
    ({"tis": "clip"}, r"tis must be one of \['off', 'truncate', 'mask'\], got 'clip' "
                      r"\(--longstraw-tis, YAML longstraw.tis\)"),
    ({"tis_cap": 0.5}, r"tis_cap must be a number >= 1, got 0.5 \(--longstraw-tis-cap"),
    ({"tis_cap": float("inf")}, "tis_cap"),
    ({"tis_cap": "2"}, "tis_cap"),
    ({"reward": "no_colon"}, r"reward must be 'module:function' or 'longstraw:<name>', got "
                             r"'no_colon'"),
])
def test_config_rejects_bad_settings(settings, message) -> None:
    with pytest.raises(ValueError, match=message):
        LongStrawConfig.of(**settings)


def test_flags_and_yaml(tmp_path) -> None:
    import yaml

    from helpers import TINY_GLM
    from megatron_longstraw.training import train
    from megatron_longstraw.runtime.errors import FlagError

    args, given = train.parse(["--longstraw", "--longstraw-config", str(TINY_GLM)])
    ls = train.resolve(args, given)[2]
    assert (ls.loss.tis, ls.loss.tis_cap, ls.group.reward) == ("truncate", 2.0, None)   # the defaults
    config = yaml.safe_load(TINY_GLM.read_text())
    config["longstraw"].update(tis="mask", tis_cap=3, reward="longstraw:exact_match")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    args, given = train.parse(["--longstraw", "--longstraw-config", str(tmp_path / "c.yaml")])
    ls = train.resolve(args, given)[2]
    assert (ls.loss.tis, ls.loss.tis_cap, ls.group.reward) == ("mask", 3, "longstraw:exact_match")
    args, given = train.parse(["--longstraw", "--longstraw-config", str(tmp_path / "c.yaml"),
                               "--longstraw-tis", "off", "--longstraw-tis-cap", "1.5"])
    assert train.resolve(args, given)[2].loss.tis == "off"                  # flags win
    with pytest.raises(FlagError, match="--longstraw-tis: invalid choice: 'clip'"):
        train.parse(["--longstraw", "--longstraw-tis", "clip"])
    args, given = train.parse(["--longstraw", "--longstraw-config", str(TINY_GLM),
                               "--longstraw-tis-cap", "0.9"])
    with pytest.raises(ValueError, match="--longstraw-tis-cap"):
        train.resolve(args, given)


def test_step_line_shows_the_mismatch_only_when_present(capsys) -> None:
    from types import SimpleNamespace

    from megatron_longstraw.training.metrics import StepLogger

    stats = {"reward_mean": 0.5, "reward_group_std": 0.5, "clip_frac": 0.0, "ratio_mean": 1.0,
             "kl": 0.0, "grad_norm": 1.0}
    result = SimpleNamespace(stats=stats, loss=0.1, page_bytes=0, page_bytes_by_kind={},
                             phase_seconds={"capture": 0.0, "scoring": 0.0, "replay": 0.0})
    logger = StepLogger(None, enabled=True)
    assert "mismatch" not in logger.log(0, result, {})
    stats.update(mismatch_abs_mean=0.25, mismatch_abs_max=1.5, mismatch_kl=0.03, tis_frac=0.125)
    line = logger.log(1, result, {})
    assert "| mismatch |d| 2.50e-01 max 1.50e+00 kl 3.00e-02 tis_frac 0.125" in line
    assert logger.scalars(result, {})["grpo/tis_frac"] == 0.125        # TensorBoard: grpo/*


# ----------------------------------------------------------------------------- the step


@pytest.fixture(scope="module")
def tiny_step(single_process):
    """A tiny fp64 GLM-5.2, a group of three, and the trainer's pre-step log-probs of it."""
    from helpers import build_tiny_glm
    from megatron_longstraw.data.group import GRPOGroup
    from megatron_longstraw.step.schedule import forward_backward_longstraw

    cfg, model = build_tiny_glm(torch.float64)
    gen = torch.Generator().manual_seed(7)
    group = GRPOGroup(torch.randint(0, cfg.vocab_size, (24,), generator=gen),
                      [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in (3, 2, 4)],
                      _t([1.0, 0.0, 0.5]))
    ls = LongStrawConfig.of(group_size=3, max_response_len=8)
    olds = forward_backward_longstraw(model, group, ls, forward_only=True).logps_old
    return model, group, [o.detach().clone() for o in olds]


def _gradient(model, group, ls):
    from megatron_longstraw.step.schedule import forward_backward_longstraw

    model.zero_grad(set_to_none=True)
    result = forward_backward_longstraw(model, group, ls)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return result, grads


def _with_engine(group, engine):
    from megatron_longstraw.data.group import GRPOGroup

    return GRPOGroup(group.prompt_ids, group.response_ids, group.rewards, logps_old=engine)


def test_step_denominator_is_the_trainers_and_weights_are_the_capped_ratios(tiny_step) -> None:
    """The engine's log-probs sit log 3 below the trainer's on every token (r = 3). The ratio's
    denominator is the trainer's: with --longstraw-tis off the update is bitwise the one without
    engine log-probs (with the engine's as denominator every ratio would be 3, all clipped); with
    truncate at C = 2 every weight is 2, so the gradient and the loss double; masked, every token
    is out of [1/2, 2] and the policy gradient is zero."""
    model, group, olds = tiny_step
    engine = [o - math.log(3) for o in olds]
    plain_result, plain = _gradient(model, group, LongStrawConfig.of(group_size=3, max_response_len=8))
    assert plain_result.token_weights is None and "mismatch_kl" not in plain_result.stats
    assert plain and any(float(g.abs().max()) > 0 for g in plain.values())

    result, off = _gradient(model, _with_engine(group, engine),
                            LongStrawConfig.of(group_size=3, max_response_len=8, tis="off"))
    assert off.keys() == plain.keys()
    assert all(torch.equal(off[n], plain[n]) for n in plain)
    for got, old in zip(result.logps_old, olds):                    # the trainer's, not the engine's
        assert torch.equal(got, old)
    assert result.stats["ratio_max"] == pytest.approx(1.0, abs=1e-12)
    # The mismatch is logged with off too: |d| = log 3 everywhere, k3 = 3 - 1 - log 3.
    assert result.stats["mismatch_abs_mean"] == pytest.approx(math.log(3), abs=1e-12)
    assert result.stats["mismatch_abs_max"] == pytest.approx(math.log(3), abs=1e-12)
    assert result.stats["mismatch_kl"] == pytest.approx(2 - math.log(3), abs=1e-12)
    assert "tis_frac" not in result.stats

    result, trunc = _gradient(model, _with_engine(group, engine),
                              LongStrawConfig.of(group_size=3, max_response_len=8))
    assert [w.tolist() for w in result.token_weights] == [[2.0] * len(o) for o in olds]
    assert result.stats["tis_frac"] == 1.0
    assert result.loss == pytest.approx(2 * plain_result.loss, rel=1e-12, abs=1e-15)
    worst = max(float((trunc[n] - 2 * plain[n]).abs().max() / plain[n].abs().max())
                for n in plain if plain[n].abs().max() > 0)
    assert worst <= 1e-12

    result, masked = _gradient(model, _with_engine(group, engine),
                               LongStrawConfig.of(group_size=3, max_response_len=8, tis="mask"))
    assert all(w.eq(0).all() for w in result.token_weights)
    assert all(float(g.abs().max()) == 0 for g in masked.values())


def test_step_weights_per_token(tiny_step) -> None:
    """Token-varying offsets: the step's weights are min(exp(old - engine), C) token by token, and
    tis_frac counts the truncated tokens (2 of 9 here)."""
    model, group, olds = tiny_step
    offsets = [_t([math.log(3), 0.1, -0.4]), _t([0.0, -math.log(3)]),
               _t([0.2, 0.0, math.log(5), -0.05])]
    engine = [o - d for o, d in zip(olds, offsets)]
    result, _ = _gradient(model, _with_engine(group, engine),
                          LongStrawConfig.of(group_size=3, max_response_len=8, tis_cap=2.0))
    expected = [[2.0, math.exp(0.1), math.exp(-0.4)], [1.0, 1 / 3],
                [math.exp(0.2), 1.0, 2.0, math.exp(-0.05)]]
    for got, want in zip(result.token_weights, expected):
        assert torch.allclose(got, _t(want), rtol=0, atol=1e-12)
    assert result.stats["tis_frac"] == pytest.approx(2 / 9, abs=1e-15)
    d = torch.cat(offsets)
    assert result.stats["mismatch_abs_mean"] == pytest.approx(float(d.abs().mean()), abs=1e-12)
    assert result.stats["mismatch_abs_max"] == pytest.approx(math.log(5), abs=1e-12)
