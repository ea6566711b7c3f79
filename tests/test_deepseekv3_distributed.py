"""DeepSeek-V3 with CP and EP folded on the same ranks, on real processes over gloo: CP2/EP2 equals
one process in log-probs, finalized gradients and the AdamW update; each rank's latent pages are
exactly its prompt shard's rows of the one-process pages.

Tolerance (fp64, 1e-9, relative for gradients and parameters): the layouts differ from one process
only in summation order (the ring's and the branch's log-sum-exp merges, the gradient sums over
CP); observed ~1e-15. A lost or doubled contribution (a branch key counted on both ranks, a
gradient averaged instead of summed) is ~1e-1 or a factor 2."""

import pytest
import torch

import dist_workers
import dist_workers_deepseekv3
from distributed import run_ranks
from megatron_longstraw.context.capture import capture_prompt
from test_deepseekv3 import build_tiny_deepseekv3

pytestmark = pytest.mark.usefixtures("single_process")

PROMPT_LEN = 150   # CP2: shards of 74-75 rows, 4 load-balanced chunks, > token_block 50
LENS = (1, 6, 17)  # a one-token response, and 17 rows padded to 18 on CP2


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process: the step's results and the captured pages, from the weights the ranks load."""
    cfg, model = build_tiny_deepseekv3(torch.float64)
    path = tmp_path_factory.mktemp("weights") / "tiny_deepseekv3.pt"
    state = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    torch.save(state, path)
    group = dist_workers.groups_for(cfg, 1, prompt_len=PROMPT_LEN, lens=LENS)[0]
    result = dist_workers.step(model, cfg, [group], 1)
    model.load_state_dict(state, strict=False)
    captured = capture_prompt(model, group.prompt_ids, dist_workers.longstraw_cfg(len(LENS)))
    pages = {layer: captured.pages.fetch(layer, "latent").clone()
             for layer in captured.pages.layers()}
    return {"path": str(path), "cfg": cfg, "result": result, "pages": pages}


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def test_cp2_ep2_equals_single_process(reference):
    ref = reference["result"]
    outs = run_ranks(dist_workers_deepseekv3.layout_worker, 2, cp=2, ep=2,
                     state_path=reference["path"], prompt_len=PROMPT_LEN, lens=LENS, repeat=2)
    worst = {"logp": 0.0, "grad": 0.0, "param": 0.0, "pages": 0.0}
    assert sorted(o["ep_rank"] for o in outs) == [0, 1]      # experts really are split
    for out in outs:
        run = out["runs"][0]
        for got, exp in zip(run["logps"][0], ref["logps"][0]):
            worst["logp"] = max(worst["logp"], float((got - exp).abs().max()))
        assert run["grads"].keys() <= ref["grads"].keys()
        for name, grad in run["grads"].items():
            worst["grad"] = max(worst["grad"], _rel(grad, ref["grads"][name]))
        for name, param in run["params"].items():
            worst["param"] = max(worst["param"], _rel(param, ref["params"][name]))
        assert abs(run["grad_norm"] - ref["grad_norm"]) <= 1e-9 * ref["grad_norm"]
        # Pages: this rank's rows of the one-process latent pages, in its shard's order.
        assert sorted(out["pages"]) == sorted(reference["pages"])
        for layer, page in out["pages"].items():
            expected = reference["pages"][layer][out["positions"]]
            worst["pages"] = max(worst["pages"], float((page - expected).abs().max()))
        # Two runs from the same weights give bitwise identical results.
        second = out["runs"][1]
        assert all(torch.equal(second["grads"][n], g) for n, g in run["grads"].items())
    # Every expert's gradient exists on its owner; every dense gradient on every rank.
    assert set().union(*(o["runs"][0]["grads"].keys() for o in outs)) == set(ref["grads"])
    for name in ref["params"]:   # replicas identical after the step
        copies = [o["runs"][0]["params"][name] for o in outs if name in o["runs"][0]["params"]]
        assert all(torch.equal(c, copies[0]) for c in copies), name
    print(f"DeepSeek-V3 CP2/EP2 vs one process (fp64): max |dlogp| {worst['logp']:.2e}, grad rel "
          f"{worst['grad']:.2e}, param rel {worst['param']:.2e}, pages {worst['pages']:.2e}")
    assert all(v <= 1e-9 for v in worst.values()), worst
