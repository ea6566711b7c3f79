"""Training checkpoints (megatron_longstraw/checkpointing/checkpoint.py): resuming equals not stopping, bit for
bit (fp64, AdamW, the real LongStraw step); a save that crashes half-way leaves the previous
checkpoint and `latest` intact; CP2/EP2 saves rank-local shards with global expert names and
resumes exactly; a run with another layout is refused with a clear message."""

import os

import pytest
import torch

from distributed import run_ranks
from helpers import build_tiny_glm
from megatron_longstraw.checkpointing import checkpoint, model_format
from megatron_longstraw.checkpointing.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.usefixtures("single_process")

PROMPT_LEN, GROUP_SIZE, RESPONSE_LEN = 100, 2, 8
OTHER_SEED = 7  # a "fresh" model starts from different weights: loading must overwrite them all


def _groups(cfg):
    from megatron_longstraw.data.groups import synthetic_group

    return [synthetic_group(cfg.vocab_size, PROMPT_LEN, GROUP_SIZE, RESPONSE_LEN, seed=s)
            for s in (0, 1)]


def _train_step(model, optimizer, group):
    from megatron_longstraw.config.settings import LongStrawConfig
    from megatron_longstraw.step.schedule import train_step

    cfg = LongStrawConfig.of(group_size=GROUP_SIZE, max_response_len=2 * RESPONSE_LEN)
    return train_step(model, optimizer, group, cfg, max_grad_norm=1.0)


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def _params(model):
    from megatron_longstraw.distributed.expert_names import global_name

    n = model.longstraw_config.n_routed_experts
    return {global_name(name, n): p.detach().clone() for name, p in model.named_parameters()}


def test_resume_equals_uninterrupted(tmp_path):
    cfg, model = build_tiny_glm(torch.float64)
    optimizer = _optimizer(model)
    first, second = _groups(cfg)
    _train_step(model, optimizer, first)
    saved = save_checkpoint(tmp_path, model, optimizer, 1, extra={"data_position": 1})
    rng_at_save = torch.get_rng_state()
    _train_step(model, optimizer, second)                      # the run that did not stop
    straight = _params(model)

    torch.rand(5)                                              # move the RNG on
    _, fresh = build_tiny_glm(torch.float64, seed=OTHER_SEED)
    fresh_optimizer = _optimizer(fresh)
    assert latest_checkpoint(tmp_path) == saved == tmp_path / "step_00000001"
    step, extra = load_checkpoint(tmp_path, fresh, fresh_optimizer)
    assert (step, extra) == (1, {"data_position": 1})
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    _train_step(fresh, fresh_optimizer, second)                # the resumed run
    resumed = _params(fresh)
    assert straight.keys() == resumed.keys()
    different = [n for n in straight if not torch.equal(straight[n], resumed[n])]
    assert not different, different[:5]


def _fake_step(model, optimizer, value):
    """An optimizer step without a forward pass (fills the AdamW state cheaply)."""
    for p in model.parameters():
        p.grad = torch.full_like(p, value)
    optimizer.step()


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    cfg, model = build_tiny_glm(torch.float64)
    optimizer = _optimizer(model)
    _fake_step(model, optimizer, 0.5)
    save_checkpoint(tmp_path, model, optimizer, 1)
    good = _params(model)
    latest_before = (tmp_path / "latest").read_text()

    _fake_step(model, optimizer, -0.25)

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash while writing the rank state")

    monkeypatch.setattr(checkpoint, "_rank_state", crash)  # after model.safetensors is written
    with pytest.raises(RuntimeError, match="simulated crash"):
        save_checkpoint(tmp_path, model, optimizer, 2)
    partial = tmp_path / ".tmp-step_00000002"
    assert (partial / "model.safetensors").exists() and not (partial / "meta.json").exists()
    assert not (tmp_path / "step_00000002").exists()
    assert (tmp_path / "latest").read_text() == latest_before
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"

    _, fresh = build_tiny_glm(torch.float64, seed=OTHER_SEED)
    fresh_optimizer = _optimizer(fresh)
    step, _ = load_checkpoint(latest_checkpoint(tmp_path), fresh, fresh_optimizer)
    assert step == 1
    assert all(torch.equal(p, good[n]) for n, p in _params(fresh).items())
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 1

    monkeypatch.undo()  # the next save succeeds and removes the leftover
    save_checkpoint(tmp_path, model, optimizer, 2, keep_last=1)
    assert not partial.exists()
    assert (tmp_path / "latest").read_text().strip() == "step_00000002"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002"]


def resume_worker(rank, save_dir, model_dir):
    """CP2/EP2: step, save, step (uninterrupted) vs fresh model + load + step (resumed)."""
    from megatron_longstraw.distributed import parallel

    parallel.initialize(context_parallel_size=2, expert_parallel_size=2,
                        init_method=os.environ["LONGSTRAW_TEST_INIT"])
    cfg, model = build_tiny_glm(torch.float64)
    optimizer = _optimizer(model)
    first, second = _groups(cfg)
    _train_step(model, optimizer, first)
    save_checkpoint(save_dir, model, optimizer, 1, extra={"rank": rank})
    _train_step(model, optimizer, second)
    straight = _params(model)

    _, fresh = build_tiny_glm(torch.float64, seed=OTHER_SEED)
    fresh_optimizer = _optimizer(fresh)
    step, extra = load_checkpoint(latest_checkpoint(save_dir), fresh, fresh_optimizer)
    _train_step(fresh, fresh_optimizer, second)
    model_format.save_model(model_dir, fresh)  # collective: gathers every expert
    resumed = _params(fresh)
    # LoRA on every linear, experts included, then merged export: gathers merged experts too.
    from megatron_longstraw.adapters.lora import LoRAConfig, apply_lora, lora_modules
    from megatron_longstraw.models.glm52.family import LORA_TARGETS as GLM52_TARGETS
    from megatron_longstraw.adapters.lora import merged_state_dict
    from megatron_longstraw.distributed.expert_names import global_name

    apply_lora(fresh, LoRAConfig(rank=2, targets=GLM52_TARGETS))
    with torch.no_grad():
        for _, module in lora_modules(fresh):
            module.lora_B.normal_(generator=torch.Generator().manual_seed(3))
    merged = {global_name(n, cfg.n_routed_experts): t.clone()
              for n, t in merged_state_dict(fresh).items() if isinstance(t, torch.Tensor)}
    model_format.save_model(f"{model_dir}-merged", fresh, merge_adapters=True)
    return {"step": step, "extra": extra, "straight": straight, "resumed": resumed,
            "merged": merged}


def test_cp2_ep2_save_resume_and_layout_mismatch(tmp_path):
    save_dir, model_dir = tmp_path / "run", tmp_path / "weights"
    outs = run_ranks(resume_worker, 2, timeout=300, save_dir=str(save_dir),
                     model_dir=str(model_dir))
    for rank, out in enumerate(outs):
        assert (out["step"], out["extra"]) == (1, {"rank": rank})
        different = [n for n in out["straight"]
                     if not torch.equal(out["straight"][n], out["resumed"][n])]
        assert not different, (rank, different[:5])

    ckpt = save_dir / "step_00000001"
    assert sorted(os.listdir(ckpt)) == ["experts_ep000.safetensors", "experts_ep001.safetensors",
                                        "meta.json", "model.safetensors", "rank_00000.pt",
                                        "rank_00001.pt"]
    # Each EP rank's shard holds its own experts under their global index (4 of 8 per layer).
    for ep_rank, experts in ((0, range(0, 4)), (1, range(4, 8))):
        names = set(model_format.SafetensorsReader([ckpt / f"experts_ep{ep_rank:03d}.safetensors"]))
        found = {int(n.split("local_experts.")[1].split(".")[0]) for n in names}
        assert found == set(experts), (ep_rank, found)

    # save_model under EP2 wrote every expert once: the union of both ranks' parameters.
    meta, weights = model_format.read_model(model_dir)
    assert meta["parallel"]["expert_parallel_size"] == 2
    union = {**outs[0]["resumed"], **outs[1]["resumed"]}
    assert set(union) <= set(weights)
    assert all(torch.equal(weights[n], union[n]) for n in union)
    # The merged export under EP2: W + s B A of every rank's experts, the names of a plain model.
    _, merged = model_format.read_model(f"{model_dir}-merged")
    union = {**outs[0]["merged"], **outs[1]["merged"]}
    assert set(merged) == set(weights) and set(union) >= set(merged)
    assert all(torch.equal(merged[n], union[n]) for n in merged)
    expert = "decoder.layers.7.mlp.experts.local_experts.5.linear_fc1.weight"   # EP rank 1's
    assert expert in outs[1]["merged"] and not torch.equal(merged[expert], weights[expert])

    # This process is CP1/EP1: the CP2/EP2 checkpoint is refused, and nothing is modified.
    _, model = build_tiny_glm(torch.float64)
    before = _params(model)
    with pytest.raises(ValueError, match=r"checkpoint was saved with CP=2/EP=2, this run has "
                                         r"CP=1/EP=1; .*same context- and expert-parallel sizes"):
        load_checkpoint(save_dir, model, _optimizer(model))
    assert all(torch.equal(p, before[n]) for n, p in _params(model).items())
