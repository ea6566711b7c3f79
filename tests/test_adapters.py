"""LoRA / QLoRA adapters (megatron_longstraw/adapters/lora.py) on the tiny GLM-5.2 (float32): NF4 error
bound, exact start, gradients and updates confined to the adapters in a LongStraw step, adapter
save/load, disabled adapters = base model, parameter and byte counts."""

import math

import pytest
import torch

from helpers import build_tiny_glm
from megatron_longstraw.adapters.lora import (
    LoRAConfig,
    LoRALinear,
    adapter_state_dict,
    apply_lora,
    disable_adapters,
    load_adapter_state_dict,
    lora_modules,
    lora_parameter_count,
    merge_adapters,
    nf4_nbytes,
    quantized_base_bytes,
    reference_view,
    trainable_parameters,
    unmerge_adapters,
)
from megatron_longstraw.config.settings import LongStrawConfig
from megatron_longstraw.data.groups import synthetic_group
from megatron_longstraw.distributed.finalize import is_expert_param
from megatron_longstraw.models.glm52.family import LORA_TARGETS as GLM52_TARGETS
from megatron_longstraw.step.schedule import train_step

pytestmark = pytest.mark.usefixtures("single_process")

# The 16 NF4 values of the QLoRA paper (Dettmers et al. 2023, appendix E).
NF4_CODE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
            -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
            0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
            0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
NF4_MAX_GAP = 1.0 - 0.6961928009986877     # widest gap between adjacent codes: [-1, -0.696]
# The absmax statistics are quantised with bitsandbytes' signed 8-bit dynamic code; its finest
# exponent spans [0.1, 1] with 64 linear steps whose midpoints are the codes, so adjacent codes are
# at most 0.9 / 64 apart.
ABSMAX_CODE_MAX_GAP = 0.9 / 64

RANK = 4


def _cfg(**kw) -> LoRAConfig:
    return LoRAConfig(**{"rank": RANK, "alpha": 8.0, "targets": GLM52_TARGETS, **kw})


def _logits(model, ids):
    with torch.no_grad():
        return model(ids[None], None, None)


def _ids(vocab: int, n: int = 24) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(7))


def _randomize_adapters(model, seed: int = 3) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, module in lora_modules(model):
            module.lora_B.copy_(0.05 * torch.randn(module.lora_B.shape, generator=gen))


def test_config_validation():
    for bad in (dict(rank=0), dict(rank=2.5), dict(alpha=0.0), dict(dropout=1.0), dict(targets=())):
        with pytest.raises(ValueError):
            LoRAConfig(**bad)
    assert LoRAConfig(rank=8, alpha=16.0).scaling == 2.0


def test_nf4_round_trip_within_blockwise_bound():
    _, model = build_tiny_glm(torch.float32)
    originals = {n: m.weight.detach().clone() for n, m in model.named_modules()
                 if n.rsplit(".", 1)[-1] in GLM52_TARGETS}
    apply_lora(model, _cfg(), quantize_base=True)
    checked = 0
    for name, module in lora_modules(model):
        state = module.quant_state
        assert state.quant_type == "nf4" and state.blocksize == 64
        assert state.nested and state.state2.blocksize == 256         # double quantisation
        assert torch.allclose(state.code, torch.tensor(NF4_CODE), atol=1e-7)
        w = originals[name].reshape(-1)
        assert module.nf4_weight.numel() == w.numel() // 2            # two 4-bit codes per byte
        error = (module.base_weight().reshape(-1) - w).abs().view(-1, 64)
        # Per block of 64: |w - dq| <= absmax * NF4_MAX_GAP / 2 (nearest code, |w / absmax| <= 1)
        # plus the double-quant error of the scale, |absmax - absmax'| * |code| with |code| <= 1.
        # The scale error: absmax - mean(absmax) is quantised per 256 blocks to the 8-bit code
        # scaled by that group's largest |absmax - mean|, so it is at most that * gap / 2.
        absmax = w.view(-1, 64).abs().amax(1)
        centred = (absmax - absmax.mean()).split(256)
        scale_error = torch.cat([c.abs().max().expand(len(c)) for c in centred])
        bound = absmax * NF4_MAX_GAP / 2 + scale_error * ABSMAX_CODE_MAX_GAP / 2
        assert (error.amax(1) <= bound * (1 + 1e-5) + 1e-9).all(), name  # + fp32 rounding
        assert error.max() > 0.1 * bound.max()                          # really quantised
        checked += 1
    assert checked == len(originals)


def test_wrapped_model_starts_identical():
    cfg, model = build_tiny_glm(torch.float32)
    ids = _ids(cfg.vocab_size)
    before = _logits(model, ids)
    summary = apply_lora(model, _cfg(), quantize_base=False)
    assert len(summary.wrapped) > 0 and summary.quantized_bytes == 0
    assert torch.equal(_logits(model, ids), before)                 # B = 0: bit-identical


def test_qlora_model_equals_its_dequantised_base():
    cfg, model = build_tiny_glm(torch.float32)
    _, reference = build_tiny_glm(torch.float32)
    ids = _ids(cfg.vocab_size)
    original = _logits(model, ids)
    apply_lora(model, _cfg(), quantize_base=True)
    with torch.no_grad():                  # the plain model with the NF4 round trip of its weights
        for name, module in lora_modules(model):
            reference.get_submodule(name).weight.copy_(module.base_weight())
    out = _logits(model, ids)
    # Same weights, same math; only the matmul kernel differs (bitsandbytes vs torch): fp32
    # rounding on logits of size ~1, so 1e-5. The NF4 error itself is far larger (second check).
    assert (out - _logits(reference, ids)).abs().max() <= 1e-5
    assert (out - original).abs().max() > 1e-4


def test_nf4_layer_keeps_the_megatron_bias_contract():
    """Biased Column/Row/modelopt linears (the tiny model has none): the NF4 path returns what the
    layer itself returns with the round-tripped weight: (out + bias, None), or (out, bias) with
    skip_bias_add."""
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    _, model = build_tiny_glm(torch.float32)
    config = model.config
    x = torch.randn(5, 1, 64, generator=torch.Generator().manual_seed(0))
    init = config.init_method
    makers = [lambda skip=skip: ColumnParallelLinear(64, 96, config=config, init_method=init,
                                                     bias=True, skip_bias_add=skip,
                                                     gather_output=False) for skip in (False, True)]
    makers += [lambda skip=skip: RowParallelLinear(64, 96, config=config, init_method=init,
                                                   bias=True, skip_bias_add=skip,
                                                   input_is_parallel=True)
               for skip in (False, True)]
    makers.append(lambda: Linear(64, 96, config=config, init_method=init, bias=True))
    for make in makers:
        base, twin = make(), make()
        with torch.no_grad():
            base.bias.normal_()
        twin.load_state_dict(base.state_dict())
        wrapper = LoRALinear(twin, _cfg(), "layer", quantize_base=True)
        with torch.no_grad():
            base.weight.copy_(wrapper.base_weight())
            expected, got = base(x), wrapper(x)
        assert isinstance(got, tuple) and len(got) == 2 == len(expected)
        assert torch.allclose(got[0], expected[0], atol=1e-6), type(base).__name__
        assert (got[1] is None) == (expected[1] is None)
        assert expected[1] is None or torch.equal(got[1], expected[1])


def test_dropout_only_where_autograd_records():
    """LoRA dropout acts in replay (grad enabled), not in the no-grad capture / scoring passes."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    _, model = build_tiny_glm(torch.float32)
    layer = ColumnParallelLinear(64, 96, config=model.config, init_method=model.config.init_method,
                                 bias=False, gather_output=False)
    wrapper = LoRALinear(layer, _cfg(dropout=0.5), "layer", quantize_base=False)
    with torch.no_grad():
        wrapper.lora_B.normal_(generator=torch.Generator().manual_seed(1))
    x = torch.randn(7, 1, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = layer(x)[0] + wrapper.delta_weight().matmul(x[..., None])[..., 0]
        first, second = wrapper(x)[0], wrapper(x)[0]
    assert torch.equal(first, second) and torch.allclose(first, plain, atol=1e-5)
    torch.manual_seed(0)
    dropped = wrapper(x)[0]                                # grad enabled: a dropout sample
    assert dropped.requires_grad and (dropped - plain).abs().max() > 1e-3


def test_grpo_steps_touch_only_adapters():
    """Two LongStraw train_steps (QLoRA, KL against the adapters-off reference): gradients reach
    the adapters only, and only adapters change."""
    cfg, model = build_tiny_glm(torch.float32, num_hidden_layers=4)   # 3 dense + 1 MoE layer
    apply_lora(model, _cfg(), quantize_base=True)
    group = synthetic_group(cfg.vocab_size, prompt_len=100, group_size=2, response_len=8, seed=1)
    ls = LongStrawConfig.of(group_size=2, max_response_len=16, token_block=64, query_block=32,
                         key_block=64, kl_coef=0.05)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    packed = {n: m.nf4_weight.clone() for n, m in lora_modules(model)}
    wrappers = dict(lora_modules(model))
    a0 = {n: m.lora_A.detach().clone() for n, m in wrappers.items()}
    dense = [n for n in wrappers if ".experts." not in n]      # every dense adapter is on the path
    adapter_names = {f"{n}.{k}" for n in wrappers for k in ("lora_A", "lora_B")}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2,
                                  weight_decay=0.0)

    train_step(model, optimizer, group, ls, ref_model=reference_view(model))
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad and with_grad <= adapter_names
    for n in dense:
        assert wrappers[n].lora_B.grad.abs().max() > 0, n
        # dL/dA = scaling * B^T (dL/dout) x^T = 0 while B = 0; Adam's step on a zero gradient
        # (no weight decay) is 0 / (0 + eps) = 0, so A is unchanged and B has moved.
        assert torch.equal(wrappers[n].lora_A.grad, torch.zeros_like(a0[n])), n
        assert torch.equal(wrappers[n].lora_A, a0[n]), n
        assert wrappers[n].lora_B.abs().max() > 0, n
    train_step(model, optimizer, group, ls, ref_model=reference_view(model))
    assert all(not torch.equal(wrappers[n].lora_A, a0[n]) for n in dense)   # B != 0 now
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[n]), n
    for n, m in wrappers.items():
        assert torch.equal(m.nf4_weight, packed[n]), n


def test_adapter_save_load_round_trip():
    cfg, model = build_tiny_glm(torch.float32)
    summary = apply_lora(model, _cfg(), quantize_base=True)
    _randomize_adapters(model)
    ids = _ids(cfg.vocab_size)
    expected = _logits(model, ids)
    state = adapter_state_dict(model)
    assert len(state) == 2 * len(summary.wrapped)
    assert all(k.endswith((".lora_A", ".lora_B")) for k in state)

    _, fresh = build_tiny_glm(torch.float32)
    apply_lora(fresh, _cfg(seed=99), quantize_base=True)
    assert not torch.equal(_logits(fresh, ids), expected)
    load_adapter_state_dict(fresh, state)
    assert torch.equal(_logits(fresh, ids), expected)
    with pytest.raises(KeyError):
        load_adapter_state_dict(fresh, dict(list(state.items())[1:]))


def test_disable_adapters_and_reference_view_give_the_base_model():
    cfg, model = build_tiny_glm(torch.float32)
    ids = _ids(cfg.vocab_size)
    base = _logits(model, ids)
    apply_lora(model, _cfg(), quantize_base=False)
    _randomize_adapters(model)
    adapted = _logits(model, ids)
    assert (adapted - base).abs().max() > 1e-3
    with disable_adapters(model):
        assert torch.equal(_logits(model, ids), base)
    assert torch.equal(_logits(model, ids), adapted)
    view = reference_view(model)
    assert torch.equal(_logits(view, ids), base)
    assert torch.equal(_logits(model, ids), adapted)            # the view leaves the model alone
    name, wrapper = next(lora_modules(model))
    assert view.get_submodule(name).base.weight is wrapper.base.weight   # shared, not copied


def test_merge_unmerge():
    cfg, model = build_tiny_glm(torch.float32)
    ids = _ids(cfg.vocab_size)
    apply_lora(model, _cfg(), quantize_base=False)
    weights = {n: m.base.weight.detach().clone() for n, m in lora_modules(model)}
    _randomize_adapters(model)
    adapted = _logits(model, ids)
    merge_adapters(model)
    assert (_logits(model, ids) - adapted).abs().max() <= 1e-5      # fp32 summation order
    with pytest.raises(ValueError):
        disable_adapters(model).__enter__()
    unmerge_adapters(model)
    for n, m in lora_modules(model):
        assert torch.allclose(m.base.weight, weights[n], atol=1e-6)  # w + d - d, fp32 rounding
    _, quantized = build_tiny_glm(torch.float32)
    apply_lora(quantized, _cfg(), quantize_base=True)
    with pytest.raises(ValueError):
        merge_adapters(quantized)


def _tiny_glm_shapes(cfg) -> list[tuple[int, int]]:
    """(in, out) of every GLM-5.2 target in the tiny model, from its config alone."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    attention = [(h, cfg.q_lora_rank),
                 (cfg.q_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)),
                 (h, cfg.kv_lora_rank + cfg.qk_rope_head_dim),
                 (cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)),
                 (heads * cfg.v_head_dim, h)]
    def swiglu(ffn):                                   # fc1 holds gate and up
        return [(h, 2 * ffn), (ffn, h)]
    num_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
    return (attention * cfg.num_hidden_layers
            + swiglu(cfg.intermediate_size) * cfg.first_k_dense_replace
            + swiglu(cfg.moe_intermediate_size) * cfg.n_routed_experts * num_moe
            + swiglu(cfg.moe_intermediate_size * cfg.n_shared_experts) * num_moe)


def test_parameter_and_byte_counts_match_the_tiny_model():
    cfg, model = build_tiny_glm(torch.float32)
    # An expert weight under EP > 1 carries allreduce=False; its adapters must inherit it.
    expert_name = next(n for n, _ in model.named_modules()
                       if n.endswith("local_experts.0.linear_fc1"))
    model.get_submodule(expert_name).weight.allreduce = False
    summary = apply_lora(model, _cfg(), quantize_base=True)
    shapes = _tiny_glm_shapes(cfg)
    assert len(summary.wrapped) == len(shapes)
    expected = lora_parameter_count(shapes, RANK)
    assert trainable_parameters(model) == summary.num_trainable == expected
    assert quantized_base_bytes(model) == sum(nf4_nbytes(i * o) for i, o in shapes)
    for name, module in lora_modules(model):
        expert_layer = name == expert_name
        assert is_expert_param(module.lora_A) == is_expert_param(module.lora_B) == expert_layer


def test_qwen36_full_size_counts():
    """Qwen3.6-27B: 48 Gated-DeltaNet + 16 gated full-attention layers, dense SwiGLU FFN."""
    h, ffn = 5120, 17408
    gdn = [(h, 16 * 128 * 2 + 48 * 128 * 2 + 48 + 48), (48 * 128, h)]       # in_proj, out_proj
    attention = [(h, 24 * 256 * 2 + 4 * 256 * 2), (24 * 256, h)]           # linear_qkv, linear_proj
    mlp = [(h, 2 * ffn), (ffn, h)]
    shapes = gdn * 48 + attention * 16 + mlp * 64
    # in_proj: 2048 + 2048 + 6144 + 6144 + 48 + 48 = 16480 outputs; linear_qkv: 14336.
    per_rank = 48 * (5120 + 16480 + 6144 + 5120) + 16 * (5120 + 14336 + 6144 + 5120) \
        + 64 * (5120 + 34816 + 17408 + 5120)
    assert per_rank == 6_066_688
    assert lora_parameter_count(shapes, 64) == 64 * per_rank == 388_268_032
    assert lora_parameter_count(shapes, 19) == 115_267_072            # ~116M (the paper's count)
    numel = sum(i * o for i, o in shapes)
    assert numel == 24_350_556_160
    # 0.5 + 1/64 + 4/(64*256) bytes per value (+ ceil and 4 offset bytes per tensor).
    assert math.isclose(sum(nf4_nbytes(i * o) for i, o in shapes) / numel,
                        0.5 + 1 / 64 + 4 / (64 * 256), rel_tol=1e-6)
