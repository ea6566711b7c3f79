"""Float64 reference precision: the Megatron-Core functions that compute in float32 whatever the
model's dtype, kept in float64 when the model is float64 (parity tests, reference scoring).

Whoever builds a float64 model calls `use_dtype(dtype)` first (the launcher, the tools, the tests'
builders); it does nothing for any other dtype, so bf16 and fp32 runs use Megatron's functions
unmodified. Each switch names the Megatron-Core 0.19.2 function it covers, why it is needed, and why
results are unchanged. `chunk_gated_delta_rule_fp64` is also the fp64 reference of the GDN kernel
parity checks (kernels/parity.py).
"""

from __future__ import annotations

import torch

from megatron_longstraw.runtime import platform
from megatron_longstraw.runtime.norms import l2norm


def use_dtype(dtype: torch.dtype) -> None:
    """Install the float64 switches below when the model about to be built is float64 (a no-op
    for every other dtype). Call before building the model: GatedDeltaNet picks its delta-rule
    function when it is constructed."""
    if dtype != torch.float64:
        return
    enable_fp64_routing()
    enable_fp64_gdn()


def check_dtype(dtype: torch.dtype) -> None:
    """Refuse to build a float64 model before `use_dtype(torch.float64)`: it would silently compute
    Megatron's float32 islands and miss fp64 parity tolerances by orders of magnitude."""
    if dtype == torch.float64 and not (_FP64_ROUTING and _FP64_GDN):
        raise RuntimeError("A float64 model needs precision.use_dtype(torch.float64) before it is "
                           "built (it keeps MoE routing and Gated DeltaNet in float64).")


_FP64_ROUTING = False


def enable_fp64_routing() -> None:
    """Keep MoE sigmoid routing in float64 when the model runs in float64 (reference precision).

    Megatron-Core 0.19.2 `moe_utils.topk_routing_with_score_function` computes sigmoid scores as
    `torch.sigmoid(logits.float())`, whatever the logits' dtype. In a float64 model that rounds the
    routing weights to float32 (~6e-8 relative), so two float64 computations of the same token that
    differ in the last bit of a logit can differ by ~1e-10 downstream: too coarse for fp64 parity
    tests. This wrapper applies only to float64 logits with sigmoid scores and no precomputed
    indices, and computes exactly Megatron's formula (top-k of sigmoid + expert_bias,
    group-limited by Megatron's own `group_limited_topk` when `group_topk` is set, as DeepSeek-V3
    routes; weights sigmoid at the chosen experts normalised and scaled) in float64. A router's
    `RouterReplay` (routing replay, routing_replay.py) picks the experts as in Megatron: its
    `get_replay_topk` with the same default top-k; without one the operations are the same as
    before.
    Everything else, bf16 and fp32 training included, calls Megatron's function unchanged.
    """
    global _FP64_ROUTING
    if _FP64_ROUTING:
        return
    _FP64_ROUTING = True
    from megatron.core.transformer.moe import moe_utils, router

    original = moe_utils.topk_routing_with_score_function

    def routing(logits, topk, use_pre_softmax=False, num_groups=None, group_topk=None,
                scaling_factor=None, score_function="softmax", expert_bias=None, fused=False,
                router_replay=None, dense_output=False, precomputed_indices=None):
        if (logits.dtype != torch.float64 or score_function != "sigmoid" or fused
                or precomputed_indices is not None):
            return original(logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor,
                            score_function, expert_bias, fused, router_replay, dense_output,
                            precomputed_indices)
        scores = torch.sigmoid(logits)
        choice = scores + expert_bias.to(scores.dtype) if expert_bias is not None else scores

        def compute_topk(scores, k, num_groups=None, group_topk=None):
            if group_topk:  # group-limited (DeepSeek-V3): Megatron's function, float64 in and out
                return moe_utils.group_limited_topk(scores, k, scores.shape[0], scores.shape[1],
                                                    num_groups, group_topk)
            return torch.topk(scores, k=k, dim=1)

        if router_replay is None:
            _, top_indices = compute_topk(choice, topk, num_groups, group_topk)
        else:  # Megatron's router replay (record / replay the chosen experts)
            _, top_indices = router_replay.get_replay_topk(choice, topk, num_groups, group_topk,
                                                           compute_topk)
        probs = scores.gather(1, top_indices)
        probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else probs
        if scaling_factor:
            probs = probs * scaling_factor
        if dense_output:
            return probs, top_indices
        routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
        routing_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
        return routing_probs, routing_map

    router.topk_routing_with_score_function = routing


def chunk_gated_delta_rule_fp64(q, k, v, g, beta, chunk_size=64, initial_state=None,
                                output_final_state=False, use_qk_l2norm_in_kernel=False,
                                cu_seqlens=None):
    """Megatron-Core 0.19.2 `torch_chunk_gated_delta_rule` with every step in float64 (the original
    casts q, k, v, g, beta, the decay mask and the state to float32). Same arguments, same chunked
    algorithm, same order of operations; returns (out [b, s, H_v, d_v] float64, final state
    [b, H_v, d_k, d_v] float64 or None)."""
    import torch.nn.functional as F

    assert cu_seqlens is None, "cu_seqlens is not supported by torch_chunk_gated_delta_rule."
    f64 = torch.float64
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q, k, v, beta, g = [x.transpose(1, 2).contiguous().to(f64) for x in (q, k, v, beta, g)]
    batch, heads, length, k_dim = k.shape
    v_dim = v.shape[-1]
    pad = (chunk_size - length % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    q = q * k_dim ** -0.5
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, v, k_beta, v_beta = (x.reshape(batch, heads, -1, chunk_size, x.shape[-1])
                               for x in (q, k, v, k_beta, v_beta))
    g = g.reshape(batch, heads, -1, chunk_size).cumsum(dim=-1)
    upper = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device), 0)
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).tril().exp().tril()
    attn = -((k_beta @ k.transpose(-1, -2)) * decay).masked_fill(upper, 0)
    for i in range(1, chunk_size):
        row, sub = attn[..., i, :i].clone(), attn[..., :i, :i].clone()
        attn[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
    attn = attn + torch.eye(chunk_size, dtype=f64, device=q.device)
    v = attn @ v_beta
    k_cumdecay = attn @ (k_beta * g.exp().unsqueeze(-1))
    state = (torch.zeros(batch, heads, k_dim, v_dim, dtype=f64, device=q.device)
             if initial_state is None else initial_state.to(f64))
    out = torch.zeros_like(v)
    strict_upper = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device), 1)
    for i in range(g.shape[2]):
        q_i, k_i, v_i = q[:, :, i], k[:, :, i], v[:, :, i]
        attn_i = (q_i @ k_i.transpose(-1, -2) * decay[:, :, i]).masked_fill_(strict_upper, 0)
        v_new = v_i - k_cumdecay[:, :, i] @ state
        out[:, :, i] = (q_i * g[:, :, i, :, None].exp()) @ state + attn_i @ v_new
        state = (state * g[:, :, i, -1, None, None].exp()
                 + (k_i * (g[:, :, i, -1, None] - g[:, :, i]).exp()[..., None]).transpose(-1, -2)
                 @ v_new)
    out = out.reshape(batch, heads, -1, v_dim)[:, :, :length].transpose(1, 2).contiguous()
    return out, (state if output_final_state else None)


_FP64_GDN = False


def enable_fp64_gdn() -> None:
    """Keep Gated DeltaNet and the gated attention's output gate in float64 when the model runs in
    float64 (reference precision for parity tests).

    Megatron-Core 0.19.2 computes these pieces in float32 whatever the input dtype:
    `gated_delta_net.common.torch_chunk_gated_delta_rule` (casts q, k, v, g, beta and the state to
    float32; FLA's chunk kernel does the same), `_GDNBase._compute_g_and_beta` (`alpha.float()`),
    `_GDNBase._apply_gated_norm` (`gate.float()`) and `Attention._apply_output_gate`
    (`gate.float()`). In a float64 model that rounds to ~6e-8 relative, too coarse for fp64 parity
    tests. The wrappers below apply only to float64 inputs and compute exactly Megatron's formulas
    (the same chunked delta-rule algorithm; g = -exp(A_log) * softplus(alpha + dt_bias),
    beta = sigmoid(beta); out_norm(x) * act(gate); x * sigmoid(gate)) in float64. Everything else,
    bf16 and fp32 training included, calls Megatron's functions unchanged. Call before building the
    model (GatedDeltaNet picks its delta-rule function when it is constructed).
    """
    global _FP64_GDN
    platform.apply()  # on CPU, platform.py entry 6 (the delta-rule choice) must come first
    if _FP64_GDN:
        return
    _FP64_GDN = True
    import torch.nn.functional as F
    from megatron.core.ssm.gated_delta_net import common as gdn_common
    from megatron.core.ssm.gated_delta_net import gdn as gdn_module
    from megatron.core.transformer.attention import Attention

    def fp64_rule(original):
        def rule(q, k, v, g, beta, *args, **kwargs):
            if v.dtype == torch.float64:
                return chunk_gated_delta_rule_fp64(q, k, v, g, beta, *args, **kwargs)
            return original(q, k, v, g, beta, *args, **kwargs)
        return rule

    for name in ("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule"):
        if getattr(gdn_module, name, None) is not None:
            setattr(gdn_module, name, fp64_rule(getattr(gdn_module, name)))

    g_and_beta = gdn_common._GDNBase._compute_g_and_beta

    def compute_g_and_beta(self, A_log, dt_bias, alpha, beta):
        if alpha.dtype != torch.float64:
            return g_and_beta(self, A_log, dt_bias, alpha, beta)
        return -A_log.exp() * F.softplus(alpha + dt_bias), beta.sigmoid()

    gated_norm = gdn_common._GDNBase._apply_gated_norm

    def apply_gated_norm(self, x, gate):
        if x.dtype != torch.float64:
            return gated_norm(self, x, gate)
        y = self.out_norm(x.reshape(-1, x.shape[-1]))
        return y * self.act_fn(gate.reshape(-1, gate.shape[-1]))

    output_gate = Attention._apply_output_gate

    def apply_output_gate(self, x, gate):
        if x.dtype != torch.float64:
            return output_gate(self, x, gate)
        return x * torch.sigmoid(gate.contiguous().view(*x.shape))

    gdn_common._GDNBase._compute_g_and_beta = compute_g_and_beta
    gdn_common._GDNBase._apply_gated_norm = apply_gated_norm
    Attention._apply_output_gate = apply_output_gate
