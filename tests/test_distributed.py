"""CP and EP folded on the same ranks, on real processes over gloo: log-probs, global DSA
selections, finalized gradients and the optimizer update equal a single process running the whole
step; failures and disagreements between ranks end the run cleanly."""

import pytest
import torch

import dist_workers
from distributed import run_ranks, run_ranks_expect_failure
from helpers import build_tiny_glm

pytestmark = pytest.mark.usefixtures("single_process")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process results for 1 and 2 groups from the same weights (saved for the ranks)."""
    cfg, model = build_tiny_glm(torch.float64)
    path = tmp_path_factory.mktemp("weights") / "tiny_glm.pt"
    state = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    torch.save(state, path)
    results = {}
    for num_groups in (1, 2):
        model.load_state_dict(state, strict=False)
        results[num_groups] = dist_workers.step(
            model, cfg, dist_workers.groups_for(cfg, num_groups), num_groups)
    return {"path": str(path), "cfg": cfg, **results}


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _check_layout(reference, outs, num_groups, world):
    ref = reference[num_groups]
    worst = {"logp": 0.0, "grad": 0.0, "param": 0.0}
    for out in outs:
        run = out["runs"][0]
        groups_here = list(range(num_groups))[out["dp_rank"]::num_groups if num_groups > 1 else 1]
        for local_g, g in enumerate(groups_here):
            for got, exp in zip(run["logps"][local_g], ref["logps"][g]):
                worst["logp"] = max(worst["logp"], float((got - exp).abs().max()))
            # Global DSA top-k: the same key positions a single process selects.
            for sel_got, sel_ref in zip(run["selections"][local_g], ref["selections"][g]):
                assert sel_got.keys() == sel_ref.keys()
                for layer in sel_ref:
                    rows = sel_ref[layer].shape[0]
                    assert torch.equal(sel_got[layer][:rows], sel_ref[layer]), layer
        assert run["grads"].keys() <= ref["grads"].keys()
        for name, grad in run["grads"].items():
            worst["grad"] = max(worst["grad"], _rel(grad, ref["grads"][name]))
        for name, param in run["params"].items():
            worst["param"] = max(worst["param"], _rel(param, ref["params"][name]))
        assert abs(run["grad_norm"] - ref["grad_norm"]) <= 1e-9 * ref["grad_norm"]
    # Every expert's gradient exists on its owner; every dense gradient on every rank.
    owned = set().union(*(o["runs"][0]["grads"].keys() for o in outs))
    assert owned == set(ref["grads"])
    # Replicas are identical after the step.
    for name in ref["params"]:
        copies = [o["runs"][0]["params"][name] for o in outs if name in o["runs"][0]["params"]]
        assert all(torch.equal(c, copies[0]) for c in copies), name
    print(f"world {world}: max |dlogp| {worst['logp']:.2e}, grad rel {worst['grad']:.2e}, "
          f"param rel {worst['param']:.2e}")
    # fp64: the layouts differ from one process only in summation order.
    assert worst["logp"] <= 1e-9 and worst["grad"] <= 1e-9 and worst["param"] <= 1e-9


@pytest.mark.parametrize("world,layouts", [(2, [(2, 2, 2)]), (4, [(4, 4, 2), (4, 2, 1)])])
def test_cp_ep_layout_equals_single_process(reference, world, layouts):
    """CP x EP (cp, ep, runs) on `world` processes, the layouts of one world in one spawn."""
    outs = run_ranks(dist_workers.layouts_worker, world, layouts=layouts,
                     state_path=reference["path"], num_groups_total=1)
    for i, (cp, _, repeat) in enumerate(layouts):
        case = [out[i] for out in outs]
        _check_layout(reference, case, 1, cp)
        if repeat < 2:
            continue
        # Two runs from the same weights give bitwise identical results.
        for out in case:
            first, second = out["runs"]
            for name in first["grads"]:
                assert torch.equal(first["grads"][name], second["grads"][name]), name
            assert all(torch.equal(a, b) for a, b in zip(first["logps"][0], second["logps"][0]))


def test_dp_by_cp_layout_equals_single_process(reference):
    # 4 ranks: DP 2 x CP 2 (EP 2 folded on CP); each DP replica runs its own GRPO group.
    outs = run_ranks(dist_workers.layout_worker, 4, cp=2, ep=2, state_path=reference["path"],
                     num_groups_total=2)
    assert sorted(o["dp_rank"] for o in outs) == [0, 0, 1, 1]
    _check_layout(reference, outs, 2, 4)


def test_failing_rank_brings_every_rank_down():
    elapsed, outcome = run_ranks_expect_failure(dist_workers.failing_capture_worker, 2,
                                                timeout=240, cp=2, failing_rank=1)
    assert "hung" not in outcome.values() and "ok" not in outcome.values(), outcome
    assert "injected failure on rank 1" in outcome[1]
    assert elapsed < 200


@pytest.mark.parametrize("what,needle", [("prompt", "prompt_len"),
                                         ("group_size", "rank 1")])
def test_disagreeing_ranks_detected_before_work(what, needle):
    elapsed, outcome = run_ranks_expect_failure(dist_workers.mismatch_worker, 2, timeout=240,
                                                what=what)
    assert set(outcome) == {0, 1}
    assert all(needle in msg for msg in outcome.values()), outcome


def test_stock_finalize_model_grads_is_wrong_under_longstraw(reference):
    """Megatron's stock DDP + finalize_model_grads on the same CP2/EP2 step. Its default averages
    over DP x CP: every gradient comes out CP = 2 times too small. Its per-token-loss mode divides
    by the global response-token count the loss already divided by. finalize.py sums instead."""
    outs = run_ranks(dist_workers.stock_finalize_worker, 2, state_path=reference["path"])
    for ratios in outs:  # each list: the distinct stock / correct ratios over all parameters
        assert ratios[False]["dense"] == pytest.approx([0.5], rel=1e-6)
        assert ratios[False]["expert"] == pytest.approx([0.5], rel=1e-6)
        tokens = ratios[True]["num_tokens"] * 2  # Megatron sums the count over DP x CP
        assert ratios[True]["dense"] == pytest.approx([1 / tokens], rel=1e-6)
        assert ratios[True]["expert"] == pytest.approx([1 / tokens], rel=1e-6)


def test_prompt_shards_shorter_than_topk(reference):
    """23 tokens on CP2: shards of 12 and 10 keys against top-k 16 (uneven candidate widths)."""
    cfg = reference["cfg"]
    group = dist_workers.groups_for(cfg, 1, prompt_len=23)[0]
    _, model = build_tiny_glm(torch.float64)
    model.load_state_dict(torch.load(reference["path"]), strict=False)
    from megatron_longstraw.step.schedule import forward_backward_longstraw

    expected = forward_backward_longstraw(model, group, dist_workers.longstraw_cfg(3)).logps
    outs = run_ranks(dist_workers.short_prompt_worker, 2, state_path=reference["path"],
                     prompt_len=23)
    for out in outs:
        for got, exp in zip(out["logps"], expected):
            assert (got - exp).abs().max() <= 1e-9
        # A plain forward under CP has no layout: refused, not silently shard-local.
        assert "no context-parallel layout" in out["plain_forward"], out["plain_forward"]


def test_a_one_process_group_leaves_no_rendezvous_for_its_children():
    """A one-process group started without a launcher uses an in-process store: it sets no
    RANK/MASTER_PORT a child process would inherit, so a tool this process starts (the bench
    tests run tools that initialise their own group) starts its own group instead of failing on
    the parent's port (EADDRINUSE, as CI saw)."""
    import os
    import subprocess
    import sys

    from helpers import ROOT

    code = ("import os, subprocess, sys\n"
            "from megatron_longstraw.distributed import parallel\n"
            "parallel.initialize()\n"
            "assert not {'RANK', 'MASTER_PORT'} & set(os.environ), sorted(os.environ)\n"
            "child = 'from megatron_longstraw.distributed import parallel; parallel.initialize(); "
            "import torch.distributed as d; print(d.get_world_size())'\n"
            "out = subprocess.run([sys.executable, '-c', child], capture_output=True, text=True)\n"
            "assert out.returncode == 0 and out.stdout.strip() == '1', out.stderr[-1500:]\n"
            "print('ok')\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**env, "TORCHDYNAMO_DISABLE": "1", "PYTHONWARNINGS": "ignore"},
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
