"""State-aware dense MLA attention for DeepSeek-V3: one set of Megatron weights, every mode.

The module is Megatron-Core's `MLASelfAttention` (same submodules, same parameter names, built from
the same spec) as an absorbed-MLA mixer (`models/mla.py`: latent rows, absorbed queries, the W_UV
up-projection) and a dense state-aware attention (`models/dense_attention.py`: the modes, shared
with Qwen3.6), with `core_attention` an `IdentityOp`. Every query attends causally over every
latent row, as MQA with one shared key/value head:

    q = [q_nope @ W_UK; rope(q_pe)]  [s, h, d_qk]     k = latent [t, 1, d_qk]   v = c_kv [t, 1, r]
    out_s = (softmax_t(q_s . latent_t * scale) @ c_kv_t) @ W_UV

through the kernel selector's `blockwise_attention` (`kernels/refs.py`: blocks of keys merged by
log-sum-exp, flash-style backward; nothing [s, h, t] is ever held). `full` attends over the current
tokens; `capture` writes each token's latent row (the only page kind: `LATENT`) and keeps no
autograd state, running token blocks in order (a block's queries see the rows written so far), so
nothing is O(P^2); `score` and `replay` attend over the captured pages plus the branch's own rows.
Prompt pages are constants in replay (`PageStore.leaf` is the hook for the exact prompt-gradient
mode).

RoPE is YaRN when the spec says so (`yarn=True`, from `rope_type: yarn`): `kernels/refs.py`
`yarn_inv_freq` and `yarn_attention_factor` (cos and sin scaled, as transformers does) replace the
plain frequencies, with the YaRN fields of Megatron's `MLATransformerConfig`; the softmax scale is
Megatron's own `softmax_scale`, mscale(factor, mscale_all_dim)^2 / sqrt(d), which is transformers'
`yarn_apply_mscale` (tests/test_deepseekv3.py checks both).

Context parallelism (`models/context_parallel.py`), as Qwen3.6's gated attention does it: capture
streams every rank's latent shard past this rank's queries (`ring_attention`: never more than one
shard of rows); branch passes gather the branch's queries and own rows, attend them over this
rank's prompt shard (the branch's own rows visible on rank 0 only) and merge by log-sum-exp to the
row owners (`attend_branch`).
"""

from __future__ import annotations

import torch

from megatron_longstraw.kernels import refs, select
from megatron_longstraw.models import context_parallel, partials
from megatron_longstraw.models.deepseekv3.config import decoder_layer_index
from megatron_longstraw.models.dense_attention import DenseStateAttention
from megatron_longstraw.models.mla import LATENT, AbsorbedMLA
from megatron_longstraw.state.attention_pass import AttentionPass


class LongStrawMLADenseAttention(DenseStateAttention, AbsorbedMLA):
    """Megatron's MLA self-attention as a state-aware mixer with dense causal attention over the
    latents (`models/dense_attention.py` runs the modes; see the module docstring for the
    math)."""

    page_kinds = (LATENT,)

    def __init__(self, config, submodules, layer_number: int, yarn: bool = False, **kwargs):
        super().__init__(config, submodules, layer_number, **kwargs)
        self.yarn = yarn

    @property
    def layer_idx(self) -> int:
        return decoder_layer_index(self.layer_number)

    # Not the base's: the block's latent rows are written and dropped before its queries attend
    # (the base holds one projection through the attention: Qwen3.6's one GEMM makes both).
    def forward_capture_block(self, x: torch.Tensor, state: AttentionPass):
        self.forward_capture_rows(x, state)
        return self.forward_capture_block_sharded(x, state)

    # Not in the base: the ring holds only the shard's input and latents (Qwen3.6: its q, gate).
    def forward_capture_sharded(self, x: torch.Tensor, state: AttentionPass):
        """Capture of this rank's load-balanced prompt shard: its latent rows become its pages;
        its queries attend every rank's shard in turn (`context_parallel.ring_attention`).
        Queries are recomputed per query block for each shard (a few % of the attention's work)
        instead of holding [n, heads, d_qk] of them. -> (output [n, 1, hidden], None)"""
        block = state.token_block
        latents = torch.cat([self._latent_rows(x[s:s + block], state.positions[s:s + block])
                             for s in range(0, x.shape[0], block)])
        self.write_rows(state, LATENT, latents)
        out, _ = context_parallel.ring_attention(
            state, latents, latents, lambda src_rows, _, src_pos: self._attend(
                x, [(src_rows, src_pos)], state.positions, state, return_lse=True))
        return torch.cat([self._project_out(out[s:s + block])[0]
                          for s in range(0, x.shape[0], block)]), None

    # ---- the math (hooks of `DenseStateAttention`) ------------------------------------------
    # Key rows: the latents [t, kv_lora_rank + rope]; query rows: the layer input x, whose
    # absorbed queries are made per query block (`_kernel_queries`); no gate.

    def _project(self, x: torch.Tensor, positions: torch.Tensor):
        return self._key_rows(x, positions), x, None

    def _key_rows(self, x: torch.Tensor, positions: torch.Tensor):
        return (self._latent_rows(x, positions),)

    def _query_rows(self, x: torch.Tensor, positions: torch.Tensor):
        return x, None

    def _key_part(self, rows, positions: torch.Tensor):
        return rows[0], positions

    def _keys_values(self, rows):
        """MQA over the latent rows: keys the whole rows, values their c_kv part ([t, 1, ...])."""
        latents, = rows
        return latents[:, None, :], latents[:, None, :self.config.kv_lora_rank]

    def _key_value_dims(self) -> tuple[int, int]:
        return 1, self.config.kv_lora_rank

    def _page_key_grads(self, state: AttentionPass):
        """A window's key and value cotangents add up on its latent rows in the page buffer."""
        rank = self.config.kv_lora_rank
        latent_grads = self.key_grads(state, LATENT)
        return None if latent_grads is None else (
            lambda start, end, grad_k, grad_v: latent_grads(
                start, end, grad_k[:, 0] + torch.nn.functional.pad(
                    grad_v[:, 0], (0, grad_k.shape[-1] - rank))))

    def _kernel_queries(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[s, 1, hidden] -> absorbed queries [s, heads, d_qk]."""
        _, query = self._queries(x, positions)
        return query

    def _kernel_parts(self, key_parts):
        """Parts of (latents, positions) as MQA (`_keys_values`); page parts are already."""
        return [part if isinstance(part, (partials.PageKeys, partials.PageWindows)) else
                (*self._keys_values(part[:1]), part[1]) for part in key_parts]

    def _kernel(self, query, key_parts, q_positions, key_block):
        """-> (out_latent [s, heads, kv_lora_rank], lse [s, heads])"""
        return partials.blockwise(query, key_parts, q_positions, self.softmax_scale, key_block)

    def _kernel_out(self, out: torch.Tensor) -> torch.Tensor:
        return self._up_project_values(out)

    def _output(self, out: torch.Tensor, gate=None):
        return self._project_out(out)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor, interleaved: bool) -> torch.Tensor:
        """Plain RoPE (`AbsorbedMLA._rope`), or YaRN's frequencies and cos/sin factor."""
        cfg = self.config
        if not self.yarn:
            return super()._rope(x, positions, interleaved)
        inv_freq = refs.yarn_inv_freq(x.shape[-1], cfg.rotary_base, cfg.rotary_scaling_factor,
                                      cfg.original_max_position_embeddings, cfg.beta_fast,
                                      cfg.beta_slow, device=x.device)
        factor = refs.yarn_attention_factor(cfg.rotary_scaling_factor, cfg.mscale,
                                            cfg.mscale_all_dim)
        return select.kernels().apply_rope(x, positions, cfg.rotary_base, interleaved,
                                           inv_freq=inv_freq, attention_factor=factor)
