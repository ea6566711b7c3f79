"""GLM-5.2 <-> transformers `GlmMoeDsaForCausalLM`: config mapping, state-dict mapping, and logit
equivalence of our Megatron HybridModel with the transformers reference (CPU, float64).

Tolerance of the logit comparison (max |d log_softmax| <= 1e-9): both models run in float64 and
`_upcast_reference` removes transformers' float32 islands (RMSNorm, RoPE angles, eager softmax,
router; left in, they cost ~6e-8, and float32 router weights against our float64 ones ~3e-9). What
remains is float64 rounding, ~1e-16 relative per operation (observed: 1.8e-15, two ulps of
log(256)). 1e-9 is ~6 orders above that noise and still below every real discrepancy seen: a
float32 router ~3e-9, float32 norms/RoPE/softmax ~6e-8, the latent-norm epsilon mismatch ~3e-5,
one differently chosen DSA key ~1e-2.
"""

from __future__ import annotations

import types

import pytest
import torch

import hf_fp64

from megatron_longstraw.runtime import precision
from megatron_longstraw.models.glm52.config import GLM52Config
from megatron_longstraw.models.glm52.hf import (
    from_hf_state_dict,
    glm52_config_from_hf,
    hf_config,
    to_hf_state_dict,
)
from megatron_longstraw.runtime.platform import manual_seed
from megatron_longstraw.state.attention_pass import AttentionPass

F64 = torch.float64
TOL = 1e-9
SEQ = 96  # > index_topk: DSA selects 16 of up to 96 keys

# Tiny GLM-5.2. The indexer score is sum_h w_h * relu(q_h . k), exactly 0 when every head's q.k < 0
# (probability 2^-heads per pair). With 4 heads (examples/glm52/tiny.yaml) such exact ties are
# frequent at the top-k boundary, and transformers' `topk` and our stable order break them
# differently (a legitimate, unspecified choice that changes the output by ~1e-2): the reference
# indexer (hf_fp64.dsa_indexer) breaks them as ours, test_zero_score_ties_break_toward_the_lower_key.
# index_n_heads=16 here: exact ties ~1e-5 per pair, absent for this seed.
# rms_norm_eps=1e-6: transformers hard-codes eps 1e-6 for q_a_layernorm / kv_a_layernorm, while
# Megatron's MLA builds q_layernorm / kv_layernorm with `layernorm_epsilon` (= rms_norm_eps); they
# agree only when rms_norm_eps == 1e-6 (see test_latent_norm_eps_matches_transformers).
TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
            q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
            num_experts_per_tok=2, index_n_heads=16, index_head_dim=16, index_topk=16,
            first_k_dense_replace=3, rms_norm_eps=1e-6)


pytestmark = pytest.mark.usefixtures("single_process")  # conftest: one-process Megatron state


def _build(cfg: GLM52Config, seed: int = 0) -> torch.nn.Module:
    """Our model in float64 with non-trivial norms and routing biases."""
    from megatron_longstraw.models.glm52.model import build_glm52_model

    manual_seed(seed)  # Megatron initialises from its RNG tracker: reseed it for reproducible weights
    precision.use_dtype(F64)
    model = build_glm52_model(cfg, params_dtype=F64)
    # Megatron's WrappedTorchNorm ignores params_dtype (norm weights stay float32, and the indexer's
    # k_norm LayerNorm then refuses float64 inputs): cast the norms; expert_bias stays float32.
    for module in model.modules():
        if isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
            module.to(F64)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # RMSNorm/LayerNorm weights (and k_norm bias) away from 1 / 0
                param.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(param))
        for name, buf in model.named_buffers():
            if name.endswith("router.expert_bias"):  # comparable to sigmoid-score gaps: reroutes
                buf.copy_(0.05 * torch.randn_like(buf))
    return model.eval()


def _upcast_reference(hf_model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch,
                      router_fp64: bool) -> None:
    """transformers computes RMSNorm, the RoPE angles, the eager softmax and the MoE router in
    float32 even for a float64 model (~6e-8 differences). Run the first three in float64, and the
    router at our router's precision (`router_fp64`: Megatron's `moe_router_dtype="fp64"` routing;
    otherwise both routers are float32 with identical inputs), and the DSA indexer's scores in
    float64 with ties broken toward the lower key position as ours (`hf_fp64.dsa_indexer`), so
    that the comparison checks the weight mapping at float64 precision; the formulas are
    unchanged."""
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_mod

    def rms_norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rotary(self, x, position_ids):
        dim, theta = self.config.qk_rope_head_dim, self.config.rope_parameters["rope_theta"]
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=F64) / dim))
        freqs = position_ids[..., None].to(F64) * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    eager_attention, router = hf_fp64.eager_attention, hf_fp64.sigmoid_router

    for module in hf_model.modules():
        if isinstance(module, hf_mod.GlmMoeDsaRMSNorm):
            module.forward = types.MethodType(rms_norm, module)
        if router_fp64 and isinstance(module, hf_mod.GlmMoeDsaTopkRouter):
            module.forward = types.MethodType(router, module)
        if isinstance(module, hf_mod.GlmMoeDsaIndexer):
            module.forward = types.MethodType(hf_fp64.dsa_indexer, module)
    rotary_emb = hf_model.model.rotary_emb
    rotary_emb.forward = types.MethodType(rotary, rotary_emb)
    monkeypatch.setattr(hf_mod, "eager_attention_forward", eager_attention)


def _hf_model(cfg: GLM52Config, model: torch.nn.Module) -> torch.nn.Module:
    from transformers import GlmMoeDsaForCausalLM

    hf_model = GlmMoeDsaForCausalLM(hf_config(cfg)).to(F64).eval()
    hf_model.load_state_dict(to_hf_state_dict(model, cfg), strict=True)
    return hf_model


def _compare(cfg: GLM52Config, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Run both models on one random sequence; returns diagnostics (see the assertions)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaMoE

    model = _build(cfg)
    hf_model = _hf_model(cfg, model)
    _upcast_reference(hf_model, monkeypatch, router_fp64=model.config.moe_router_dtype == "fp64")
    for i in range(cfg.num_hidden_layers):
        assert isinstance(model.decoder.layers[2 * i + 1].mlp, MoELayer) == (i >= 3)
        assert isinstance(hf_model.model.layers[i].mlp, GlmMoeDsaMoE) == (i >= 3)
        assert (hf_model.model.layers[i].self_attn.indexer is None) == (not cfg.has_own_indexer(i))

    hf_selection, router_inputs = {}, {}
    for i, layer in enumerate(hf_model.model.layers):
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.register_forward_hook(
                lambda mod, inp, out, i=i: hf_selection.__setitem__(i, out.long()))
        if i >= cfg.first_k_dense_replace:
            layer.mlp.gate.register_forward_hook(
                lambda mod, inp, out, i=i: router_inputs.__setitem__(i, inp[0].detach().clone()))

    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, SEQ))
    with torch.no_grad():
        state = AttentionPass(mode="full", positions=torch.arange(SEQ))
        ours = model(ids, None, attention_mask=state)
        ref = hf_model(ids).logits
    diff = (torch.log_softmax(ours, -1) - torch.log_softmax(ref, -1)).abs().max().item()

    # Selections as sets of visible keys (transformers also returns masked future keys when fewer
    # than index_topk are visible; we return -1 there).
    mismatched = {}
    for i, hf_idx in hf_selection.items():
        rows = [s for s in range(SEQ)
                if {k for k in state.selections[i][s].tolist() if k >= 0}
                != {k for k in hf_idx[0, s].tolist() if k <= s}]
        if rows:
            mismatched[i] = rows
    # Does the random expert_bias change which experts some tokens get?
    rerouted = {}
    for i, x in router_inputs.items():
        gate = hf_model.model.layers[i].mlp.gate
        scores = torch.sigmoid(torch.nn.functional.linear(x.float().reshape(-1, cfg.hidden_size),
                                                          gate.weight.float()))
        unbiased = scores.topk(cfg.num_experts_per_tok, -1).indices.sort(-1).values
        biased = (scores + gate.e_score_correction_bias).topk(
            cfg.num_experts_per_tok, -1).indices.sort(-1).values
        rerouted[i] = int((unbiased != biased).any(-1).sum())
    return dict(diff=diff, mismatched=mismatched, rerouted=rerouted, full_layers=sorted(hf_selection))


def test_tiny_config_has_indexshare_and_moe() -> None:
    cfg = GLM52Config(**TINY)
    kinds = cfg.indexer_types()
    assert "full" in kinds and "shared" in kinds, kinds
    assert [cfg.is_moe_layer(i) for i in range(8)] == [False] * 3 + [True] * 5
    assert SEQ > cfg.index_topk


def test_logits_match_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = GLM52Config(**TINY)
    result = _compare(cfg, monkeypatch)
    assert result["full_layers"] == [i for i in range(8) if cfg.has_own_indexer(i)]
    assert not result["mismatched"], f"DSA selections differ (layer: rows): {result['mismatched']}"
    assert all(n > 0 for n in result["rerouted"].values()), result["rerouted"]
    assert result["diff"] <= TOL, result["diff"]


def test_zero_score_ties_break_toward_the_lower_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """With 4 index heads (examples/glm52/tiny.yaml) a key whose every head scores below zero
    scores exactly 0 after the ReLU, and such ties fall at the top-k boundary in several rows
    (counted on the reference's scores, whatever torch.topk would do with them): ours keeps the
    lower key position (kernels/refs.py), as the reference does, and the two agree."""
    cfg = GLM52Config(**{**TINY, "index_n_heads": 4})
    hf_fp64.boundary_ties.clear()
    result = _compare(cfg, monkeypatch)
    assert sum(hf_fp64.boundary_ties) > 0, "no tie at the top-k boundary: the case tests nothing"
    assert not result["mismatched"] and result["diff"] <= TOL, result


def test_latent_norm_eps_matches_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """GLM-5.2's rms_norm_eps is 1e-5, but its latent norms use 1e-6 (`latent_norm_eps`)."""
    cfg = GLM52Config(**{**TINY, "rms_norm_eps": 1e-5})
    result = _compare(cfg, monkeypatch)
    assert not result["mismatched"] and result["diff"] <= TOL, result["diff"]


@pytest.mark.parametrize("tie", [False, True])
def test_state_dict_round_trip_is_exact(tie: bool) -> None:
    cfg = GLM52Config(**{**TINY, "tie_word_embeddings": tie})
    source, target = _build(cfg, seed=0), _build(cfg, seed=1)
    hf_sd = to_hf_state_dict(source, cfg)
    assert ("lm_head.weight" in hf_sd) == (not tie)
    assert hf_sd["model.layers.3.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    assert "model.layers.3.self_attn.indexer.wq_b.weight" not in hf_sd  # IndexShare layer
    from_hf_state_dict(hf_sd, target, cfg)
    src = dict(source.named_parameters()) | dict(source.named_buffers())
    dst = dict(target.named_parameters()) | dict(target.named_buffers())
    names = [n for n in src if not n.endswith("local_tokens_per_expert")]
    assert names and all(n in dst for n in names)
    for name in names:
        assert src[name].dtype == dst[name].dtype and torch.equal(src[name], dst[name]), name
    again = to_hf_state_dict(target, cfg)
    assert again.keys() == hf_sd.keys()
    assert all(torch.equal(again[k], hf_sd[k]) for k in hf_sd)


def test_missing_and_unexpected_keys_are_reported() -> None:
    cfg = GLM52Config(**TINY)
    model = _build(cfg)
    hf_sd = to_hf_state_dict(model, cfg)
    before = {n: p.clone() for n, p in model.named_parameters()}

    missing = dict(hf_sd)
    del missing["model.layers.6.self_attn.indexer.k_norm.bias"]
    with pytest.raises(KeyError, match=r"missing 1 \['model\.layers\.6\.self_attn\.indexer\.k_norm\.bias'\]"):
        from_hf_state_dict(missing, model, cfg)

    extra = dict(hf_sd, **{"model.layers.8.eh_proj.weight": torch.zeros(1)})
    with pytest.raises(KeyError, match=r"unexpected 1 \['model\.layers\.8\.eh_proj\.weight'\]"):
        from_hf_state_dict(extra, model, cfg)

    wrong = dict(hf_sd, **{"model.norm.weight": torch.zeros(3, dtype=F64)})
    with pytest.raises(ValueError, match=r"model\.norm\.weight|decoder\.final_norm\.weight"):
        from_hf_state_dict(wrong, model, cfg)
    # Nothing was written by the failed loads.
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_config_round_trip() -> None:
    cfg = GLM52Config(**{**TINY, "rope_theta": 5000.0, "tie_word_embeddings": True})
    hf = hf_config(cfg)
    assert hf.indexer_types == cfg.indexer_types()
    assert hf.mlp_layer_types == ["dense"] * 3 + ["sparse"] * 5
    assert glm52_config_from_hf(hf) == cfg
    assert glm52_config_from_hf(hf.to_dict()) == cfg


def test_config_from_dict_without_freq_and_offset() -> None:
    cfg = GLM52Config(**TINY)  # freq 4, offset 3
    d = hf_config(cfg).to_dict()
    del d["index_topk_freq"], d["index_skip_topk_offset"]
    back = glm52_config_from_hf(d)
    assert back.indexer_types() == cfg.indexer_types()
    assert back == cfg

    # A checkpoint-style config.json: legacy rope_theta, only indexer_types, MTP field.
    d = {"model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"],
         **TINY, "num_key_value_heads": 4, "rope_theta": 1000000, "num_nextn_predict_layers": 1,
         "indexer_types": ["full", "full", "shared", "full", "shared", "full", "shared", "full"]}
    back = glm52_config_from_hf(d)
    assert back.indexer_types() == d["indexer_types"]
    assert (back.index_topk_freq, back.index_skip_topk_offset) == (2, 2)
    assert back.rope_theta == 1e6

    d["indexer_types"] = ["full", "shared", "shared", "full", "full", "shared", "full", "full"]
    with pytest.raises(ValueError, match="not an IndexShare pattern"):
        glm52_config_from_hf(d)


def test_unrepresentable_settings_raise() -> None:
    with pytest.raises(ValueError, match="indexer_rope_interleaved"):
        hf_config(GLM52Config(**{**TINY, "indexer_rope_interleaved": False}))
    with pytest.raises(ValueError, match="num_experts_per_tok=1"):
        hf_config(GLM52Config(**{**TINY, "num_experts_per_tok": 1}))
    d = hf_config(GLM52Config(**TINY)).to_dict()
    d["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                            "original_max_position_embeddings": 4096}
    with pytest.raises(ValueError, match="rope_type"):
        glm52_config_from_hf(d)
