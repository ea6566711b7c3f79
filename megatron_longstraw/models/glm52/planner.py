"""The GLM-5.2 family of the planner: parameters, pages and replay activations of
`models/glm52` (checked against the model in tests/test_planner.py). The MLA + MoE pieces it
shares with DeepSeek-V3 are `planner/mla.py`'s; GLM-5.2's own are the DSA indexer (its
parameters, index-key pages, scores and top-k selections) and the sparse attention core."""

from __future__ import annotations

from megatron_longstraw.kernels import refs
from megatron_longstraw.models.footprint import (
    Footprint, Item, PageKind, ParamGroup, PlanSpec, block_state_items, branch_blocks_rows,
    branch_host_pages, branch_members, head_chunk_bytes, local_prompt_rows, lse_merge_saved,
    outside_layers_saved, rank_rows, rms_norm_saved, streamed_capture_device, streamed_capture_host,
)
from megatron_longstraw.models.mla_footprint import (
    CP_REPLAY_NOTE, capture_moe_items, ffn_saved, lse_merge_item, mla_moe_params, mla_outer_saved,
)


# ---- GLM-5.2 ------------------------------------------------------------------------------------



def glm52_params(cfg) -> list[ParamGroup]:
    """Every parameter of build_glm52_model: the MLA + MoE groups plus the DSA indexer."""
    h, di, hi = cfg.hidden_size, cfg.index_head_dim, cfg.index_n_heads
    # DSAIndexer: linear_wq_b, linear_wk, k_norm (LayerNorm: weight + bias), linear_weights_proj
    indexer = cfg.q_lora_rank * hi * di + h * di + 2 * di + h * hi
    # FP8 checkpoints (family.FP8_LINEARS): linear_wq_b and linear_wk; weights_proj stays bf16
    fp8 = [(cfg.q_lora_rank, hi * di, 1), (h, di, 1)] * cfg.num_full_indexer_layers()
    return mla_moe_params(cfg, [ParamGroup("DSA indexer", cfg.num_full_indexer_layers() * indexer,
                                           kind="indexer", fp8_shapes=fp8)])


def glm52_pages(cfg, latent_bytes: float, index_key_bytes: float) -> list[PageKind]:
    """MLA latent rows [c_kv; k_pe] on every layer, index-key rows on full indexer layers
    (attention.py: LATENT, INDEX_KEY)."""
    return [PageKind("latent", (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * latent_bytes,
                     cfg.num_hidden_layers),
            PageKind("index_key", cfg.index_head_dim * index_key_bytes,
                     cfg.num_full_indexer_layers())]


def glm52_replay_saved(cfg, rows: int, cp: int, prefix_len: int, b: float, router_bytes: float = 4,
                       acc: float | None = None, query_block: int | None = None,
                       earlier: int = 0) -> dict[str, float]:
    """Bytes autograd saves while one member's branch is replayed, as SavedTensorMeter counts them
    (one count per saved reference; views of one storage count once each).

    rows: this rank's branch rows (R, or R_pad / CP), or of one block of a blockwise branch. Under
    CP the attention core works on the whole gathered branch or block (rows x CP query rows:
    attention.py `_replay_context_parallel`) and the LSE merge saves every rank's partial output.
    earlier: this rank's rows of a blockwise branch's earlier blocks, a third key part (replay.py). b: activation bytes; acc: float32-or-wider accumulation.
    Returns the parts and the two totals the meter sees: `checkpointed` (whole-layer checkpointing:
    layer inputs + LM head + loss) and `uncheckpointed` (every layer's tensors).
    """
    acc = acc or max(b, 4.0)
    h, H, kvr = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    d_qk = kvr + cfg.qk_rope_head_dim
    c = rows
    q = rows * cp                                      # attention query rows (gathered under CP)
    k = min(cfg.index_topk, prefix_len + earlier * cp + q)   # selection width

    calls = -(-q // min(query_block or q, q)) if q else 0   # sparse core calls per part
    sparse_block = min(q, query_block or q, refs.SPARSE_QUERY_BLOCK)

    def core(width, key_rows):   # refs.sparse_mla_attention over one part's `width` selected rows
        return (4 * q * width                          # the part's key index (int32)
                + q * H * d_qk * b                     # absorbed queries
                + calls * key_rows * d_qk * b          # the part's latent rows (a reference a call)
                + q * H * (kvr * b + acc))             # out and lse

    # Two parts (models/partials.py): the prompt's pages (this rank's shard) at the selection's
    # width, the branch's own q rows at most q wide; their log-sum-exp merge saves both partial
    # outputs and lses and the merged ones.
    prefix_rows = local_prompt_rows(prefix_len + 1, cp)
    prefix_width = min(k, prefix_rows)
    own_width = min(k, q)
    attention = (
        mla_outer_saved(cfg, c, b)
        + core(prefix_width, prefix_rows) + core(own_width, q)
        + 3 * q * H * (kvr * b + acc)                  # the merge
        # a blockwise branch's earlier blocks: their part (its cotangents go to the host buffers,
        # refs.sparse_mla_attention_to_sink) and one more partial in the merge
        + (core(min(k, earlier), earlier) + q * H * (kvr * b + acc) if earlier else 0)
        + H * c * kvr * b                              # out_latent . W_UV (einsum)
    )
    if cp > 1:  # collectives.merge_partials_by_lse: this rank's [q, H, kvr] partial, its c rows kept
        attention += lse_merge_saved(q, c, H, kvr, acc)
    E = cfg.n_routed_experts
    # the router's sigmoid / top-k scratch: two [c, E] and one [c] (measured)
    dense, moe = ffn_saved(cfg, c, b, router_bytes, 2 * c * E * router_bytes + c * router_bytes)
    routed = c * cfg.num_experts_per_tok               # (token, expert) pairs
    # Saved references the meter counts that are no bytes of their own on a device: the sparse
    # core's latent rows (the page window, charged by replay's page-window line; the branch's own
    # rows once), the expanded scatter index, and the log-probs saved a second time by gather.
    attention_views = calls * (prefix_rows + earlier) * d_qk * b + (calls - 1) * q * d_qk * b
    moe_views = routed * h * 8 - routed * 8
    layers = [attention + (moe if cfg.is_moe_layer(i) else dense)
              for i in range(cfg.num_hidden_layers)]
    layers_device = [attention - attention_views + (moe - moe_views if cfg.is_moe_layer(i) else dense)
                     for i in range(cfg.num_hidden_layers)]
    embed, inputs, head, loss = outside_layers_saved(cfg, c, b, acc, rms_norm_saved(c, h, b))
    return {"embedding": embed, "checkpoint_inputs": inputs, "layer_working_set": max(layers),
            "layer_working_set_device": max(layers_device),
            "attention_working_set": attention, "head": head, "head_device": head,
            "loss": loss,
            # The sparse core's backward (refs._SparseMLAAttention.backward): the queries'
            # gradient [q, heads, latent], the own rows' [q, latent], and one block's gathered
            # rows and their gradient [block, k, latent], the value product [block, k, kv_lora]
            # and two score tensors [block, heads, k]; saves no gathered rows. (The LM head's
            # chunk backward is `head_chunk_bytes`, beside the layers' backward.)
            "largest_saved_tensor": max(
                (q * H * d_qk + q * d_qk
                 + sparse_block * (2 * k * d_qk + k * kvr + 2 * H * k)) * acc,
                q * H * kvr * acc if cp > 1 else 0),
            "checkpointed": embed + inputs + head + loss,
            "uncheckpointed": embed + sum(layers) + head + loss}


def glm52(spec: PlanSpec, prompt_len: int) -> Footprint:
    cfg = spec.model
    b, acc = spec.act_bytes, max(spec.act_bytes, 4.0)
    H, kvr, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    d_qk, di, hi, topk = kvr + dr, cfg.index_head_dim, cfg.index_n_heads, cfg.index_topk
    cp = spec.cp
    n, total, rows, r_pad = rank_rows(prompt_len, cp, spec.response_len)
    k = min(topk, total + r_pad)
    pages = glm52_pages(cfg, spec.latent_bytes, spec.index_key_bytes)
    index_row = di * spec.index_key_bytes
    # fp8 index-key pages (1 + 4/di bytes a value: the only format below 2) are read dequantised
    # to the latents' dtype (pages.py, fp8.dequantize_rows): a read holds those rows, and while a
    # page part is dequantised, its values widened and their product (float32, float64 for fp64).
    fp8_keys = spec.index_key_bytes < 2
    index_read = di * spec.latent_bytes if fp8_keys else index_row
    wide = max(4.0, spec.latent_bytes)
    dequant = lambda rows: 2 * min(rows, spec.page_tokens) * di * wide if fp8_keys else 0
    blk = branch_blocks_rows(spec.response_len, spec.response_block, cp)
    saved = glm52_replay_saved(cfg, blk.rows, cp, total, b, acc=acc, query_block=spec.query_block,
                               earlier=blk.earlier)
    indexer_block = lambda queries: (queries * hi * spec.key_block * acc + queries * spec.key_block * acc
                                     + 2 * queries * (topk + min(topk, spec.key_block)) * (acc + 8))

    # Capture (capture.py; attention.py; common.run_group), one layer at a time. Attention layers
    # and MoE layers peak separately ("one of" groups: the largest counts).
    qb = min(spec.query_block, max(n, 1))
    tb = min(spec.token_block, max(n, 1))
    # The block's selected rows: the distinct ones read from the pages (PageStore.gather, at most
    # query_block x topk of them), then [query_block, topk, latent] indexed from those.
    sparse_block = Item("sparse attention block [query_block, topk, latent] + the distinct selected "
                        "rows + logits",
                        (qb * topk + min(qb * topk, n)) * d_qk * b + qb * H * topk * (b + 3 * acc),
                        group="block")
    indexer = Item("indexer scores block [query_block, index_heads, key_block] fp32",
                   indexer_block(qb), group="block")
    # Streamed: one token block at a time, keys read by windows from the pages (one process) or,
    # under CP, from every rank's rows gathered in host memory (context_parallel.StreamedCapture).
    capture_attention = streamed_capture_device(cfg, n, tb, b, cp, d_qk + di) + [
        Item("capture own rows of one token block [token_block, latent + index]",
             tb * (d_qk + di) * b),
        Item("capture attention output of one token block [token_block, heads*v] x2 (block "
             "list + cat)", 2 * tb * H * cfg.v_head_dim * b),
        Item("index-key window [key_block, index] (read from the pages)",
             spec.key_block * di * b + (spec.key_block * index_row + dequant(spec.key_block)
                                        if fp8_keys and cp == 1 else 0)),
        indexer, sparse_block,
    ]
    capture_moe = capture_moe_items(cfg, spec, n, window_values=d_qk + di)
    capture_host = streamed_capture_host(cfg, n, b, min(topk, total),
                                         total if cp > 1 else 0, d_qk + di)
    # Scoring and replay stream the pages: replay.py prefetches layer l+1 while l runs (two
    # layers' local pages, every kind; on CPU views of the pages unless `PageStore.device_copies`);
    # the pages and the branch's rows are attended as two parts (models/partials.py: no cat); the
    # CP path builds a global position lookup. A branch longer than `response_block` runs block by
    # block (`blk`): the working sets below are one block's; what grows with R is listed apart.
    latent_rows = n * d_qk * spec.latent_bytes
    two_layers = 2 * (latent_rows + n * index_read) + dequant(n)
    q, c, earlier = blk.block, blk.rows, blk.earlier
    common = [Item("key positions: the prompt shard's [P/CP] and their cat with the earlier "
                   "blocks' [P/CP + R/CP] int64 (CP path; at most [P + R])",
                   8 * (total + r_pad) if cp > 1 else 0),
              # replay.py `_Blocks`: every kept block's positions and their cat (the view)
              Item("the earlier blocks' positions [R/CP] int64 x2 (kept + the view's cat) and the "
                   "member's log-probs [R/CP] fp32 (per block, kept)",
                   16 * earlier + rows * acc)]
    # Every member's DSA selections wait for replay in host memory, as int32, this rank's rows
    # of them (replay.score_member; replay gathers a block's rows from the ranks).
    branch_kinds = glm52_pages(cfg, b, b)              # the branch's own pages: the model's dtype
    # With K updates per capture, the G x K members' selections are held through its K updates.
    host = capture_host + [Item("scored DSA selections: G x K x full indexer layers x [R/CP, "
                                "topk] int32 (this rank's rows)",
                                spec.group_size * spec.updates_per_capture
                                * cfg.num_full_indexer_layers() * rows * k * 4, measured=True)]
    widened = lambda kind: kind.row_bytes * acc / b    # a cotangent row: fp32 or wider
    host += branch_host_pages(branch_kinds, blk, spec.page_tokens, widened, branch_members(spec))
    block_state = block_state_items(branch_kinds, blk, widened)
    # One layer's earlier-block rows read to the device (like the prompt's page window): latents,
    # and in scoring the index keys for the top-k.
    earlier_latents = Item("the earlier blocks' latent rows of one layer [R/CP, latent] (read "
                           "from the branch pages)", earlier * d_qk * b)
    scoring = common + block_state[:1] + [
        Item("streamed page window (2 layers' local pages)", two_layers),
        earlier_latents,
        Item("the earlier blocks' index keys of one layer [R/CP, index] (read from the branch "
             "pages)", earlier * di * b),
        # One process: the top-k runs over [prompt; branch] index keys and positions (a cat).
        Item("index keys and positions of [prompt; branch] [P + R, index] + int64 (one process)",
             (n + earlier + q) * (di * b + 8) if cp == 1 else 0),
        Item("scoring LM head (chunked): logits and log-softmax [min(R/CP, 1024), vocab] fp32",
             head_chunk_bytes(cfg, c, acc, 2)),
        # The pass keeps every full indexer layer's selection of the block's rows (under CP
        # every rank selects for all of them) until the block ends, when this rank's rows go to
        # host memory (replay._own_selections); the current layer's top-k is int64 while its
        # attention runs.
        Item("the block's DSA selections: full indexer layers x [block, topk] int32 + the "
             "current layer's int64",
             cfg.num_full_indexer_layers() * 4 * q * k + 8 * q * k),
        # Under CP every rank gathers the block's rows (attention.py, _replay_context_parallel):
        # queries, index queries and weights, index keys, latents; and attends them all, its
        # partial outputs and lses before the merge.
        Item("gathered block rows [block, heads x latent + index heads x (index + 1) + index + "
             "latent] + partial outputs [block, heads, kv_lora_rank] and lse (CP)",
             q * ((H * d_qk + hi * (di + 1) + di + d_qk) * b + H * (kvr * b + acc))
             if cp > 1 else 0),
        Item("indexer scores [query_block, index_heads, key_block] fp32",
             indexer_block(min(spec.query_block, q)), group="step"),
        # Under CP the gathered queries are selected per query block too (attention.py): the
        # exchanged candidates are [query_block, CP x sources x topk] (sources: the prompt shard,
        # the earlier blocks' rows, the block's own).
        Item("global top-k merge [query_block, CP x (2 or 3) topk] (scores, positions, sort)",
             min(spec.query_block, q) * cp * (3 if earlier else 2) * k * (3 * acc + 5 * 8)
             if cp > 1 else 0,
             group="step"),
        lse_merge_item(cfg, q, cp, acc),
    ]
    replay = common + block_state + [
        # The backward's recompute reads one layer's latent rows; the forward holds two layers'
        # prefetched pages (every kind), while no layer's saved tensors are alive.
        Item("streamed page window: one layer's local latent rows (the backward)", latent_rows),
        earlier_latents,
        Item("replay forward: two layers' prefetched pages, beyond the latent rows above",
             two_layers - latent_rows, group="graph"),
        Item("replay checkpoint inputs [block/CP, h] x layers + token ids",
             saved["checkpoint_inputs"] + saved["embedding"], measured=True),
        # A blockwise branch's forward without autograd (replay._forward_blocks) runs a block's
        # layers over the same keys with the selections given: a part of this line's tensors.
        Item("replay recompute working set (one decoder layer of one block)",
             saved["layer_working_set_device"], measured=True, group="graph"),
        Item("replay LM head + loss, and one head chunk's backward: logits, log-softmax and its "
             "gradient [min(block/CP, 1024), vocab] fp32",
             saved["head_device"] + saved["loss"] + head_chunk_bytes(cfg, c, acc, 3),
             measured=True, group="graph"),
        # The pages are a constant part (models/partials.py): no gradient buffer spans them.
        Item("replay backward transient (the sparse core's backward block, or the largest gradient)",
             saved["largest_saved_tensor"], measured=True),
    ]
    # Every capture, scoring and replay line is checked against the live-bytes meter, summed per
    # phase, at two prompt lengths: at CP 1 an upper bound the runs reach to 75-99% (capture per
    # layer kind: tests/test_capture_streamed.py; scoring and replay, the page window copied as
    # on a device: tests/test_replay_memory.py), at CP 2 an upper bound (the CP-only lines:
    # tests/test_capture_streamed_cp.py).
    for item in capture_attention + capture_moe + scoring + replay:
        item.measured = True
    notes = [CP_REPLAY_NOTE] if cp > 1 else []
    return Footprint(params=glm52_params(cfg), pages=pages,
                     phases={"capture (attention layer)": capture_attention,
                             "capture (MoE layer)": capture_moe,
                             "scoring": scoring, "replay": replay},
                     replay_saved=saved, notes=notes, host=host)
