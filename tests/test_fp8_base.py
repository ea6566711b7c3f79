"""The FP8 frozen base (megatron_longstraw/adapters/fp8_base.py, `--longstraw-fp8-base`) on the tiny GLM-5.2:
its forward equals the model holding the dequantised weights (bitwise, fp32 and fp64), a LongStraw
step changes only the adapters (FP8 bytes and every base tensor bitwise unchanged, the experts in
FP8 without adapters), a model-format directory with FP8 weights loads dequantised or kept as
stored, the planner's FP8 weight bytes equal the model's resident bytes, and misfits are refused
with the tensor or flag named.

Why bitwise: an FP8 layer computes `torch.matmul(x, W.t())` (Megatron's product) with W
dequantised in x's precision, so a plain layer holding that W computes the same bits; the tiny
weights fit one dequantise slice (fp8.SLICE_VALUES). The FP8 error itself (~2^-4 of each weight)
shows in the logits against the unquantised model (> 1e-4)."""

import pytest
import torch

from helpers import TINY_GLM, build_tiny_glm
from megatron_longstraw.kernels import fp8
from megatron_longstraw.checkpointing import model_format
from megatron_longstraw.training import train
from megatron_longstraw.adapters.lora import LoRAConfig, apply_lora, lora_modules, reference_view
from megatron_longstraw.config.settings import LongStrawConfig
from megatron_longstraw.data.groups import synthetic_group
from megatron_longstraw.adapters.fp8_base import (
    FP8Linear, apply_fp8_base, fp8_base_bytes, fp8_modules, matches,
)
from megatron_longstraw.models.glm52.family import FP8_LINEARS
from megatron_longstraw.models.glm52.family import LORA_TARGETS as GLM52_TARGETS
from megatron_longstraw.planner import PlanSpec, base_weight_bytes, glm52_params
from megatron_longstraw.step.schedule import train_step

pytestmark = pytest.mark.usefixtures("single_process")

# 4 layers (3 dense, 1 MoE); intermediate 160: each half of the dense linear_fc1 spans two row
# blocks, so its two scale grids (4 rows) differ from one grid over 320 rows (3 rows).
SMALL = dict(num_hidden_layers=4, intermediate_size=160)


def _lora(**kw) -> LoRAConfig:
    return LoRAConfig(**{"rank": 4, "alpha": 8.0, "targets": GLM52_TARGETS, **kw})


def _logits(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(ids[None], None, None).double(), dim=-1)


def _ids(cfg, n=24):
    return torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(7))


def _plain_name(name: str) -> str:
    return name[:-len(".base")] if name.endswith(".base") else name


def _write_fp8_dir(path, model, cfg):
    """The model in the model format with the family's FP8 linears as a block-FP8 checkpoint
    would ship them (weight float8_e4m3fn + weight_scale_inv); returns {weight name: (q, s)}."""
    tensors = dict(model_format.full_state_dict(model))
    stored = {}
    for name in list(tensors):
        module = name[:-len(".weight")]
        if name.endswith(".weight") and module != "output_layer" and matches(module, FP8_LINEARS):
            q, s = fp8.quantize(tensors[name], name, fp8.row_parts(name))
            tensors[name], tensors[fp8.scale_name(name)] = q, s
            stored[name] = (q, s)
    model_format.write_model(path, tensors, "glm52", cfg.to_dict(), torch.float32)
    return stored


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_equals_the_dequantised_model(dtype):
    cfg, model = build_tiny_glm(dtype, **SMALL)
    _, reference = build_tiny_glm(dtype, **SMALL)
    ids = _ids(cfg)
    original = _logits(model, ids)
    summary = apply_fp8_base(model, FP8_LINEARS)
    apply_lora(model, _lora())
    assert not summary.from_checkpoint and len(summary.names) == len(dict(fp8_modules(model)))
    with torch.no_grad():                  # the plain model holding the dequantised weights
        for name, layer in fp8_modules(model):
            reference.get_submodule(_plain_name(name)).weight.copy_(layer.weight)
    out = _logits(model, ids)
    assert torch.equal(out, _logits(reference, ids))
    assert (out - original).abs().max() > 1e-4          # the FP8 rounding is there
    fc1 = model.get_submodule("decoder.layers.1.mlp.linear_fc1.base")
    assert fc1.row_parts == 2 and tuple(fc1.weight_scale_inv.shape) == (4, 1)


def test_step_changes_only_the_adapters():
    """Two LongStraw steps (KL against the adapters-off reference), experts without adapters:
    gradients reach the adapters only; FP8 bytes, scales and every other tensor are unchanged."""
    cfg, model = build_tiny_glm(torch.float32, num_hidden_layers=4)
    apply_fp8_base(model, FP8_LINEARS)
    apply_lora(model, _lora(exclude=("*.experts.*",)))
    layers = dict(fp8_modules(model))
    experts = [n for n in layers if ".experts." in n]
    assert experts and all(not n.endswith(".base") for n in experts)   # FP8, no adapters
    # No dequantised copy is resident: FP8 linears own no weight parameter.
    fp8_linears = {_plain_name(n) for n in layers}
    assert not any(n.endswith(".weight") and _plain_name(n[:-len(".weight")]) in fp8_linears
                   for n, _ in model.named_parameters())
    stored = {n: (m.weight_fp8.view(torch.uint8).clone(), m.weight_scale_inv.clone())
              for n, m in layers.items()}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    wrappers = dict(lora_modules(model))
    adapter_names = {f"{n}.{k}" for n in wrappers for k in ("lora_A", "lora_B")}
    group = synthetic_group(cfg.vocab_size, prompt_len=100, group_size=2, response_len=8, seed=1)
    ls = LongStrawConfig.of(group_size=2, max_response_len=16, token_block=64, query_block=32,
                         key_block=64, kl_coef=0.05)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2,
                                  weight_decay=0.0)
    for _ in range(2):
        train_step(model, optimizer, group, ls, ref_model=reference_view(model))
        with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
        assert with_grad and with_grad <= adapter_names
    assert all(wrappers[n].lora_B.abs().max() > 0 for n in wrappers)
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[n]), n
    for n, m in layers.items():
        assert torch.equal(m.weight_fp8.view(torch.uint8), stored[n][0]), n
        assert torch.equal(m.weight_scale_inv, stored[n][1]), n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_fp8_weights_load_as_stored_and_the_planner_counts_them(tmp_path, dtype):
    cfg, source = build_tiny_glm(torch.float32, **SMALL)
    stored = _write_fp8_dir(tmp_path / "fp8", source, cfg)
    # Without the FP8 base the weights load dequantised into the model's dtype.
    _, plain = build_tiny_glm(dtype, seed=5, **SMALL)
    model_format.load_model(tmp_path / "fp8", plain)
    params = dict(plain.named_parameters())
    for name, (q, s) in stored.items():
        assert torch.equal(params[name], fp8.dequantize(q, s, dtype, fp8.row_parts(name))), name
    # With it, every FP8 weight keeps its bytes and scales, and no dequantised copy remains.
    _, model = build_tiny_glm(dtype, seed=5, **SMALL)
    sources = {}
    model_format.load_model(tmp_path / "fp8", model, fp8_sources=sources)
    assert set(sources) == set(stored)
    summary = apply_fp8_base(model, FP8_LINEARS, sources)
    assert summary.from_checkpoint and len(summary.names) == len(stored)
    for name, layer in fp8_modules(model):
        q, s = stored[f"{name}.weight"]
        assert torch.equal(layer.weight_fp8.view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(layer.weight_scale_inv, s), name
    ids = _ids(cfg)
    assert torch.equal(_logits(model, ids), _logits(plain, ids))
    # The planner's base weights (--weight-dtype fp8) are the bytes this model holds: its
    # parameters (embedding, head, norms, routers, indexer weights_proj, in the model's dtype)
    # plus the FP8 values and block scales.
    spec = PlanSpec(family="glm52", model=cfg, prompt_len=2, group_size=2, response_len=1,
                    act_bytes=torch.empty((), dtype=dtype).element_size(), fp8_base=True)
    resident = sum(p.numel() * p.element_size() for p in model.parameters()) \
        + fp8_base_bytes(model)
    assert base_weight_bytes(spec, glm52_params(cfg)) == resident
    assert fp8_base_bytes(model) == sum(fp8.nbytes(*q.shape, fp8.row_parts(n))
                                        for n, (q, _) in stored.items())


def test_misfits_are_refused_with_the_tensor_or_flag_named(tmp_path):
    from safetensors.torch import load_file, save_file

    cfg, source = build_tiny_glm(torch.float32, **SMALL)
    _write_fp8_dir(tmp_path / "fp8", source, cfg)
    weights = tmp_path / "fp8" / model_format.MODEL_WEIGHTS
    tensors = load_file(str(weights))
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    # One grid over all 320 rows instead of gate's and up's own: the wrong scale shape.
    tensors[fp8.scale_name(name)] = fp8.quantize(source.get_submodule(name[:-7]).weight)[1]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    _, model = build_tiny_glm(torch.float32, **SMALL)
    with pytest.raises(fp8.FP8Error, match=r"linear_fc1\.weight_scale_inv is F32 of shape "
                                           r"\[3, 1\], but .*linear_fc1\.weight \[320, 64\] in 2 "
                                           r"row parts, each in 128 x 128 blocks, needs "
                                           r"F32 \[4, 1\]"):
        model_format.load_model(tmp_path / "fp8", model)
    del tensors[fp8.scale_name(name)]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(fp8.FP8Error, match=r"linear_fc1\.weight is float8_e4m3fn but "
                                           r".*linear_fc1\.weight_scale_inv is missing"):
        model_format.load_model(tmp_path / "fp8", model)
    with pytest.raises(ValueError, match="declares no FP8 linears"):
        apply_fp8_base(model, ())

    def resolve(*flags):
        args, given = train.parse(["--longstraw", "--longstraw-config", str(TINY_GLM), *flags])
        family, _, ls, _ = train.resolve(args, given)
        return train.resolve_lora(args, family, ls)

    with pytest.raises(ValueError, match=r"--longstraw-fp8-base .* but LoRA is off: .*Add "
                                         r"--longstraw-lora"):
        resolve("--longstraw-fp8-base")
    with pytest.raises(ValueError, match=r"--longstraw-fp8-base and --longstraw-qlora .* pass one"):
        resolve("--longstraw-qlora", "--longstraw-fp8-base")
    lora, _ = resolve("--longstraw-lora", "--longstraw-fp8-base")
    assert lora.fp8_base and lora.record()["fp8_base"] is True
    assert lora.describe().startswith("LoRA on an FP8 base")


def test_fp8_base_runs_once_and_before_the_adapters():
    """apply_fp8_base refuses a model whose linears are FP8 already, or wrapped by LoRA already
    (it recognises LoRA's wrappers by their `base` module: lora.py builds on fp8_base.py)."""
    _, model = build_tiny_glm(torch.float32, **SMALL)
    apply_fp8_base(model, FP8_LINEARS)
    with pytest.raises(ValueError, match="runs once, before adapters.apply_lora"):
        apply_fp8_base(model, FP8_LINEARS)
    _, model = build_tiny_glm(torch.float32, **SMALL)
    apply_lora(model, _lora())
    with pytest.raises(ValueError, match="runs once, before adapters.apply_lora"):
        apply_fp8_base(model, FP8_LINEARS)
    _, model = build_tiny_glm(torch.float32, **SMALL)
    assert apply_fp8_base(model, FP8_LINEARS) is not None   # a plain model is accepted


def test_launcher_keeps_the_checkpoint_fp8(tmp_path, monkeypatch):
    """examples/pretrain_gpt.py's path: a model-format directory with FP8 weights, LoRA without
    expert adapters on the FP8 base: one step, the base as stored, bytes in the receipt."""
    from megatron_longstraw.models.glm52.config import GLM52Config
    from megatron_longstraw.models.glm52.model import build_glm52_model

    cfg = GLM52Config.from_yaml(TINY_GLM)
    stored = _write_fp8_dir(tmp_path / "fp8", build_glm52_model(cfg), cfg)
    seen = []
    real = train.setup_model
    monkeypatch.setattr(train, "setup_model",
                        lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    receipt = train.main([
        "--longstraw", "--longstraw-family", "glm52", "--longstraw-config", str(TINY_GLM),
        "--longstraw-synthetic-prompt-len", "48", "--longstraw-synthetic-response-len", "4",
        "--longstraw-group-size", "2", "--longstraw-dtype", "fp32", "--lr", "1e-2",
        "--longstraw-out-dir", str(tmp_path), "--longstraw-run-name", "t", "--train-iters", "1",
        "--longstraw-lora", "--longstraw-fp8-base", "--longstraw-lora-rank", "4",
        "--longstraw-lora-exclude", "*.experts.*", "--load", str(tmp_path / "fp8")])
    model = seen[0].model
    layers = dict(fp8_modules(model))
    assert {f"{_plain_name(n)}.weight" for n in layers} == set(stored)
    for name, layer in layers.items():
        assert torch.equal(layer.weight_fp8.view(torch.uint8),
                           stored[f"{_plain_name(name)}.weight"][0].view(torch.uint8)), name
    assert all(isinstance(m.base, FP8Linear) for _, m in lora_modules(model))
    assert receipt["fp8_base_bytes"] == fp8_base_bytes(model) > 0
    assert receipt["lora"]["fp8_base"] is True
