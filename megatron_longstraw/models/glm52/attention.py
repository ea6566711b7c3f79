"""State-aware MLA + DSA attention for GLM-5.2.

The module is Megatron-Core's `MLASelfAttention` (same submodules, same parameter names, built from the
same spec) as an absorbed-MLA mixer (`models/mla.py`: latent rows, absorbed queries, the W_UV
up-projection; `models/mixer.py`: the modes), with `core_attention` swapped for `DSAIndexHolder`,
which holds Megatron's own `DSAIndexer` on layers that compute a top-k and nothing on IndexShare
layers. Each query attends over its DSA selection (FlashMLA's sparse contract):

    out_s = (softmax_{t in topk(s)}(query_s . latent_t * scale) @ c_kv_t) @ W_UV

`full` attends over the current tokens; `capture` also writes each token's latent row and index key
to the pages and keeps no autograd state; `score` and `replay` attend over the captured prompt
pages plus the current tokens' own rows (replay reuses scoring's selections: indexer replay).
Prompt pages are constants: the replay gradient is the conditional gradient d loss / d theta at
fixed prompt state (docs/design.md section 7); `PageStore.leaf` is the hook for the exact prompt-gradient
mode.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from megatron_longstraw.distributed import collectives
from megatron_longstraw.kernels import refs, select
from megatron_longstraw.runtime.memory import note_host
from megatron_longstraw.models import context_parallel, partials
from megatron_longstraw.models.glm52.config import has_own_indexer
from megatron_longstraw.models.mla import LATENT, AbsorbedMLA
from megatron_longstraw.state.attention_pass import AttentionPass, member_pass

INDEX_KEY = "index_key"  # page kind: DSA indexer key rows


def decoder_layer_index(layer_number: int) -> int:
    """0-based GLM-5.2 decoder layer of a HybridStack attention symbol.

    GLM-5.2's pattern alternates one attention symbol and one FFN symbol (`D-`/`DE`), and
    HybridStack numbers symbols from 1, so attention symbol n belongs to decoder layer (n - 1) // 2.
    """
    return (layer_number - 1) // 2


class DSAIndexHolder(MegatronModule):
    """`core_attention` slot of the GLM-5.2 attention: Megatron's `DSAIndexer` when this layer computes
    its own top-k, None on IndexShare layers (which then have no indexer weights, as in the checkpoint).
    The attention math itself lives in `kernels` and is called by `LongStrawMLASelfAttention`."""

    def __init__(self, config, submodules, layer_number: int, pg_collection=None, **unused_kwargs):
        super().__init__(config=config)
        self.layer_idx = decoder_layer_index(layer_number)
        self.topk_source = self.layer_idx
        while not has_own_indexer(self.topk_source, config.dsa_indexer_topk_freq,
                                  config.dsa_indexer_skip_topk_offset):
            self.topk_source -= 1
        self.indexer = None
        if self.topk_source == self.layer_idx:
            self.indexer = build_module(submodules.indexer, config=config, pg_collection=pg_collection)


class LongStrawMLASelfAttention(AbsorbedMLA):
    """Megatron's MLA self-attention as a state-aware mixer (`models/mixer.py` dispatches the
    modes; see the module docstring for the math)."""

    selection_kinds = (INDEX_KEY,)   # index keys only select: no prompt gradient

    @property
    def layer_idx(self) -> int:
        return self.core_attention.layer_idx

    def plain_pass(self, hidden_states: torch.Tensor) -> AttentionPass:
        return self._implicit_full_pass(hidden_states, self.layer_idx)

    def forward_full(self, x: torch.Tensor, state: AttentionPass):
        """Over the current tokens' own rows."""
        latents, index_keys = self._token_rows(x, state)
        return self._project_out(self._attend(x, state, [latents], index_keys, state.positions))

    def forward_capture(self, x: torch.Tensor, state: AttentionPass):
        """The prompt (this rank's shard): its rows become pages; its queries attend over the
        whole prompt's rows (gathered across CP in position order: global causal context and
        global top-k)."""
        latents, index_keys = self._token_rows(x, state)
        self.write_rows(state, LATENT, latents)
        if index_keys is not None:
            self.write_rows(state, INDEX_KEY, index_keys)
            # The top-k scores the keys as the pages hold them (fp8 pages: dequantised), as
            # streamed capture, scoring and decoding read them.
            index_keys = state.pages.round_trip(INDEX_KEY, index_keys)
            state.selections.clear()   # capture keeps one [P, k] selection: the latest full layer's
        positions = state.positions
        if state.cp.size > 1:
            latents, positions = context_parallel.gather_prompt_keys(latents, state)
            if index_keys is not None:
                index_keys, _ = context_parallel.gather_prompt_keys(index_keys, state)
        return self._project_out(self._attend(x, state, [latents], index_keys, positions))

    def forward_capture_block(self, x: torch.Tensor, state: AttentionPass):
        """One token block of the prompt (streamed capture, one process): its rows are appended to
        the pages, then attended with the earlier ones (`forward_capture_block_sharded`)."""
        self.forward_capture_rows(x, state)
        return self.forward_capture_block_sharded(x, state)

    def forward_capture_rows(self, x: torch.Tensor, state: AttentionPass):
        """The block's latent rows and index keys to the pages; nothing attended."""
        latents, index_keys = self._token_rows(x, state)
        self.write_rows(state, LATENT, latents)
        if index_keys is not None:
            self.write_rows(state, INDEX_KEY, index_keys)
        return torch.zeros_like(x), None

    def forward_capture_block_sharded(self, x: torch.Tensor, state: AttentionPass):
        """The block's queries over the layer's rows so far (`capture_keys`: the pages, or under
        CP every rank's rows in host memory), `_attend_keys`. Device memory: a block's rows, a
        window, a query block's selected rows; never the layer's pages."""
        k = min(self.config.dsa_indexer_topk, state.cp.global_len)
        return self._project_out(self._attend_keys(x, state, self.capture_keys(state),
                                                   int(state.positions[-1]) + 1, k))

    def _attend_keys(self, x: torch.Tensor, state: AttentionPass, keys, num_keys: int,
                     k: int) -> torch.Tensor:
        """The current rows' queries over key rows [0, num_keys) read from `keys` (row =
        position: `capture_keys`, or a member's `decode.DecodeKeys` on one process): per query
        block, the top-k is scored over the index keys one key window at a time (running top-k,
        causal by position), and only the selected latent rows are read. -> [s, h, v]"""
        outputs = []
        for start in range(0, x.shape[0], state.query_block):
            end = min(start + state.query_block, x.shape[0])
            positions = state.positions[start:end]
            q_compressed, query = self._queries(x[start:end], positions)
            selection = self._selection(x[start:end], q_compressed, state, start, end,
                                        lambda q_index, w: self._topk_pages(
                                            q_index, w, keys, state, num_keys, positions, k))
            rows, local = self._selected_page_rows(keys, selection, x.device, x.dtype)
            out_latent, _ = partials.sparse_mla(query, [rows], local, self.softmax_scale,
                                                self.config.kv_lora_rank)
            outputs.append(self._up_project_values(out_latent))
        return torch.cat(outputs)

    def _topk_pages(self, q_index, weights, keys, state: AttentionPass, num_keys: int,
                    query_positions, k: int) -> torch.Tensor:
        """Top-k over this layer's index keys at positions [0, num_keys), read from `keys`
        (`capture_keys`) one key window at a time -> [s, k] global positions."""
        cfg = self.config

        def read(start, end):
            return (keys.window(INDEX_KEY, start, end, q_index.device),
                    torch.arange(start, end, device=q_index.device))

        idx, _ = refs.indexer_topk_windows(q_index, weights, read, num_keys, query_positions, k,
                                           scale=cfg.dsa_indexer_head_dim ** -0.5,
                                           relu=cfg.dsa_indexer_scoring_relu,
                                           key_block=state.key_block)
        return idx

    def _selected_page_rows(self, keys, selection: torch.Tensor, device, dtype):
        """The latent rows a selection [s, k] (global positions, -1 = none) reads, gathered from
        `keys` (`capture_keys`) -> (rows [u, d_qk], indices [s, k] into them)."""
        used, local = partials.compact_selection(selection)
        if used is None:                      # nothing selected: one row keeps the shapes valid
            used = selection.new_zeros(1)
        rows = keys.gather(LATENT, used, device).to(dtype)
        return rows, local

    def forward_prompt_backward(self, x: torch.Tensor, state: AttentionPass):
        """One token block of the prompt under autograd (one process): its queries attend over
        the layer's latent pages with capture's selections (`page_rows`: the selected rows'
        cotangents go to the page buffer); its own latent rows get theirs in `prompt_rows`."""
        part = self.page_rows(state, LATENT, x.device, x.dtype)
        return self._project_out(self._attend(x, state, [part], None, None))

    def forward_prompt_rows(self, x: torch.Tensor, state: AttentionPass):
        """The block's latent rows (what capture wrote) to `emit`; nothing attended."""
        self.emit(state, LATENT, self._latent_rows(x, state.positions))
        return torch.zeros_like(x), None

    def forward_prompt_backward_sharded(self, x: torch.Tensor, state: AttentionPass):
        """The prompt (this rank's shard) under autograd, attending as capture did with capture's
        selections (the top-k is discrete: no gradient through it); its latent rows go to `emit`
        (index keys get no cotangent: they only select). Under CP the whole prompt's latent rows
        are gathered under autograd: each row's cotangent returns to its owner."""
        latents, _ = self._token_rows(x, state, index_keys=False)
        self.emit(state, LATENT, latents)
        keys, positions = latents, state.positions
        if state.cp.size > 1:
            keys = context_parallel.gather_prompt_keys_differentiable(latents, state)
            positions = torch.arange(state.cp.global_len, device=x.device)
        return self._project_out(self._attend(x, state, [keys], None, positions))

    def forward_replay(self, x: torch.Tensor, state: AttentionPass):
        """One branch (or one block of it) over the captured pages, the earlier blocks' rows and
        its own rows: parts of keys in position order (`models/partials.py`: no gradient buffer
        spans the prompt's rows), so an index into their concatenation is a global position."""
        latents, index_keys = self._token_rows(x, state, index_keys=not state.reuse_selections)
        self.emit_branch(state, LATENT, latents)
        self.emit_branch(state, INDEX_KEY, index_keys)
        parts, positions, index_parts = [latents], state.positions, [index_keys]
        # Index keys feed the top-k only (never a gradient), and only when it is computed here:
        # replay reuses scoring's selections and reads no earlier index keys.
        top_k_here = index_keys is not None and not state.reuse_selections
        earlier = self.earlier_pass(state)
        for source in (earlier, state if state.prefix_len > 0 else None):
            if source is None:
                continue
            parts.insert(0, self.page_rows(source, LATENT, x.device, latents.dtype))
            if top_k_here:
                index_parts.insert(0, self.read_page(source, INDEX_KEY, x.device, index_keys.dtype,
                                                     differentiable=False))
        if top_k_here and len(index_parts) > 1:
            index_keys = torch.cat(index_parts)      # one process: every position from 0 on
            positions = torch.arange(index_keys.shape[0], device=x.device)
        return self._project_out(self._attend(x, state, parts, index_keys, positions))

    def forward_decode(self, x: torch.Tensor, state: AttentionPass):
        """The step's rows by member (`decode.DecodeCache.segments`: a new token, or a block of an
        observation's ids): a segment's latent rows and index keys join its member's branch
        pages; its queries attend as a streamed capture block's do (`_attend_keys`) over the
        prompt's and the member's rows (`decode.DecodeKeys`, row = position): a top-k over their
        index keys one key window at a time, causal by position (full indexer layers), or its
        source layer's for the same member (IndexShare), then only the selected latent rows are
        gathered."""
        latents, index_keys = self._token_rows(x, state)
        outputs = []
        for segment in range(len(state.decode.segments)):
            span = state.decode.rows(segment)
            keys = self.decode_rows(state, segment,
                                    self._decode_new_rows(latents, index_keys, span))
            k = min(self.config.dsa_indexer_topk, keys.num_rows)
            outputs.append(self._attend_keys(x[span], member_pass(state, segment), keys,
                                             keys.num_rows, k))
        return self._project_out(torch.cat(outputs))

    def forward_decode_sharded(self, x: torch.Tensor, state: AttentionPass):
        """`forward_decode` with the prompt's pages sharded over CP (every rank runs the same
        rows; the members' branch pages are the same on every rank): per query block of a
        segment, the top-k merges every rank's candidates (`_decode_candidates`: its prompt
        shard, plus the member's rows on rank 0, one key window at a time), each rank attends
        over the rows of the selection it holds (gathered), and the partial outputs merge by
        log-sum-exp."""
        cp = state.cp
        here = context_parallel.branch_keys_counted_here(state)
        latents, index_keys = self._token_rows(x, state)
        outputs = []
        for segment in range(len(state.decode.segments)):
            span = state.decode.rows(segment)
            member, rows = member_pass(state, segment), x[span]
            keys = self.decode_rows(state, segment,
                                    self._decode_new_rows(latents, index_keys, span),
                                    branch_here=here)
            k = min(self.config.dsa_indexer_topk, state.prefix_len + keys.num_generated)
            for start in range(0, rows.shape[0], state.query_block):
                end = min(start + state.query_block, rows.shape[0])
                positions = member.positions[start:end]
                q_compressed, query = self._queries(rows[start:end], positions)
                selection = self._selection(
                    rows[start:end], q_compressed, member, start, end,
                    lambda q_index, w: collectives.merge_topk_candidates(
                        *self._decode_candidates(q_index, w, keys, positions, state), k,
                        cp.layout))
                local = context_parallel.local_key_index(selection, keys.prompt_positions,
                                                         state.prefix_len, here)
                out, lse = self._decode_attend(query, keys, local, latents.dtype)
                merged = context_parallel.merge_replicated(out, lse, state)
                outputs.append(self._up_project_values(merged))
        return self._project_out(torch.cat(outputs))

    def _decode_candidates(self, q_index, weights, keys, position, state: AttentionPass):
        """This rank's DSA candidates for decode queries [s, ...] at `position` [s]: the top-k over
        the index keys of `keys` (`decode.DecodeKeys`) at positions up to each query's, read one
        key window at a time -> (scores [s, topk], global positions [s, topk]), padded with -inf
        / -1 to the full top-k width, so that every rank contributes the same shape to the
        candidate exchange."""
        cfg = self.config

        def read(start, end):
            rows = torch.arange(start, end, device=q_index.device)
            return keys.window(INDEX_KEY, start, end, q_index.device), keys.positions(rows)

        idx, scores = refs.indexer_topk_windows(q_index, weights, read, keys.num_rows, position,
                                                cfg.dsa_indexer_topk,
                                                scale=cfg.dsa_indexer_head_dim ** -0.5,
                                                relu=cfg.dsa_indexer_scoring_relu,
                                                key_block=state.key_block)
        return scores, torch.where(idx >= 0, keys.positions(idx.clamp(min=0)), -1)

    def _decode_attend(self, query: torch.Tensor, keys, local: torch.Tensor, dtype):
        """Decode queries [s, h, d_qk] over the rows of `keys` (`decode.DecodeKeys`) that `local`
        [s, k] selects (row indices, -1 = none): only those latent rows are gathered (one query
        block's selection on the device, never the layer's rows). -> (out [s, h, kv_lora_rank],
        lse)"""
        used, local = partials.compact_selection(local)
        if used is None:        # nothing selected here: one zero row keeps the shapes valid
            rows = query.new_zeros((1, query.shape[-1]), dtype=dtype)
        else:
            rows = keys.gather(LATENT, used, query.device, dtype)
        return partials.sparse_mla(query, [rows], local, self.softmax_scale,
                                   self.config.kv_lora_rank)

    @staticmethod
    def _decode_new_rows(latents: torch.Tensor, index_keys: torch.Tensor | None,
                         span: slice) -> dict[str, torch.Tensor]:
        """`decode`: a segment's new rows by page kind (its index keys on full indexer layers)."""
        rows = {LATENT: latents[span]}
        if index_keys is not None:
            rows[INDEX_KEY] = index_keys[span]
        return rows

    def _attend(self, x: torch.Tensor, state: AttentionPass, key_parts, key_index,
                key_positions) -> torch.Tensor:
        """The current tokens' queries, per query block, over keys all held here: latent rows in
        parts ([t_i, d_qk] each, together the key axis), index keys [t, d_i] or None, global
        positions [t] (these two only where the top-k is computed). -> [s, h, v]"""
        outputs = []
        for start in range(0, x.shape[0], state.query_block):
            end = min(start + state.query_block, x.shape[0])
            q_compressed, query = self._queries(x[start:end], state.positions[start:end])
            selection = self._selection(x[start:end], q_compressed, state, start, end,
                                        lambda q_index, w: self._topk_local(
                                            q_index, w, key_index, key_positions,
                                            state.positions[start:end], state))
            out_latent, _ = partials.sparse_mla(query, key_parts, selection, self.softmax_scale,
                                                self.config.kv_lora_rank)
            outputs.append(self._up_project_values(out_latent))
        return torch.cat(outputs)

    def forward_replay_sharded(self, x: torch.Tensor, state: AttentionPass):
        return self._project_out(self._replay_context_parallel(x, state))

    def _replay_context_parallel(self, x: torch.Tensor, state: AttentionPass) -> torch.Tensor:
        """A branch pass with the prompt sharded over CP (`models/context_parallel.py`): this rank
        owns rows [start, end) of the branch (or of the current block of a blockwise one); all of
        its queries attend over this rank's prompt shard, its rows of the earlier blocks and (on
        rank 0) the current rows, with the global top-k, and the partial outputs merge by
        log-sum-exp to the row owners. -> [c, h, v]"""
        cp = state.cp
        own_latents, own_index_keys = self._token_rows(x, state,
                                                       index_keys=not state.reuse_selections)
        self.emit_branch(state, LATENT, own_latents)
        self.emit_branch(state, INDEX_KEY, own_index_keys)
        q_compressed, query = self._queries(x, state.positions)
        branch_positions = cp.branch_positions                     # [rows], all ranks
        here = context_parallel.branch_keys_counted_here(state)
        earlier = self.earlier_pass(state)
        held = [cp.prefix_positions] + ([] if earlier is None else [state.branch.positions])

        def candidates(q_index, weights):
            # Per query block: the exchanged candidates are [query_block, CP * 3 * top-k], not
            # [R, CP * 3 * top-k] (every rank runs the same blocks: each merge is a collective).
            all_q = collectives.gather_rows(q_index, cp.layout)
            all_w = collectives.gather_rows(weights, cp.layout)
            sources = [(self.read_page(state, INDEX_KEY, x.device, differentiable=False),
                        cp.prefix_positions)]
            if earlier is not None:
                sources.append((self.read_page(earlier, INDEX_KEY, x.device, differentiable=False),
                                state.branch.positions))
            sources.append((collectives.gather_rows(own_index_keys, cp.layout), branch_positions))
            k = min(self.config.dsa_indexer_topk, int(branch_positions[-1]) + 1)
            selection = []
            for start in range(0, all_q.shape[0], state.query_block):
                rows = slice(start, start + state.query_block)
                found = [self._shard_topk(all_q[rows], all_w[rows], keys, key_positions,
                                          branch_positions[rows], state)
                         for keys, key_positions in sources]
                if not here:                  # the current rows' keys count on rank 0 only
                    found[-1] = (found[-1][0].fill_(float("-inf")), found[-1][1].fill_(-1))
                scores, positions = (torch.cat(parts, 1) for parts in zip(*found))
                selection.append(collectives.merge_topk_candidates(scores, positions, k,
                                                                   cp.layout))
            return torch.cat(selection)

        selection = self._selection(x, q_compressed, state, 0, branch_positions.numel(),
                                    candidates, gathered=True)

        def attend(all_query, all_latents):
            # Keys here: this rank's prompt rows, its rows of the earlier blocks, then the
            # current rows; selected positions map to them (-1: a key held by another rank, or a
            # current key off rank 0).
            parts = [self.page_rows(source, LATENT, x.device, own_latents.dtype)
                     for source in (state, earlier) if source is not None] + [all_latents]
            local = context_parallel.local_key_index(selection, torch.cat(held),
                                                     int(branch_positions[0]), here)
            outs, lses = [], []
            for start in range(0, all_query.shape[0], state.query_block):
                end = min(start + state.query_block, all_query.shape[0])
                out, lse = partials.sparse_mla(all_query[start:end], parts, local[start:end],
                                               self.softmax_scale, self.config.kv_lora_rank)
                outs.append(out)
                lses.append(lse)
            return torch.cat(outs), torch.cat(lses)

        merged = context_parallel.attend_branch(state, (query, own_latents), attend)
        return self._up_project_values(merged)

    # ---- pieces ---------------------------------------------------------------------------

    _implicit: list[AttentionPass] = []

    @classmethod
    def _implicit_full_pass(cls, hidden_states: torch.Tensor, layer_idx: int) -> AttentionPass:
        """A plain Megatron forward (no LongStraw pass given) is one sequence from position 0.
        Decoder layer 0 always has its own indexer; it opens the pass the later layers share, so
        IndexShare layers find their source layer's top-k. One such forward at a time: interleaved
        forwards of several sequences (recompute of another graph) need explicit passes.
        Kept on the class, not handed down as the pass: Megatron's own full recompute
        (`megatron.core.recompute.checkpointed_forward`, the conventional baseline of
        tools/bench.py) saves `attention_mask` with `save_for_backward`, which takes tensors only,
        so a plain forward cannot carry an `AttentionPass` there."""
        if layer_idx == 0 or not cls._implicit:
            positions = torch.arange(hidden_states.shape[0], device=hidden_states.device)
            cls._implicit[:] = [AttentionPass(mode="full", positions=positions)]
        state = cls._implicit[0]
        if state.positions.numel() != hidden_states.shape[0]:
            raise RuntimeError(
                "A plain forward (no LongStraw pass given) shares its IndexShare top-k between "
                "the layers of one sequence at a time; this layer sees another sequence (e.g. an "
                "activation recompute interleaved with another forward). Give such forwards "
                "their pass: `model(input_ids, position_ids, "
                "attention_mask=AttentionPass(mode='full', positions=...))`.")
        return state

    def _index_keys(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[s, 1, h] -> DSA index keys [s, index_head_dim] (LayerNorm, RoPE on the first dims)."""
        indexer = self.core_attention.indexer
        k, _ = indexer.linear_wk(x)
        k = indexer.k_norm(k[:, 0])
        return self._rope_indexer(k, positions)

    def _rope_indexer(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rope_dim = self.config.qk_pos_emb_head_dim
        x_pe, x_pass = torch.split(x, [rope_dim, x.shape[-1] - rope_dim], dim=-1)
        x_pe = self._rope(x_pe, positions, interleaved=self.config.dsa_indexer_rope_interleaved)
        return torch.cat([x_pe, x_pass], dim=-1)

    def _token_rows(self, x: torch.Tensor, state: AttentionPass, index_keys: bool = True):
        """Token-wise: latent rows and (full indexer layers, unless `index_keys` is False: a pass
        that computes no top-k) index keys of the current tokens, chunk by chunk (O(s) memory)."""
        core: DSAIndexHolder = self.core_attention
        latents, keys = [], []
        for start in range(0, x.shape[0], state.token_block):
            end = min(start + state.token_block, x.shape[0])
            latents.append(self._latent_rows(x[start:end], state.positions[start:end]))
            if core.indexer is not None and index_keys:
                with torch.no_grad():  # keys only feed the selection (no gradient path)
                    keys.append(self._index_keys(x[start:end], state.positions[start:end]))
        return torch.cat(latents), (torch.cat(keys) if keys else None)

    def _index_queries(self, x, q_compressed, positions):
        """Indexer queries [s, h_i, d_i] (RoPE'd) and head weights [s, h_i] of the current rows."""
        cfg = self.config
        indexer = self.core_attention.indexer
        q_index, _ = indexer.linear_wq_b(q_compressed)
        q_index = q_index[:, 0].view(x.shape[0], cfg.dsa_indexer_n_heads, cfg.dsa_indexer_head_dim)
        weights, _ = indexer.linear_weights_proj(x)
        return (self._rope_indexer(q_index, positions),
                weights[:, 0] * cfg.dsa_indexer_n_heads ** -0.5)

    def _topk_local(self, q_index, weights, keys, key_positions, query_positions, state):
        """Top-k over keys all held here -> [s, k] key indices (= global positions here)."""
        cfg = self.config
        idx, _ = select.kernels().indexer_topk(
            q_index, weights, keys, query_positions, key_positions, cfg.dsa_indexer_topk,
            scale=cfg.dsa_indexer_head_dim ** -0.5, relu=cfg.dsa_indexer_scoring_relu,
            key_block=state.key_block)
        return torch.where(idx >= 0, key_positions[idx.clamp(min=0)], -1)

    def _shard_topk(self, q_index, weights, keys, key_positions, query_positions, state):
        """This rank's candidates: top-k over its keys -> (scores [s, topk], global positions),
        padded to the full top-k width (-inf / -1) so that every rank contributes the same shape to
        the candidate exchange even when its shard holds fewer than top-k keys."""
        cfg = self.config
        idx, scores = select.kernels().indexer_topk(
            q_index, weights, keys, query_positions, key_positions, cfg.dsa_indexer_topk,
            scale=cfg.dsa_indexer_head_dim ** -0.5, relu=cfg.dsa_indexer_scoring_relu,
            key_block=state.key_block)
        missing = cfg.dsa_indexer_topk - idx.shape[1]
        if missing > 0:
            idx = torch.cat([idx, idx.new_full((idx.shape[0], missing), -1)], dim=1)
            scores = torch.cat([scores, scores.new_full((scores.shape[0], missing),
                                                        float("-inf"))], dim=1)
        return scores, torch.where(idx >= 0, key_positions[idx.clamp(min=0)], -1)

    def _keep_block_selection(self, state: AttentionPass, selection: torch.Tensor,
                              row: int) -> None:
        """Streamed capture: this layer's selection of rows [row, row + s) into its buffer of all
        captured rows (int32 global positions, in the pages' storage); the first block of a full
        indexer layer drops the previous one's (IndexShare reads only the latest)."""
        buffer = state.selections.get(self.layer_idx)
        if buffer is None:
            state.selections.clear()
            rows = state.cp.layout.shard_len(state.cp.global_len)   # this rank's captured rows
            buffer = note_host(torch.empty((rows, selection.shape[1]),
                                           dtype=torch.int32, device=state.pages.storage_device))
            state.selections[self.layer_idx] = buffer
        buffer[row:row + selection.shape[0]] = selection.to(buffer.device, torch.int32)

    def _selection(self, x, q_compressed, state: AttentionPass, start, end, compute,
                   gathered: bool = False) -> torch.Tensor:
        """Top-k key positions [end - start, k] for query rows [start, end): computed by
        `compute(q_index, weights)` on full indexer layers, replayed from a scoring pass (indexer
        replay), or shared from the source layer (IndexShare). Selections are global key
        positions, so they mean the same thing on every rank and in every layout."""
        core: DSAIndexHolder = self.core_attention
        selections = state.selections
        offset = state.block_start if state.mode == "capture_block" else 0
        if core.indexer is None or state.reuse_selections:
            source = core.topk_source if core.indexer is None else core.layer_idx
            if source not in selections:
                raise RuntimeError(f"DSA layer {core.layer_idx} needs the top-k of layer {source}, "
                                   "which this pass has not computed (IndexShare order or "
                                   "indexer replay without a scoring pass).")
            selection = selections[source][offset + start:offset + end].to(x.device, torch.long)
        else:
            with torch.no_grad():  # the indexer is not trained by the policy loss
                rows = state.positions if gathered else state.positions[start:end]
                q_index, weights = self._index_queries(x, q_compressed, rows)
                selection = compute(q_index, weights)
            if state.mode == "capture_block":
                self._keep_block_selection(state, selection, offset + start)
            else:
                # Kept for IndexShare's later layers and, scoring, for replay: int32 (global
                # positions; -1 for none), as replay.score_member returns them.
                kept, previous = selection.to(torch.int32), selections.get(core.layer_idx)
                selections[core.layer_idx] = (kept if start == 0 or previous is None
                                              else torch.cat([previous, kept]))
        if state.used_selections is not None:
            used = state.used_selections.get(core.layer_idx)
            state.used_selections[core.layer_idx] = (
                selection if start == 0 or used is None else torch.cat([used, selection]))
        return selection
