"""Qwen3.6 under context parallelism, on real processes over gloo: CP2 and CP4 equal one process in
log-probs, gradients and the optimizer update; each rank's captured GDN state and conv tail are
exactly its heads' slice of the one-process state (the recurrence is exact across prompt shards);
each rank's K/V pages are its prompt shard's rows."""

import pytest
import torch

import dist_workers
from distributed import run_ranks
from helpers import build_tiny_qwen
from megatron_longstraw.context.capture import capture_prompt
from megatron_longstraw.models.qwen36.gdn import CONV_TAIL, GDN_STATE

pytestmark = pytest.mark.usefixtures("single_process")

PROMPT_LEN = 150   # CP4: shards of 37-38 rows, 8 load-balanced chunks; > 2 delta-rule chunks
LENS = (1, 6, 17)  # a one-token response, and 17 rows padded to 20 on CP4


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process: the step's results, and the captured pages, from the weights the ranks load."""
    cfg, model = build_tiny_qwen(torch.float64)
    path = tmp_path_factory.mktemp("weights") / "tiny_qwen.pt"
    state = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    torch.save(state, path)
    group = dist_workers.groups_for(cfg, 1, prompt_len=PROMPT_LEN, lens=LENS)[0]
    result = dist_workers.step(model, cfg, [group], 1)
    model.load_state_dict(state, strict=False)
    captured = capture_prompt(model, group.prompt_ids, dist_workers.longstraw_cfg(len(LENS)))
    pages = {(layer, kind): captured.pages.fetch(layer, kind).clone()
             for layer in captured.pages.layers() for kind in captured.pages.kinds(layer)}
    return {"path": str(path), "cfg": cfg, "result": result, "pages": pages}


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _head_slice(cfg, kind, tensor, rank, cp):
    """This rank's share of a one-process GDN page: value heads for the state; for the conv tail
    the channels of its query/key heads and value heads (sections [q; k; v] cut per rank)."""
    if kind == GDN_STATE:
        per = tensor.shape[0] // cp
        return tensor[rank * per:(rank + 1) * per]
    qk = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    sections = torch.split(tensor, [qk, qk, tensor.shape[1] - 2 * qk], dim=1)
    return torch.cat([s.chunk(cp, dim=1)[rank] for s in sections], dim=1)


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_equals_single_process(reference, cp):
    cfg, ref = reference["cfg"], reference["result"]
    outs = run_ranks(dist_workers.qwen_layout_worker, cp, cp=cp, state_path=reference["path"],
                     prompt_len=PROMPT_LEN, lens=LENS, repeat=2 if cp == 2 else 1)
    worst = {"logp": 0.0, "grad": 0.0, "param": 0.0, "state": 0.0}
    for rank, out in enumerate(outs):
        run = out["runs"][0]
        for got, exp in zip(run["logps"][0], ref["logps"][0]):
            worst["logp"] = max(worst["logp"], float((got - exp).abs().max()))
        assert run["grads"].keys() == ref["grads"].keys()
        for name, grad in run["grads"].items():
            worst["grad"] = max(worst["grad"], _rel(grad, ref["grads"][name]))
        for name, param in run["params"].items():
            worst["param"] = max(worst["param"], _rel(param, ref["params"][name]))
        assert abs(run["grad_norm"] - ref["grad_norm"]) <= 1e-9 * ref["grad_norm"]
        for again in out["runs"][1:]:  # a second run from the same weights: bitwise identical
            assert all(torch.equal(again["grads"][n], g) for n, g in run["grads"].items())
        # Pages: GDN state and conv tail are this rank's heads of the one-process pages; K/V pages
        # are the one-process rows at this rank's prompt positions.
        assert {k for k, _ in out["pages"]} == {k for k, _ in reference["pages"]}
        for (layer, kind), tensor in out["pages"].items():
            full = reference["pages"][(layer, kind)]
            if kind in (GDN_STATE, CONV_TAIL):
                expected = _head_slice(cfg, kind, full, rank, cp)
            else:
                expected = full[out["positions"]]
            assert tensor.shape == expected.shape, (layer, kind)
            worst["state"] = max(worst["state"], _rel(tensor, expected))
        # A plain forward under CP has no layout: refused, not silently shard-local.
        assert "context parallel" in out["plain_forward"], out["plain_forward"]
    # Replicas are identical after the step.
    for name in ref["params"]:
        assert all(torch.equal(o["runs"][0]["params"][name], outs[0]["runs"][0]["params"][name])
                   for o in outs), name
    print(f"CP{cp}: max |dlogp| {worst['logp']:.2e}, grad rel {worst['grad']:.2e}, "
          f"param rel {worst['param']:.2e}, pages rel {worst['state']:.2e}")
    # fp64: the layouts differ from one process only in summation order.
    assert max(worst.values()) <= 1e-9, worst
