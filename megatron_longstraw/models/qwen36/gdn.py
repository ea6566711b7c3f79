"""State-aware Gated DeltaNet for Qwen3.6: one set of Megatron weights, three modes.

The module is Megatron-Core's `GatedDeltaNet` (same submodules, same parameter names: `in_proj`
rows [q; k; v; z; beta; alpha], depthwise `conv1d` over [q; k; v], `A_log`, `dt_bias`, `out_norm`,
`out_proj`) with `forward` replaced. Per token t and value head h (q, k l2-normalised, q scaled by
d_k^-1/2; S is the recurrent state [d_k, d_v] of head h):

    qkv_t    = silu(conv1d([qkv_{t-3}; ..; qkv_t]))      causal conv, kernel 4, pre-activation inputs
    g_t      = -exp(A_log) * softplus(alpha_t + dt_bias),  beta_t = sigmoid(beta_t)
    S_t      = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T
    o_t      = S_t^T q_t,   out_t = out_proj(out_norm(o_t) * silu(z_t))

Everything a later token reads from earlier ones is therefore (S, the last kernel - 1 conv inputs):
fixed-size, whatever the prompt length. `capture` runs the prompt in token blocks, carrying that
pair from block to block, and stores only the final pair per layer (`PageStore.put`: kinds
`gdn_state` [H_v, d_k, d_v] and `conv_tail` [kernel - 1, conv_dim]); `replay` starts the branch from
it (conv over [tail; branch], recurrence with `initial_state`); `full` starts from zeros (exactly
Megatron's zero-padded conv and zero initial state). The recurrence is Megatron's chosen kernel
(`self.gated_delta_rule`: FLA's chunk kernel on GPU, Megatron's PyTorch chunk implementation on CPU,
see platform.py entry 6), which accepts an initial state and returns the final one.

Context parallelism (Megatron's own GDN CP scheme): the recurrence is sequential in tokens but
independent across heads, so `in_proj`'s output goes from this rank's rows of every head to every
row of this rank's heads (`collectives.HeadParallel`, an all-to-all after Megatron's head permutation
`_build_head_perm_for_split_sections`), the conv and the recurrence run over the whole sequence in
position order for H_v / CP value heads (and their H_k / CP query/key heads) with this rank's slice
of `conv1d`, `A_log` and `dt_bias` (`get_parameter_local_cp`), and the gated-norm output goes back
to rows before `out_proj`. Per head the computation is the one-process computation, so the state is
exact across shards. Capture keeps this rank's heads' state and conv channels (the pages shard by
heads: 1 / CP of the state per rank); replay exchanges the branch the same way and continues from
them. CP must divide the query/key heads (checked when the model is built).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.ssm.gated_delta_net import GatedDeltaNet
from megatron.core.ssm.gated_delta_net.common import (
    _build_head_perm_for_split_sections,
    get_parameter_local_cp,
)

from megatron_longstraw.models.mixer import StateAwareMixer
from megatron_longstraw.models.qwen36.config import decoder_layer_index
from megatron_longstraw.distributed.collectives import HeadParallel
from megatron_longstraw.kernels import refs
from megatron_longstraw.runtime.memory import note_host
from megatron_longstraw.state.attention_pass import AttentionPass

GDN_STATE = "gdn_state"  # fixed page kind: recurrent state [H_v, d_k, d_v] after the prefix
CONV_TAIL = "conv_tail"  # fixed page kind: last kernel - 1 conv inputs [kernel - 1, conv_dim]
STAGED = "gdn"           # streamed capture under CP: the host buffer of the exchange


RECURRENT_MAX_TOKENS = 8
"""Up to this many tokens per call, on CPU, the delta rule runs token by token (`_mix`)."""


class LongStrawGatedDeltaNet(StateAwareMixer, GatedDeltaNet):
    """Megatron's Gated DeltaNet as a state-aware mixer (`models/mixer.py` dispatches the modes;
    see the module docstring for the math)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.layer_idx = decoder_layer_index(self.layer_number)

    def forward_full(self, x: torch.Tensor, state: AttentionPass):
        """From zero state (Megatron's zero-padded conv and zero initial state)."""
        return self._continue(x, state, *self._zero_state(x))

    carried_kinds = (GDN_STATE, CONV_TAIL)   # the blockwise prompt backward carries these

    def forward_capture(self, x: torch.Tensor, state: AttentionPass):
        return self._capture(x, state, self._exchange(x, state)), None

    def _keep_boundary(self, state: AttentionPass, conv_tail, recurrent) -> None:
        """The exact gradient: the carried state at a token block's start, in the pages' storage
        (host memory), for the prompt backward to restart the block from."""
        def keep(tensor):
            return None if tensor is None else note_host(
                tensor.to(state.pages.storage_device, copy=True))

        state.boundaries.setdefault(self.layer_idx, []).append(
            {CONV_TAIL: keep(conv_tail), GDN_STATE: keep(recurrent)})

    def forward_capture_block(self, x: torch.Tensor, state: AttentionPass):
        """One token block of the prompt (streamed capture, one process), continuing from the
        (conv tail, state) the previous block stored in the pages (zeros at the first block);
        the block's end state replaces them there."""
        if state.block_start == 0:
            conv_tail, recurrent = self._zero_state(x)
        else:
            conv_tail = self.read_page(state, CONV_TAIL, x.device, x.dtype)
            recurrent = self.read_page(state, GDN_STATE, x.device)[None]
        if state.boundaries is not None:   # the exact gradient restarts each block here
            self._keep_boundary(state, conv_tail, recurrent)
        mixed, conv_tail, recurrent = self._mix(self.in_proj(x)[0], conv_tail, recurrent, True)
        self.write_state(state, GDN_STATE, recurrent[0])
        self.write_state(state, CONV_TAIL, conv_tail)
        return self.out_proj(mixed)

    def forward_capture_rows(self, x: torch.Tensor, state: AttentionPass):
        """Streamed capture under CP, a layer's first phase: the block's mixer input into a host
        buffer of this rank's rows (`capture_exchange` runs the recurrence over it)."""
        staged = state.streamed.buffer(STAGED, (state.streamed.local_len,) + tuple(x.shape[1:]),
                                       x.dtype)
        staged[state.block_start:state.block_start + x.shape[0]].copy_(x)
        return torch.zeros_like(x), None

    def capture_exchange(self, state: AttentionPass) -> None:
        """Streamed capture under CP (collective): one global token block at a time, in order,
        every rank's rows of the block go to this rank's heads (`HeadParallel`), the recurrence
        continues from the carried (conv tail, state), and the outputs go back to their rows and
        through `out_proj` into the host buffer, in place of the block's inputs. The final pair is
        this rank's heads' pages. The blocks are one process's token blocks, so each head runs
        the one-process computation."""
        streamed, layout, total = state.streamed, state.cp.layout, state.cp.global_len
        staged = streamed.buffer(STAGED)
        device = state.positions.device
        conv_tail = recurrent = None
        for start in range(0, total, state.token_block):
            end = min(start + state.token_block, total)
            lo, hi = layout.shard_rows_within(total, start, end)
            rows = staged[lo:hi].to(device)
            if conv_tail is None:
                conv_tail, recurrent = self._zero_state(rows)
            exchange = HeadParallel.for_prompt_block(layout, total, start, end, device)
            projected = self._to_heads(self.in_proj(rows)[0], exchange)
            mixed, conv_tail, recurrent = self._mix(projected, conv_tail, recurrent, True)
            out, streamed.bias = self.out_proj(self._to_rows(mixed, exchange))
            staged[lo:hi].copy_(out)
        self.write_state(state, GDN_STATE, recurrent[0])
        self.write_state(state, CONV_TAIL, conv_tail)

    def forward_capture_block_sharded(self, x: torch.Tensor, state: AttentionPass):
        """Streamed capture under CP: the block's mixer output, computed by `capture_exchange`."""
        rows = state.streamed.buffer(STAGED)[state.block_start:state.block_start + x.shape[0]]
        return rows.to(x.device), state.streamed.bias

    def forward_prompt_backward(self, x: torch.Tensor, state: AttentionPass):
        """One token block of the prompt under autograd (one process), continuing from the state
        at its start (`state.carried`: what capture kept at that block boundary; None at the
        first block: zeros); the state at its end (recurrent state and conv tail, what capture
        carries to the next block and finally stores) goes to `emit`."""
        carried = state.carried or {}
        conv_tail, recurrent = carried.get(CONV_TAIL), carried.get(GDN_STATE)
        if conv_tail is None:
            conv_tail, recurrent = self._zero_state(x)
        mixed, conv_tail, recurrent = self._mix(self.in_proj(x)[0], conv_tail, recurrent, True)
        self.emit(state, GDN_STATE, recurrent[0])
        self.emit(state, CONV_TAIL, conv_tail)
        return self.out_proj(mixed)

    def forward_prompt_backward_sharded(self, x: torch.Tensor, state: AttentionPass):
        """The prompt under autograd from zero state, every row of this rank's heads through the
        differentiable rows <-> heads exchange (CP); the state after it (recurrent state and conv
        tail of this rank's heads, what capture stores) goes to `emit`."""
        exchange = self._exchange(x, state)
        conv_tail, recurrent = self._zero_state(x)
        projected = self._to_heads(self.in_proj(x)[0], exchange)
        mixed, conv_tail, recurrent = self._mix(projected, conv_tail, recurrent, True)
        self.emit(state, GDN_STATE, recurrent[0])
        self.emit(state, CONV_TAIL, conv_tail)
        return self.out_proj(self._to_rows(mixed, exchange))

    def forward_replay(self, x: torch.Tensor, state: AttentionPass):
        """From the state at the branch's start: the captured prefix's (zeros when nothing was
        captured), or for a later block of a blockwise branch the state the earlier blocks
        carried to it (`earlier_pass`); such a block hands its end state to `emit_branch`."""
        source = self.earlier_pass(state) or (state if state.prefix_len > 0 else None)
        if source is None:
            conv_tail, recurrent = self._zero_state(x)
        else:
            conv_tail = self.read_page(source, CONV_TAIL, x.device, x.dtype)
            recurrent = self.read_page(source, GDN_STATE, x.device)[None]
        return self._continue(x, state, conv_tail, recurrent)

    def forward_decode(self, x: torch.Tensor, state: AttentionPass):
        """The step's rows by member (`decode.DecodeCache.segments`: a new token, or a block of an
        observation's ids), each segment continuing its member's (conv tail, state): the
        prompt's at the first step, its own afterwards (a block: the chunked rule over it).
        Under CP every rank runs the same rows for its heads (the pages hold its heads' state)
        and the heads' outputs are gathered before `out_proj`."""
        projected = self.in_proj(x)[0]
        if state.cp.size > 1:   # the same rows on every rank: keep this rank's heads' columns
            head_perm = _build_head_perm_for_split_sections(self.in_proj_split_sections,
                                                            self.cp_size, projected.device)
            columns = projected[:, 0].index_select(-1, head_perm)
            projected = columns.chunk(state.cp.size, dim=-1)[state.cp.rank][:, None]
        outputs = []
        for segment in range(len(state.decode.segments)):
            conv_tail = state.decode.carried(segment, self.layer_idx, CONV_TAIL)
            recurrent = state.decode.carried(segment, self.layer_idx, GDN_STATE)
            if conv_tail is None:
                if state.prefix_len > 0:
                    conv_tail = self.read_page(state, CONV_TAIL, x.device, x.dtype)
                    recurrent = self.read_page(state, GDN_STATE, x.device)[None]
                else:
                    conv_tail, recurrent = self._zero_state(x)
            mixed, conv_tail, recurrent = self._mix(projected[state.decode.rows(segment)],
                                                    conv_tail, recurrent, True)
            # the tail is a view of [tail; rows]: kept alone, not with a block's rows
            state.decode.carry(segment, self.layer_idx, CONV_TAIL, conv_tail.clone())
            state.decode.carry(segment, self.layer_idx, GDN_STATE, recurrent)
            outputs.append(mixed)
        mixed = torch.cat(outputs)
        if state.cp.size > 1:   # every head's output, rank-major as `_to_rows` orders them
            parts = [torch.empty_like(mixed) for _ in range(state.cp.size)]
            torch.distributed.all_gather(parts, mixed.contiguous(), group=state.cp.group)
            mixed = torch.cat(parts, dim=-1)
        return self.out_proj(mixed)

    def _continue(self, x: torch.Tensor, state: AttentionPass, conv_tail, recurrent):
        """The branch (or whole sequence, or one block of a blockwise branch) continuing from
        (conv_tail, recurrent); a block's end state goes to `emit_branch`."""
        exchange = self._exchange(x, state)
        projected = self._to_heads(self.in_proj(x)[0], exchange)
        keep = state.branch is not None
        mixed, conv_tail, recurrent = self._mix(projected, conv_tail, recurrent, keep)
        if keep:
            self.emit_branch(state, CONV_TAIL, conv_tail)
            self.emit_branch(state, GDN_STATE, recurrent[0])
        return self.out_proj(self._to_rows(mixed, exchange))

    def _capture(self, x: torch.Tensor, state: AttentionPass, exchange) -> torch.Tensor:
        """Run the prompt (this rank's rows) carrying (conv tail, state) from token block to block;
        store the final pair. On one process everything is per token block; under CP the exchange
        needs this rank's whole `in_proj` output (the size of its shard of the prompt)."""
        block = state.token_block
        conv_tail, recurrent = self._zero_state(x)
        blocks = range(0, x.shape[0], block)
        if exchange is None:
            outputs = []
            for start in blocks:
                if state.boundaries is not None:   # the exact gradient restarts each block here
                    self._keep_boundary(state, conv_tail, recurrent)
                mixed, conv_tail, recurrent = self._mix(self.in_proj(x[start:start + block])[0],
                                                        conv_tail, recurrent, True)
                outputs.append(self.out_proj(mixed)[0])
        else:
            projected = self._to_heads(torch.cat([self.in_proj(x[s:s + block])[0] for s in blocks]),
                                       exchange)                   # [P, 1, in_proj_dim / CP]
            mixed = []
            for start in range(0, projected.shape[0], block):
                out, conv_tail, recurrent = self._mix(projected[start:start + block], conv_tail,
                                                      recurrent, True)
                mixed.append(out)
            mixed = self._to_rows(torch.cat(mixed), exchange)     # [n_local, 1, H_v * d_v]
            del projected
            outputs = [self.out_proj(mixed[s:s + block])[0] for s in blocks]
        self.write_state(state, GDN_STATE, recurrent[0])
        self.write_state(state, CONV_TAIL, conv_tail)
        return torch.cat(outputs)

    def _exchange(self, x: torch.Tensor, state: AttentionPass) -> HeadParallel | None:
        """The rows <-> heads exchange of this pass under CP (None on one process)."""
        cp = state.cp
        if cp.size == 1:
            return None
        if state.mode in ("capture", "prompt_backward"):
            return HeadParallel.for_prompt(cp.layout, cp.global_len, x.device)
        return HeadParallel.for_branch(cp.layout, cp.branch_len, x.device)

    def _to_heads(self, projected: torch.Tensor, exchange: HeadParallel | None) -> torch.Tensor:
        """`in_proj` output [n, 1, in_proj_dim] -> [S, 1, in_proj_dim / CP]: every row of this
        rank's heads, sections [q; k; v; z; beta; alpha] as `feat_dim_split` expects."""
        if exchange is None:
            return projected
        head_perm = _build_head_perm_for_split_sections(self.in_proj_split_sections, self.cp_size,
                                                        projected.device)
        return exchange.to_heads(projected[:, 0].index_select(-1, head_perm))[:, None]

    def _to_rows(self, mixed: torch.Tensor, exchange: HeadParallel | None) -> torch.Tensor:
        """Gated-norm output [S, 1, H_v / CP * d_v] -> this rank's rows [n, 1, H_v * d_v]."""
        if exchange is None:
            return mixed
        return exchange.to_rows(mixed[:, 0])[:, None]

    def _zero_state(self, x: torch.Tensor):
        """(conv tail [kernel - 1, conv_dim / CP] of zeros, recurrent state None: the kernel's
        zeros) before the first token."""
        return x.new_zeros(self.conv_kernel_dim - 1, self.conv_dim_local_tp // self.cp_size), None

    def _mix(self, qkvzba: torch.Tensor, conv_tail: torch.Tensor, recurrent, keep_state: bool):
        """The mixer on `in_proj` output [n, 1, in_proj_dim / CP] (this rank's heads) continuing
        from (conv_tail, recurrent). Returns (gated-normed core output [n, 1, H_v / CP * d_v], new
        conv tail, new state or None)."""
        num_tokens = qkvzba.shape[0]
        cp_group = self.pg_collection.cp
        qkvzba = qkvzba.transpose(0, 1)                                    # [1, n, in_proj_dim]
        qkv, gate, beta, alpha = torch.split(qkvzba, self.feat_dim_split, dim=-1)
        gate = gate.reshape(1, num_tokens, -1, self.value_head_dim)

        # Causal depthwise conv over [tail; current] (no padding): row t sees inputs t-3 .. t.
        conv_in = torch.cat([conv_tail[None].to(qkv.dtype), qkv], dim=1)   # [1, k - 1 + n, conv_dim]
        new_tail = conv_in[0, conv_in.shape[1] - (self.conv_kernel_dim - 1):]
        sections = [self.qk_dim_local_tp, self.qk_dim_local_tp, self.v_dim_local_tp]
        weight = get_parameter_local_cp(self.conv1d.weight, 0, cp_group, sections)
        bias = (get_parameter_local_cp(self.conv1d.bias, 0, cp_group, sections)
                if self.conv_bias else None)
        conv_out = F.conv1d(conv_in.transpose(1, 2), weight, bias,
                            groups=self.conv_dim_local_tp // self.cp_size)  # [1, conv_dim, n]
        qkv = self.act_fn(conv_out).transpose(1, 2)                        # [1, n, conv_dim]

        query, key, value, gate, beta, alpha = self._prepare_input_for_gated_delta_rule(
            qkv, gate, 1, num_tokens, beta, alpha)
        g, beta = self._compute_g_and_beta(get_parameter_local_cp(self.A_log, 0, cp_group),
                                           get_parameter_local_cp(self.dt_bias, 0, cp_group),
                                           alpha, beta)
        # A few tokens on CPU (decode steps, short branches): the same rule token by token,
        # without the chunked form's 64-token padding (refs.recurrent_gated_delta_rule).
        rule = (refs.recurrent_gated_delta_rule
                if num_tokens <= RECURRENT_MAX_TOKENS and not query.is_cuda
                else self.gated_delta_rule)
        core, final_state = rule(
            query, key, value, g=g, beta=beta, initial_state=recurrent,
            output_final_state=keep_state, use_qk_l2norm_in_kernel=False)
        normed = self._apply_gated_norm(core, gate)                         # [n * H_v, d_v]
        mixed = normed.reshape(1, num_tokens, -1).transpose(0, 1)          # [n, 1, H_v * d_v]
        return mixed, new_tail, final_state
