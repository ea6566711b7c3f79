"""DeepSeek-V3 (`deepseekv3`: dense MLA + group-limited MoE, YaRN RoPE) on one process: our model
equals transformers' `DeepseekV3ForCausalLM`, capture + replay equal a full-sequence forward,
gradients equal autograd, the HF state dict round-trips bitwise, pages are latent rows only.

Tolerances. fp64, 1e-9 on log-probs: our paths differ from each other only in summation order
(blockwise attention, chunked projections; observed ~1e-15), and from transformers, once its
float32 islands are upcast (`upcast_reference`: RMSNorm, RoPE frequencies and angles (YaRN's
included), eager softmax, router), only in float64 rounding. Every real discrepancy is larger: a
float32 router ~3e-9, float32 RoPE frequencies ~1e-5 at these positions, YaRN against plain RoPE
~1 (on these weights, `build_tiny_deepseekv3`), a wrong mapping ~1e-2. fp32 replay vs full: 1e-5 (float32
rounding ~1e-7 relative, accumulated over 4 layers and a 512-way log-softmax). Relative gradient
errors 1e-9 for the same reason as the log-probs.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

import hf_fp64
from helpers import ROOT, full_sequence_logprobs, scoring_vs_full_sequence
from megatron_longstraw.runtime import precision
from megatron_longstraw.context.capture import capture_prompt
from megatron_longstraw.config.settings import LongStrawConfig
from megatron_longstraw.grpo.loss import grpo_loss
from megatron_longstraw.config.loss import GRPOLossConfig
from megatron_longstraw.kernels import refs
from megatron_longstraw.models.deepseekv3.config import DeepseekV3Config
from megatron_longstraw.models.deepseekv3.hf import (
    deepseekv3_config_from_hf,
    from_hf_state_dict,
    hf_config,
    to_hf_state_dict,
)
from megatron_longstraw.runtime.platform import manual_seed
from megatron_longstraw.step.replay import score_member
from megatron_longstraw.step.schedule import forward_backward_longstraw
from megatron_longstraw.data.group import GRPOGroup
from megatron_longstraw.state.attention_pass import AttentionPass

pytestmark = pytest.mark.usefixtures("single_process")  # conftest: one-process Megatron state

F64 = torch.float64
TOL = 1e-9
TINY_DEEPSEEK = ROOT / "examples" / "deepseekv3" / "tiny.yaml"
PROMPT_LEN = 300          # > token_block 50, query_block 29, key_block 37 below
RESPONSE_LENS = (1, 6, 17)
# RoPE variants compared with transformers: plain; DeepSeek-V3's YaRN (mscale = mscale_all_dim:
# cos/sin factor 1, softmax x mscale(40)^2); a YaRN whose cos/sin factor is not 1 (mscale 1,
# mscale_all_dim 0.5: factor mscale(40, 1) / mscale(40, 0.5) = 1.16).
ROPE = {
    "default": dict(rope_type="default"),
    "yarn": dict(rope_type="yarn"),
    "yarn_scaled": dict(rope_type="yarn", mscale=1.0, mscale_all_dim=0.5, beta_fast=16.0,
                        original_max_position_embeddings=1024),
}


def tiny_config(**overrides) -> DeepseekV3Config:
    values = DeepseekV3Config.from_yaml(TINY_DEEPSEEK).to_dict()
    values.update(overrides)
    return DeepseekV3Config.from_dict(values)


def build_tiny_deepseekv3(dtype=F64, seed: int = 0, **overrides):
    """The tiny example model with non-trivial latent/residual norms and routing correction biases
    comparable to the sigmoid-score gaps (they reroute tokens). Weights are drawn with std 0.08,
    not the config's 0.02: attention is then far from uniform, so the RoPE variants change the
    log-probs by O(1) (YaRN against plain RoPE: ~1.0; at 0.02 only ~2e-3)."""
    from megatron_longstraw.models.deepseekv3.model import build_deepseekv3_model

    manual_seed(seed)  # Megatron initialises from its RNG tracker: reseed for reproducible weights
    precision.use_dtype(dtype)
    cfg = tiny_config(**{"init_std": 0.08, **overrides})
    model = build_deepseekv3_model(cfg, params_dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("router.expert_bias"):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=gen, dtype=buf.dtype))
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
    return cfg, model


def _group(vocab: int, prompt_len: int = PROMPT_LEN, lens=RESPONSE_LENS, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=gen)
    responses = [torch.randint(0, vocab, (n,), generator=gen) for n in lens]
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0][:len(lens)], dtype=F64)
    return GRPOGroup(prompt_ids=prompt, response_ids=responses, rewards=rewards)


def _small_blocks(**kw) -> LongStrawConfig:
    # Blocks that do not divide the lengths, so block boundaries fall inside every phase.
    kw.setdefault("group_size", len(RESPONSE_LENS))
    return LongStrawConfig.of(query_block=29, key_block=37, token_block=50, max_response_len=64, **kw)


# ---- transformers reference ---------------------------------------------------------------------


def yarn_inv_freq_fp64(rope: dict, dim: int) -> torch.Tensor:
    """transformers' `_compute_yarn_parameters` frequencies restated in float64 (it computes them
    in float32); checked against transformers' own in test_yarn_matches_transformers."""
    base, factor = rope["rope_theta"], rope["factor"]
    orig = rope["original_max_position_embeddings"]
    corr = lambda rot: dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
    low = max(math.floor(corr(rope.get("beta_fast") or 32)), 0)
    high = min(math.ceil(corr(rope.get("beta_slow") or 1)), dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=F64) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=F64) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def upcast_reference(hf_model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers computes RMSNorm, the RoPE frequencies and angles, the eager softmax and the
    router in float32 even for a float64 model. Run them in float64 (same formulas), so the
    comparison checks the mapping and the math at float64 precision."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_mod

    def rms_norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rotary(self, x, position_ids):
        rope, dim = self.config.rope_parameters, self.config.qk_rope_head_dim
        if self.rope_type == "yarn":
            inv_freq = yarn_inv_freq_fp64(rope, dim)
        else:
            inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=F64) / dim))
        freqs = position_ids[..., None].to(F64) * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return ((emb.cos() * self.attention_scaling).to(x.dtype),
                (emb.sin() * self.attention_scaling).to(x.dtype))

    eager_attention, router = hf_fp64.eager_attention, hf_fp64.sigmoid_router

    for module in hf_model.modules():
        if isinstance(module, hf_mod.DeepseekV3RMSNorm):
            module.forward = types.MethodType(rms_norm, module)
        if isinstance(module, hf_mod.DeepseekV3TopkRouter):
            module.forward = types.MethodType(router, module)
    rotary_emb = hf_model.model.rotary_emb
    rotary_emb.forward = types.MethodType(rotary, rotary_emb)
    monkeypatch.setattr(hf_mod, "eager_attention_forward", eager_attention)


def _hf_model(cfg: DeepseekV3Config, model: torch.nn.Module) -> torch.nn.Module:
    from transformers import DeepseekV3ForCausalLM

    hf_model = DeepseekV3ForCausalLM(hf_config(cfg)).to(F64).eval()
    hf_model.load_state_dict(to_hf_state_dict(model, cfg), strict=True)
    return hf_model


def _routing_effects(hf_model, cfg, router_inputs) -> dict:
    """Per MoE layer: tokens whose experts the group limit changes (against an unlimited top-k of
    the same biased scores), and tokens the correction bias reroutes."""
    limited, rerouted = {}, {}
    for i, x in router_inputs.items():
        gate = hf_model.model.layers[i].mlp.gate
        scores = torch.sigmoid(x.reshape(-1, cfg.hidden_size) @ gate.weight.T)
        choice = scores + gate.e_score_correction_bias
        k = cfg.num_experts_per_tok
        _, _, used = gate(x)
        used = used.sort(-1).values
        unlimited = choice.topk(k, -1).indices.sort(-1).values
        unbiased = scores.topk(k, -1).indices.sort(-1).values
        limited[i] = int((used != unlimited).any(-1).sum())
        rerouted[i] = int((unlimited != unbiased).any(-1).sum())
    return {"limited": limited, "rerouted": rerouted}


@pytest.mark.parametrize("rope", sorted(ROPE))
def test_logprobs_match_transformers(rope, monkeypatch):
    """Full-sequence forward and capture + replay of our model against transformers (fp64), with
    group-limited routing that changes experts (n_group 4, topk_group 2)."""
    cfg, model = build_tiny_deepseekv3(F64, **ROPE[rope])
    model.eval()
    hf_model = _hf_model(cfg, model)
    upcast_reference(hf_model, monkeypatch)
    router_inputs = {}
    for i in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        hf_model.model.layers[i].mlp.gate.register_forward_hook(
            lambda mod, inp, out, i=i: router_inputs.__setitem__(i, inp[0].detach().clone()))

    prompt_len, response_len = 80, 16
    ids = torch.randint(0, cfg.vocab_size, (prompt_len + response_len,),
                        generator=torch.Generator().manual_seed(3))
    prompt, response = ids[:prompt_len], ids[prompt_len:]
    rows = slice(prompt_len - 1, prompt_len + response_len - 1)
    with torch.no_grad():
        ref_all = torch.log_softmax(hf_model(ids[None]).logits[0], -1)                # [S, V]
        effects = _routing_effects(hf_model, cfg, router_inputs)
        state = AttentionPass(mode="full", positions=torch.arange(ids.numel()), token_block=40,
                              query_block=24, key_block=32)
        ours_all = torch.log_softmax(model(ids[None], None, attention_mask=state)[0], -1)
        ls = _small_blocks(group_size=2)
        captured = capture_prompt(model, prompt, ls)
        replayed, _ = score_member(model, captured, response, ls)
    ref = ref_all[rows].gather(-1, response[:, None]).squeeze(-1)
    full_error = (ours_all - ref_all).abs().max().item()
    replay_error = (replayed - ref).abs().max().item()
    print(f"DeepSeek-V3 vs transformers ({rope}, fp64): full-sequence max |d log_softmax| "
          f"{full_error:.2e}, capture+replay max |d logp| {replay_error:.2e}, routing {effects}")
    assert all(n > 0 for n in effects["limited"].values()), effects   # the group limit matters
    assert any(n > 0 for n in effects["rerouted"].values()), effects  # so does the bias
    assert full_error <= TOL and replay_error <= TOL


def test_yarn_matches_transformers():
    """`refs.yarn_inv_freq` / `yarn_attention_factor` against transformers' YaRN (its frequencies
    are float32: relative 1e-6), the test's float64 restatement (1e-15), and the softmax scale of
    Megatron's MLA against transformers' `yarn_apply_mscale` (1e-15)."""
    from transformers.modeling_rope_utils import _compute_yarn_parameters
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    for name, overrides in ROPE.items():
        cfg = tiny_config(**overrides)
        hf = hf_config(cfg)
        rope = hf.rope_parameters
        dim = cfg.qk_rope_head_dim
        scale = yarn_apply_mscale(rope, (cfg.qk_nope_head_dim + dim) ** -0.5)
        _, model = build_tiny_deepseekv3(torch.float32, **overrides)
        attention = model.decoder.layers[0].self_attention
        assert abs(attention.softmax_scale - scale) <= 1e-15 * scale, name
        if cfg.rope_type != "yarn":
            continue
        inv_freq, factor = _compute_yarn_parameters(hf)
        ours = refs.yarn_inv_freq(dim, cfg.rope_theta, cfg.rope_factor,
                                  cfg.original_max_position_embeddings, cfg.beta_fast,
                                  cfg.beta_slow)
        assert torch.allclose(ours, inv_freq.to(F64), rtol=1e-6, atol=0), name
        assert torch.allclose(ours, yarn_inv_freq_fp64(rope, dim), rtol=1e-15, atol=0), name
        assert not torch.allclose(ours[-1:], 1.0 / cfg.rope_theta ** (torch.arange(
            0, dim, 2, dtype=F64)[-1:] / dim))                               # YaRN changed them
        assert refs.yarn_attention_factor(cfg.rope_factor, cfg.mscale, cfg.mscale_all_dim) \
            == pytest.approx(factor, rel=1e-15), name
    # Plain RoPE is unchanged by the new arguments: the default frequencies, bitwise.
    x, pos = torch.randn(7, 3, 8, dtype=F64), torch.arange(100, 107)
    plain = 1.0 / (1e4 ** (torch.arange(0, 8, 2, dtype=F64) / 8))
    assert torch.equal(refs.apply_rope(x, pos, 1e4, True),
                       refs.apply_rope(x, pos, 1e4, True, inv_freq=plain, attention_factor=1.0))


# ---- capture + replay against a full-sequence forward -------------------------------------------


# fp64: the two paths differ only in summation order (blockwise attention, chunked projections),
# so agreement is at rounding level; 1e-9 leaves ~6 orders of margin. fp32: 1e-5.
@pytest.mark.parametrize("dtype,tol", [(F64, 1e-9), (torch.float32, 1e-5)])
def test_replay_logprobs_equal_full_sequence(dtype, tol):
    cfg, model = build_tiny_deepseekv3(dtype)
    group = _group(cfg.vocab_size)
    ls = _small_blocks()
    captured = capture_prompt(model, group.prompt_ids, ls)
    worst, selections = scoring_vs_full_sequence(model, group, captured, ls)
    assert not any(selections)                                   # dense attention: no top-k
    print(f"DeepSeek-V3 replay vs full sequence ({dtype}): max |d logp| {worst:.2e}")
    assert worst <= tol


def test_capture_longer_than_blocks_equals_one_block():
    """A 300-token prompt in token blocks of 50 (queries 29, keys 37) gives the same latent pages
    as one block for the whole prompt: each block's queries see exactly the rows before them."""
    cfg, model = build_tiny_deepseekv3(F64)
    prompt = _group(cfg.vocab_size).prompt_ids
    small = capture_prompt(model, prompt, _small_blocks())
    whole = capture_prompt(model, prompt, LongStrawConfig.of(group_size=3, query_block=4096,
                                                          key_block=4096, token_block=4096))
    assert small.prefix_len == PROMPT_LEN - 1
    for layer in range(cfg.num_hidden_layers):
        assert small.pages.kinds(layer) == ["latent"]
        a, b = small.pages.fetch(layer, "latent"), whole.pages.fetch(layer, "latent")
        assert a.shape == (PROMPT_LEN - 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        assert (a - b).abs().max().item() <= 1e-12


def test_page_bytes_per_token_are_latent_rows():
    from megatron_longstraw import planner

    cfg, model = build_tiny_deepseekv3(torch.float32)
    captured = capture_prompt(model, _group(cfg.vocab_size, prompt_len=257).prompt_ids,
                              LongStrawConfig.of(page_tokens=100))
    # Hand count: 4 layers x (kv_lora_rank 32 + rope 8) fp32 values, nothing else.
    assert captured.pages.bytes_per_token() == 4 * 40 * 4 == cfg.page_bytes_per_token(4)
    assert captured.pages.nbytes() == 256 * 4 * 40 * 4
    assert sorted(captured.pages.layers()) == list(range(4))
    spec = planner.PlanSpec(family="deepseekv3", model=cfg, prompt_len=257, group_size=2,
                            response_len=16, latent_bytes=4, act_bytes=4, weight_bytes=4,
                            page_tokens=100)
    result = planner.plan(spec, search_max=False)
    assert result.page_bytes_per_token == captured.pages.bytes_per_token()
    assert result.host_page_bytes_per_rank_logical == captured.pages.nbytes()
    assert result.host_page_bytes_per_rank == captured.pages.nbytes(allocated=True) == 300 * 4 * 40 * 4
    params = planner.FAMILIES["deepseekv3"](spec, 257).params
    assert sum(g.count for g in params) == sum(p.numel() for p in model.parameters())


# ---- gradients ----------------------------------------------------------------------------------


def _reference_grads(model, group, trainable, detach_prompt_state):
    loss_cfg = GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.28)
    for p in model.parameters():
        p.grad = None
    logps = [full_sequence_logprobs(model, group.prompt_ids, r, detach_prompt_state)
             for r in group.response_ids]
    grpo_loss(logps, [lp.detach() for lp in logps], group.rewards, loss_cfg).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()
            if n in trainable and p.grad is not None}


def _longstraw_grads(model, group, trainable, **kw):
    for p in model.parameters():
        p.grad = None
    forward_backward_longstraw(model, group, _small_blocks(clip_eps_high=0.28, **kw))
    return {n: p.grad.clone() for n, p in model.named_parameters()
            if n in trainable and p.grad is not None}


def _worst_relative(got, ref) -> float:
    assert got.keys() == ref.keys() and got
    return max(float((got[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-300)) for n in ref)


def test_gradients_post_attention_params_equal_full_autograd():
    """Only the final norm and output layer train: LongStraw's gradient is the exact GRPO gradient."""
    cfg, model = build_tiny_deepseekv3(F64)
    trainable = {"decoder.final_norm.weight", "output_layer.weight"}
    for name, p in model.named_parameters():
        p.requires_grad_(name in trainable)
    group = _group(cfg.vocab_size)
    ref = _reference_grads(model, group, trainable, detach_prompt_state=False)
    got = _longstraw_grads(model, group, trainable)
    worst = _worst_relative(got, ref)
    print(f"DeepSeek-V3 post-attention gradients vs full autograd: worst relative {worst:.2e}")
    assert worst <= 1e-9 and all(g.abs().sum() > 0 for g in got.values())


def test_gradients_all_params_equal_autograd_with_detached_prompt_state():
    """Every parameter, at fixed prompt state (the latent rows of the captured tokens detached in
    the reference): the conditional gradient replay computes."""
    cfg, model = build_tiny_deepseekv3(F64)
    trainable = {n for n, _ in model.named_parameters()}
    group = _group(cfg.vocab_size, prompt_len=120)
    ref = _reference_grads(model, group, trainable, detach_prompt_state=True)
    got = _longstraw_grads(model, group, trainable)
    worst = _worst_relative(got, ref)
    print(f"DeepSeek-V3 all gradients vs detached-prompt autograd: worst relative {worst:.2e}")
    assert worst <= 1e-9
    assert any("experts" in n and g.abs().sum() > 0 for n, g in got.items())


# ---- config and state dict ----------------------------------------------------------------------


def test_config_pattern_validation_and_hf_round_trip():
    cfg = tiny_config()
    assert cfg.hybrid_layer_pattern() == "+-" + "+E" * 3
    assert DeepseekV3Config().hybrid_layer_pattern() == "+-" * 3 + "+E" * 58
    assert DeepseekV3Config().page_bytes_per_token() == 61 * 576 * 2   # 70,272 B per token (bf16)
    for bad, needle in ((dict(n_group=3), "divisible"), (dict(topk_group=5), "Group-limited"),
                        (dict(rope_type="linear"), "rope_type"), (dict(qk_rope_head_dim=7), "even"),
                        (dict(first_k_dense_replace=5), "first_k_dense_replace")):
        with pytest.raises(ValueError, match=needle):
            tiny_config(**bad)
    for overrides in ROPE.values():
        cfg = tiny_config(**overrides)
        assert deepseekv3_config_from_hf(hf_config(cfg)) == cfg
        assert deepseekv3_config_from_hf(hf_config(cfg).to_dict()) == cfg
    # A checkpoint-style config.json (Kimi-K2's: legacy `rope_scaling`, no groups, MTP field).
    kimi = {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
            **{k: v for k, v in hf_config(tiny_config()).to_dict().items()
               if k not in ("rope_parameters", "model_type")},
            "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0, "rope_theta": 50000.0,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc",
            "rope_scaling": {"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 4096}}
    back = deepseekv3_config_from_hf(kimi)
    assert (back.rope_type, back.rope_factor, back.beta_fast, back.rope_theta, back.n_group) == (
        "yarn", 32.0, 1.0, 50000.0, 1)
    with pytest.raises(ValueError, match="rope_type='dynamic'"):
        deepseekv3_config_from_hf({**kimi, "rope_scaling": {"type": "dynamic", "factor": 8.0}})
    with pytest.raises(ValueError, match="num_experts_per_tok // topk_group"):
        hf_config(tiny_config(num_experts_per_tok=6, topk_group=2))


@pytest.mark.parametrize("tie", [False, True])
def test_state_dict_round_trip_is_exact(tie):
    source = build_tiny_deepseekv3(F64, seed=0, tie_word_embeddings=tie)[1]
    cfg, target = build_tiny_deepseekv3(F64, seed=1, tie_word_embeddings=tie)
    hf_sd = to_hf_state_dict(source, cfg)
    assert ("lm_head.weight" in hf_sd) == (not tie)
    assert hf_sd["model.layers.1.mlp.experts.gate_up_proj"].shape == (16, 64, 64)
    assert "model.layers.0.mlp.gate_proj.weight" in hf_sd                 # layer 0 is dense
    from transformers import DeepseekV3ForCausalLM

    expected = DeepseekV3ForCausalLM(hf_config(cfg)).state_dict()
    assert {n: tuple(t.shape) for n, t in hf_sd.items()} == {
        n: tuple(t.shape) for n, t in expected.items() if not (tie and n == "lm_head.weight")}
    from_hf_state_dict(hf_sd, target, cfg)
    src = dict(source.named_parameters()) | dict(source.named_buffers())
    dst = dict(target.named_parameters()) | dict(target.named_buffers())
    names = [n for n in src if not n.endswith("local_tokens_per_expert")]
    for name in names:
        assert src[name].dtype == dst[name].dtype and torch.equal(src[name], dst[name]), name
    again = to_hf_state_dict(target, cfg)
    assert again.keys() == hf_sd.keys() and all(torch.equal(again[k], hf_sd[k]) for k in hf_sd)
    with pytest.raises(KeyError, match=r"unexpected 1 \['model\.layers\.4\.eh_proj\.weight'\]"):
        from_hf_state_dict(dict(hf_sd, **{"model.layers.4.eh_proj.weight": torch.zeros(1)}),
                           target, cfg)
