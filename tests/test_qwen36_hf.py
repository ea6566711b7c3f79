"""Qwen3.6 <-> transformers `Qwen3_5ForCausalLM`: config mapping, state-dict mapping, and log-prob
equivalence of our Megatron HybridModel with the transformers reference (CPU, float64).

Tolerance of the log-prob comparison (max |d log_softmax| <= 1e-9): both models run in float64 and
`_upcast_reference` removes transformers' float32 islands (zero-centred and gated RMSNorms, RoPE
angles, eager softmax, the GDN decay `A_log.float()` / `a.float()` and its float32 delta rule,
replaced by the per-token recurrence in float64); our side keeps float64 through
`precision.enable_fp64_gdn`. What remains is float64 rounding, ~1e-16 relative per operation
(observed ~1e-15). 1e-9 is ~6 orders above that noise and far below every real discrepancy:
float32 islands ~1e-7, a wrong out_norm offset (w vs 1 + w) ~1e-1, swapped gate/query rows or GQA
groups ~1e-1, conv off by one token ~1e-2.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from megatron_longstraw.runtime import precision
from megatron_longstraw.models.qwen36.config import Qwen36Config
from megatron_longstraw.models.qwen36.hf import (
    from_hf_state_dict,
    hf_config,
    qwen36_config_from_hf,
    text_state_dict,
    to_hf_state_dict,
)
from megatron_longstraw.runtime.platform import manual_seed
from megatron_longstraw.state.attention_pass import AttentionPass

F64 = torch.float64
TOL = 1e-9
SEQ = 96  # two 64-token chunks of the chunked delta rule

# Tiny Qwen3.6: 8 layers (G G G * G G G *), 6 query heads in 2 K/V groups (a swapped group shows),
# partial RoPE on 8 of 32 dims, GDN with 2 QK heads and 6 V heads.
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=8,
            num_attention_heads=6, num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=6, rope_theta=10000.0)

pytestmark = pytest.mark.usefixtures("single_process")  # conftest: one-process Megatron state


def _build(cfg: Qwen36Config, seed: int = 0) -> torch.nn.Module:
    """Our model in float64 with non-trivial norms, decays and biases."""
    from megatron_longstraw.models.qwen36.model import build_qwen36_model

    manual_seed(seed)
    precision.use_dtype(F64)
    model = build_qwen36_model(cfg, params_dtype=F64)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=F64)
            if "norm" in name:          # zero-centred gains away from 0
                param.copy_(0.1 * noise)
            elif name.endswith("A_log"):  # slow decays: the state carries many tokens
                param.copy_(torch.empty_like(param).uniform_(0.02, 0.5, generator=gen).log())
            elif name.endswith("dt_bias"):
                param.copy_(0.5 * noise)
    return model.eval()


def recurrent_gated_delta_rule(q, k, v, g, beta):
    """The gated delta rule token by token in the inputs' dtype: q, k [b, s, h, d_k] (l2-normed),
    v [b, s, h, d_v], g, beta [b, s, h]. Returns (out [b, s, h, d_v], state [b, h, d_k, d_v])."""
    q = q * q.shape[-1] ** -0.5
    state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    out = []
    for t in range(q.shape[1]):
        state = state * g[:, t, :, None, None].exp()
        delta = (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t])) * beta[:, t, :, None]
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(out, dim=1), state


def _upcast_reference(hf_model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run transformers' float32 islands in float64 (same formulas; see the module docstring)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_mod

    def rms_norm(self, x):  # Qwen3_5RMSNorm: zero-centred
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)

    def gated_norm(self, x, gate):  # Qwen3_5RMSNormGated: plain gain, then silu(gate)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x * F.silu(gate)

    def rotary(self, x, position_ids):  # text positions: the three mRoPE axes are equal
        cfg = self.config
        dim = int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"])
        inv_freq = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=F64) / dim))
        positions = position_ids[0] if position_ids.dim() == 3 else position_ids  # [b, s]
        freqs = positions[..., None].to(F64) * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        key, value = hf_mod.repeat_kv(key, module.num_key_value_groups), hf_mod.repeat_kv(
            value, module.num_key_value_groups)
        weights = torch.matmul(query, key.transpose(2, 3)) * scaling
        if attention_mask is not None:
            weights = weights + attention_mask
        weights = torch.softmax(weights, dim=-1)
        return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights

    def gdn_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        # Qwen3_5GatedDeltaNet.forward (no cache) without its float32 casts.
        batch, seq, _ = hidden_states.shape
        mixed_qkv = self.in_proj_qkv(hidden_states).transpose(1, 2)
        z = self.in_proj_z(hidden_states).reshape(batch, seq, -1, self.head_v_dim)
        b, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)
        mixed_qkv = hf_mod.causal_conv1d_fn(mixed_qkv, self.conv1d.weight.squeeze(1),
                                            self.conv1d.bias, activation=self.activation)
        query, key, value = torch.split(mixed_qkv.transpose(1, 2),
                                        [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = hf_mod.l2norm(query.reshape(batch, seq, -1, self.head_k_dim))
        key = hf_mod.l2norm(key.reshape(batch, seq, -1, self.head_k_dim))
        value = value.reshape(batch, seq, -1, self.head_v_dim)
        repeat = self.num_v_heads // self.num_k_heads
        query, key = query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)
        g = -self.A_log.exp() * F.softplus(a + self.dt_bias)
        core, _ = recurrent_gated_delta_rule(query, key, value, g, b.sigmoid())
        core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(core.reshape(batch, seq, -1))

    for module in hf_model.modules():
        if isinstance(module, hf_mod.Qwen3_5RMSNorm):
            module.forward = types.MethodType(rms_norm, module)
        elif isinstance(module, hf_mod.Qwen3_5RMSNormGated):
            module.forward = types.MethodType(gated_norm, module)
        elif isinstance(module, hf_mod.Qwen3_5GatedDeltaNet):
            module.forward = types.MethodType(gdn_forward, module)
    rotary_emb = hf_model.model.rotary_emb
    rotary_emb.forward = types.MethodType(rotary, rotary_emb)
    monkeypatch.setattr(hf_mod, "eager_attention_forward", eager_attention)


def _hf_model(cfg: Qwen36Config, model: torch.nn.Module) -> torch.nn.Module:
    from transformers import Qwen3_5ForCausalLM

    hf_model = Qwen3_5ForCausalLM(hf_config(cfg)).to(F64).eval()
    hf_model.load_state_dict(to_hf_state_dict(model, cfg), strict=True)
    return hf_model


def _logprob_diff(cfg: Qwen36Config, model, hf_model, seed: int = 1) -> float:
    torch.manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (1, SEQ))
    with torch.no_grad():
        state = AttentionPass(mode="full", positions=torch.arange(SEQ), token_block=40,
                              query_block=24, key_block=32)
        ours = model(ids, None, attention_mask=state)
        ref = hf_model(ids).logits
    return (torch.log_softmax(ours, -1) - torch.log_softmax(ref, -1)).abs().max().item()


def test_logprobs_match_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention, Qwen3_5GatedDeltaNet

    cfg = Qwen36Config(**TINY)
    model = _build(cfg)
    hf_model = _hf_model(cfg, model)
    kinds = ["full" if isinstance(getattr(layer, "self_attn", None), Qwen3_5Attention)
             else "gdn" if isinstance(getattr(layer, "linear_attn", None), Qwen3_5GatedDeltaNet)
             else "?" for layer in hf_model.model.layers]
    assert kinds == ["gdn"] * 3 + ["full"] + ["gdn"] * 3 + ["full"]
    assert model.decoder.layer_type_list == list("G-G-G-*-G-G-G-*-")
    _upcast_reference(hf_model, monkeypatch)
    diff = _logprob_diff(cfg, model, hf_model)
    print(f"max |d log-prob| vs transformers: {diff:.3e}")
    assert diff <= TOL, diff


def test_comparison_detects_a_wrong_gate_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison is not vacuous: swapping the query and gate rows of one head, or using a
    plain instead of a zero-centred GDN out_norm gain, moves the log-probs far past TOL."""
    cfg = Qwen36Config(**TINY)
    model = _build(cfg)
    hf_model = _hf_model(cfg, model)
    _upcast_reference(hf_model, monkeypatch)
    q_proj = hf_model.model.layers[3].self_attn.q_proj.weight
    with torch.no_grad():
        d = cfg.head_dim
        q_proj[:2 * d] = torch.cat([q_proj[d:2 * d], q_proj[:d]]).clone()
    swapped = _logprob_diff(cfg, model, hf_model)
    hf_model.load_state_dict(to_hf_state_dict(model, cfg))
    with torch.no_grad():
        hf_model.model.layers[0].linear_attn.norm.weight.sub_(1.0)
    plain_gain = _logprob_diff(cfg, model, hf_model)
    print(f"swapped q/gate head: {swapped:.3e}; plain out_norm gain: {plain_gain:.3e}")
    assert swapped > 1e3 * TOL and plain_gain > 1e3 * TOL


@pytest.mark.parametrize("tie", [False, True])
def test_state_dict_round_trip(tie: bool) -> None:
    cfg = Qwen36Config(**{**TINY, "tie_word_embeddings": tie})
    source, target = _build(cfg, seed=0), _build(cfg, seed=1)
    hf_sd = to_hf_state_dict(source, cfg)
    assert ("lm_head.weight" in hf_sd) == (not tie)
    assert hf_sd["model.layers.3.self_attn.q_proj.weight"].shape == (6 * 2 * 32, 64)
    assert hf_sd["model.layers.0.linear_attn.in_proj_qkv.weight"].shape == (2 * 32 + 96, 64)
    assert "model.layers.3.linear_attn.in_proj_qkv.weight" not in hf_sd  # full-attention layer
    from_hf_state_dict(hf_sd, target, cfg)
    src, dst = dict(source.named_parameters()), dict(target.named_parameters())
    assert src.keys() == dst.keys()
    for name in src:
        if name.endswith("out_norm.weight"):  # w -> w + 1 -> w - 1: exact up to one ulp of 1
            assert (src[name] - dst[name]).abs().max() <= 2.3e-16, name
        else:
            assert torch.equal(src[name], dst[name]), name
    again = to_hf_state_dict(target, cfg)
    assert again.keys() == hf_sd.keys()
    assert all(torch.equal(again[k], hf_sd[k]) for k in hf_sd if not k.endswith("linear_attn.norm.weight"))


def test_missing_unexpected_and_misshapen_keys_are_reported() -> None:
    cfg = Qwen36Config(**TINY)
    model = _build(cfg)
    hf_sd = to_hf_state_dict(model, cfg)
    before = {n: p.clone() for n, p in model.named_parameters()}

    missing = dict(hf_sd)
    del missing["model.layers.1.linear_attn.in_proj_b.weight"]
    with pytest.raises(KeyError, match=r"missing 1 \['model\.layers\.1\.linear_attn\.in_proj_b\.weight'\]"):
        from_hf_state_dict(missing, model, cfg)
    extra = dict(hf_sd, **{"mtp.fc.weight": torch.zeros(1)})
    with pytest.raises(KeyError, match=r"unexpected 1 \['mtp\.fc\.weight'\]"):
        from_hf_state_dict(extra, model, cfg)
    wrong = dict(hf_sd, **{"model.layers.3.self_attn.k_proj.weight": torch.zeros(3, 64, dtype=F64)})
    with pytest.raises(ValueError, match=r"k_proj"):
        from_hf_state_dict(wrong, model, cfg)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())

    # A vision-language checkpoint's text tensors load after `text_state_dict`.
    vlm = {k.replace("model.", "model.language_model.", 1): v for k, v in hf_sd.items()}
    vlm.update({"model.visual.patch_embed.proj.weight": torch.zeros(1), "mtp.fc.weight": torch.zeros(1)})
    assert text_state_dict(vlm).keys() == hf_sd.keys()


def test_config_round_trip() -> None:
    cfg = Qwen36Config(**{**TINY, "rope_theta": 5e6, "tie_word_embeddings": True})
    hf = hf_config(cfg)
    assert hf.layer_types == cfg.layer_types()
    assert hf.rope_parameters["partial_rotary_factor"] == 0.25
    assert qwen36_config_from_hf(hf) == cfg
    assert qwen36_config_from_hf(hf.to_dict()) == cfg
    # A checkpoint-style vision-language config.json: the text model sits under text_config.
    full = Qwen36Config()
    names = [*TINY, "max_position_embeddings", "rms_norm_eps"]
    text = {name: getattr(full, name) for name in names} | {
        "model_type": "qwen3_5_text", "full_attention_interval": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True}}
    assert qwen36_config_from_hf({"model_type": "qwen3_5", "text_config": text}) == full
    with pytest.raises(ValueError, match="layer_types"):
        qwen36_config_from_hf({**text, "layer_types": ["linear_attention"] * 3 + ["full_attention"]
                               + ["linear_attention"] * 60})
