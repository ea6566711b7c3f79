"""State-aware gated full attention for Qwen3.6: one set of Megatron weights, three modes.

The module is Megatron-Core's `SelfAttention` with `attention_output_gate` (same submodules, same
parameter names, built from the same spec) with `forward` replaced:

    q, gate, k, v = linear_qkv(x)                     GQA: heads / groups query heads per K/V head
    q, k = q_norm(q), k_norm(k)                       zero-centred RMSNorm per head
    q, k = rope(q), rope(k)                           first rotary_percent of each head, half-split
    o = softmax(q k^T / sqrt(d) + causal) v           blockwise over keys, log-sum-exp merge
    out = linear_proj(o * sigmoid(gate))

Which keys exist and which positions the tokens have come from the installed `AttentionPass`
(`state.py`): `full` attends over the current tokens; `capture` also appends each token's K (after
norm and RoPE) and V to the page store and keeps no autograd state; `replay` attends over the
captured prompt pages plus the current tokens. Memory: capture runs token blocks in order (a block's
queries see the keys written so far), so nothing is O(P^2); attention itself runs per query block
and per key block (`BlockwiseAttention`: O(query_block x heads x key_block) scratch, backward
recomputes per block), so replay never holds a [R, heads, P] score matrix. Prompt pages are
constants in replay (`PageStore.leaf` is the hook for the exact prompt-gradient mode).

Context parallelism (DESIGN section 3): each rank captures its load-balanced prompt shard and keeps
its K/V rows as pages; capture streams every shard's K/V past every rank's queries in turn
(broadcast, partial attention, log-sum-exp merge); replay gathers the branch's queries, attends
them over each rank's shard and merges the partial outputs by log-sum-exp, as for GLM-5.2. No head
constraint: GQA groups stay whole on every rank.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.attention import SelfAttention

from megatron_longstraw import parallel
from megatron_longstraw.kernels import select
from megatron_longstraw.kernels.refs import merge_partial_attention
from megatron_longstraw.models.qwen36.config import decoder_layer_index
from megatron_longstraw.parallel import CPLayout
from megatron_longstraw.state import AttentionPass, current_pass

KEY = "key"      # page kind: K rows [P, groups, head_dim] (after k_norm and RoPE)
VALUE = "value"  # page kind: V rows [P, groups, head_dim]


def _scores(q, k, q_pos, k_pos, scale, acc):
    """q [s, g, r, d], k [t, g, d] -> causal scores [s, g, r, t] in `acc` (-inf where masked)."""
    scores = torch.einsum("sgrd,tgd->sgrt", q.to(acc), k.to(acc)) * scale
    if int(k_pos.max()) <= int(q_pos.min()):                            # all visible: no mask
        return scores
    future = k_pos[None, :] > q_pos[:, None]                            # [s, t]
    return scores.masked_fill(future[:, None, None, :], float("-inf"))


def _key_blocks(q_pos, k_pos, key_block):
    """Key blocks [start, end) that at least one query can see (key i visible iff k_pos[i] <= q_pos)."""
    last = int(q_pos.max())
    for start in range(0, k_pos.numel(), key_block):
        end = min(start + key_block, k_pos.numel())
        if int(k_pos[start:end].min()) <= last:
            yield start, end


class BlockwiseAttention(torch.autograd.Function):
    """Causal GQA softmax attention over keys in blocks (online softmax / log-sum-exp merge), with a
    backward that recomputes each block's scores (flash-attention style): saved tensors are the
    inputs, the output and the log-sum-exp, never a [s, heads, t] matrix.

    q: [s, g, r, d] (g K/V groups, r query heads per group), k, v: [t, g, d], q_pos [s], k_pos [t]
    (integer positions; key i is visible to query j iff k_pos[i] <= q_pos[j]). Returns (out
    [s, g, r, d] in q's dtype, log-sum-exp [s, g, r] in float32 or wider), both differentiable (the
    log-sum-exp lets partial results over disjoint key sets merge exactly, as under context
    parallelism). A query with no visible key gets out 0 and log-sum-exp -inf.
    """

    @staticmethod
    def forward(ctx, q, k, v, q_pos, k_pos, scale: float, key_block: int):
        acc = torch.promote_types(q.dtype, torch.float32)
        shape = q.shape[:3]
        row_max = torch.full(shape, float("-inf"), dtype=acc, device=q.device)
        row_sum = torch.zeros(shape, dtype=acc, device=q.device)
        out = torch.zeros(q.shape[:3] + v.shape[-1:], dtype=acc, device=q.device)
        for start, end in _key_blocks(q_pos, k_pos, key_block):
            scores = _scores(q, k[start:end], q_pos, k_pos[start:end], scale, acc)
            new_max = torch.maximum(row_max, scores.amax(-1))
            shift = new_max.nan_to_num(neginf=0.0)                     # rows with nothing visible yet
            probs = torch.exp(scores - shift[..., None])
            rescale = torch.exp(row_max - shift)
            row_sum = row_sum * rescale + probs.sum(-1)
            out = out * rescale[..., None] + torch.einsum("sgrt,tgd->sgrd", probs,
                                                          v[start:end].to(acc))
            row_max = new_max
        out = torch.where(row_sum[..., None] > 0, out / row_sum.clamp_min(1e-300)[..., None], 0.0)
        lse = row_max + row_sum.log()                                   # -inf where nothing visible
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, q_pos, k_pos, out, lse)
        ctx.scale, ctx.key_block = scale, key_block
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, q_pos, k_pos, out, lse = ctx.saved_tensors
        scale, acc = ctx.scale, lse.dtype
        grad_out = grad_out.to(acc)
        q_acc = q.to(acc)
        # d lse / d score = prob, so a log-sum-exp gradient enters like -delta (flash backward).
        delta = (grad_out * out.to(acc)).sum(-1)                        # [s, g, r]
        if grad_lse is not None:
            delta = delta - grad_lse.to(acc).nan_to_num(0.0)
        lse = lse.nan_to_num(neginf=0.0)
        grad_q = torch.zeros_like(q_acc)
        grad_k = torch.zeros(k.shape, dtype=acc, device=k.device) if ctx.needs_input_grad[1] else None
        grad_v = torch.zeros(v.shape, dtype=acc, device=v.device) if ctx.needs_input_grad[2] else None
        for start, end in _key_blocks(q_pos, k_pos, ctx.key_block):
            k_blk, v_blk = k[start:end].to(acc), v[start:end].to(acc)
            probs = torch.exp(_scores(q_acc, k_blk, q_pos, k_pos[start:end], scale, acc)
                              - lse[..., None])                         # [s, g, r, t]
            if grad_v is not None:
                grad_v[start:end] += torch.einsum("sgrt,sgrd->tgd", probs, grad_out)
            grad_scores = probs * (torch.einsum("sgrd,tgd->sgrt", grad_out, v_blk) - delta[..., None])
            grad_q += torch.einsum("sgrt,tgd->sgrd", grad_scores, k_blk) * scale
            if grad_k is not None:
                grad_k[start:end] += torch.einsum("sgrt,sgrd->tgd", grad_scores, q_acc) * scale
        return (grad_q.to(q.dtype), None if grad_k is None else grad_k.to(k.dtype),
                None if grad_v is None else grad_v.to(v.dtype), None, None, None, None)


def blockwise_attention(q, k, v, q_pos, k_pos, scale: float, key_block: int,
                        return_lse: bool = False):
    """q [s, heads, d], k, v [t, groups, d] -> out [s, heads, d], and with `return_lse` also the
    log-sum-exp [s, heads] (see `BlockwiseAttention`)."""
    groups = k.shape[1]
    grouped = q.reshape(q.shape[0], groups, q.shape[1] // groups, q.shape[2])
    out, lse = BlockwiseAttention.apply(grouped, k, v, q_pos, k_pos, scale, key_block)
    out = out.reshape(q.shape[0], q.shape[1], v.shape[-1])
    return (out, lse.reshape(q.shape[0], q.shape[1])) if return_lse else out


class LongStrawGatedSelfAttention(SelfAttention):
    """Megatron's gated self-attention with a capture/replay-aware forward (module docstring)."""

    def __init__(self, config, submodules, layer_number: int, rotary_base: float = 10000.0,
                 rotary_percent: float = 1.0, **kwargs):
        if not config.attention_output_gate:
            raise ValueError("Qwen3.6 full attention needs attention_output_gate=True.")
        super().__init__(config, submodules, layer_number, **kwargs)
        self.layer_idx = decoder_layer_index(layer_number)
        self.rotary_base = rotary_base
        self.rotary_dim = int(self.hidden_size_per_attention_head * rotary_percent)
        self.scale = self.hidden_size_per_attention_head ** -0.5

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **unused_kwargs):
        """hidden_states: [s, 1, hidden] (input-layernormed). Returns (output [s, 1, hidden], bias)."""
        if hidden_states.shape[1] != 1:
            raise ValueError("LongStraw attention processes one sequence at a time (batch 1); got "
                             f"batch {hidden_states.shape[1]}.")
        state = current_pass() or AttentionPass(
            mode="full", positions=torch.arange(hidden_states.shape[0], device=hidden_states.device))
        if state.cp.size > 1:
            if state.mode == "capture":
                return self._capture_context_parallel(hidden_states, state)
            if state.mode == "replay":
                return self.linear_proj(self._replay_context_parallel(hidden_states, state))
            raise ValueError(f"A {state.mode!r} pass has no context-parallel layout; under CP run "
                             "the model through LongStraw capture and replay.")
        if state.mode == "replay":
            return self.linear_proj(self._replay(hidden_states, state))
        if state.mode == "capture" or not torch.is_grad_enabled():
            return self._causal_in_order(hidden_states, state)
        return self.linear_proj(self._full_with_grad(hidden_states, state))

    # ---- modes ------------------------------------------------------------------------------

    def _causal_in_order(self, x: torch.Tensor, state: AttentionPass):
        """No autograd (capture, or a full forward under no_grad): token blocks in order; a block's
        queries attend over the K/V rows written so far (a preallocated buffer). Capture appends
        each block's K/V to the pages. -> (output [s, 1, hidden], None)"""
        num_tokens = x.shape[0]
        keys = values = None
        outputs = []
        for start in range(0, num_tokens, state.token_block):
            end = min(start + state.token_block, num_tokens)
            positions = state.positions[start:end]
            q, k, v, gate = self._project(x[start:end], positions)
            if state.mode == "capture":
                state.pages.append(self.layer_idx, KEY, k)
                state.pages.append(self.layer_idx, VALUE, v)
            if keys is None:
                keys = k.new_empty((num_tokens,) + k.shape[1:])
                values = v.new_empty((num_tokens,) + v.shape[1:])
            keys[start:end], values[start:end] = k, v
            out = self._attend(q, keys[:end], values[:end], positions, state.positions[:end], state)
            outputs.append(self.linear_proj(self._gate(out, gate))[0])
        return torch.cat(outputs), None

    def _full_with_grad(self, x: torch.Tensor, state: AttentionPass) -> torch.Tensor:
        """The whole sequence under autograd (the full-sequence reference). -> [s, 1, heads * d]"""
        q, k, v, gate = self._project(x, state.positions)
        return self._gate(self._attend(q, k, v, state.positions, state.positions, state), gate)

    def _replay(self, x: torch.Tensor, state: AttentionPass) -> torch.Tensor:
        """The branch's queries over the captured pages plus its own rows. -> [s, 1, heads * d]"""
        q, k, v, gate = self._project(x, state.positions)
        keys, values, key_positions = k, v, state.positions
        if state.prefix_len > 0:
            read = state.pages.leaf if state.prompt_state_grad else state.pages.fetch
            keys = torch.cat([read(self.layer_idx, KEY, x.device).to(k.dtype), k])
            values = torch.cat([read(self.layer_idx, VALUE, x.device).to(v.dtype), v])
            key_positions = torch.cat([torch.arange(state.prefix_len, device=x.device),
                                       state.positions])
        return self._gate(self._attend(q, keys, values, state.positions, key_positions, state), gate)

    def _capture_context_parallel(self, x: torch.Tensor, state: AttentionPass):
        """Capture of this rank's load-balanced prompt shard (DESIGN section 3). Its K/V rows become
        its pages; its queries need every earlier prompt key, on every rank: each rank's K/V shard
        is broadcast in turn and the queries' partial attention over it merges into a running
        (output, log-sum-exp), so no rank ever holds more than one shard of keys (O(P / CP)).
        -> (output [n, 1, hidden], None)"""
        cp, block = state.cp, state.token_block
        projections = [self._project(x[s:s + block], state.positions[s:s + block])
                       for s in range(0, x.shape[0], block)]
        q, k, v, gate = (torch.cat(parts) for parts in zip(*projections))
        del projections
        state.pages.append(self.layer_idx, KEY, k)
        state.pages.append(self.layer_idx, VALUE, v)
        shards = [CPLayout(None, cp.size, r).prompt_positions(state.global_len, x.device)
                  for r in range(cp.size)]
        rows = max(p.numel() for p in shards)
        out = lse = None
        for src in range(cp.size):
            src_k = parallel.broadcast_rows(k, src, rows, cp)
            src_v = parallel.broadcast_rows(v, src, rows, cp)
            # Padding rows get a position after every query: never visible.
            src_pos = parallel.broadcast_rows(state.positions, src, rows, cp, fill=state.global_len)
            part_out, part_lse = self._attend(q, src_k, src_v, state.positions, src_pos, state,
                                              return_lse=True)
            if out is None:
                out, lse = part_out, part_lse
            else:
                out, lse = merge_partial_attention([out, part_out], [lse, part_lse])
        return torch.cat([self.linear_proj(self._gate(out[s:s + block], gate[s:s + block]))[0]
                          for s in range(0, x.shape[0], block)]), None

    def _replay_context_parallel(self, x: torch.Tensor, state: AttentionPass) -> torch.Tensor:
        """Replay with the prompt pages sharded over CP. This rank owns rows [start, end) of the
        (padded) branch. The branch's queries, keys and values are gathered; each rank attends all
        branch queries over its own prompt shard, and rank 0 over the branch's own rows as well (on
        the other ranks those rows get positions no query sees, so they count once while every rank
        keeps the same autograd graph, and so the same backward collectives); the partial outputs
        merge by log-sum-exp and each rank keeps its rows. -> [c, 1, heads * d]"""
        cp = state.cp
        q, k, v, gate = self._project(x, state.positions)
        all_q, all_k, all_v = (parallel.gather_rows(t, cp) for t in (q, k, v))
        branch_positions = state.branch_positions
        if cp.rank != 0:
            branch_positions = torch.full_like(branch_positions,
                                               state.prefix_len + state.branch_len)
        read = state.pages.leaf if state.prompt_state_grad else state.pages.fetch
        keys = torch.cat([read(self.layer_idx, KEY, x.device).to(k.dtype), all_k])
        values = torch.cat([read(self.layer_idx, VALUE, x.device).to(v.dtype), all_v])
        key_positions = torch.cat([state.prefix_positions, branch_positions])
        out, lse = self._attend(all_q, keys, values, state.branch_positions, key_positions, state,
                                return_lse=True)
        return self._gate(parallel.merge_partials_by_lse(out, lse, cp), gate)

    # ---- pieces -----------------------------------------------------------------------------

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

    def _attend(self, q, keys, values, q_positions, key_positions, state, return_lse=False):
        """Per query block over all given keys (causal by position). -> out [s, heads, d] (and
        log-sum-exp [s, heads] with `return_lse`)."""
        parts = []
        for start in range(0, q.shape[0], state.query_block):
            end = min(start + state.query_block, q.shape[0])
            parts.append(blockwise_attention(q[start:end], keys, values, q_positions[start:end],
                                             key_positions, self.scale, state.key_block,
                                             return_lse=return_lse))
        if return_lse:
            return tuple(torch.cat(p) for p in zip(*parts))
        return torch.cat(parts)

    def _gate(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o * sigmoid(gate) (Megatron's `_apply_output_gate`). [s, heads, d] -> [s, 1, heads * d]"""
        out = out.reshape(out.shape[0], 1, -1)
        return self._apply_output_gate(out, gate)
