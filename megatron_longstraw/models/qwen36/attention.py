"""State-aware gated full attention for Qwen3.6: one set of Megatron weights, three modes.

The module is Megatron-Core's `SelfAttention` with `attention_output_gate` (same submodules, same
parameter names, built from the same spec) as a dense state-aware attention
(`models/dense_attention.py`: the modes, over this family's K/V rows; `models/mixer.py`: the
dispatch), whose math is:

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
from megatron_longstraw.models.dense_attention import DenseStateAttention
from megatron_longstraw.models.qwen36.config import decoder_layer_index
from megatron_longstraw.state.attention_pass import AttentionPass

KEY = "key"      # page kind: K rows [P, groups, head_dim] (after k_norm and RoPE)
VALUE = "value"  # page kind: V rows [P, groups, head_dim]


class LongStrawGatedSelfAttention(DenseStateAttention, SelfAttention):
    """Megatron's gated self-attention as a state-aware mixer (`models/dense_attention.py` runs
    the modes; see the module docstring for the math)."""

    page_kinds = (KEY, VALUE)

    def __init__(self, config, submodules, layer_number: int, rotary_base: float = 10000.0,
                 rotary_percent: float = 1.0, **kwargs):
        if not config.attention_output_gate:
            raise ValueError("Qwen3.6 full attention needs attention_output_gate=True.")
        super().__init__(config, submodules, layer_number, **kwargs)
        self.layer_idx = decoder_layer_index(layer_number)
        self.rotary_base = rotary_base
        self.rotary_dim = int(self.hidden_size_per_attention_head * rotary_percent)
        self.scale = self.hidden_size_per_attention_head ** -0.5

    # Not in the base: the ring holds the shard's q and gate (DeepSeek-V3 holds only its input).
    def forward_capture_sharded(self, x: torch.Tensor, state: AttentionPass):
        """Capture of this rank's load-balanced prompt shard. Its K/V rows become its pages; its
        queries attend every rank's K/V shard in turn (`context_parallel.ring_attention`: never
        more than one shard of keys, O(P / CP)). -> (output [n, 1, hidden], None)"""
        block = state.token_block
        projections = [self._project(x[s:s + block], state.positions[s:s + block])
                       for s in range(0, x.shape[0], block)]
        rows, queries, gates = zip(*projections)
        q = torch.cat(queries)
        k, v = (torch.cat(kind_rows) for kind_rows in zip(*rows))
        gate = torch.cat(gates)
        del projections, rows, queries, gates
        self.write_rows(state, KEY, k)
        self.write_rows(state, VALUE, v)
        out, _ = context_parallel.ring_attention(
            state, k, v, lambda src_k, src_v, src_pos: self._attend(
                q, [(src_k, src_v, src_pos)], state.positions, state, return_lse=True))
        return torch.cat([self._output(out[s:s + block], gate[s:s + block])[0]
                          for s in range(0, x.shape[0], block)]), None

    # ---- the math (hooks of `DenseStateAttention`) ------------------------------------------

    def _project(self, x: torch.Tensor, positions: torch.Tensor):
        """[s, 1, hidden] -> ((k, v) [s, groups, d], q [s, heads, d], gate [s, heads, d]); q, k
        normed and roped. Megatron's own split of `linear_qkv` (per group: q heads, gate heads,
        k, v)."""
        q, k, v, gate = self.get_query_key_value_tensors(x, output_gate=True)
        q, k, v, gate = q[:, 0], k[:, 0], v[:, 0], gate[:, 0]
        q, k = self._rope(q, positions), self._rope(k, positions)
        return (k, v), q, gate

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE on the first `rotary_dim` dims of each head (half-split pairs, transformers'
        `rotate_half`); the other dims pass through."""
        rotated, passed = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        rotated = select.kernels().apply_rope(rotated, positions, self.rotary_base, interleaved=False)
        return torch.cat([rotated, passed], dim=-1)

    def _key_part(self, rows, positions: torch.Tensor):
        keys, values = rows
        return keys, values, positions

    def _keys_values(self, rows):
        return rows

    def _key_value_dims(self) -> tuple[int, int]:
        return self.num_query_groups_per_partition, self.hidden_size_per_attention_head

    def _page_key_grads(self, state: AttentionPass):
        """A key window's K and V cotangents to the KEY and VALUE page buffers (or None)."""
        key_grads = self.key_grads(state, KEY)
        value_grads = self.key_grads(state, VALUE)
        return None if key_grads is None else (
            lambda start, end, grad_k, grad_v: (key_grads(start, end, grad_k),
                                                value_grads(start, end, grad_v)))

    def _kernel(self, q, key_parts, q_positions, key_block):
        return partials.blockwise(q, key_parts, q_positions, self.scale, key_block)

    def _output(self, out: torch.Tensor, gate: torch.Tensor):
        """o * sigmoid(gate) (Megatron's `_apply_output_gate`), then `linear_proj`.
        [s, heads, d] -> (output [s, 1, hidden], bias)"""
        out = out.reshape(out.shape[0], 1, -1)
        return self.linear_proj(self._apply_output_gate(out, gate))
