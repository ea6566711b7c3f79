"""State-aware dense MLA attention for DeepSeek-V3: one set of Megatron weights, every mode.

The module is Megatron-Core's `MLASelfAttention` (same submodules, same parameter names, built from
the same spec) as an absorbed-MLA mixer (`models/mla.py`: latent rows, absorbed queries, the W_UV
up-projection; `models/mixer.py`: the modes), with `core_attention` an `IdentityOp`. Every query
attends causally over every latent row, as MQA with one shared key/value head:

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
from megatron_longstraw.models.mla import LATENT, AbsorbedMLA
from megatron_longstraw.state.attention_pass import AttentionPass


class LongStrawMLADenseAttention(AbsorbedMLA):
    """Megatron's MLA self-attention as a state-aware mixer with dense causal attention over the
    latents (see the module docstring for the math)."""

    def __init__(self, config, submodules, layer_number: int, yarn: bool = False, **kwargs):
        super().__init__(config, submodules, layer_number, **kwargs)
        self.yarn = yarn

    @property
    def layer_idx(self) -> int:
        return decoder_layer_index(self.layer_number)

    # ---- modes ------------------------------------------------------------------------------

    def forward_full(self, x: torch.Tensor, state: AttentionPass):
        """The current tokens as one sequence (the full-sequence reference)."""
        if not torch.is_grad_enabled():
            return self._causal_in_order(x, state, write_pages=False)
        latents = self._latent_rows(x, state.positions)
        return self._project_out(self._attend(x, state.positions, [(latents, state.positions)],
                                              state))

    def forward_prompt_backward(self, x: torch.Tensor, state: AttentionPass):
        """One token block of the prompt under autograd (one process): its queries attend over
        the layer's latent pages (`_page_keys`, streamed: each window's cotangents go to the page
        buffer); its own latent rows get theirs in `prompt_rows`."""
        part = self._page_keys(state, x.device, x.dtype, state.cp.prefix_positions)
        return self._project_out(self._attend(x, state.positions, [part], state))

    def forward_prompt_rows(self, x: torch.Tensor, state: AttentionPass):
        """The block's latent rows (what capture wrote) to `emit`; nothing attended."""
        self.emit(state, LATENT, self._latent_rows(x, state.positions))
        return torch.zeros_like(x), None

    def forward_prompt_backward_sharded(self, x: torch.Tensor, state: AttentionPass):
        """The prompt (this rank's shard) under autograd, causal over the whole prompt's rows
        (gathered under autograd under CP); its latent rows go to `emit`."""
        latents = self._latent_rows(x, state.positions)
        self.emit(state, LATENT, latents)
        keys, positions = latents, state.positions
        if state.cp.size > 1:
            keys = context_parallel.gather_prompt_keys_differentiable(latents, state)
            positions = torch.arange(state.cp.global_len, device=x.device)
        return self._project_out(self._attend(x, state.positions, [(keys, positions)], state))

    def forward_capture(self, x: torch.Tensor, state: AttentionPass):
        """The prompt (this rank's shard): its latent rows become pages."""
        return self._causal_in_order(x, state, write_pages=True)

    def forward_capture_block(self, x: torch.Tensor, state: AttentionPass):
        """One token block of the prompt (streamed capture, one process): its latent rows are
        appended to the pages, then attended with the earlier ones
        (`forward_capture_block_sharded`)."""
        self.forward_capture_rows(x, state)
        return self.forward_capture_block_sharded(x, state)

    def forward_capture_rows(self, x: torch.Tensor, state: AttentionPass):
        """The block's latent rows to the pages; nothing attended."""
        self.write_rows(state, LATENT, self._latent_rows(x, state.positions))
        return torch.zeros_like(x), None

    def forward_capture_block_sharded(self, x: torch.Tensor, state: AttentionPass):
        """The block's queries over the layer's latent rows at positions up to the block's last,
        read one key window at a time from `capture_keys` (the pages, or under CP every rank's
        rows in host memory; `partials.PageWindows`, MQA: keys the rows, values their c_kv
        part)."""
        keys, device, dtype, rank = self.capture_keys(state), x.device, x.dtype, self.config.kv_lora_rank

        def read(start, end):
            rows = keys.window(LATENT, start, end, device).to(dtype)
            return rows[:, None, :], rows[:, None, :rank]

        part = partials.PageWindows(read, int(state.positions[-1]) + 1, 1, rank)
        return self._project_out(self._attend(x, state.positions, [part], state))

    def forward_replay(self, x: torch.Tensor, state: AttentionPass):
        """One branch over the captured pages plus its own rows, two parts of keys
        (`models/partials.py`: no gradient buffer spans the prompt's rows)."""
        latents = self._latent_rows(x, state.positions)
        parts = [(latents, state.positions)]
        if state.prefix_len > 0:
            parts.insert(0, self._page_keys(state, x.device, latents.dtype,
                                            partials.prompt_key_positions(state.prefix_len,
                                                                          x.device)))
        return self._project_out(self._attend(x, state.positions, parts, state))

    def forward_decode(self, x: torch.Tensor, state: AttentionPass):
        """One new token per member (row i: member `state.decode.members[i]`): its latent row
        joins the member's branch cache; its query attends over the prompt's latent pages plus
        that cache."""
        latents = self._latent_rows(x, state.positions)
        outputs = []
        for row in range(x.shape[0]):
            own, positions = self.decode_rows(state, row, LATENT, latents[row:row + 1])
            parts = [(own, positions)]
            if state.prefix_len > 0:
                parts.insert(0, self._page_keys(state, x.device, latents.dtype,
                                                partials.prompt_key_positions(state.prefix_len,
                                                                              x.device)))
            outputs.append(self._attend(x[row:row + 1], state.positions[row:row + 1], parts,
                                        state))
        return self._project_out(torch.cat(outputs))

    def forward_decode_sharded(self, x: torch.Tensor, state: AttentionPass):
        """`forward_decode` with the prompt's latent rows sharded over CP (every rank runs the
        same rows; the members' caches are the same on every rank): each rank attends over its
        shard (rank 0 also over the member's cache), and the partial outputs merge by
        log-sum-exp (after W_UV: linear, so the merge commutes with it)."""
        latents = self._latent_rows(x, state.positions)
        outputs = []
        for row in range(x.shape[0]):
            own, positions = self.decode_rows(state, row, LATENT, latents[row:row + 1])
            parts = [self._page_keys(state, x.device, latents.dtype, state.cp.prefix_positions)]
            if context_parallel.branch_keys_counted_here(state):
                parts.append((own, positions))
            out, lse = self._attend(x[row:row + 1], state.positions[row:row + 1], parts, state,
                                    return_lse=True)
            outputs.append(context_parallel.merge_replicated(out, lse, state))
        return self._project_out(torch.cat(outputs))

    def _causal_in_order(self, x: torch.Tensor, state: AttentionPass, write_pages: bool):
        """No autograd (capture, or a full forward under no_grad): `StateAwareMixer.causal_in_order`
        over the latent rows; a block's queries attend over the rows written so far.
        -> (output [s, 1, hidden], None)"""
        return self.causal_in_order(
            x, state, (LATENT,), write_pages,
            rows=lambda x_block, positions: ((self._latent_rows(x_block, positions),), x_block),
            attend=lambda x_block, latents, positions, key_positions: self._project_out(
                self._attend(x_block, positions, [(latents[0], key_positions)], state)))

    def forward_replay_sharded(self, x: torch.Tensor, state: AttentionPass):
        return self._project_out(self._replay_context_parallel(x, state))

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
                x, state.positions, [(src_rows, src_pos)], state, return_lse=True))
        return torch.cat([self._project_out(out[s:s + block])[0]
                          for s in range(0, x.shape[0], block)]), None

    def _replay_context_parallel(self, x: torch.Tensor, state: AttentionPass) -> torch.Tensor:
        """A branch pass with the prompt pages sharded over CP: all branch queries attend over
        this rank's latent shard plus the branch's own rows (visible on rank 0 only), merged by
        log-sum-exp to the row owners. -> [c, heads, v_head_dim]"""
        own_latents = self._latent_rows(x, state.positions)
        _, query = self._queries(x, state.positions)

        def attend(all_query, all_latents):
            parts = [self._page_keys(state, x.device, own_latents.dtype,
                                     state.cp.prefix_positions),
                     (all_latents, context_parallel.branch_key_positions(state))]
            return self._dense(all_query, state.cp.branch_positions, parts, state)

        merged = context_parallel.attend_branch(state, (query, own_latents), attend)
        return self._up_project_values(merged)

    # ---- pieces -----------------------------------------------------------------------------

    def _page_keys(self, state: AttentionPass, device, dtype, positions) -> partials.PageKeys:
        """This layer's latent pages as an MQA part (keys the rows, values their c_kv part) at key
        `positions`; with the exact prompt gradient, streamed: a window's key and value
        cotangents add up on its latent rows in the page buffer."""
        rows = self.read_page(state, LATENT, device, dtype, differentiable=False)
        rank = self.config.kv_lora_rank
        latent_grads = self.key_grads(state, LATENT)
        sink = None if latent_grads is None else (
            lambda start, end, grad_k, grad_v: latent_grads(
                start, end, grad_k[:, 0] + torch.nn.functional.pad(
                    grad_v[:, 0], (0, grad_k.shape[-1] - rank))))
        return partials.PageKeys(rows[:, None, :], rows[:, None, :rank], positions, sink)

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

    def _attend(self, x, positions, key_parts, state, return_lse=False):
        """The current tokens' queries, computed per query block, over latent rows all held here,
        in parts of (latents [t_i, d_qk], global key positions [t_i]). -> [s, heads, v_head_dim]
        (and lse [s, heads] with `return_lse`)."""
        outs, lses = [], []
        for start in range(0, x.shape[0], state.query_block):
            end = min(start + state.query_block, x.shape[0])
            _, query = self._queries(x[start:end], positions[start:end])
            out, lse = self._dense(query, positions[start:end], key_parts, state)
            outs.append(self._up_project_values(out))
            lses.append(lse)
        out = torch.cat(outs)
        return (out, torch.cat(lses)) if return_lse else out

    def _dense(self, query, query_positions, key_parts, state):
        """Absorbed queries [s, heads, d_qk] over latent rows in parts of (latents [t_i, d_qk],
        key positions [t_i]) as MQA (one K/V group: keys the whole rows, values their c_kv part),
        per query block. -> (out_latent [s, heads, kv_lora_rank], lse [s, heads])."""
        rank = self.config.kv_lora_rank
        mqa = [part if isinstance(part, (partials.PageKeys, partials.PageWindows)) else
               (part[0][:, None, :], part[0][:, None, :rank], part[1]) for part in key_parts]
        parts = [partials.blockwise(query[start:start + state.query_block], mqa,
                                    query_positions[start:start + state.query_block],
                                    self.softmax_scale, state.key_block)
                 for start in range(0, query.shape[0], state.query_block)]
        out, lse = (torch.cat(p) for p in zip(*parts))
        return out, lse
