"""State-aware MLA + DSA attention for GLM-5.2: one set of Megatron weights, three modes.

The module is Megatron-Core's `MLASelfAttention` (same submodules, same parameter names, built from the
same spec) with `forward` replaced, and `core_attention` swapped for `DSAIndexHolder`, which holds
Megatron's own `DSAIndexer` on layers that compute a top-k and nothing on IndexShare layers. The
forward computes in absorbed-MLA form (FlashMLA's sparse contract):

    latent_t = [kv_norm(c_kv_t); rope(k_pe_t)]                    [t, kv_lora_rank + rope]
    query_s  = [q_nope_s @ W_UK; rope(q_pe_s)]                    [s, h, kv_lora_rank + rope]
    out_s    = (softmax_{t in topk(s)}(query_s . latent_t * scale) @ c_kv_t) @ W_UV

which equals standard MLA with up-projected keys/values (matrix associativity). Which keys exist and
which positions the tokens have come from the installed `AttentionPass` (see `state.py`):
`full` attends over the current tokens; `capture` also writes each token's latent row and index key
to the page store and keeps no autograd state; `replay` attends over the captured prompt pages plus
the current tokens' own rows. Prompt pages are constants: the replay gradient is the conditional
gradient d loss / d theta at fixed prompt state (DESIGN section 7); `PageStore.leaf` is the hook for
the exact prompt-gradient mode.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import build_module

from megatron_longstraw import parallel
from megatron_longstraw.kernels import select
from megatron_longstraw.models.glm52.config import has_own_indexer
from megatron_longstraw.state import AttentionPass, current_pass

LATENT = "latent"        # page kind: MLA latent rows [c_kv; k_pe]
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


class LongStrawMLASelfAttention(MLASelfAttention):
    """Megatron's MLA self-attention with a capture/replay-aware forward (see module docstring)."""

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **unused_kwargs):
        """hidden_states: [s, 1, hidden] (input-layernormed). Returns (output [s, 1, hidden], bias)."""
        if hidden_states.shape[1] != 1:
            raise ValueError("LongStraw attention processes one sequence at a time (batch 1); got "
                             f"batch {hidden_states.shape[1]}.")
        core: DSAIndexHolder = self.core_attention
        state = current_pass() or self._implicit_full_pass(hidden_states, core.layer_idx)
        if state.mode == "full" and self.config.context_parallel_size > 1:
            raise ValueError(
                "A plain forward of this model has no context-parallel layout (each rank would "
                f"treat its shard as a whole sequence); the model was built for CP="
                f"{self.config.context_parallel_size}: run it through LongStraw capture and replay "
                "(schedule.forward_backward_longstraw / replay.score_member), or build it with CP 1.")
        if state.mode == "replay" and state.cp.size > 1:
            out = self._replay_context_parallel(hidden_states, state)
        else:
            out = self._attend_local_keys(hidden_states, state)
        return self.linear_proj(out.reshape(hidden_states.shape[0], 1, -1))

    def _attend_local_keys(self, x: torch.Tensor, state: AttentionPass) -> torch.Tensor:
        """Every key this rank attends to is materialised here: the current tokens' own rows, the
        captured prefix (replay), or the whole prompt gathered across CP (capture). -> [s, h, v]"""
        core: DSAIndexHolder = self.core_attention
        own_latents, own_index_keys = self._token_rows(x, state)
        if state.mode == "capture":
            state.pages.append(core.layer_idx, LATENT, own_latents)
            if own_index_keys is not None:
                state.pages.append(core.layer_idx, INDEX_KEY, own_index_keys)

        key_latents, key_index, key_positions = own_latents, own_index_keys, state.positions
        if state.mode == "capture" and state.cp.size > 1:
            # The prompt is sharded: every rank sees the whole prompt's keys (global causal
            # context, global top-k) in position order, and keeps only its own rows as pages.
            total = state.global_len
            key_latents = parallel.gather_sequence(own_latents, state.positions, total, state.cp)
            if own_index_keys is not None:
                key_index = parallel.gather_sequence(own_index_keys, state.positions, total, state.cp)
            key_positions = torch.arange(total, device=x.device)
        elif state.mode == "replay" and state.prefix_len > 0:
            read = state.pages.leaf if state.prompt_state_grad else state.pages.fetch
            prefix_latents = read(core.layer_idx, LATENT, x.device)
            key_latents = torch.cat([prefix_latents.to(own_latents.dtype), own_latents])
            if own_index_keys is not None:
                prefix_index = state.pages.fetch(core.layer_idx, INDEX_KEY, x.device)
                key_index = torch.cat([prefix_index.to(own_index_keys.dtype), own_index_keys])
            key_positions = torch.cat([torch.arange(state.prefix_len, device=x.device),
                                       state.positions])

        outputs = []
        for start in range(0, x.shape[0], state.query_block):
            end = min(start + state.query_block, x.shape[0])
            q_compressed, query = self._queries(x[start:end], state.positions[start:end])
            selection = self._selection(x[start:end], q_compressed, state, start, end,
                                        lambda q_index, w: self._topk_local(
                                            q_index, w, key_index, key_positions,
                                            state.positions[start:end], state))
            kernels = select.kernels()
            out_latent, _ = kernels.sparse_mla_attention(query, key_latents, selection,
                                                         self.softmax_scale, self.config.kv_lora_rank)
            outputs.append(self._up_project_values(out_latent))
        return torch.cat(outputs)

    def _replay_context_parallel(self, x: torch.Tensor, state: AttentionPass) -> torch.Tensor:
        """Replay with the prompt sharded over CP (DESIGN section 3). This rank owns rows
        [start, end) of the branch. The branch's queries are gathered; each rank attends them over
        its own prompt shard (and rank 0 over the branch's own rows as well, so those count once);
        the partial outputs merge by log-sum-exp and each rank keeps its own rows. -> [c, h, v]"""
        core: DSAIndexHolder = self.core_attention
        cp = state.cp
        own_latents, own_index_keys = self._token_rows(x, state)
        q_compressed, query = self._queries(x, state.positions)
        branch_positions = state.branch_positions                  # [R_pad], all ranks
        all_query = parallel.gather_rows(query, cp)                # [R_pad, h, d_qk]
        all_latents = parallel.gather_rows(own_latents, cp)        # [R_pad, d_qk]

        def candidates(q_index, weights):
            # Per query block: the exchanged candidates are [query_block, CP * 2 * top-k], not
            # [R, CP * 2 * top-k] (every rank runs the same blocks: each merge is a collective).
            all_q = parallel.gather_rows(q_index, cp)
            all_w = parallel.gather_rows(weights, cp)
            prefix_keys = state.pages.fetch(core.layer_idx, INDEX_KEY, x.device)
            all_index_keys = parallel.gather_rows(own_index_keys, cp)
            k = min(self.config.dsa_indexer_topk, state.prefix_len + branch_positions.numel())
            selection = []
            for start in range(0, all_q.shape[0], state.query_block):
                rows = slice(start, start + state.query_block)
                scores, pos = self._shard_topk(all_q[rows], all_w[rows], prefix_keys,
                                               state.prefix_positions, branch_positions[rows], state)
                own_s, own_p = self._shard_topk(all_q[rows], all_w[rows], all_index_keys,
                                                branch_positions, branch_positions[rows], state)
                if cp.rank != 0:  # the branch's own keys are candidates on exactly one rank
                    own_s, own_p = own_s.fill_(float("-inf")), own_p.fill_(-1)
                selection.append(parallel.merge_topk_candidates(
                    torch.cat([scores, own_s], 1), torch.cat([pos, own_p], 1), k, cp))
            return torch.cat(selection)

        selection = self._selection(x, q_compressed, state, 0, branch_positions.numel(),
                                    candidates, gathered=True)
        # Keys here: this rank's prompt rows, then the branch's rows. Every rank holds the branch
        # rows (so the autograd graph, and with it the order of backward collectives, is the same
        # on every rank), but only rank 0 lets queries select them: they count exactly once.
        read = state.pages.leaf if state.prompt_state_grad else state.pages.fetch
        prefix_latents = read(core.layer_idx, LATENT, x.device).to(own_latents.dtype)
        key_latents = torch.cat([prefix_latents, all_latents])
        lookup = torch.full((state.prefix_len + branch_positions.numel(),), -1, dtype=torch.long,
                            device=x.device)
        lookup[state.prefix_positions] = torch.arange(prefix_latents.shape[0], device=x.device)
        if cp.rank == 0:
            lookup[branch_positions] = prefix_latents.shape[0] + torch.arange(
                branch_positions.numel(), device=x.device)
        local = torch.where(selection >= 0, lookup[selection.clamp(min=0)], -1)

        outs, lses = [], []
        kernels = select.kernels()
        for start in range(0, all_query.shape[0], state.query_block):
            end = min(start + state.query_block, all_query.shape[0])
            out, lse = kernels.sparse_mla_attention(all_query[start:end], key_latents,
                                                    local[start:end], self.softmax_scale,
                                                    self.config.kv_lora_rank)
            outs.append(out)
            lses.append(lse)
        return self._up_project_values(parallel.merge_partials_by_lse(torch.cat(outs),
                                                                      torch.cat(lses), cp))

    # ---- pieces ---------------------------------------------------------------------------

    _implicit: list[AttentionPass] = []

    @classmethod
    def _implicit_full_pass(cls, hidden_states: torch.Tensor, layer_idx: int) -> AttentionPass:
        """A plain Megatron forward (no LongStraw pass installed) is one sequence from position 0.
        Decoder layer 0 always has its own indexer; it opens the pass the later layers share, so
        IndexShare layers find their source layer's top-k. One such forward at a time: interleaved
        forwards of several sequences (recompute of another graph) need explicit passes."""
        if layer_idx == 0 or not cls._implicit:
            positions = torch.arange(hidden_states.shape[0], device=hidden_states.device)
            cls._implicit[:] = [AttentionPass(mode="full", positions=positions)]
        state = cls._implicit[0]
        if state.positions.numel() != hidden_states.shape[0]:
            raise RuntimeError(
                "A plain forward (no LongStraw pass installed) shares its IndexShare top-k between "
                "the layers of one sequence at a time; this layer sees another sequence (e.g. an "
                "activation recompute interleaved with another forward). Run such forwards inside "
                "`with attention_pass(AttentionPass(mode='full', positions=...))`.")
        return state

    def _rope(self, x: torch.Tensor, positions: torch.Tensor, interleaved: bool) -> torch.Tensor:
        return select.kernels().apply_rope(x, positions, self.config.rotary_base, interleaved)

    def _latent_rows(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[s, 1, h] -> latent rows [s, kv_lora_rank + rope]: kv_norm(c_kv) and roped k_pe."""
        kv, _ = self.linear_kv_down_proj(x)
        c_kv, k_pe = torch.split(kv[:, 0], [self.config.kv_lora_rank,
                                            self.config.qk_pos_emb_head_dim], dim=-1)
        c_kv = self.kv_layernorm(c_kv)
        return torch.cat([c_kv, self._rope(k_pe, positions, interleaved=True)], dim=-1)

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

    def _token_rows(self, x: torch.Tensor, state: AttentionPass):
        """Token-wise: latent rows and (full indexer layers) index keys of the current tokens,
        chunk by chunk (O(s) memory)."""
        core: DSAIndexHolder = self.core_attention
        latents, index_keys = [], []
        for start in range(0, x.shape[0], state.token_block):
            end = min(start + state.token_block, x.shape[0])
            latents.append(self._latent_rows(x[start:end], state.positions[start:end]))
            if core.indexer is not None:
                with torch.no_grad():  # keys only feed the selection (no gradient path)
                    index_keys.append(self._index_keys(x[start:end], state.positions[start:end]))
        return torch.cat(latents), (torch.cat(index_keys) if index_keys else None)

    def _queries(self, x: torch.Tensor, positions: torch.Tensor):
        """[s, 1, h] -> (q_compressed [s, 1, q_lora_rank], absorbed query [s, heads, d_qk])."""
        cfg = self.config
        q_compressed, _ = self.linear_q_down_proj(x)
        q_compressed = self.q_layernorm(q_compressed)
        q, _ = self.linear_q_up_proj(q_compressed)
        q = q[:, 0].view(x.shape[0], self.num_attention_heads_per_partition, self.q_head_dim)
        q_nope, q_pe = torch.split(q, [cfg.qk_head_dim, cfg.qk_pos_emb_head_dim], dim=-1)
        w_uk, _ = self._absorbed_weights()
        query = torch.cat([torch.einsum("shd,hdr->shr", q_nope, w_uk),
                           self._rope(q_pe, positions, interleaved=True)], dim=-1)
        return q_compressed, query

    def _absorbed_weights(self):
        """W_UK [heads, qk_head_dim, kv_lora_rank], W_UV [heads, v_head_dim, kv_lora_rank]."""
        cfg = self.config
        w_kv = self.linear_kv_up_proj.weight.view(self.num_attention_heads_per_partition,
                                                  cfg.qk_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return torch.split(w_kv, [cfg.qk_head_dim, cfg.v_head_dim], dim=1)

    def _up_project_values(self, out_latent: torch.Tensor) -> torch.Tensor:
        """[s, heads, kv_lora_rank] -> [s, heads, v_head_dim]."""
        _, w_uv = self._absorbed_weights()
        return torch.einsum("shr,hvr->shv", out_latent, w_uv)

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

    def _selection(self, x, q_compressed, state: AttentionPass, start, end, compute,
                   gathered: bool = False) -> torch.Tensor:
        """Top-k key positions [end - start, k] for query rows [start, end): computed by
        `compute(q_index, weights)` on full indexer layers, replayed from a scoring pass (indexer
        replay), or shared from the source layer (IndexShare). Selections are global key
        positions, so they mean the same thing on every rank and in every layout."""
        core: DSAIndexHolder = self.core_attention
        selections = state.selections
        if core.indexer is None or state.reuse_selections:
            source = core.topk_source if core.indexer is None else core.layer_idx
            if source not in selections:
                raise RuntimeError(f"DSA layer {core.layer_idx} needs the top-k of layer {source}, "
                                   "which this pass has not computed (IndexShare order or "
                                   "indexer replay without a scoring pass).")
            selection = selections[source][start:end].to(x.device, torch.long)  # may be compact
        else:
            with torch.no_grad():  # the indexer is not trained by the policy loss
                rows = state.positions if gathered else state.positions[start:end]
                q_index, weights = self._index_queries(x, q_compressed, rows)
                selection = compute(q_index, weights)
            if state.mode == "capture" and start == 0:
                selections.clear()  # capture keeps one [P, k] selection: the latest full layer's
            previous = selections.get(core.layer_idx)
            selections[core.layer_idx] = (selection if start == 0 or previous is None
                                          else torch.cat([previous, selection]))
        if state.used_selections is not None:
            used = state.used_selections.get(core.layer_idx)
            state.used_selections[core.layer_idx] = (
                selection if start == 0 or used is None else torch.cat([used, selection]))
        return selection
