"""The DeepSeek-V3 family of the memory planner (`megatron_longstraw/planner`, tools/plan_memory.py):
parameters, pages and per-phase working sets of `models/deepseekv3`. The pages (latent rows only)
are checked against captured bytes exactly (tests/test_deepseekv3.py); the parameter count against
the built model; the phase items are analytic (read off attention.py and the shared MoE path, not
measured). The MLA + MoE pieces are `planner/mla.py`'s (shared with GLM-5.2); DeepSeek-V3's own
are the dense attention core and the group-limited router's scratch."""

from __future__ import annotations

from megatron_longstraw.models.footprint import (
    Footprint, Item, PageKind, ParamGroup, PlanSpec, block_state_items, branch_blocks_rows,
    branch_host_pages, branch_members, head_chunk_bytes, local_prompt_rows, lse_merge_saved,
    outside_layers_saved, rank_rows, rms_norm_saved, streamed_capture_device, streamed_capture_host,
)
from megatron_longstraw.models.mla_footprint import (
    CP_REPLAY_NOTE, capture_moe_items, ffn_saved, lse_merge_item, mla_moe_params, mla_outer_saved,
)


def deepseekv3_params(cfg) -> list[ParamGroup]:
    """Every parameter of build_deepseekv3_model: the MLA + MoE groups, nothing else."""
    return mla_moe_params(cfg)


def deepseekv3_pages(cfg, latent_bytes: float) -> list[PageKind]:
    """MLA latent rows [c_kv; k_pe] on every layer (attention.py: LATENT), nothing else."""
    return [PageKind("latent", (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * latent_bytes,
                     cfg.num_hidden_layers)]


def deepseekv3_replay_saved(cfg, rows: int, cp: int, prefix_len: int, b: float,
                            router_bytes: float = 4, acc: float | None = None,
                            earlier: int = 0) -> dict[str, float]:
    """Bytes autograd saves while one member's branch is replayed (analytic; the GLM-5.2 planner's
    conventions, `planner/glm52.py`). rows: this rank's branch rows; under CP the attention works
    on the whole gathered branch (R_pad queries) over the local prompt shard. The dense attention
    saves its inputs, output and log-sum-exp (`refs.blockwise_attention`): the keys are the local
    prompt rows plus the branch's own, [P/CP + R_pad, d_qk], once per layer."""
    acc = acc or max(b, 4.0)
    h, H, kvr = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    d_qk = kvr + cfg.qk_rope_head_dim
    c = rows
    q = rows * cp                                      # attention query rows (gathered under CP)
    # local prompt rows + a blockwise branch's earlier blocks' rows here + the block's own
    keys = local_prompt_rows(prefix_len + 1, cp) + earlier + q
    # Two partials (models/partials.py: the prompt's rows, the branch's own), each saving the
    # queries, its output, lse and positions; the log-sum-exp merge saves both and the merged ones.
    attention = (
        mla_outer_saved(cfg, c, b)
        + 2 * q * H * d_qk * b + keys * d_qk * b       # blockwise attention: queries, key rows
        + 2 * (q * H * kvr * b + q * H * acc) + 8 * (2 * q + keys)   # outputs, lses, positions
        + 3 * q * H * (kvr * b + acc)                  # the merge
        + H * q * kvr * b                              # out_latent . W_UV (einsum)
    )
    if cp > 1:  # collectives.merge_partials_by_lse: this rank's [q, H, kvr] partial, its c rows kept
        attention += lse_merge_saved(q, c, H, kvr, acc)
    # the router's scratch: sigmoid, group mask, top-k over [c, E]
    dense, moe = ffn_saved(cfg, c, b, router_bytes, 3 * c * cfg.n_routed_experts * router_bytes)
    layers = [attention + (moe if cfg.is_moe_layer(i) else dense)
              for i in range(cfg.num_hidden_layers)]
    embed, inputs, head, loss = outside_layers_saved(cfg, c, b, acc, rms_norm_saved(c, h, b))
    return {"embedding": embed, "checkpoint_inputs": inputs, "layer_working_set": max(layers),
            "attention_working_set": attention, "head": head, "loss": loss,
            "largest_saved_tensor": max(keys * d_qk * b, q * H * d_qk * b),
            "checkpointed": embed + inputs + head + loss,
            "uncheckpointed": embed + sum(layers) + head + loss}


def deepseekv3(spec: PlanSpec, prompt_len: int) -> Footprint:
    cfg = spec.model
    b, acc = spec.act_bytes, max(spec.act_bytes, 4.0)
    H, kvr, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    d_qk, v = kvr + dr, cfg.v_head_dim
    cp = spec.cp
    n, total, rows, r_pad = rank_rows(prompt_len, cp, spec.response_len)
    blk = branch_blocks_rows(spec.response_len, spec.response_block, cp)
    q, c, earlier = blk.block, blk.rows, blk.earlier
    saved = deepseekv3_replay_saved(cfg, c, cp, total, b, acc=acc, earlier=earlier)
    scores = lambda queries: 3 * queries * H * spec.key_block * acc  # one key block's scores/probs

    # Capture (capture.py; attention.py), one layer at a time.
    qb = min(spec.query_block, max(n, 1))
    tb = min(spec.token_block, max(n, 1))
    dense_block = Item("dense attention block: absorbed queries + [query_block, heads, key_block] "
                       "scores", qb * H * d_qk * b + scores(qb), group="block")
    # Streamed: one token block at a time, latent rows read by windows from the pages (one
    # process) or from every rank's rows gathered in host memory (CP).
    capture_attention = streamed_capture_device(cfg, n, tb, b, cp, d_qk) + [
        Item("capture latent rows of one token block [token_block, latent]", tb * d_qk * b),
        Item("latent window [key_block, latent] (read from the pages)",
             spec.key_block * d_qk * b),
        Item("capture attention output of one token block [token_block, heads*v] x2 (block "
             "list + cat)", 2 * tb * H * v * b),
        dense_block,
    ]
    capture_moe = capture_moe_items(cfg, spec, n, window_values=d_qk)
    capture_host = streamed_capture_host(cfg, n, b, 0, total if cp > 1 else 0, d_qk)
    # Scoring and replay stream the pages: replay.py prefetches layer l+1 while l runs (two
    # layers' local pages; on CPU a view of the pages); the pages and the branch's rows are
    # attended as two parts (models/partials.py: no cat).
    common = [Item("streamed page window (2 layers' local pages)",
                   2 * n * d_qk * spec.latent_bytes)]
    qs = min(spec.query_block, q)
    common += [Item("the earlier blocks' positions [R/CP] int64 x2 (kept + the view's cat) and "
                    "the member's log-probs [R/CP] fp32 (per block, kept)", 16 * earlier + rows * acc),
               Item("the earlier blocks' latent rows of one layer [R/CP, latent] (read from the "
                    "branch pages) + their positions", earlier * (d_qk * b + 8))]
    branch_kinds = deepseekv3_pages(cfg, b)           # the branch's own rows: the model's dtype
    widened = lambda kind: kind.row_bytes * acc / b    # a cotangent row: fp32 or wider
    block_state = block_state_items(branch_kinds, blk, widened)
    scoring = common + block_state[:1] + [
        Item("scoring LM head (chunked): logits and log-softmax [min(block/CP, 1024), vocab] fp32",
             head_chunk_bytes(cfg, c, acc, 2)),
        Item("dense attention block [query_block, heads, key_block]", scores(qs), group="step"),
        lse_merge_item(cfg, q, cp, acc),
    ]
    replay = common + block_state + [
        Item("replay checkpoint inputs [block/CP, h] x layers + token ids",
             saved["checkpoint_inputs"] + saved["embedding"]),
        Item("replay recompute working set (one decoder layer)", saved["layer_working_set"],
             group="graph"),
        Item("replay LM head + loss, and one head chunk's backward [min(block/CP, 1024), vocab] "
             "fp32 x3", saved["head"] + saved["loss"] + head_chunk_bytes(cfg, c, acc, 3),
             group="graph"),
        # The pages are a constant part (models/partials.py): only the branch's own rows get a
        # key gradient.
        Item("replay backward: the block rows' key gradient [block, latent] fp32 + one key "
             "block's scores", q * d_qk * acc + scores(qs)),
    ]
    notes = ["DeepSeek-V3's replay and capture figures are analytic (no SavedTensorMeter check "
             "yet); its pages are exact."]
    if cp > 1:
        notes.append(CP_REPLAY_NOTE)
    return Footprint(params=deepseekv3_params(cfg), pages=deepseekv3_pages(cfg, spec.latent_bytes),
                     phases={"capture (attention layer)": capture_attention,
                             "capture (MoE layer)": capture_moe,
                             "scoring": scoring, "replay": replay},
                     replay_saved=saved, notes=notes,
                     host=capture_host + branch_host_pages(branch_kinds, blk, spec.page_tokens,
                                                           widened, branch_members(spec)))
