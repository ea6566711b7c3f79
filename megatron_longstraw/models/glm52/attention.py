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
        x = hidden_states  # [s, 1, h]
        num_tokens = x.shape[0]

        # Token-wise: the current tokens' latent rows and index keys (chunked; O(s) memory).
        latents, index_keys = [], []
        for start in range(0, num_tokens, state.token_block):
            end = min(start + state.token_block, num_tokens)
            latents.append(self._latent_rows(x[start:end], state.positions[start:end]))
            if core.indexer is not None:
                index_keys.append(self._index_keys(x[start:end], state.positions[start:end]))
        own_latents = torch.cat(latents)
        own_index_keys = torch.cat(index_keys) if index_keys else None
        if state.mode == "capture":
            state.pages.append(core.layer_idx, LATENT, own_latents)
            if own_index_keys is not None:
                state.pages.append(core.layer_idx, INDEX_KEY, own_index_keys)

        # Keys: captured prompt rows (constants) followed by the current tokens' rows.
        key_latents, key_index, key_positions = own_latents, own_index_keys, state.positions
        if state.mode == "replay" and state.prefix_len > 0:
            read = state.pages.leaf if state.prompt_state_grad else state.pages.fetch
            prefix_latents = read(core.layer_idx, LATENT, x.device)
            key_latents = torch.cat([prefix_latents.to(own_latents.dtype), own_latents])
            if own_index_keys is not None:
                prefix_index = state.pages.fetch(core.layer_idx, INDEX_KEY, x.device)
                key_index = torch.cat([prefix_index.to(own_index_keys.dtype), own_index_keys])
            key_positions = torch.cat([
                torch.arange(state.prefix_len, device=x.device), state.positions])

        outputs = []
        for start in range(0, num_tokens, state.query_block):
            end = min(start + state.query_block, num_tokens)
            outputs.append(self._attend_block(x[start:end], state, start, end, key_latents,
                                              key_index, key_positions))
        out = torch.cat(outputs)                                  # [s, h, v]
        out = out.reshape(num_tokens, 1, -1)
        return self.linear_proj(out)

    # ---- pieces ---------------------------------------------------------------------------

    _implicit: list[AttentionPass] = []

    @classmethod
    def _implicit_full_pass(cls, hidden_states: torch.Tensor, layer_idx: int) -> AttentionPass:
        """A plain Megatron forward (no LongStraw pass installed) is one sequence from position 0.
        Decoder layer 0 always has its own indexer; it opens the pass the later layers share, so
        IndexShare layers find their source layer's top-k."""
        if layer_idx == 0 or not cls._implicit:
            positions = torch.arange(hidden_states.shape[0], device=hidden_states.device)
            cls._implicit[:] = [AttentionPass(mode="full", positions=positions)]
        return cls._implicit[0]

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

    def _attend_block(self, x, state: AttentionPass, start: int, end: int, key_latents,
                      key_index, key_positions) -> torch.Tensor:
        """Sparse attention of the current tokens [start, end) -> [end - start, heads, v_head_dim]."""
        cfg = self.config
        core: DSAIndexHolder = self.core_attention
        kernels = select.kernels()
        positions = state.positions[start:end]
        num_heads = self.num_attention_heads_per_partition

        q_compressed, _ = self.linear_q_down_proj(x)
        q_compressed = self.q_layernorm(q_compressed)              # [b, 1, q_lora_rank]
        q, _ = self.linear_q_up_proj(q_compressed)
        q = q[:, 0].view(end - start, num_heads, self.q_head_dim)
        q_nope, q_pe = torch.split(q, [cfg.qk_head_dim, cfg.qk_pos_emb_head_dim], dim=-1)
        w_kv = self.linear_kv_up_proj.weight.view(num_heads, cfg.qk_head_dim + cfg.v_head_dim,
                                                  cfg.kv_lora_rank)
        w_uk, w_uv = torch.split(w_kv, [cfg.qk_head_dim, cfg.v_head_dim], dim=1)
        query = torch.cat([torch.einsum("shd,hdr->shr", q_nope, w_uk),
                           self._rope(q_pe, positions, interleaved=True)], dim=-1)

        selection = self._selection(x, q_compressed, state, start, end, key_index, key_positions)
        if state.used_selections is not None:
            used = state.used_selections.get(core.layer_idx)
            state.used_selections[core.layer_idx] = (
                selection if start == 0 or used is None else torch.cat([used, selection]))
        out_latent, _ = kernels.sparse_mla_attention(query, key_latents, selection,
                                                     self.softmax_scale, cfg.kv_lora_rank)
        return torch.einsum("shr,hvr->shv", out_latent, w_uv)

    def _selection(self, x, q_compressed, state: AttentionPass, start, end, key_index,
                   key_positions) -> torch.Tensor:
        """Top-k key indices [end - start, k] for the block: computed (full indexer layers), replayed
        from a scoring pass (indexer replay), or shared from the source layer (IndexShare)."""
        core: DSAIndexHolder = self.core_attention
        selections = state.selections
        if core.indexer is None or state.reuse_selections:
            source = core.topk_source if core.indexer is None else core.layer_idx
            if source not in selections:
                raise RuntimeError(f"DSA layer {core.layer_idx} needs the top-k of layer {source}, "
                                   "which this pass has not computed (IndexShare order or "
                                   "indexer replay without a scoring pass).")
            return selections[source][start:end]
        cfg = self.config
        indexer = core.indexer
        with torch.no_grad():  # the indexer is not trained by the policy loss (no gradient path)
            positions = state.positions[start:end]
            q_index, _ = indexer.linear_wq_b(q_compressed)
            q_index = q_index[:, 0].view(end - start, cfg.dsa_indexer_n_heads, cfg.dsa_indexer_head_dim)
            q_index = self._rope_indexer(q_index, positions)
            weights, _ = indexer.linear_weights_proj(x)
            weights = weights[:, 0] * cfg.dsa_indexer_n_heads ** -0.5
            idx, _ = select.kernels().indexer_topk(
                q_index, weights, key_index, positions, key_positions, cfg.dsa_indexer_topk,
                scale=cfg.dsa_indexer_head_dim ** -0.5, relu=cfg.dsa_indexer_scoring_relu,
                key_block=state.key_block)
        # Selections are indices into [prefix; current] keys; stored per layer for IndexShare and
        # for indexer replay, growing block by block.
        if state.mode == "capture" and start == 0:
            selections.clear()  # capture keeps one [P, k] selection: the latest full layer's
        previous = selections.get(core.layer_idx)
        selections[core.layer_idx] = idx if start == 0 or previous is None else torch.cat([previous, idx])
        return idx
