"""Multi-head latent attention in absorbed form, over Megatron-Core's `MLASelfAttention` weights:
the math every MLA family shares (GLM-5.2 adds DSA's sparse selection on top; DeepSeek-V3 attends
densely over the latents).

    latent_t = [kv_norm(c_kv_t); rope(k_pe_t)]                    [t, kv_lora_rank + rope]
    query_s  = [q_nope_s @ W_UK; rope(q_pe_s)]                    [s, h, kv_lora_rank + rope]
    out_s    = (softmax_t(query_s . latent_t * scale) @ c_kv_t) @ W_UV

which equals standard MLA with up-projected keys and values (matrix associativity), and is
FlashMLA's contract: the latent rows are all a prompt token leaves behind (one row per token and
layer, shared by every head), so they are the pages.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from megatron_longstraw.kernels import select
from megatron_longstraw.models.mixer import StateAwareMixer

LATENT = "latent"        # page kind: MLA latent rows [c_kv; k_pe]


class AbsorbedMLA(StateAwareMixer, MLASelfAttention):
    """`MLASelfAttention` (same submodules and parameters) as a state-aware mixer, with the pieces
    of the absorbed form; a family's subclass implements the modes (`models/mixer.py`)."""

    def _rope(self, x: torch.Tensor, positions: torch.Tensor, interleaved: bool) -> torch.Tensor:
        return select.kernels().apply_rope(x, positions, self.config.rotary_base, interleaved)

    def _latent_rows(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[s, 1, h] -> latent rows [s, kv_lora_rank + rope]: kv_norm(c_kv) and roped k_pe."""
        kv, _ = self.linear_kv_down_proj(x)
        c_kv, k_pe = torch.split(kv[:, 0], [self.config.kv_lora_rank,
                                            self.config.qk_pos_emb_head_dim], dim=-1)
        c_kv = self.kv_layernorm(c_kv)
        return torch.cat([c_kv, self._rope(k_pe, positions, interleaved=True)], dim=-1)

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

    def _project_out(self, out: torch.Tensor):
        """[s, heads, v_head_dim] -> linear_proj's (output [s, 1, hidden], bias)."""
        return self.linear_proj(out.reshape(out.shape[0], 1, -1))
