"""The Qwen3.6 family of the planner: parameters, pages (fixed GDN state, per-token K/V) and the
capture, scoring and replay working sets of `models/qwen36` (checked against the model and the
live-bytes meter, see `qwen36`)."""

from __future__ import annotations

from megatron_longstraw.models.footprint import (
    Footprint, Item, PageKind, ParamGroup, PlanSpec, block_state_items, branch_blocks_rows,
    branch_host_pages, branch_members, head_chunk_bytes, lse_merge_saved, outside_layers_saved,
    phase_bytes, rank_rows, streamed_capture_device, streamed_capture_host,
)


# ---- Qwen3.6 ------------------------------------------------------------------------------------

GDN_CHUNK = 64
"""Token chunk of both delta-rule kernels (Megatron's `torch_chunk_gated_delta_rule` default and
FLA's `chunk_gated_delta_rule`)."""


def _qwen36_sizes(cfg) -> tuple[int, int]:
    """(full-attention layers, GDN layers)."""
    num_attention = cfg.num_full_attention_layers()
    return num_attention, cfg.num_hidden_layers - num_attention


def _check_qwen36_cp(cfg, cp: int) -> None:
    if cfg.linear_num_key_heads % cp:
        raise ValueError(f"CP {cp} must divide the GDN query/key heads ({cfg.linear_num_key_heads}): "
                         "GDN layers shard by heads under context parallelism.")


def qwen36_params(cfg) -> list[ParamGroup]:
    """Every parameter of build_qwen36_model (Megatron names in comments)."""
    h, V, ffn = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    H, G, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    num_attention, num_gdn = _qwen36_sizes(cfg)
    L = cfg.num_hidden_layers
    gdn_proj = [(h, 2 * hk * dk + 2 * hv * dv + 2 * hv),   # in_proj rows [q; k; v; z; beta; alpha]
                (hv * dv, h)]                              # out_proj
    # input_layernorm, conv1d (depthwise [conv_dim, 1, kernel], no bias), A_log, dt_bias, out_norm
    gdn = (h + cfg.conv_dim() * cfg.linear_conv_kernel_dim + 2 * hv + dv
           + sum(i * o for i, o in gdn_proj))
    attention_proj = [(h, 2 * H * d + 2 * G * d),           # linear_qkv rows [q; gate; k; v]
                      (H * d, h)]                           # linear_proj
    # input_layernorm, q_layernorm, k_layernorm (per head_dim)
    attention = h + 2 * d + sum(i * o for i, o in attention_proj)
    mlp_proj = [(h, 2 * ffn), (ffn, h)]                     # linear_fc1 (gated), linear_fc2
    return [
        ParamGroup("embedding", V * h, kind="embedding"),
        ParamGroup("output_layer + final_norm", V * (0 if cfg.tie_word_embeddings else h) + h,
                   kind="head"),
        ParamGroup("Gated DeltaNet", num_gdn * gdn, kind="attention", lora_shapes=gdn_proj * num_gdn),
        ParamGroup("gated attention", num_attention * attention, kind="attention",
                   lora_shapes=attention_proj * num_attention),
        # pre_mlp_layernorm + the two linears, every layer
        ParamGroup("dense MLP", L * (h + 3 * h * ffn), kind="mlp", lora_shapes=mlp_proj * L),
    ]


def qwen36_pages(cfg, kv_bytes: float, conv_bytes: float, state_bytes: float, cp: int = 1,
                 captured: bool = True) -> list[PageKind]:
    """One rank's captured kinds: K and V rows [groups, head_dim] per full-attention layer
    (attention.py KEY, VALUE; under CP this rank's prompt shard); per GDN layer the recurrent state
    [H_v / CP, d_k, d_v] and the conv tail [kernel - 1, conv_dim / CP] (gdn.py GDN_STATE, CONV_TAIL;
    under CP sharded by heads). `captured` False (a one-token prompt): nothing is stored."""
    _check_qwen36_cp(cfg, cp)
    num_attention, num_gdn = _qwen36_sizes(cfg)
    num_gdn = num_gdn if captured else 0
    row = cfg.num_key_value_heads * cfg.head_dim * kv_bytes
    state = cfg.linear_num_value_heads // cp * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    tail = (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim() // cp
    return [PageKind("key", row, num_attention), PageKind("value", row, num_attention),
            PageKind("gdn_state", state * state_bytes, num_gdn, sequence=False),
            PageKind("conv_tail", tail * conv_bytes, num_gdn, sequence=False)]


def zero_centred_norm_saved(rows: int, width: int, acc: float) -> float:
    """models/norms.ZeroCenteredRMSNorm over [rows, width], all in `acc`: pow's input, rsqrt's
    output, the normalising product's two inputs, the gain product's two inputs ((1 + weight) is
    a new tensor)."""
    return (3 * rows * width + 2 * rows + width) * acc


def torch_chunk_delta_rule_saved(rows: int, heads: int, dk: int, dv: int,
                                 f: float = 4) -> tuple[float, float]:
    """Megatron-Core's `torch_chunk_gated_delta_rule` (the CPU kernel, gated_delta_net/common.py)
    under autograd, from an initial state that needs no gradient (a captured page, or zeros): every
    tensor in float32 (`f`), rows padded to whole chunks of C = GDN_CHUNK. Line numbers are
    Megatron-Core 0.19.2's.

    The last chunk's state update (lines 888-889) feeds only the final state, which replay drops, so
    its graph, with the two `exp` outputs it saved, is freed when the call returns.

    Returns (bytes kept until backward, bytes of that last update: saved while the call runs, freed
    when it returns)."""
    C, H = GDN_CHUNK, heads
    chunks = -(-rows // C)
    if chunks == 0:
        return 0.0, 0.0
    T = chunks * C
    square = H * chunks * C * C                                # one [H, chunks, C, C] tensor
    before_loop = (
        H * T * (dv + 1) + H * T * (dk + 1)                    # v * beta, k * beta (846, 847)
        + square                                               # decay_mask = exp(...) (860)
        + 2 * H * T * dk + 2 * square                          # (k_beta @ k^T) * decay_mask (861)
        + H * chunks * (C - 1) * C * (C + 1) // 3              # row [i], sub [i, i] per i < C (865)
        + square + H * T * dv                                  # attn @ v_beta (867)
        + 2 * H * T + H * T * dk + square + H * T * dk         # attn @ (k_beta * exp(g)) (868)
    )
    per_chunk = (2 * H * C * dk + 2 * H * C * C                # q_i @ k_i^T * decay_mask_i (882)
                 + H * dk * dv                                 # k_cumdecay_i @ S (883)
                 + 2 * H * C + H * C * dk + H * dk * dv        # (q_i * exp(g_i)) @ S (885)
                 + H * C * C + H * C * dv)                     # attn_i @ v_new (886)
    state_grad = 2 * H * C * dk        # S has grad from chunk 2 on: 883/885 save their left side
    update = (H + H * dk * dv                                  # S * exp(g_last) (888)
              + 2 * H * C + H * C * dk + H * dk * C + H * C * dv)  # (k * exp(..))^T @ v_new (889)
    floats = (before_loop + chunks * per_chunk + (chunks - 1) * (state_grad + update)
              + max(chunks - 2, 0) * H)                        # 888 saves exp(g_last) once S has grad
    masks = C * C + chunks * C * C                             # bool masks of 861 and 882
    last_update = update + (H if chunks > 1 else 0)
    return floats * f + masks, last_update * f


def torch_chunk_delta_rule_forward_peak(rows: int, heads: int, dk: int, dv: int,
                                        f: float = 4) -> float:
    """Peak bytes of Megatron-Core's `torch_chunk_gated_delta_rule` without autograd (capture's
    CPU kernel; gated_delta_net/common.py, line numbers of Megatron-Core 0.19.2) over `rows`
    tokens and `heads` heads, every tensor in float32 (`f`), rows padded to whole chunks of
    C = GDN_CHUNK, beyond its inputs and the initial state (the caller's). The peak is one of
    three moments: `attn + eye` (866), chunk 0's `q_i @ k_i^T * decay_mask_i` (882, the whole
    [H, chunks, C, C] `attn` still bound; rebinding it there frees it), or a later line of the
    chunk loop (its locals attn, v_prime, v_new, attn_inter live on into the next chunk)."""
    C, H = GDN_CHUNK, heads
    chunks = -(-rows // C)
    if chunks == 0:
        return 0.0
    T = chunks * C
    square = H * chunks * C * C                                # one [H, chunks, C, C] tensor
    before_loop = (3 * H * T * dk + H * T * dv                 # key (padded), query * scale, k_beta, v_beta
                   + 2 * H * T                                 # beta (padded), g.cumsum
                   + 2 * square                                # decay_mask, attn (860, 861)
                   + H * chunks * (C - 1) * C)                 # the last step's row, sub clones (863, 864)
    at_eye = before_loop + H * T * dv + square                 # value (padded) alive; attn + eye (866)
    loop = before_loop + 2 * H * T * dv + H * T * dk           # value = attn @ v_beta, core_attn_out, k_cumdecay
    c, cv = H * C * C, H * C * dv                              # one chunk's [H, C, C], [H, C, d_v]
    per_chunk = max(c + 5 * cv,                                # 886: attn_inter + attn @ v_new
                    c + 3 * cv + H * C * (dk + 1) + 3 * H * dk * dv,  # 888-889: the state update
                    3 * c + 3 * cv if chunks > 1 else 0)       # 882 with the previous chunk's locals
    floats = max(at_eye, loop + 2 * c, loop - square + per_chunk)
    return floats * f + C * C                                  # + the bool mask (855 / 875)


def fla_chunk_delta_rule_saved(rows: int, heads: int, dk: int, dv: int, b: float) -> float:
    """FLA's `ChunkGatedDeltaRuleFunction` (the GPU kernel): saves q, k, v (H_v heads), g's chunk
    cumsum (fp32), beta and A [rows, H, C] in k's dtype (fla/ops/gated_delta_rule/chunk.py); the
    initial state it also saves is the fetched page (counted in the page window). Analytic."""
    return rows * heads * ((2 * dk + dv + 1 + GDN_CHUNK) * b + 4)


def qwen36_replay_saved(cfg, rows: int, cp: int, prefix_len: int, b: float, query_block: int,
                        acc: float | None = None) -> dict[str, float]:
    """Bytes autograd saves while one member's branch is replayed, as SavedTensorMeter counts them
    (one count per saved reference), kind by kind, with the CPU kernels (torch chunk delta rule,
    PyTorch l2norm); `*_device` figures swap in FLA's kernels and count tensors saved several times
    once.

    rows: this rank's branch rows (R, or R_pad / CP). prefix_len: this rank's captured prompt rows.
    Under CP (docs/design.md section 3 as models/qwen36 implements it; checked at CP = 2) GDN layers run
    all R_pad rows for H_v / CP heads (in_proj output exchanged to heads and back), and full
    attention gathers all R_pad queries, keys and values, attends over [prefix shard; branch] and
    merges the partial outputs by log-sum-exp into this rank's rows. Returns the parts and the
    totals `checkpointed` (whole-layer checkpointing: layer inputs + LM head + loss) and
    `uncheckpointed` (every layer's tensors; the larger of the end of the forward and the moment
    inside the last GDN layer, see below).
    """
    _check_qwen36_cp(cfg, cp)
    acc = acc or max(b, 4.0)
    f = max(4.0, b)                                    # the torch delta rule computes in float32
    h, ffn = cfg.hidden_size, cfg.intermediate_size
    H, G, d, rot = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim()
    hk, hv = cfg.linear_num_key_heads // cp, cfg.linear_num_value_heads // cp   # this rank's heads
    dk, dv, K = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    conv = cfg.conv_dim() // cp
    in_proj = 2 * cfg.linear_num_key_heads * dk + 2 * cfg.linear_num_value_heads * dv \
        + 2 * cfg.linear_num_value_heads
    c = rows
    s = rows * cp                                      # GDN rows, attention queries (all, under CP)
    norm = lambda n, w: zero_centred_norm_saved(n, w, acc)
    mlp = norm(c, h) + c * h * b + 4 * c * ffn * b    # pre_mlp_layernorm, fc1 in, GLU (3), fc2 in

    gdn_after_core = (norm(s * hv, dv)                           # out_norm (returns x's dtype)
                      + s * hv * dv * (b + 2 * acc)              # * silu(gate.float())
                      + c * hv * cp * dv * b)                    # out_proj input (this rank's rows)
    gdn_outer = (
        norm(c, h) + c * h * b                         # input_layernorm, in_proj input
        + conv * (s + K - 1) * b + conv * s * b        # conv1d input [tail; branch], silu input
        + 2 * hv * b + 2 * s * hv * acc + s * hv * b   # g = -exp(A_log) * softplus(.), sigmoid(beta)
    )
    if cp > 1:
        # collectives.HeadParallel: in_proj output to heads (head permutation index, row index), this
        # rank's conv1d weight (a copy); back to rows (index_copy's index and source)
        gdn_outer += 8 * in_proj + 8 * s + conv * K * b
        gdn_after_core += 8 * s + s * hv * dv * b
    gdn_outer += gdn_after_core
    l2norm = 3 * s * 2 * hk * dk * acc + 2 * s * 2 * hk * acc      # models/norms.l2norm on [q; k]
    l2norm_device = s * 2 * hk * (dk * b + 4)                       # FLA l2norm: output, rstd
    core, core_transient = torch_chunk_delta_rule_saved(s, hv, dk, dv, f)
    gdn = gdn_outer + l2norm + core
    gdn_device = gdn_outer + l2norm_device + fla_chunk_delta_rule_saved(s, hv, dk, dv, b)

    keys = prefix_len + s                              # [prefix (shard); branch]
    num_query_blocks = -(-s // query_block)
    # Two partials (models/partials.py: the prompt's pages, the branch's rows), each saving the
    # query block, its output, lse and the query positions; their log-sum-exp merge saves both
    # partials and the merged output and lse.
    part = s * (H * d * b + H * acc + 8)               # a partial's out, lse, q positions
    queries = 2 * (s * H * d * b + part)
    merge = s * H * (3 * d * b + 3 * acc)
    key_rows = keys * (2 * G * d * b + 8)              # K, V (pages; branch rows), positions
    attention_outer = (
        norm(c, h) + c * h * b                         # input_layernorm, linear_qkv input
        + norm(c * H, d) + norm(c * G, d)              # q_layernorm, k_layernorm
        + 4 * c * rot * b                              # RoPE cos / sin, q and k
        + c * H * d * (b + 2 * acc)                    # o * sigmoid(gate)
        + c * H * d * b                                # linear_proj input
    )
    if cp > 1:  # log-sum-exp merge of this rank's [s, H, d] partial, keeping its c rows
        attention_outer += lse_merge_saved(s, c, H, d, acc)
    attention = attention_outer + queries + merge + num_query_blocks * key_rows   # keys per query block
    # device: the query block and the partials' outputs are one storage each, whatever saves them
    attention_device = attention_outer + s * H * d * b + 2 * part + s * H * (d * b + acc) + key_rows

    # token ids, checkpoint inputs, LM head (the zero-centred final_norm), loss
    embed, inputs, head, loss = outside_layers_saved(cfg, c, b, acc, norm(c, h))
    layers = [attention + mlp if cfg.is_full_attention(i) else gdn + mlp
              for i in range(cfg.num_hidden_layers)]
    end_of_forward = embed + sum(layers) + head + loss
    # Without checkpointing the meter can peak inside the last GDN layer instead (short branches
    # over a short prefix): as its delta rule returns, the last state update is still saved and
    # the gated norm after it not yet.
    gdn_idx = [i for i in range(cfg.num_hidden_layers) if not cfg.is_full_attention(i)]
    inside_last_gdn = (embed + sum(layers[:gdn_idx[-1]]) + gdn - gdn_after_core + core_transient
                       if gdn_idx else 0.0)
    return {"embedding": embed, "checkpoint_inputs": inputs,
            "gdn_layer": gdn + mlp, "attention_layer": attention + mlp,
            "layer_working_set": max(gdn, attention) + mlp,
            "layer_working_set_device": max(gdn_device, attention_device) + mlp,
            "gdn_working_set_device": gdn_device + mlp,
            "attention_working_set_device": attention_device + mlp,
            "head": head, "head_device": head, "loss": loss,
            # The pages are a constant part (models/partials.py): of the keys only the branch's
            # own rows [s, G, d] get a gradient.
            "largest_saved_tensor": max(s * G * d * b, s * hv * dv * acc,
                                        s * H * d * acc if cp > 1 else 0),
            "checkpointed": embed + inputs + head + loss,
            "end_of_forward": end_of_forward, "inside_last_gdn": inside_last_gdn,
            "uncheckpointed": max(end_of_forward, inside_last_gdn)}


def qwen36(spec: PlanSpec, prompt_len: int) -> Footprint:
    """Qwen3.6 against models/qwen36: parameters, pages and the replay saved set checked on CPU
    (tests/test_planner.py); capture, scoring and replay against the live-bytes meter with the
    CPU's delta rule (`gdn_kernels="torch"`; tests/test_capture_streamed.py,
    tests/test_replay_memory.py, at CP 2 tests/test_capture_streamed_cp.py); FLA's scratch and
    saved set (the GPU's kernels) analytic."""
    cfg = spec.model
    b, acc = spec.act_bytes, max(spec.act_bytes, 4.0)
    cp, R = spec.cp, spec.response_len
    h, ffn, H, G, d = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                       cfg.num_key_value_heads, cfg.head_dim)
    hv, dk, dv = cfg.linear_num_value_heads // cp, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    in_proj = 2 * cfg.linear_num_key_heads * dk + 2 * cfg.linear_num_value_heads * dv \
        + 2 * cfg.linear_num_value_heads
    n, total, rows, r_pad = rank_rows(prompt_len, cp, R)
    state_bytes = max(4.0, b)                           # both delta-rule kernels keep S in fp32
    pages = qwen36_pages(cfg, spec.latent_bytes, spec.latent_bytes, state_bytes, cp, total > 0)
    # A branch longer than `response_block` runs block by block (replay.py): scoring and replay
    # hold one block's working set (`q` rows gathered, `c` per rank); the earlier blocks' K/V rows
    # (`earlier` per rank) are a key part read from host pages, like the prompt's (replay's
    # working set counts them with the prompt's key rows).
    blk = branch_blocks_rows(R, spec.response_block, cp)
    q, c, earlier = blk.block, blk.rows, blk.earlier
    saved = qwen36_replay_saved(cfg, c, cp, n + earlier, b, spec.query_block, acc=acc)
    kv_row = 2 * G * d * spec.latent_bytes              # one layer's K and V page bytes per token
    fixed = sum(p.row_bytes for p in pages if not p.sequence and p.num_layers)  # one GDN layer

    # Capture (capture.py, attention.py, gdn.py; models/common.run_group), one layer at a time.
    tb = min(spec.token_block, max(n, 1))
    kb = spec.key_block
    scores = lambda queries: 3 * queries * H * kb * acc  # scores, probabilities, their product
    fla_block = lambda tokens: (             # FLA forward scratch for `tokens` rows
        tokens * hv * ((3 * dk + 4 * dv + 64) * b + 64 * 4 + 8)   # q k v w u v_new o, A, g, beta
        + -(-tokens // GDN_CHUNK) * hv * dk * dv * b)             # h: the state at every chunk start
    conv, K = cfg.conv_dim() // cp, cfg.linear_conv_kernel_dim
    gdn_block = lambda tokens: (tokens * in_proj // cp * b       # in_proj output (this rank's heads)
                                + 3 * tokens * conv * b          # conv input, output, silu
                                + 3 * tokens * hv * dv * acc     # gated norm
                                + fla_block(tokens))
    # The CPU's rule (gdn.py `_mix`, Megatron's `_prepare_input_for_gated_delta_rule`) at its peak:
    # in_proj output, conv input [tail; block] (the new tail is a view of it), conv output and
    # silu, the rule's inputs q, k (repeated to H_v heads), v, gate (contiguous copies), alpha's
    # copy, g (fp32) and sigmoid(beta), and the rule's own working set.
    gdn_torch_block = lambda tokens: (
        tokens * in_proj // cp * b + (tokens + K - 1) * conv * b + 2 * tokens * conv * b
        + tokens * hv * (2 * dk + 2 * dv) * b + tokens * hv * (2 * b + acc)
        + torch_chunk_delta_rule_forward_peak(tokens, hv, dk, dv, max(4.0, b)))
    # Streamed: one token block at a time, K/V read by windows from the pages (one process) or
    # from every rank's rows gathered in host memory (CP); GDN under CP exchanges one global
    # token block at a time (gdn.capture_exchange), its output rows staged in host memory.
    residual = streamed_capture_device(cfg, n, tb, b, cp, 2 * G * d)
    rot = cfg.rotary_dim()

    def attention_block(tokens: int) -> list[Item]:
        """One block of `tokens` queries through gated attention without autograd (attention.py
        `_project`; models/dense_attention.py's capture and replay modes): what lives through the
        layer call, then one of four moments (the group: never together)."""
        return [
            Item("linear_qkv output [tokens, (2 heads + 2 groups) x d] (k, v are views of it)",
                 tokens * (2 * H + 2 * G) * d * b),
            Item("gate [tokens, heads, d] (Megatron's split copies it), q and k after norm and "
                 "RoPE", tokens * (2 * H + G) * d * b),
            Item("q_layernorm: the split's copy of q + fp32 x2", tokens * H * d * (b + 2 * acc),
                 group="attention"),
            Item("RoPE: normed q + rotated halves", tokens * H * d * b + 3 * tokens * H * rot * b,
                 group="attention"),
            Item("attention over key windows: output blocks and their cat [tokens, heads, d] x2, "
                 "lse fp32, K/V window [key_block, groups, d] x2, block scores [query_block, "
                 "heads, key_block] fp32 x3", 2 * tokens * H * d * b + tokens * H * acc
                 + 2 * kb * G * d * b + scores(min(spec.query_block, tokens)), group="attention"),
            Item("output gate: output, sigmoid(gate), product [tokens, heads, d] x3",
                 3 * tokens * H * d * b, group="attention")]

    def mlp_block(tokens: int) -> list[Item]:
        return [Item("MLP: fc1 output [tokens, 2 ffn], silu, x_linear + offset, product [tokens, "
                     "ffn] (Megatron's unfused GLU)", 5 * tokens * ffn * b, group="mlp"),
                Item("pre_mlp_layernorm (zero-centred, fp32)", tokens * h * (3 * acc + b),
                     group="mlp")]

    def prefixed(prefix: str, items: list[Item]) -> list[Item]:
        for item in items:
            item.name = f"{prefix} {item.name}"
        return items

    capture_attention = residual + prefixed("capture (token block)", attention_block(tb))
    gdn_item = (Item("capture GDN token block: in_proj, conv, the rule's inputs and the torch "
                     "chunked rule's working set + the carried state", gdn_torch_block(tb) + fixed,
                     group="gdn")
                if spec.gdn_kernels == "torch" else
                Item("GDN token block scratch (in_proj, conv, gated norm, FLA chunk kernel incl. "
                     "per-chunk states) + the carried state (FLA: analytic)", gdn_block(tb) + fixed,
                     group="gdn"))
    capture_gdn = residual + [gdn_item]
    if cp > 1:
        # gdn.capture_exchange: a global token block's rows may all be one rank's (the load-
        # balanced shards are chunks of P / 2CP), so in_proj's output is up to [tb, in_proj_dim];
        # the exchange's buffers are freed before the rule runs (a moment of their own: the group).
        capture_gdn.append(Item("capture GDN exchange of one global token block (CP): in_proj "
                                "rows [tb, in_proj_dim] x4 (output, padded, sent, received)",
                                4 * tb * in_proj * b, group="gdn"))
        capture_gdn.append(Item("capture GDN exchange (CP): the previous global block's gated-"
                                "norm output [tb, H_v / CP x d_v] and out_proj output [tb, h] "
                                "(bound until the next block's replace them), the exchange's "
                                "row indices, head permutation and this rank's conv1d weight",
                                tb * (hv * dv + h) * b + 8 * (in_proj + 3 * tb) + conv * K * b))
    capture_host = streamed_capture_host(cfg, n, b, 0, total if cp > 1 else 0, 2 * G * d,
                                         staged=cp > 1)
    capture_mlp = residual + prefixed("capture (token block)", mlp_block(tb))
    # Scoring and replay stream the pages: replay.py prefetches layer l+1 while l runs, so one
    # attention layer's K/V and one GDN layer's state are on the device at once.
    window = Item("streamed page window (one attention layer's K/V + one GDN layer's state)",
                  n * kv_row + fixed)
    # Scoring runs the branch's layers one at a time ("one of: layer"): attention over the pages
    # and its own K/V, GDN over all R_pad rows (this rank's heads under CP), the MLP, the LM head.
    gdn_scoring = (Item("scoring GDN layer over the branch: in_proj, conv, the rule's inputs and "
                        "the torch chunked rule's working set + the carried state",
                        gdn_torch_block(q) + fixed, group="layer")
                   if spec.gdn_kernels == "torch" else
                   Item("scoring GDN layer over the branch (in_proj, conv, gated norm, FLA chunk "
                        "kernel) + the carried state (FLA: analytic)", gdn_block(q) + fixed,
                        group="layer"))
    tables = Item("the earlier blocks' positions [R/CP] int64 x2 (kept + the view's cat) and the "
                  "member's log-probs [R/CP] fp32 (per block, kept)", 16 * earlier + rows * acc)
    earlier_kv = Item("the earlier blocks' K/V rows of one attention layer [R/CP, 2 x groups x d] "
                      "(read from the branch pages) + their positions", earlier * (kv_row + 8))
    # The branch's own state: the model's dtype; its cotangents: the GDN state is fp32 already,
    # K/V and the conv tail widen to fp32.
    branch_kinds = qwen36_pages(cfg, b, b, state_bytes, cp)
    widened = lambda kind: kind.row_bytes if kind.name == "gdn_state" else kind.row_bytes * acc / b
    block_state = block_state_items(branch_kinds, blk, widened)
    scoring = block_state[:1] + [window, tables, earlier_kv,
               Item("scoring attention layer over the branch: capture's token-block lines for "
                    "one block's queries", phase_bytes(attention_block(q)), group="layer"),
               gdn_scoring,
               Item("scoring MLP over one block [block rows]: the larger of the GLU and the norm",
                    phase_bytes(mlp_block(q)), group="layer"),
               Item("scoring LM head (chunked): logits and log-softmax [min(block/CP, 1024), "
                    "vocab] fp32", head_chunk_bytes(cfg, c, acc, 2), group="layer"),
               Item("LSE merge: [weight * out; weight] [block, heads, d + 1] fp32 + reduce-scatter",
                    2 * q * H * (d + 1) * acc if cp > 1 else 0)]
    replay = block_state + [
        Item(f"{window.name}; scoring's bytes, seen there", window.bytes),
        tables, earlier_kv,
        Item("replay checkpoint inputs [block/CP, h] x layers + token ids",
             saved["checkpoint_inputs"] + saved["embedding"], measured=True),
        Item("replay recompute: attention layer + MLP (K/V cat counted once)",
             saved["attention_working_set_device"], measured=True, group="graph"),
        Item("replay recompute: GDN layer + MLP (FLA kernel's saved set, analytic)",
             saved["gdn_working_set_device"], group="graph") if spec.gdn_kernels == "fla" else
        Item("replay recompute: GDN layer + MLP (torch chunked rule's saved set)",
             saved["gdn_layer"], measured=True, group="graph"),
        Item("replay LM head + loss, and one head chunk's backward: logits, log-softmax and its "
             "gradient [min(block/CP, 1024), vocab] fp32",
             saved["head_device"] + saved["loss"] + head_chunk_bytes(cfg, c, acc, 3),
             measured=True, group="graph"),
        # The pages are a constant part (models/partials.py; exact mode: one key window's
        # cotangents at a time): only the branch's own K/V get a gradient buffer.
        Item("replay attention backward: grad K/V [block, groups, d] fp32 x2 + block scratch",
             2 * q * G * d * acc + scores(min(spec.query_block, q))),
        Item("replay backward transient (gradient of the largest saved tensor)",
             saved["largest_saved_tensor"]),
    ]
    # Capture is checked against the live-bytes meter at two prompt lengths, with the delta rule
    # the CPU runs: per layer kind on one process (tests/test_capture_streamed.py: 0.95-0.99 of
    # the plan), per phase at CP 2 (tests/test_capture_streamed_cp.py: 0.99). Every line but
    # FLA's. Scoring likewise, per phase, one process and CP 2 (tests/test_replay_memory.py,
    # tests/test_capture_streamed_cp.py: 0.97-0.995).
    for item in capture_attention + capture_gdn + capture_mlp + scoring:
        if "analytic" not in item.name:
            item.measured = True
    # The replay phase, planned with the delta rule the CPU runs (gdn_kernels="torch"), is
    # checked against the live-bytes meter at two prompt lengths (tests/test_replay_memory.py):
    # every replay line but FLA's saved set. Its peak is inside a GDN layer, where no K/V window
    # is held: the window's line is in the sum, not seen; the same window is seen in scoring.
    for item in replay:
        if "analytic" not in item.name:
            item.measured = True
    notes = ["qwen36: parameters, page bytes and replay saved-tensor bytes (CPU kernels) are checked "
             "against the model (tests/test_planner.py); capture, scoring and replay against the "
             "live-bytes meter with the CPU's delta rule (gdn_kernels='torch'); the GDN layer's "
             "device working set with FLA's kernels (the default) is analytic."]
    if cp > 1:
        notes.append(f"CP = {cp}: per-rank pages (K/V of the load-balanced prompt shard; GDN state "
                     "and conv tail sharded by heads, 1 / CP per rank) and replay saved bytes follow "
                     "models/qwen36's CP path, checked at CP = 2 on the tiny model; other sizes are "
                     "the same formulas, not measured. Scoring and replay run GDN over one block's "
                     "rows for H_v / CP heads and gather one block's queries for attention: those "
                     "working sets grow with the block (response_block), not R.")
    return Footprint(params=qwen36_params(cfg), pages=pages,
                     phases={"capture (attention layer)": capture_attention,
                             "capture (GDN layer)": capture_gdn, "capture (MLP layer)": capture_mlp,
                             "scoring": scoring, "replay": replay},
                     replay_saved=saved, notes=notes,
                     host=capture_host + branch_host_pages(branch_kinds, blk, spec.page_tokens,
                                                           widened, branch_members(spec)))
