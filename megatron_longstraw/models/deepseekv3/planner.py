"""The DeepSeek-V3 family of the memory planner (`megatron_longstraw/planner`, tools/plan_memory.py):
parameters, pages and per-phase working sets of `models/deepseekv3`. The pages (latent rows only)
are checked against captured bytes exactly (tests/test_deepseekv3.py); the parameter count against
the built model; the phase items are analytic (read off attention.py and the shared MoE path, not
measured)."""

from __future__ import annotations

from megatron_longstraw.planner.common import (
    Footprint, Item, PageKind, ParamGroup, PlanSpec, local_prompt_rows, lse_merge_saved,
)


def deepseekv3_params(cfg) -> list[ParamGroup]:
    """Every parameter of build_deepseekv3_model (Megatron names in comments)."""
    h, H, qr, kvr = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    dn, dr, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    L, V = cfg.num_hidden_layers, cfg.vocab_size
    proj = [(h, qr), (qr, H * (dn + dr)), (h, kvr + dr), (kvr, H * (dn + v)), (H * v, h)]
    # input_layernorm + q_layernorm + kv_layernorm; linear_q_down/up, linear_kv_down/up, linear_proj
    attention = h + qr + kvr + sum(i * o for i, o in proj)
    dense, moe = cfg.first_k_dense_replace, L - cfg.first_k_dense_replace
    mlp = lambda ffn: [(h, 2 * ffn), (ffn, h)]         # linear_fc1 (gated), linear_fc2
    shared = cfg.moe_intermediate_size * cfg.n_shared_experts
    return [
        ParamGroup("embedding", V * h, kind="embedding"),
        ParamGroup("output_layer + final_norm", V * (0 if cfg.tie_word_embeddings else h) + h,
                   kind="head"),
        ParamGroup("attention (MLA)", L * attention, kind="attention", lora_shapes=proj * L),
        # pre_mlp_layernorm, linear_fc1 (gated: 2 x ffn), linear_fc2
        ParamGroup("dense MLP", dense * (h + 3 * h * cfg.intermediate_size), kind="mlp",
                   lora_shapes=mlp(cfg.intermediate_size) * dense),
        ParamGroup("MoE router + shared expert + norm",
                   moe * (h + cfg.n_routed_experts * h + 3 * h * shared), kind="mlp",
                   lora_shapes=mlp(shared) * moe),
        ParamGroup("routed experts", moe * cfg.n_routed_experts * 3 * h * cfg.moe_intermediate_size,
                   expert=True, kind="experts",
                   lora_shapes=mlp(cfg.moe_intermediate_size) * moe * cfg.n_routed_experts),
    ]


def deepseekv3_pages(cfg, latent_bytes: float) -> list[PageKind]:
    """MLA latent rows [c_kv; k_pe] on every layer (attention.py: LATENT), nothing else."""
    return [PageKind("latent", (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * latent_bytes,
                     cfg.num_hidden_layers)]


def deepseekv3_replay_saved(cfg, rows: int, cp: int, prefix_len: int, b: float,
                            router_bytes: float = 4, acc: float | None = None) -> dict[str, float]:
    """Bytes autograd saves while one member's branch is replayed (analytic; the GLM-5.2 planner's
    conventions, `planner/glm52.py`). rows: this rank's branch rows; under CP the attention works
    on the whole gathered branch (R_pad queries) over the local prompt shard. The dense attention
    saves its inputs, output and log-sum-exp (`refs.blockwise_attention`): the keys are the local
    prompt rows plus the branch's own, [P/CP + R_pad, d_qk], once per layer."""
    acc = acc or max(b, 4.0)
    h, H, qr, kvr = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    dn, dr, v, V = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.vocab_size
    d_qk = kvr + dr
    c = rows
    q = rows * cp                                      # attention query rows (gathered under CP)
    keys = local_prompt_rows(prefix_len + 1, cp) + q   # local prompt rows + the branch's own
    norm = lambda width: (3 * c * width + 2 * c) * b   # torch RMSNorm: input, rstd x2, two products
    attention = (
        norm(h)                                        # input_layernorm
        + c * h * b + norm(kvr) + 2 * c * dr * b       # linear_kv_down_proj input, kv_layernorm, RoPE
        + c * h * b + norm(qr) + c * qr * b            # linear_q_down_proj, q_layernorm, q_up input
        + H * c * dn * b + 2 * c * dr * b              # q_nope . W_UK (einsum), RoPE of q_pe
        + q * H * d_qk * b + keys * d_qk * b           # blockwise attention: queries, key rows
        + q * H * kvr * b + q * H * acc + 8 * (q + keys)   # its output, lse, positions
        + H * q * kvr * b                              # out_latent . W_UV (einsum)
        + c * H * v * b                                # linear_proj input
    )
    if cp > 1:  # parallel.merge_partials_by_lse: this rank's [q, H, kvr] partial, its c rows kept
        attention += lse_merge_saved(q, c, H, kvr, acc)
    mlp = lambda ffn: c * h * b + 4 * c * ffn * b     # linear_fc1 input, GLU (3), linear_fc2 input
    dense = norm(h) + mlp(cfg.intermediate_size)
    routed = c * cfg.num_experts_per_tok               # (token, expert) pairs
    E = cfg.n_routed_experts
    moe = (norm(h) + mlp(cfg.moe_intermediate_size * cfg.n_shared_experts)
           + c * h * b                                 # router input
           + 3 * c * E * router_bytes + routed * router_bytes  # sigmoid, group mask, top-k
           + 5 * routed * 8                            # top-k and permutation indices (int64)
           + routed * (h * b + 5 * cfg.moe_intermediate_size * b + router_bytes)  # experts + probs
           + routed * h * 8)                           # unpermute scatter index (expanded view)
    layers = [attention + (moe if cfg.is_moe_layer(i) else dense)
              for i in range(cfg.num_hidden_layers)]
    head = norm(h) + c * h * b + 2 * c * V * acc + 8 * c   # final_norm, output_layer, log-softmax, gather
    loss = 4 * c * acc + 2 * acc                       # grpo.member_loss: ratio, clip, min, scalars
    embed = 8 * c                                      # token ids
    inputs = cfg.num_hidden_layers * c * h * b         # checkpoint inputs, one per decoder layer
    return {"embedding": embed, "checkpoint_inputs": inputs, "layer_working_set": max(layers),
            "attention_working_set": attention, "head": head, "loss": loss,
            "largest_saved_tensor": max(keys * d_qk * b, q * H * d_qk * b, c * V * acc),
            "checkpointed": embed + inputs + head + loss,
            "uncheckpointed": embed + sum(layers) + head + loss}


def deepseekv3(spec: PlanSpec, prompt_len: int) -> Footprint:
    cfg = spec.model
    b, acc = spec.act_bytes, max(spec.act_bytes, 4.0)
    h, H, kvr, dr = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    d_qk, v = kvr + dr, cfg.v_head_dim
    cp, R = spec.cp, spec.response_len
    n = local_prompt_rows(prompt_len, cp)               # captured rows on this rank
    total = max(prompt_len - 1, 0)
    rows = -(-R // cp)                                  # this rank's branch rows
    r_pad = rows * cp
    saved = deepseekv3_replay_saved(cfg, rows, cp, total, b, acc=acc)
    scores = lambda queries: 3 * queries * H * spec.key_block * acc  # one key block's scores/probs

    # Capture (attention.py `_causal_in_order` / `_capture_context_parallel`), one layer at a time.
    qb = min(spec.query_block, max(n, 1))
    chunk = -(-n // max(1, -(-n // spec.token_block))) if n else 0
    routed = chunk * cfg.num_experts_per_tok * spec.moe_imbalance
    shard = local_prompt_rows(prompt_len, cp) if cp > 1 else 0
    capture_attention = [
        Item("capture residual stream [P/CP, h] x2 (layer input, input-norm output)", 2 * n * h * b),
        Item("capture latent rows [P/CP, latent] (buffer / the local shard)", n * d_qk * b),
        Item("ring attention: one broadcast shard of latent rows + positions (CP)",
             shard * (d_qk * b + 8)),
        Item("capture attention output [P/CP, heads*v] x2 (running + partial, or block list)",
             2 * n * H * v * b if cp > 1 else 2 * min(n, spec.token_block) * H * v * b),
        Item("dense attention block: absorbed queries + [query_block, heads, key_block] scores",
             qb * H * d_qk * b + scores(qb), group="block"),
    ]
    capture_moe = [
        Item("capture residual stream [P/CP, h] x3 (layer input, chunk outputs, cat)", 3 * n * h * b),
        Item("MoE dispatch buffers (one token chunk: permuted, received, expert in/out)",
             routed * (4 * h * b + 3 * cfg.moe_intermediate_size * b)),
    ]
    # Scoring and replay stream the pages: replay.py prefetches layer l+1 while l runs (two
    # layers' local pages), attention cats [prefix; branch] latents.
    common = [Item("streamed page window (2 layers' local pages + latent cat copy)",
                   2 * n * d_qk * spec.latent_bytes + (n + r_pad) * d_qk * b)]
    qs = min(spec.query_block, r_pad)
    scoring = common + [
        Item("dense attention block [query_block, heads, key_block]", scores(qs), group="step"),
        Item("LSE merge: [weight * out; weight] [R, heads, kv_lora_rank + 1] fp32 + reduce-scatter",
             2 * r_pad * H * (kvr + 1) * acc if cp > 1 else 0, group="step"),
    ]
    replay = common + [
        Item("replay checkpoint inputs [R/CP, h] x layers + token ids",
             saved["checkpoint_inputs"] + saved["embedding"]),
        Item("replay recompute working set (one decoder layer)", saved["layer_working_set"],
             group="graph"),
        Item("replay LM head + loss (before the layers' backward)",
             saved["head"] + saved["loss"], group="graph"),
        Item("replay backward: key-row gradient [P/CP + R, latent] fp32 + one key block's scores",
             (n + r_pad) * d_qk * acc + scores(qs)),
    ]
    notes = ["DeepSeek-V3's replay and capture figures are analytic (no SavedTensorMeter check "
             "yet); its pages are exact."]
    if cp > 1:
        notes.append("CP replay gathers all R_pad branch queries on every rank and merges the "
                     "partial outputs [R_pad, heads, kv_lora_rank] by log-sum-exp with a "
                     "reduce-scatter: the attention working set grows with R, not R/CP.")
    return Footprint(params=deepseekv3_params(cfg), pages=deepseekv3_pages(cfg, spec.latent_bytes),
                     phases={"capture (attention layer)": capture_attention,
                             "capture (MoE layer)": capture_moe,
                             "scoring": scoring, "replay": replay},
                     replay_saved=saved, notes=notes)
