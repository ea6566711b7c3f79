"""Several optimizer steps over one capture (step/schedule.py `train_on_capture`).

The reference is written out here from the public phases: capture the prompt once, score every
member once (the PPO denominator), then for each update replay its G members over the kept capture
with a plain forward (`replay_member` computing its own selections at the current weights, where
the step scores the members again and reuses what scoring picked), the loss of
`grpo.loss.member_loss` with the capture-time log-probs and the advantages of the chosen scope,
and one optimizer step. Float64; the two must agree to round-off."""

from __future__ import annotations

import pytest
import torch

from megatron_longstraw.config.settings import LongStrawConfig
from megatron_longstraw.context.capture import capture_prompt
from megatron_longstraw.data.group import GRPOGroup
from megatron_longstraw.distributed.finalize import finalize_longstraw_grads
from megatron_longstraw.grpo.loss import group_advantages, member_loss
from megatron_longstraw.step.replay import replay_member, score_member
from megatron_longstraw.step.schedule import train_on_capture, train_step

pytestmark = pytest.mark.usefixtures("single_process")

CONFIGS = {"glm52": "examples/glm52/tiny.yaml", "qwen36": "examples/qwen36/tiny.yaml",
           "deepseekv3": "examples/deepseekv3/tiny.yaml"}
G, K = 2, 3
LENS = (5, 3, 6, 4, 2, 5)   # G x K members


def _model(family):
    """The family's tiny fp64 model as the CP workers build it (tests/dist_workers.py)."""
    if family == "deepseekv3":
        from test_deepseekv3 import build_tiny_deepseekv3 as build
    else:
        from helpers import build_tiny_glm, build_tiny_qwen

        build = build_tiny_glm if family == "glm52" else build_tiny_qwen
    return build(torch.float64)


REWARDS = [1.0, 0.0, 0.5, 0.0, 1.0, 0.25]
BLOCKS = dict(max_response_len=16, query_block=7, key_block=11, token_block=13,
              clip_eps_high=0.28)


def _group(vocab, seed=0, lens=LENS, prompt_len=33):
    gen = torch.Generator().manual_seed(seed)
    return GRPOGroup(torch.randint(vocab, (prompt_len,), generator=gen),
                     [torch.randint(vocab, (n,), generator=gen) for n in lens],
                     rewards=torch.tensor(REWARDS[:len(lens)], dtype=torch.float64))


def _settings(**kw):
    return LongStrawConfig.of(group_size=G, **BLOCKS, **kw)


def _reference(model, optimizer, group, ls, updates, scope, epochs=1):
    """K plain updates over one capture, written out (module docstring); with `epochs` E the K
    mini-batches E times in order. -> per update the members' replayed log-probs."""
    loss_cfg = ls.loss_config()
    captured = capture_prompt(model, group.prompt_ids, ls.capture)
    old = [score_member(model, captured, r, ls)[0] for r in group.response_ids]
    adv_all = group_advantages(group.rewards.double(), eps=loss_cfg.adv_eps)
    out = []
    for k in [k for _ in range(epochs) for k in range(updates)]:
        members = range(k * G, (k + 1) * G)
        adv = adv_all[list(members)] if scope == "capture" else \
            group_advantages(group.rewards[list(members)].double(), eps=loss_cfg.adv_eps)
        optimizer.zero_grad(set_to_none=True)
        logps = []
        for j, i in enumerate(members):
            response = group.response_ids[i]

            def loss_fn(logp, tokens=slice(None), i=i, j=j, n=int(response.numel())):
                return member_loss(logp, old[i][tokens], adv[j], num_members=G, cfg=loss_cfg,
                                   num_tokens=n)

            logp = replay_member(model, captured, response, None, ls, loss_fn)[0]
            logps.append(logp.detach())
        finalize_longstraw_grads(model)
        optimizer.step()
        out.append(logps)
    return out


@pytest.mark.parametrize("family,scope", [("glm52", "capture"), ("glm52", "update"),
                                          ("qwen36", "capture"), ("deepseekv3", "capture")])
def test_k_updates_equal_a_hand_written_loop_over_one_capture(family, scope):
    cfg, model = _model(family)
    group = _group(cfg.vocab_size)
    ls = _settings()
    results = train_on_capture(model, torch.optim.SGD(model.parameters(), lr=0.3), group, ls,
                               updates=K, advantage_scope=scope)
    ours = {n: p.detach().clone() for n, p in model.named_parameters()}

    _, ref_model = _model(family)
    expected = _reference(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.3), group, ls,
                          K, scope)
    assert len(results) == K
    for k, (result, logps) in enumerate(zip(results, expected)):
        assert not result.skipped and result.stats["update_in_capture"] == k
        for got, want in zip(result.logps, logps):
            assert torch.allclose(got, want, rtol=0, atol=1e-12), (k, (got - want).abs().max())
    # the updates moved the weights, and the ratio away from 1 after the first
    assert results[0].stats["ratio_max"] == pytest.approx(1.0, abs=1e-12)
    assert abs(results[-1].stats["ratio_mean"] - 1.0) > 1e-6
    worst = max(float((ours[n] - p.detach()).abs().max())
                for n, p in ref_model.named_parameters())
    assert worst < 1e-12, worst


@pytest.mark.parametrize("updates,epochs", [(3, 2), (1, 3)])
def test_epochs_over_the_mini_batches_equal_the_loop_written_out(updates, epochs):
    """PPO's epochs: E passes over the K mini-batches, E x K optimizer steps over one capture, the
    capture-time denominators throughout (fp64, 1e-12); E > 1 at K = 1 is PPO over one batch."""
    cfg, model = _model("glm52")
    group = _group(cfg.vocab_size, lens=LENS[:G * updates])
    group.rewards = group.rewards[:G * updates]
    ls = _settings(updates_per_capture=updates, epochs=epochs)
    results = train_on_capture(model, torch.optim.SGD(model.parameters(), lr=0.3), group, ls)
    _, ref_model = _model("glm52")
    expected = _reference(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.3), group, ls,
                          updates, "capture", epochs=epochs)
    assert len(results) == len(expected) == updates * epochs
    for n, (result, logps) in enumerate(zip(results, expected)):
        assert result.stats["update_in_capture"] == n and result.stats["epoch"] == n // updates
        for got, want in zip(result.logps, logps):
            assert torch.allclose(got, want, rtol=0, atol=1e-12), (n, (got - want).abs().max())
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
    assert abs(results[-1].stats["ratio_mean"] - 1.0) > 1e-6    # the last epoch is off-policy


def test_one_update_is_train_step_bitwise():
    cfg, model = _model("glm52")
    group = _group(cfg.vocab_size, lens=LENS[:G])
    ls = _settings()
    [ours] = train_on_capture(model, torch.optim.SGD(model.parameters(), lr=0.3), group, ls,
                              updates=1)
    _, plain = _model("glm52")
    theirs = train_step(plain, torch.optim.SGD(plain.parameters(), lr=0.3), group, ls)
    assert all(torch.equal(a, b) for a, b in zip(ours.logps, theirs.logps))
    assert ours.stats == theirs.stats
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))


def test_the_first_update_is_the_step_over_its_members():
    """Update 0 over members [0, G) with the capture's advantages is train_step over those G
    members when their advantages agree (scope "update")."""
    cfg, model = _model("glm52")
    group = _group(cfg.vocab_size)
    ls = _settings()
    first = train_on_capture(model, torch.optim.SGD(model.parameters(), lr=0.3), group, ls,
                             updates=K, advantage_scope="update")[0]
    _, plain = _model("glm52")
    head = GRPOGroup(group.prompt_ids, group.response_ids[:G], group.rewards[:G])
    step = train_step(plain, torch.optim.SGD(plain.parameters(), lr=0.3), head, ls)
    assert all(torch.equal(a, b) for a, b in zip(first.logps, step.logps))
    assert first.stats["grad_norm"] == step.stats["grad_norm"]


def test_bad_requests_are_refused_with_what_to_do():
    cfg, model = _model("glm52")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    with pytest.raises(ValueError, match=r"one capture serves 3 updates of G = 2, so a group has "
                                         r"6 members"):
        train_on_capture(model, optimizer, _group(cfg.vocab_size, lens=LENS[:4]), _settings(),
                         updates=3)
    with pytest.raises(ValueError, match=r"exact prompt gradient needs the prompt's state at the "
                                         r"current weights.*--longstraw-prompt-grad detached"):
        train_on_capture(model, optimizer, _group(cfg.vocab_size), _settings(prompt_grad="exact"),
                         updates=3)
    with pytest.raises(ValueError, match=r"updates=0: give the number of mini-batches per "
                                         r"capture \(updates\) and of passes over them"):
        train_on_capture(model, optimizer, _group(cfg.vocab_size), _settings(), updates=0)
    with pytest.raises(ValueError, match=r"epochs=0: give the number of mini-batches"):
        train_on_capture(model, optimizer, _group(cfg.vocab_size), _settings(), updates=3,
                         epochs=0)
    with pytest.raises(ValueError, match=r"advantage_scope='group'"):
        train_on_capture(model, optimizer, _group(cfg.vocab_size), _settings(), updates=3,
                         advantage_scope="group")


@pytest.mark.parametrize("world,cases", [
    (2, [("glm52", 2, 2, 48), ("qwen36", 2, 1, 40), ("deepseekv3", 2, 2, 40)])])
def test_k_updates_under_cp_and_ep_equal_one_process(tmp_path, world, cases):
    """Real gloo ranks, CP (x EP folded): K updates over one capture give every member's log-probs
    of every update, the drift measured before each update after the first, and the weights
    after the last, as on one process (each rank holds its own experts)."""
    import dist_workers
    from distributed import run_ranks

    expected, jobs = [], []
    for family, cp, ep, prompt_len in cases:
        cfg, model = _model(family)
        path = tmp_path / f"{family}.pt"
        torch.save({k: v.clone() for k, v in model.state_dict().items()
                    if not k.endswith("_extra_state")}, path)
        results = train_on_capture(model, torch.optim.SGD(model.parameters(), lr=0.3),
                                   _group(cfg.vocab_size, prompt_len=prompt_len), _settings(),
                                   updates=K, drift_every=1)
        expected.append(([[lp.detach() for lp in r.logps] for r in results],
                         {n: p.detach() for n, p in model.named_parameters()},
                         [r.stats for r in results]))
        jobs.append((family, cp, ep, str(path), prompt_len))
    outs = run_ranks(dist_workers.capture_reuse_worker, world, cases=jobs, lens=LENS,
                     rewards=REWARDS, updates=K, settings=dict(group_size=G, **BLOCKS),
                     drift_every=1)
    for case, (family, cp, ep, _) in enumerate(cases):
        logps, params, stats = expected[case]
        worst = 0.0
        for out in outs:
            got = out[case]
            for update, want in zip(got["stats"][1:], stats[1:], strict=True):
                drift = {k: v for k, v in want.items() if k.startswith("drift/")}
                assert len(drift) == 6
                for key, value in drift.items():
                    assert update[key] == pytest.approx(value, rel=1e-8, abs=1e-12), key
            for update, want in zip(got["logps"], logps, strict=True):
                worst = max([worst] + [float((a - b).abs().max()) for a, b in zip(update, want)])
            for name, value in got["params"].items():
                local = name if name in params else None
                assert local is not None, name
                worst = max(worst, float((value - params[name]).abs().max()))
        print(f"{family} CP{cp}/EP{ep}: {K} updates over one capture vs one process {worst:.2e}")
        assert worst <= 1e-10, (family, cp, ep, worst)


def test_no_weight_change_means_no_drift():
    cfg, model = _model("glm52")
    results = train_on_capture(model, torch.optim.SGD(model.parameters(), lr=0.0),
                               _group(cfg.vocab_size), _settings(), updates=K, drift_every=1)
    assert "drift/kl" not in results[0].stats          # before update 0 the capture is fresh
    for result in results[1:]:
        s = result.stats
        assert s["drift/logp_abs_max"] == 0 and s["drift/kl"] == 0
        assert s["drift/grad_rel_norm"] == 0 and s["drift/grad_cosine"] == pytest.approx(1, abs=1e-12)
        assert s["drift/recaptured"] == 0


def test_drift_equals_a_fresh_capture_written_out():
    """Before update 1 (after one SGD step): the members of update 1 scored over the kept capture
    and over one made at the new weights, and the GRPO gradient over each, written out."""
    cfg, model = _model("glm52")
    group = _group(cfg.vocab_size, lens=LENS[:2 * G])
    ls = _settings()
    results = train_on_capture(model, torch.optim.SGD(model.parameters(), lr=0.3), group, ls,
                               updates=2, drift_every=1)
    got = results[1].stats

    _, ref_model = _model("glm52")
    optimizer = torch.optim.SGD(ref_model.parameters(), lr=0.3)
    loss_cfg = ls.loss_config()
    kept = capture_prompt(ref_model, group.prompt_ids, ls.capture)
    old = [score_member(ref_model, kept, r, ls)[0] for r in group.response_ids]
    adv = group_advantages(group.rewards.double(), eps=loss_cfg.adv_eps)
    members = range(G, 2 * G)

    def grads_over(captured, idx):
        ref_model.zero_grad(set_to_none=True)
        logps = []
        for i in idx:
            response = group.response_ids[i]

            def loss_fn(logp, tokens=slice(None), i=i, n=int(response.numel())):
                return member_loss(logp, old[i][tokens], adv[i], num_members=G, cfg=loss_cfg,
                                   num_tokens=n)
            logps.append(replay_member(ref_model, captured, response, None, ls, loss_fn)[0])
        finalize_longstraw_grads(ref_model)
        return logps, {n: p.grad.double().clone() for n, p in ref_model.named_parameters()
                       if p.grad is not None}

    grads_over(kept, range(G))          # update 0
    optimizer.step()
    stale_logps, g_stale = grads_over(kept, members)
    fresh_logps, g_fresh = grads_over(capture_prompt(ref_model, group.prompt_ids, ls.capture),
                                      members)
    gap = torch.cat([(f - s).detach() for f, s in zip(fresh_logps, stale_logps)])
    dot = lambda a, b: sum(float((a[n] * b[n]).sum()) for n in a)   # noqa: E731
    cosine = dot(g_stale, g_fresh) / (dot(g_stale, g_stale) * dot(g_fresh, g_fresh)) ** 0.5
    rel = sum(float((g_stale[n] - g_fresh[n]).pow(2).sum()) for n in g_fresh) ** 0.5 \
        / dot(g_fresh, g_fresh) ** 0.5
    assert float(gap.abs().max()) > 1e-6          # the step moved the prompt's state
    assert got["drift/logp_abs_mean"] == pytest.approx(float(gap.abs().mean()), rel=1e-9)
    assert got["drift/logp_abs_max"] == pytest.approx(float(gap.abs().max()), rel=1e-9)
    assert got["drift/kl"] == pytest.approx(float((gap.exp() - gap - 1).mean()), rel=1e-6)
    assert got["drift/grad_cosine"] == pytest.approx(cosine, rel=1e-9)
    assert got["drift/grad_rel_norm"] == pytest.approx(rel, rel=1e-6)


def test_a_drift_past_the_bound_recaptures():
    cfg, model = _model("glm52")
    group = _group(cfg.vocab_size)
    tight = train_on_capture(model, torch.optim.SGD(model.parameters(), lr=0.3), group,
                             _settings(), updates=K, drift_every=1, drift_bound=1e-12)
    assert [r.stats["drift/recaptured"] for r in tight[1:]] == [1.0, 1.0]
    _, model = _model("glm52")
    loose = train_on_capture(model, torch.optim.SGD(model.parameters(), lr=0.3), group,
                             _settings(), updates=K, drift_every=1, drift_bound=1e3)
    assert [r.stats["drift/recaptured"] for r in loose[1:]] == [0.0, 0.0]
    # update 1 replayed over the fresh capture in one run, over the kept one in the other
    assert not torch.allclose(tight[1].logps[0], loose[1].logps[0], rtol=0, atol=1e-9)
    assert all(torch.equal(a, b) for a, b in zip(tight[0].logps, loose[0].logps))
    with pytest.raises(ValueError, match=r"drift_bound=0.1: .* needs the drift measured"):
        train_on_capture(model, torch.optim.SGD(model.parameters(), lr=0.3), group, _settings(),
                         updates=K, drift_bound=0.1)


# ---- through the launcher ------------------------------------------------------------------------

TINY_GLM = "examples/glm52/tiny.yaml"


def _launch_flags(tmp_path, *extra):
    return ["--longstraw", "--longstraw-config", TINY_GLM, "--longstraw-synthetic-prompt-len", "32",
            "--longstraw-synthetic-response-len", "4", "--longstraw-group-size", "2",
            "--longstraw-dtype", "fp64", "--longstraw-out-dir", str(tmp_path),
            "--longstraw-run-name", "k", "--no-longstraw-live-bytes", "--lr", "1e-2",
            "--lr-decay-style", "cosine", "--min-lr", "1e-3", *extra]


def _history(tmp_path):
    import json

    return json.loads((tmp_path / "k" / "receipt.json").read_text())["history"]


def test_the_launcher_takes_k_updates_per_capture_and_resumes_between_captures(tmp_path):
    """--longstraw-updates-per-capture 2, --train-iters 4: two captures, four updates, each with
    its own learning rate (the schedule steps per update), the drift measured before each second
    update; a run stopped after the first capture's save resumes to the same weights and
    figures."""
    from megatron_longstraw.training import train

    k_flags = ["--longstraw-updates-per-capture", "2", "--longstraw-drift-every", "1",
               "--train-iters", "4"]
    train.main(_launch_flags(tmp_path / "whole", *k_flags, "--save", str(tmp_path / "w"),
                             "--save-interval", "2"))
    history = _history(tmp_path / "whole")
    assert [h["step"] for h in history] == [0, 1, 2, 3]
    assert [h["grpo/update_in_capture"] for h in history] == [0, 1, 0, 1]
    assert [h["consumed_groups"] for h in history] == [1, 1, 2, 2]   # a batch per capture
    assert len({h["optimizer/lr"] for h in history}) == 4
    assert all("grpo/drift/kl" in h for h in history[1::2])
    assert not any("grpo/drift/kl" in h for h in history[0::2])
    assert history[1]["time/capture_s"] == 0 < history[0]["time/capture_s"]
    assert (tmp_path / "whole" / "k" / "run_curves.png").exists()   # with the drift panel

    # stop after the first capture (its save), resume: the same second capture
    train.main(_launch_flags(tmp_path / "first", *k_flags,
                             "--exit-interval", "2", "--save", str(tmp_path / "ckpt"),
                             "--save-interval", "2"))
    train.main(_launch_flags(tmp_path / "resumed", *k_flags, "--save", str(tmp_path / "ckpt"),
                             "--save-interval", "2", "--load", str(tmp_path / "ckpt")))
    resumed = _history(tmp_path / "resumed")
    assert [h["step"] for h in resumed] == [2, 3]
    for key in ("grpo/grad_norm", "grpo/ratio_mean", "grpo/drift/logp_abs_mean", "optimizer/lr"):
        assert [h.get(key, -1.0) for h in resumed] == pytest.approx(
            [h.get(key, -1.0) for h in history[2:]], rel=1e-9, abs=1e-15), key


def test_the_launcher_takes_epochs(tmp_path):
    """--longstraw-epochs 2 at one update per capture: two updates over one capture of one
    batch, the second an epoch later over the same members."""
    from megatron_longstraw.training import train

    train.main(_launch_flags(tmp_path, "--longstraw-epochs", "2", "--train-iters", "2"))
    history = _history(tmp_path)
    assert [h["grpo/update_in_capture"] for h in history] == [0, 1]
    assert [h["grpo/epoch"] for h in history] == [0, 1]
    assert [h["consumed_groups"] for h in history] == [1, 1]
    assert history[0]["grpo/reward_mean"] == history[1]["grpo/reward_mean"]   # same members


@pytest.mark.parametrize("flags,message", [
    (["--longstraw-updates-per-capture", "2", "--train-iters", "3"],
     r"--train-iters 3 is not a multiple of --longstraw-updates-per-capture 2"),
    (["--longstraw-updates-per-capture", "2", "--train-iters", "4", "--save-interval", "3"],
     r"--save-interval 3 is not a multiple"),
    (["--longstraw-updates-per-capture", "2", "--longstraw-prompt-grad", "exact"],
     r"updates_per_capture .* with the exact prompt gradient"),
    (["--longstraw-drift-every", "1"], r"every step captures afresh"),
    (["--longstraw-drift-first-last"], r"drift_first_last .* every step captures afresh"),
    (["--longstraw-updates-per-capture", "2", "--longstraw-epochs", "2", "--train-iters", "6"],
     r"--train-iters 6 is not a multiple of --longstraw-updates-per-capture 2 x "
     r"--longstraw-epochs 2 = 4"),
    (["--longstraw-epochs", "2", "--longstraw-prompt-grad", "exact"],
     r"x epochs \(--longstraw-epochs\) 2 with the exact prompt gradient"),
    (["--longstraw-updates-per-capture", "2", "--longstraw-drift-bound", "0.1",
      "--train-iters", "2"], r"needs the drift measured \(--longstraw-drift-every N or "
                             r"--longstraw-drift-first-last\)"),
])
def test_bad_reuse_settings_are_refused_before_any_work(tmp_path, flags, message):
    from megatron_longstraw.runtime.errors import ConfigError
    from megatron_longstraw.training import train

    with pytest.raises(ConfigError, match=message):
        train.main(_launch_flags(tmp_path, *flags))


def test_the_drift_schedules():
    """Every N-th update, the first and last that can differ (1 and K - 1), or both; never update
    0 (the capture's own weights); a run measures exactly there."""
    from megatron_longstraw.step.schedule import drift_updates

    assert drift_updates(8, 3) == {3, 6}
    assert drift_updates(8, 0, first_last=True) == {1, 7}
    assert drift_updates(8, 3, first_last=True) == {1, 3, 6, 7}
    assert drift_updates(2, 0, first_last=True) == {1}
    assert drift_updates(1, 1, first_last=True) == set() and drift_updates(8) == set()
    with pytest.raises(ValueError, match=r"drift_every=-1: measure the drift before every N-th"):
        drift_updates(4, -1)
    cfg, model = _model("glm52")
    lens = (5, 3, 6, 4, 2, 5, 3, 4)                    # G x 4 members
    group = _group(cfg.vocab_size, lens=lens)
    group.rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 0.25, 0.0, 1.0], dtype=torch.float64)
    results = train_on_capture(model, torch.optim.SGD(model.parameters(), lr=0.3), group,
                               _settings(drift_first_last=True, updates_per_capture=4))
    assert ["drift/logp_abs_mean" in r.stats for r in results] == [False, True, False, True]
    assert ["drift" in r.phase_seconds for r in results] == [False, True, False, True]
    assert 0 < results[1].stats["drift/logp_abs_mean"] < results[3].stats["drift/logp_abs_mean"]


def test_k_updates_with_loss_masks_engine_logprobs_and_token_mean():
    """Agent trajectories (loss masks), the engine's log-probs (truncated importance weights) and
    DAPO's token mean through K updates over one capture, against the loop written out with
    them: each update's divisors count that update's trained tokens."""
    from megatron_longstraw.grpo.offpolicy import importance_weights

    cfg, model = _model("glm52")
    group = _group(cfg.vocab_size)
    gen = torch.Generator().manual_seed(5)
    group.loss_masks = [torch.rand(n, generator=gen) > 0.3 for n in LENS]
    for m in group.loss_masks:
        m[0] = True                                       # every member trains a token
    group.logps_old = [-torch.rand(n, generator=gen, dtype=torch.float64) - 1.0 for n in LENS]
    ls = _settings(loss_aggregation="token_mean", tis_cap=1.5)
    results = train_on_capture(model, torch.optim.SGD(model.parameters(), lr=0.3), group, ls,
                               updates=K)

    _, ref_model = _model("glm52")
    optimizer = torch.optim.SGD(ref_model.parameters(), lr=0.3)
    loss_cfg = ls.loss_config()
    captured = capture_prompt(ref_model, group.prompt_ids, ls.capture)
    old = [score_member(ref_model, captured, r, ls)[0] for r in group.response_ids]
    weights = [importance_weights(o, e, "truncate", 1.5)[0] for o, e in zip(old, group.logps_old)]
    adv = group_advantages(group.rewards.double(), eps=loss_cfg.adv_eps)
    for k, result in enumerate(results):
        members = list(range(k * G, (k + 1) * G))
        trained = [int(group.loss_masks[i].sum()) for i in members]
        optimizer.zero_grad(set_to_none=True)
        for j, i in enumerate(members):
            def loss_fn(logp, tokens=slice(None), i=i, j=j):
                return member_loss(logp, old[i][tokens], adv[i], num_members=G, cfg=loss_cfg,
                                   num_tokens=trained[j], group_tokens=sum(trained),
                                   token_weight=weights[i][tokens],
                                   loss_mask=group.loss_masks[i][tokens])
            want = replay_member(ref_model, captured, group.response_ids[i], None, ls, loss_fn)[0]
            assert torch.allclose(result.logps[j], want.detach(), rtol=0, atol=1e-12), (k, j)
        finalize_longstraw_grads(ref_model)
        optimizer.step()
        assert "tis_frac" in result.stats and result.stats["mismatch_abs_max"] > 0
    worst = max(float((a - b).abs().max())
                for a, b in zip(model.parameters(), ref_model.parameters()))
    assert worst < 1e-12, worst


def test_several_groups_share_each_update_and_each_has_its_drift():
    """Two prompts (micro-batches of one update): the drift is measured for each before any of
    the update's gradients exist, and the figures are their mean; the update equals the loop
    written out over both groups."""
    cfg, model = _model("glm52")
    groups = [_group(cfg.vocab_size, seed=s, lens=LENS[:2 * G]) for s in (0, 1)]
    results = train_on_capture(model, torch.optim.SGD(model.parameters(), lr=0.3), groups,
                               _settings(), updates=2, loss_scale=0.5, drift_every=1)
    assert results[1].stats["drift/logp_abs_mean"] > 0
    _, single = _model("glm52")
    one = train_on_capture(single, torch.optim.SGD(single.parameters(), lr=0.3), groups[:1],
                           _settings(), updates=2, loss_scale=0.5, drift_every=1)
    assert one[1].stats["drift/logp_abs_mean"] != results[1].stats["drift/logp_abs_mean"]
    assert len(results[1].logps) == 2 * G


def test_k_updates_keep_branch_pages_only_for_the_update_at_hand(monkeypatch):
    """With reuse_branch_pages, the first scoring keeps the blockwise pages of update 0's members
    only: a later update's members are scored again before their replay, so theirs never wait in
    host memory through the earlier updates. Same updates as without kept pages (fp64)."""
    from megatron_longstraw.step import schedule

    real, kept = schedule.score_member, []

    def recording(*args, keep_pages=False, **kwargs):
        kept.append(keep_pages)
        return real(*args, keep_pages=keep_pages, **kwargs)

    cfg, model = _model("glm52")
    group = _group(cfg.vocab_size)
    monkeypatch.setattr(schedule, "score_member", recording)
    with_pages = train_on_capture(model, torch.optim.SGD(model.parameters(), lr=0.3), group,
                                  _settings(response_block=2, reuse_branch_pages=True), updates=K)
    assert kept == [True] * G + [False] * (G * (K - 1)) + [True] * (G * (K - 1))
    _, model = _model("glm52")
    plain = train_on_capture(model, torch.optim.SGD(model.parameters(), lr=0.3), group,
                             _settings(response_block=2), updates=K)
    for a, b in zip(with_pages, plain):
        for x, y in zip(a.logps, b.logps):
            assert torch.allclose(x, y, rtol=0, atol=1e-12)
