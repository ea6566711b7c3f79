"""Initial weights do not depend on the CP / EP layout (models/expert_init.py): the same seed
gives the same full (EP 1 names) state dict at EP 1, EP 2, CP 2, CP 2 x EP 2, bitwise, and the
launcher's one-step demo reports the same gradient norm on 1 and 2 processes.

Before the fix an EP rank drew its experts where rank 0 draws its own, and every layer after the
first MoE layer drew from a stream shifted by the number of local experts: 110 of GLM-5.2's 201
tensors differed at EP 2, and the demo's gradient norm with them.

The gradient-norm tolerance (relative 1e-5) is fp32 summation order: the layouts sum the same
partial gradients in another order (CP's log-sum-exp merges and gradient sums); a different
initial weight moves the norm by percents."""

import json
from pathlib import Path

import pytest
import torch

import dist_workers_init
from distributed import run_ranks
import processes

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("family", ["glm52", "deepseekv3"])
def test_initial_weights_equal_across_layouts(family):
    one = run_ranks(dist_workers_init.initial_weights_worker, 1, family=family,
                    layouts=[(1, 1)], seed=1234)[0][0]
    layouts = [(2, 2), (1, 2), (2, 1)]
    two = run_ranks(dist_workers_init.initial_weights_worker, 2, family=family,
                    layouts=layouts, seed=1234)[0]
    for (cp, ep), full in zip(layouts, two):
        assert full.keys() == one.keys(), (cp, ep)
        differ = [n for n in one if not torch.equal(one[n], full[n])]
        assert not differ, f"CP{cp}/EP{ep}: {len(differ)} tensors differ, e.g. {differ[:3]}"
    # The experts are not one draw repeated: every expert of a layer differs from the others.
    experts = [t for n, t in one.items()
               if ".mlp.experts.local_experts." in n and n.endswith("linear_fc1.weight")]
    assert len(experts) >= 8 and len({float(t.sum()) for t in experts}) == len(experts)
    other_seed = run_ranks(dist_workers_init.initial_weights_worker, 1, family=family,
                           layouts=[(1, 1)], seed=1235)[0][0]
    assert not torch.equal(other_seed[next(n for n in one if "local_experts.0." in n)],
                           one[next(n for n in one if "local_experts.0." in n)])


def _demo_grad_norm(tmp_path: Path, nproc: int) -> float:
    """The Makefile's demo command (glm52, CP = EP = nproc, seed 1234, G = 4) on a 1024-token
    prompt: the step's gradient norm from the receipt."""
    out = processes.run(
        [str(ROOT / ".venv" / "bin" / "torchrun"), "--standalone", "--nproc-per-node", str(nproc),
         str(ROOT / "examples" / "pretrain_gpt.py"), "--longstraw",
         "--context-parallel-size", str(nproc), "--expert-model-parallel-size", str(nproc),
         "--train-iters", "1", "--lr", "1e-4", "--clip-grad", "1.0", "--seed", "1234",
         "--longstraw-group-size", "4", "--longstraw-config", "examples/glm52/tiny.yaml",
         "--longstraw-synthetic-prompt-len", "1024", "--longstraw-out-dir", str(tmp_path),
         "--longstraw-run-name", f"n{nproc}", "--tensorboard-dir", str(tmp_path / f"tb{nproc}")],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "TORCHDYNAMO_DISABLE": "1", "PYTHONWARNINGS": "ignore",
             "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    receipt = json.loads((tmp_path / f"n{nproc}" / "receipt.json").read_text())
    return receipt["stats"]["grad_norm"]


def test_demo_grad_norm_equal_on_1_and_2_processes(tmp_path):
    one, two = _demo_grad_norm(tmp_path, 1), _demo_grad_norm(tmp_path, 2)
    assert two == pytest.approx(one, rel=1e-5), (one, two)
