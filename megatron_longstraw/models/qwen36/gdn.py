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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.ssm.gated_delta_net import GatedDeltaNet

from megatron_longstraw.models.qwen36.config import decoder_layer_index
from megatron_longstraw.state import AttentionPass, current_pass

GDN_STATE = "gdn_state"  # fixed page kind: recurrent state [H_v, d_k, d_v] after the prefix
CONV_TAIL = "conv_tail"  # fixed page kind: last kernel - 1 conv inputs [kernel - 1, conv_dim]


class LongStrawGatedDeltaNet(GatedDeltaNet):
    """Megatron's Gated DeltaNet with a capture/replay-aware forward (see module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.layer_idx = decoder_layer_index(self.layer_number)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **unused_kwargs):
        """hidden_states: [s, 1, hidden] (input-layernormed). Returns (output [s, 1, hidden], bias)."""
        if hidden_states.shape[1] != 1:
            raise ValueError("LongStraw GDN processes one sequence at a time (batch 1); got batch "
                             f"{hidden_states.shape[1]}.")
        state = current_pass()
        if (state is not None and state.cp.size > 1) or self.cp_size > 1 or self.tp_size > 1:
            raise ValueError("Qwen3.6 GDN layers run with context and tensor parallel size 1 in "
                             "this version (build_qwen36_model rejects other layouts).")
        conv_tail, recurrent = self._start_state(hidden_states, state)
        if state is not None and state.mode == "capture":
            outputs = []
            for start in range(0, hidden_states.shape[0], state.token_block):
                block = hidden_states[start:start + state.token_block]
                mixed, conv_tail, recurrent = self._mix(block, conv_tail, recurrent, True)
                outputs.append(self.out_proj(mixed)[0])
            state.pages.put(self.layer_idx, GDN_STATE, recurrent[0])
            state.pages.put(self.layer_idx, CONV_TAIL, conv_tail)
            return torch.cat(outputs), None
        mixed, _, _ = self._mix(hidden_states, conv_tail, recurrent, False)
        return self.out_proj(mixed)

    def _start_state(self, x: torch.Tensor, state: AttentionPass | None):
        """(conv tail [kernel - 1, conv_dim], recurrent state [1, H_v, d_k, d_v] or None) before the
        current tokens: the captured prefix's in replay, zeros (None: the kernel's zeros) otherwise."""
        if state is not None and state.mode == "replay" and state.prefix_len > 0:
            read = state.pages.leaf if state.prompt_state_grad else state.pages.fetch
            tail = read(self.layer_idx, CONV_TAIL, x.device).to(x.dtype)
            return tail, read(self.layer_idx, GDN_STATE, x.device)[None]
        return x.new_zeros(self.conv_kernel_dim - 1, self.conv_dim_local_tp), None

    def _mix(self, x: torch.Tensor, conv_tail: torch.Tensor, recurrent, keep_state: bool):
        """The mixer on [n, 1, hidden] continuing from (conv_tail, recurrent). Returns (gated-normed
        core output [n, 1, H_v * d_v] for `out_proj`, new conv tail, new state or None)."""
        num_tokens = x.shape[0]
        qkvzba, _ = self.in_proj(x)
        qkvzba = qkvzba.transpose(0, 1)                                    # [1, n, in_proj_dim]
        qkv, gate, beta, alpha = torch.split(qkvzba, self.feat_dim_split, dim=-1)
        gate = gate.reshape(1, num_tokens, -1, self.value_head_dim)

        # Causal depthwise conv over [tail; current] (no padding): row t sees inputs t-3 .. t.
        conv_in = torch.cat([conv_tail[None].to(qkv.dtype), qkv], dim=1)   # [1, k - 1 + n, conv_dim]
        new_tail = conv_in[0, conv_in.shape[1] - (self.conv_kernel_dim - 1):]
        conv_out = F.conv1d(conv_in.transpose(1, 2), self.conv1d.weight, self.conv1d.bias,
                            groups=self.conv_dim_local_tp)                 # [1, conv_dim, n]
        qkv = self.act_fn(conv_out).transpose(1, 2)                        # [1, n, conv_dim]

        query, key, value, gate, beta, alpha = self._prepare_input_for_gated_delta_rule(
            qkv, gate, 1, num_tokens, beta, alpha)
        g, beta = self._compute_g_and_beta(self.A_log, self.dt_bias, alpha, beta)
        core, final_state = self.gated_delta_rule(
            query, key, value, g=g, beta=beta, initial_state=recurrent,
            output_final_state=keep_state, use_qk_l2norm_in_kernel=False)
        normed = self._apply_gated_norm(core, gate)                         # [n * H_v, d_v]
        mixed = normed.reshape(1, num_tokens, -1).transpose(0, 1)          # [n, 1, H_v * d_v]
        return mixed, new_tail, final_state
