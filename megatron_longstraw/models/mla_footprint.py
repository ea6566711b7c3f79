"""What the planner's MLA + MoE families share (GLM-5.2: `planner/glm52.py`, DeepSeek-V3:
`models/deepseekv3/planner.py`): the parameters of MLA attention, the dense MLP and the MoE, the
bytes replay saves around the attention core and in the FFNs, and the MoE capture and the
log-sum-exp merge items. Each family adds its attention core (DSA's sparse selection, dense
attention) and what it alone holds (GLM-5.2's indexer and its index-key pages)."""

from __future__ import annotations

from collections.abc import Sequence

from megatron_longstraw.models.footprint import (
    Item, ParamGroup, PlanSpec, rms_norm_saved, streamed_capture_device,
)

CP_REPLAY_NOTE = ("CP scoring and replay gather one block's queries (response_block rows, or "
                  "the whole padded branch when shorter) on every rank and merge the partial "
                  "outputs [block, heads, kv_lora_rank] by log-sum-exp with a reduce-scatter: "
                  "the attention working set grows with the block, not R.")


def mla_moe_params(cfg, after_attention: Sequence[ParamGroup] = ()) -> list[ParamGroup]:
    """Every parameter of an MLA + MoE model (Megatron names in comments); `after_attention`:
    the family's own groups (GLM-5.2's DSA indexer)."""
    h, H, qr, kvr = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    dn, dr, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    L, V = cfg.num_hidden_layers, cfg.vocab_size
    proj = [(h, qr), (qr, H * (dn + dr)), (h, kvr + dr), (kvr, H * (dn + v)), (H * v, h)]
    # input_layernorm + q_layernorm + kv_layernorm; linear_q_down/up, linear_kv_down/up, linear_proj
    attention = h + qr + kvr + sum(i * o for i, o in proj)
    dense, moe = cfg.first_k_dense_replace, L - cfg.first_k_dense_replace
    mlp = lambda ffn: [(h, 2 * ffn), (ffn, h)]         # linear_fc1 (gated), linear_fc2
    # FP8 (Family.fp8_linears): the same linears; linear_fc1's gate and up in their own blocks
    fp8_mlp = lambda ffn: [(h, 2 * ffn, 2), (ffn, h, 1)]
    fp8_proj = [(i, o, 1) for i, o in proj]
    shared = cfg.moe_intermediate_size * cfg.n_shared_experts
    return [
        ParamGroup("embedding", V * h, kind="embedding"),
        ParamGroup("output_layer + final_norm", V * (0 if cfg.tie_word_embeddings else h) + h,
                   kind="head"),
        ParamGroup("attention (MLA)", L * attention, kind="attention", lora_shapes=proj * L,
                   fp8_shapes=fp8_proj * L),
        *after_attention,
        # pre_mlp_layernorm, linear_fc1 (gated: 2 x ffn), linear_fc2
        ParamGroup("dense MLP", dense * (h + 3 * h * cfg.intermediate_size), kind="mlp",
                   lora_shapes=mlp(cfg.intermediate_size) * dense,
                   fp8_shapes=fp8_mlp(cfg.intermediate_size) * dense),
        ParamGroup("MoE router + shared expert + norm",
                   moe * (h + cfg.n_routed_experts * h + 3 * h * shared), kind="mlp",
                   lora_shapes=mlp(shared) * moe, fp8_shapes=fp8_mlp(shared) * moe),
        ParamGroup("routed experts", moe * cfg.n_routed_experts * 3 * h * cfg.moe_intermediate_size,
                   expert=True, kind="experts",
                   lora_shapes=mlp(cfg.moe_intermediate_size) * moe * cfg.n_routed_experts,
                   fp8_shapes=fp8_mlp(cfg.moe_intermediate_size) * moe * cfg.n_routed_experts),
    ]


# ---- replay: what autograd saves (SavedTensorMeter's convention) --------------------------------


def mla_outer_saved(cfg, c: int, b: float) -> float:
    """MLA around its attention core for c rows: everything up to the absorbed queries and latent
    rows, and the output projection's input. The core and the W_UV up-projection are the
    family's."""
    h, H, qr, kvr = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    dn, dr, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    return (
        rms_norm_saved(c, h, b)                        # input_layernorm
        + c * h * b                                    # linear_kv_down_proj input
        + rms_norm_saved(c, kvr, b)                    # kv_layernorm (c_kv)
        + 2 * c * dr * b                               # RoPE of k_pe (cos, sin saved twice)
        + c * h * b + rms_norm_saved(c, qr, b)         # linear_q_down_proj input, q_layernorm
        + c * qr * b                                   # linear_q_up_proj input
        + H * c * dn * b                               # q_nope . W_UK (einsum)
        + 2 * c * dr * b                               # RoPE of q_pe
        + c * H * v * b                                # linear_proj input
    )


def ffn_saved(cfg, c: int, b: float, router_bytes: float,
              router_scores: float) -> tuple[float, float]:
    """(dense MLP layer, MoE layer) for c rows. `router_scores`: the bytes the family's router
    saves over the [c, experts] scores (sigmoid, group mask, ...); the top-k probabilities,
    indices, permutation, experts and unpermute index are counted here."""
    h = cfg.hidden_size
    mlp = lambda ffn: c * h * b + 4 * c * ffn * b     # linear_fc1 input, GLU (3), linear_fc2 input
    dense = rms_norm_saved(c, h, b) + mlp(cfg.intermediate_size)
    routed = c * cfg.num_experts_per_tok               # (token, expert) pairs
    moe = (rms_norm_saved(c, h, b) + mlp(cfg.moe_intermediate_size * cfg.n_shared_experts)
           + c * h * b                                 # router input
           + router_scores + routed * router_bytes     # the router's scores, top-k probabilities
           + 5 * routed * 8                            # top-k and permutation indices (int64)
           + routed * (h * b + 5 * cfg.moe_intermediate_size * b + router_bytes)  # experts + probs
           + routed * h * 8)                           # unpermute scatter index (expanded view)
    return dense, moe


# ---- phase items --------------------------------------------------------------------------------


def capture_moe_items(cfg, spec: PlanSpec, n: int, window_values: int = 0) -> list[Item]:
    """A capture MoE layer (capture.py, streamed): one token block of this rank's n prompt rows
    at a time; the positions table is the only prompt-sized device tensor (and under CP the
    exchange's key windows, `window_values` per row, stay); one block's dispatch buffers."""
    h, b = cfg.hidden_size, spec.act_bytes
    tb = min(spec.token_block, max(n, 1))
    routed = (tb if n else 0) * cfg.num_experts_per_tok * spec.moe_imbalance
    return [
        *streamed_capture_device(cfg, n, tb, b, spec.cp, window_values),
        Item("MoE dispatch buffers (one token chunk: permuted, received, expert in/out)",
             routed * (4 * h * b + 3 * cfg.moe_intermediate_size * b)),
    ]


def lse_merge_item(cfg, r_pad: int, cp: int, acc: float) -> Item:
    """Scoring under CP: collectives.merge_partials_by_lse of one block's gathered queries' partial
    latent outputs (`r_pad`: the block's padded rows)."""
    H, kvr = cfg.num_attention_heads, cfg.kv_lora_rank
    return Item("LSE merge: [weight * out; weight] [block, heads, kv_lora_rank + 1] fp32 + "
                "reduce-scatter",
                2 * r_pad * H * (kvr + 1) * acc if cp > 1 else 0, group="step")
