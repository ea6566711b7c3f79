"""Nothing derived from the weights goes stale across optimizer steps (issue: several updates per
capture, item 3).

Every quantity the model computes from its parameters is recomputed from them at each use: NF4
and FP8 base weights are dequantised per GEMM (kernels/nf4.py, kernels/fp8.py), LoRA's effective
weight `base + scaling B A` and MLA's absorbed W_UK / W_UV are formed from `.weight` per call
(adapters/lora.py, models/mla.py), the Gated DeltaNet decay `g = -exp(A_log) softplus(a + dt_bias)`
per chunk (models/qwen36/gdn.py), and decode runs the same modules. These tests hold that: the model
takes two real AdamW steps over one capture (`train_on_capture`, K = 2), then every path (capture +
scoring as training uses them, a plain full-sequence forward, decode, the merged export) must
give exactly what a model built fresh from the new weights gives. Each also checks that the step
moved that path (so a stale copy would be seen), and that the KL reference (the adapters off)
did not move. The prompt's pages are the one cache reused on purpose (measured: test_capture_reuse.py)."""

from __future__ import annotations

import pytest
import torch

from helpers import build_tiny_glm, build_tiny_qwen
from megatron_longstraw.adapters.lora import (
    LoRAConfig, apply_lora, lora_modules, merge_adapters, merged_state_dict, reference_view,
    unmerge_adapters,
)
from megatron_longstraw.config.sampling import SamplingParams
from megatron_longstraw.config.settings import LongStrawConfig
from megatron_longstraw.context.capture import capture_prompt
from megatron_longstraw.data.group import GRPOGroup
from megatron_longstraw.rollout.decode import generate
from megatron_longstraw.step.replay import score_member
from megatron_longstraw.step.schedule import (
    forward_backward_longstraw, train_on_capture, train_step,
)

pytestmark = pytest.mark.usefixtures("single_process")

G, K = 2, 2
SMALL = dict(num_hidden_layers=4)   # 3 dense layers and one MoE layer
LS = dict(group_size=G, max_response_len=8, query_block=7, key_block=11, token_block=13)


def _base(family, dtype):
    if family == "qwen36":
        return build_tiny_qwen(dtype)
    if family == "deepseekv3":
        from test_deepseekv3 import build_tiny_deepseekv3

        return build_tiny_deepseekv3(dtype)
    return build_tiny_glm(dtype, **SMALL)


def _lora_cfg():
    from megatron_longstraw.models.glm52.family import LORA_TARGETS

    return LoRAConfig(rank=4, alpha=8.0, targets=LORA_TARGETS)


def _build(case):
    """(model config, model) of a case: a family trained in full, or GLM-5.2 with LoRA over a
    bf16-like plain, NF4 or FP8 base. Deterministic: the same case builds the same model."""
    family, base = case
    dtype = torch.float32 if base in ("nf4", "fp8") else torch.float64
    cfg, model = _base(family, dtype)
    if base == "fp8":
        from megatron_longstraw.adapters.fp8_base import apply_fp8_base
        from megatron_longstraw.models.glm52.family import FP8_LINEARS

        apply_fp8_base(model, FP8_LINEARS)
    if base != "full":
        apply_lora(model, _lora_cfg(), quantize_base=base == "nf4")
    return cfg, model


def _group(vocab, members, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return GRPOGroup(torch.randint(vocab, (29,), generator=gen),
                     [torch.randint(vocab, (n,), generator=gen) for n in (4, 6, 3, 5)[:members]],
                     rewards=torch.tensor([1.0, 0.0, 0.25, 0.75][:members], dtype=torch.float64))


def _paths(model, vocab, ls) -> dict[str, torch.Tensor]:
    """Every way the run computes from the weights, on fixed inputs: scoring over a capture (the
    training path), a plain full-sequence forward, decode's tokens and log-probs, and for LoRA
    the KL reference (adapters off)."""
    group = _group(vocab, 3, seed=5)
    out = {}
    with torch.no_grad():
        captured = capture_prompt(model, group.prompt_ids, ls)
        out["scoring"] = torch.cat([score_member(model, captured, r, ls)[0].double()
                                    for r in group.response_ids])
        ids = torch.cat([group.prompt_ids, group.response_ids[1]])
        out["forward"] = torch.log_softmax(model(ids[None], None, None).double(), dim=-1)
        made = generate(model, captured, 2, SamplingParams(max_new_tokens=5, seed=3), ls)
        out["decode tokens"] = torch.cat([m.token_ids for m in made])
        out["decode logprobs"] = torch.cat([m.logprobs.double() for m in made])
        if any(True for _ in lora_modules(model)):
            ref = reference_view(model)
            out["reference"] = torch.log_softmax(ref(ids[None], None, None).double(), dim=-1)
    return out


def _step(model, cfg, ls):
    """Two real AdamW steps over one capture; every parameter with a gradient moves (the DSA
    indexer is not trained by the policy loss, an expert no token chose gets none)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=2e-2, weight_decay=0.0)
    before = [p.detach().clone() for p in trainable]
    results = train_on_capture(model, optimizer, _group(cfg.vocab_size, G * K), ls, updates=K)
    assert len(results) == K
    moved = [not torch.equal(p, b) for p, b in zip(trainable, before)]
    assert all(m for m, p in zip(moved, trainable) if p.grad is not None and p.grad.any())
    assert sum(moved) >= len(trainable) // 2, (sum(moved), len(trainable))


CASES = [("glm52", "full"), ("qwen36", "full"), ("deepseekv3", "full"), ("glm52", "lora"),
         ("glm52", "nf4"), ("glm52", "fp8")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_every_path_after_optimizer_steps_equals_a_model_built_from_the_new_weights(case):
    cfg, model = _build(case)
    ls = LongStrawConfig.of(**LS)
    before = _paths(model, cfg.vocab_size, ls)
    _step(model, cfg, ls)
    if case == ("qwen36", "full"):   # the GDN decay's inputs are among what moved
        names = {n for n, p in model.named_parameters() if p.grad is not None}
        assert any(n.endswith("A_log") for n in names) and any(n.endswith("dt_bias") for n in names)
    after = _paths(model, cfg.vocab_size, ls)

    _, fresh = _build(case)
    missing, unexpected = fresh.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(n.endswith("_extra_state") for n in missing), (missing,
                                                                               unexpected)
    rebuilt = _paths(fresh, cfg.vocab_size, ls)
    assert after.keys() == rebuilt.keys()
    for path in after:
        assert torch.equal(after[path], rebuilt[path]), path      # same weights, same arithmetic
    assert (after["scoring"] - before["scoring"]).abs().max() > 1e-3
    assert (after["forward"] - before["forward"]).abs().max() > 1e-3
    if "reference" in after:   # the frozen base: the KL reference does not move
        assert torch.equal(after["reference"], before["reference"])


def test_the_merged_export_after_steps_is_the_trained_policy():
    """merged_state_dict of a trained LoRA model, loaded into the plain model, computes what the
    adapters do (fp64, 1e-10: one rounding of base + B A per weight); merging for export and
    unmerging gives back the model that trains."""
    cfg, model = _build(("glm52", "lora"))
    ls = LongStrawConfig.of(**LS)
    _step(model, cfg, ls)
    _, plain = build_tiny_glm(torch.float64, **SMALL)
    missing, unexpected = plain.load_state_dict(merged_state_dict(model), strict=False)
    assert not unexpected and all(n.endswith("_extra_state") for n in missing)
    trained, exported = _paths(model, cfg.vocab_size, ls), _paths(plain, cfg.vocab_size, ls)
    for path in ("scoring", "forward", "decode logprobs"):
        assert torch.allclose(exported[path], trained[path], rtol=0, atol=1e-10), path
    assert torch.equal(exported["decode tokens"], trained["decode tokens"])
    merge_adapters(model)
    merged = _paths_without_reference(model, cfg.vocab_size, ls)
    assert torch.allclose(merged["scoring"], trained["scoring"], rtol=0, atol=1e-10)
    unmerge_adapters(model)
    assert torch.allclose(_paths(model, cfg.vocab_size, ls)["scoring"], trained["scoring"],
                          rtol=0, atol=1e-10)


def _paths_without_reference(model, vocab, ls):
    group = _group(vocab, 3, seed=5)
    with torch.no_grad():
        captured = capture_prompt(model, group.prompt_ids, ls)
        return {"scoring": torch.cat([score_member(model, captured, r, ls)[0].double()
                                      for r in group.response_ids])}


def test_training_a_model_with_merged_adapters_is_refused():
    """A merged adapter's update sits in the base weight and the forward skips the adapter: a step
    would move adapters nothing reads. Refused before any work; scoring (forward only) runs."""
    cfg, model = _build(("glm52", "lora"))
    merge_adapters(model)
    ls = LongStrawConfig.of(**LS)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    group = _group(cfg.vocab_size, G)
    with pytest.raises(ValueError, match=r"LoRA adapters are merged into their base weights .*"
                                         r"unmerge_adapters\(model\) before training"):
        train_step(model, optimizer, group, ls)
    with pytest.raises(ValueError, match="unmerge_adapters"):
        train_on_capture(model, optimizer, _group(cfg.vocab_size, G * K), ls, updates=K)
    assert all(p.grad is None for p in model.parameters())
    result = forward_backward_longstraw(model, group, ls, forward_only=True)
    assert all(torch.isfinite(lp).all() for lp in result.logps)
