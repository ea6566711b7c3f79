"""State-aware gated full attention for Qwen3.6: one set of Megatron weights, three modes.

The module is Megatron-Core's `SelfAttention` with `attention_output_gate` (same submodules, same
parameter names, built from the same spec) with `forward` replaced:

    q, gate, k, v = linear_qkv(x)                     GQA: heads / groups query heads per K/V head
    q, k = q_norm(q), k_norm(k)                       zero-centred RMSNorm per head
    q, k = rope(q), rope(k)                           first rotary_percent of each head, half-split
    o = softmax(q k^T / sqrt(d) + causal) v           blockwise over keys, log-sum-exp merge
    out = linear_proj(o * sigmoid(gate))

Which keys exist and which positions the tokens have come from the given `AttentionPass`
(`state.py`): `full` attends over the current tokens; `capture` also appends each token's K (after
norm and RoPE) and V to the page store and keeps no autograd state; `replay` attends over the
captured prompt pages plus the current tokens. Memory: capture runs token blocks in order (a block's
queries see the keys written so far), so nothing is O(P^2); attention itself runs per query block
and per key block (the kernel selector's `blockwise_attention`, `kernels/refs.py`:
O(query_block x heads x key_block) scratch, backward recomputes per block), so replay never holds
a [R, heads, P] score matrix. Prompt pages are
constants in replay (`PageStore.leaf` is the hook for the exact prompt-gradient mode).

Context parallelism (`models/context_parallel.py`): each rank captures its load-balanced prompt
shard and keeps its K/V rows as pages; capture streams every shard's K/V past every rank's queries
in turn (`ring_attention`); branch passes gather the branch's queries, attend them over each rank's
shard and merge the partial outputs by log-sum-exp (`attend_branch`), as for GLM-5.2. No head
constraint: GQA groups stay whole on every rank.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.attention import SelfAttention

from megatron_longstraw.kernels import select
from megatron_longstraw.models import context_parallel, partials
from megatron_longstraw.models.mixer import StateAwareMixer
from megatron_longstraw.models.qwen36.config import decoder_layer_index
from megatron_longstraw.state.attention_pass import AttentionPass

KEY = "key"      # page kind: K rows [P, groups, head_dim] (after k_norm and RoPE)
VALUE = "value"  # page kind: V rows [P, groups, head_dim]


class LongStrawGatedSelfAttention(StateAwareMixer, SelfAttention):
    """Megatron's gated self-attention as a state-aware mixer (`models/mixer.py` dispatches the
    modes; see the module docstring for the math)."""

    def __init__(self, config, submodules, layer_number: int, rotary_base: float = 10000.0,
                 rotary_percent: float = 1.0, **kwargs):
        if not config.attention_output_gate:
            raise ValueError("Qwen3.6 full attention needs attention_output_gate=True.")
        super().__init__(config, submodules, layer_number, **kwargs)
        self.layer_idx = decoder_layer_index(layer_number)
        self.rotary_base = rotary_base
        self.rotary_dim = int(self.hidden_size_per_attention_head * rotary_percent)
        self.scale = self.hidden_size_per_attention_head ** -0.5

    # ---- modes ------------------------------------------------------------------------------

    def forward_full(self, x: torch.Tensor, state: AttentionPass):
        if not torch.is_grad_enabled():
            return self._causal_in_order(x, state, write_pages=False)
        return self.linear_proj(self._full_with_grad(x, state))

    def forward_capture(self, x: torch.Tensor, state: AttentionPass):
        return self._causal_in_order(x, state, write_pages=True)

    def forward_capture_block(self, x: torch.Tensor, state: AttentionPass):
        """One token block of the prompt (streamed capture, one process): its K/V rows are
        appended to the pages, and its queries attend over the pages' rows so far
        (`_attend_capture_keys`)."""
        q, k, v, gate = self._project(x, state.positions)
        self.write_rows(state, KEY, k)
        self.write_rows(state, VALUE, v)
        return self._attend_capture_keys(q, gate, state)

    def forward_capture_rows(self, x: torch.Tensor, state: AttentionPass):
        """Streamed capture under CP, a layer's first phase: the block's K/V rows to the pages."""
        _, k, v, _ = self._project(x, state.positions)
        self.write_rows(state, KEY, k)
        self.write_rows(state, VALUE, v)
        return torch.zeros_like(x), None

    def forward_capture_block_sharded(self, x: torch.Tensor, state: AttentionPass):
        """Streamed capture under CP: the block's queries over every rank's K/V rows of the layer
        (gathered in host memory by `capture_exchange`). K/V are projected again with the
        queries (one GEMM; its K/V columns are a few % of it)."""
        q, _, _, gate = self._project(x, state.positions)
        return self._attend_capture_keys(q, gate, state)

    def _attend_capture_keys(self, q, gate, state: AttentionPass):
        """The block's queries over the layer's K/V rows at positions up to the block's last,
        read one key window at a time from `capture_keys` (`partials.PageWindows`)."""
        keys, device, dtype = self.capture_keys(state), q.device, q.dtype
        part = partials.PageWindows(
            lambda start, end: (keys.window(KEY, start, end, device).to(dtype),
                                keys.window(VALUE, start, end, device).to(dtype)),
            int(state.positions[-1]) + 1, self.num_query_groups_per_partition,
            self.hidden_size_per_attention_head)
        return self.linear_proj(self._gate(self._attend(q, [part], state.positions, state), gate))

    def forward_prompt_backward(self, x: torch.Tensor, state: AttentionPass):
        """One token block of the prompt under autograd (one process): its queries attend over
        the layer's K/V pages (`_page_keys`, streamed: each key window's cotangents go to the
        page buffers); its own K/V rows get theirs in `prompt_rows`."""
        q, _, _, gate = self._project(x, state.positions)
        part = self._page_keys(state, x.device, q.dtype, state.cp.prefix_positions)
        return self.linear_proj(self._gate(self._attend(q, [part], state.positions, state), gate))

    def forward_prompt_rows(self, x: torch.Tensor, state: AttentionPass):
        """The block's K and V rows (after norm and RoPE: what capture wrote) to `emit`."""
        _, k, v, _ = self._project(x, state.positions)
        self.emit(state, KEY, k)
        self.emit(state, VALUE, v)
        return torch.zeros_like(x), None

    def forward_prompt_backward_sharded(self, x: torch.Tensor, state: AttentionPass):
        """The prompt (this rank's shard) under autograd over the whole prompt's K/V (gathered
        under autograd under CP); its K and V rows (after norm and RoPE) go to `emit`."""
        q, k, v, gate = self._project(x, state.positions)
        self.emit(state, KEY, k)
        self.emit(state, VALUE, v)
        keys, values, positions = k, v, state.positions
        if state.cp.size > 1:
            keys = context_parallel.gather_prompt_keys_differentiable(k, state)
            values = context_parallel.gather_prompt_keys_differentiable(v, state)
            positions = torch.arange(state.cp.global_len, device=x.device)
        out = self._attend(q, [(keys, values, positions)], state.positions, state)
        return self.linear_proj(self._gate(out, gate))

    def forward_replay(self, x: torch.Tensor, state: AttentionPass):
        return self.linear_proj(self._replay(x, state))

    def forward_decode(self, x: torch.Tensor, state: AttentionPass):
        """One new token per member (row i: member `state.decode.members[i]`): its K/V rows join
        the member's branch cache; its query attends over the prompt's K/V pages plus that
        cache."""
        q, k, v, gate = self._project(x, state.positions)
        outputs = []
        for row in range(x.shape[0]):
            keys, positions = self.decode_rows(state, row, KEY, k[row:row + 1])
            values, _ = self.decode_rows(state, row, VALUE, v[row:row + 1])
            parts = [(keys, values, positions)]
            if state.prefix_len > 0:
                parts.insert(0, self._page_keys(state, x.device, k.dtype,
                                                partials.prompt_key_positions(state.prefix_len,
                                                                              x.device)))
            outputs.append(self._attend(q[row:row + 1], parts, state.positions[row:row + 1],
                                        state))
        return self.linear_proj(self._gate(torch.cat(outputs), gate))

    def forward_decode_sharded(self, x: torch.Tensor, state: AttentionPass):
        """`forward_decode` with the prompt's K/V sharded over CP (every rank runs the same rows;
        the members' caches are the same on every rank): each rank attends over its shard (rank
        0 also over the member's cache), and the partial outputs merge by log-sum-exp."""
        q, k, v, gate = self._project(x, state.positions)
        outputs = []
        for row in range(x.shape[0]):
            keys, positions = self.decode_rows(state, row, KEY, k[row:row + 1])
            values, _ = self.decode_rows(state, row, VALUE, v[row:row + 1])
            parts = [self._page_keys(state, x.device, k.dtype, state.cp.prefix_positions)]
            if context_parallel.branch_keys_counted_here(state):
                parts.append((keys, values, positions))
            out, lse = self._attend(q[row:row + 1], parts, state.positions[row:row + 1], state,
                                    return_lse=True)
            outputs.append(context_parallel.merge_replicated(out, lse, state))
        return self.linear_proj(self._gate(torch.cat(outputs), gate))

    def _causal_in_order(self, x: torch.Tensor, state: AttentionPass, write_pages: bool):
        """No autograd (capture, or a full forward under no_grad): `StateAwareMixer.causal_in_order`
        over the K/V rows; a block's queries attend over the K/V written so far.
        -> (output [s, 1, hidden], None)"""

        def rows(x_block, positions):
            q, k, v, gate = self._project(x_block, positions)
            return (k, v), (q, gate)

        def attend(query_gate, key_value, positions, key_positions):
            (q, gate), (keys, values) = query_gate, key_value
            out = self._attend(q, [(keys, values, key_positions)], positions, state)
            return self.linear_proj(self._gate(out, gate))

        return self.causal_in_order(x, state, (KEY, VALUE), write_pages, rows, attend)

    def _full_with_grad(self, x: torch.Tensor, state: AttentionPass) -> torch.Tensor:
        """The whole sequence under autograd (the full-sequence reference). -> [s, 1, heads * d]"""
        q, k, v, gate = self._project(x, state.positions)
        return self._gate(self._attend(q, [(k, v, state.positions)], state.positions, state), gate)

    def _replay(self, x: torch.Tensor, state: AttentionPass) -> torch.Tensor:
        """The branch's queries over the captured pages plus its own rows, two parts of keys
        (`models/partials.py`: no gradient buffer spans the prompt's rows). -> [s, 1, heads * d]"""
        q, k, v, gate = self._project(x, state.positions)
        parts = [(k, v, state.positions)]
        if state.prefix_len > 0:
            parts.insert(0, self._page_keys(state, x.device, k.dtype, partials.prompt_key_positions(
                state.prefix_len, x.device)))
        return self._gate(self._attend(q, parts, state.positions, state), gate)

    def forward_replay_sharded(self, x: torch.Tensor, state: AttentionPass):
        return self.linear_proj(self._replay_context_parallel(x, state))

    def forward_capture_sharded(self, x: torch.Tensor, state: AttentionPass):
        """Capture of this rank's load-balanced prompt shard. Its K/V rows become its pages; its
        queries attend every rank's K/V shard in turn (`context_parallel.ring_attention`: never
        more than one shard of keys, O(P / CP)). -> (output [n, 1, hidden], None)"""
        block = state.token_block
        projections = [self._project(x[s:s + block], state.positions[s:s + block])
                       for s in range(0, x.shape[0], block)]
        q, k, v, gate = (torch.cat(parts) for parts in zip(*projections))
        del projections
        self.write_rows(state, KEY, k)
        self.write_rows(state, VALUE, v)
        out, _ = context_parallel.ring_attention(
            state, k, v, lambda src_k, src_v, src_pos: self._attend(
                q, [(src_k, src_v, src_pos)], state.positions, state, return_lse=True))
        return torch.cat([self.linear_proj(self._gate(out[s:s + block], gate[s:s + block]))[0]
                          for s in range(0, x.shape[0], block)]), None

    def _replay_context_parallel(self, x: torch.Tensor, state: AttentionPass) -> torch.Tensor:
        """A branch pass with the prompt pages sharded over CP (`models/context_parallel.py`):
        all branch queries attend over this rank's K/V shard plus the branch's own rows (visible
        on rank 0 only), merged by log-sum-exp to the row owners. -> [c, 1, heads * d]"""
        q, k, v, gate = self._project(x, state.positions)

        def attend(all_q, all_k, all_v):
            parts = [self._page_keys(state, x.device, k.dtype, state.cp.prefix_positions),
                     (all_k, all_v, context_parallel.branch_key_positions(state))]
            return self._attend(all_q, parts, state.cp.branch_positions, state, return_lse=True)

        return self._gate(context_parallel.attend_branch(state, (q, k, v), attend), gate)

    # ---- pieces -----------------------------------------------------------------------------

    def _page_keys(self, state: AttentionPass, device, dtype, positions) -> partials.PageKeys:
        """This layer's K/V pages as a dense attention part at key `positions` (with the exact
        prompt gradient, streamed: each key window's cotangents go to the page buffers)."""
        key_grads = self.key_grads(state, KEY)
        value_grads = self.key_grads(state, VALUE)
        sink = None if key_grads is None else (
            lambda start, end, grad_k, grad_v: (key_grads(start, end, grad_k),
                                                value_grads(start, end, grad_v)))
        return partials.PageKeys(self.read_page(state, KEY, device, dtype, differentiable=False),
                                 self.read_page(state, VALUE, device, dtype, differentiable=False),
                                 positions, sink)

    def _project(self, x: torch.Tensor, positions: torch.Tensor):
        """[s, 1, hidden] -> q [s, heads, d], k, v [s, groups, d] (q, k normed and roped), gate
        [s, heads, d]. Megatron's own split of `linear_qkv` (per group: q heads, gate heads, k, v)."""
        q, k, v, gate = self.get_query_key_value_tensors(x, output_gate=True)
        q, k, v, gate = q[:, 0], k[:, 0], v[:, 0], gate[:, 0]
        return self._rope(q, positions), self._rope(k, positions), v, gate

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE on the first `rotary_dim` dims of each head (half-split pairs, transformers'
        `rotate_half`); the other dims pass through."""
        rotated, passed = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        rotated = select.kernels().apply_rope(rotated, positions, self.rotary_base, interleaved=False)
        return torch.cat([rotated, passed], dim=-1)

    def _attend(self, q, key_parts, q_positions, state, return_lse=False):
        """Per query block over all given keys, in parts of (keys, values, key positions), causal
        by position. -> out [s, heads, d] (and log-sum-exp [s, heads] with `return_lse`)."""
        blocks = []
        for start in range(0, q.shape[0], state.query_block):
            end = min(start + state.query_block, q.shape[0])
            blocks.append(partials.blockwise(q[start:end], key_parts, q_positions[start:end],
                                             self.scale, state.key_block))
        out, lse = (torch.cat(p) for p in zip(*blocks))
        return (out, lse) if return_lse else out

    def _gate(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o * sigmoid(gate) (Megatron's `_apply_output_gate`). [s, heads, d] -> [s, 1, heads * d]"""
        out = out.reshape(out.shape[0], 1, -1)
        return self._apply_output_gate(out, gate)
