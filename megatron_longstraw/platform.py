"""Megatron-Core on CPU with gloo: every adaptation in one place (applied only without CUDA).

Nothing outside this file knows whether it runs on CPU. Each entry names the Megatron-Core 0.19.2
function it covers, why it is needed, and why results are unchanged. On a CUDA machine `apply()` does
nothing and Megatron runs unmodified.
"""

from __future__ import annotations

import contextlib

import torch

_APPLIED = False


def has_cuda() -> bool:
    return torch.cuda.is_available()


def device() -> torch.device:
    """The compute device of this process (the local GPU, else the CPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if has_cuda() else torch.device("cpu")


def dist_backend() -> str:
    return "nccl" if has_cuda() else "gloo"


class CPURNGStatesTracker:
    """Stands in for `megatron.core.tensor_parallel.random.CudaRNGStatesTracker` without CUDA.

    Why: the CUDA tracker stores `torch.cuda.get_rng_state()` per name, which initialises CUDA.
    Unchanged results: same interface and semantics (named, seeded, forkable streams), on the CPU
    generator; the streams only drive initialisation and dropout (0 in LongStraw configs).
    """

    def __init__(self, *args, **kwargs):
        self.reset()

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise Exception(f"rng state {name} / seed {seed} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        original = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(original)


def manual_seed(seed: int) -> None:
    """Seed every RNG stream Megatron uses (replaces `model_parallel_cuda_manual_seed` on CPU).

    Same stream layout as Megatron: data-parallel seed = seed, tensor-parallel = seed + 2718 + tp_rank,
    expert = seed + 1024 + 100 * ep_rank + etp_rank.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    torch.manual_seed(seed)
    if has_cuda():
        mrandom.model_parallel_cuda_manual_seed(seed)
        return
    apply()
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME,
                seed + 2718 + ps.get_tensor_model_parallel_rank())
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME,
                seed + 1024 + 100 * ps.get_expert_model_parallel_rank()
                + ps.get_expert_tensor_parallel_rank())


class _CPUEvent:
    """No-op event: CPU work is synchronous, so every event has already happened."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


class _CPUStream:
    """No-op stream with the torch.cuda.Stream methods Megatron calls (wait_stream, record_event,
    synchronize). CPU kernels run in program order, so ordering between "streams" already holds."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event or _CPUEvent()

    def synchronize(self) -> None:
        pass

    def __eq__(self, other) -> bool:
        return isinstance(other, _CPUStream)

    def __hash__(self) -> int:
        return 0


_CPU_STREAM = _CPUStream()


_FP64_ROUTING = False


def enable_fp64_routing() -> None:
    """Keep MoE sigmoid routing in float64 when the model runs in float64 (reference precision).

    Megatron-Core 0.19.2 `moe_utils.topk_routing_with_score_function` computes sigmoid scores as
    `torch.sigmoid(logits.float())`, whatever the logits' dtype. In a float64 model that rounds the
    routing weights to float32 (~6e-8 relative), so two float64 computations of the same token that
    differ in the last bit of a logit can differ by ~1e-10 downstream: too coarse for fp64 parity
    tests. This wrapper applies only to float64 logits with sigmoid scores and no group limit,
    replay or precomputed indices, and computes exactly Megatron's formula (top-k of
    sigmoid + expert_bias, weights sigmoid at the chosen experts normalised and scaled) in float64.
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
                or (num_groups or 1) > 1 or router_replay is not None
                or precomputed_indices is not None):
            return original(logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor,
                            score_function, expert_bias, fused, router_replay, dense_output,
                            precomputed_indices)
        scores = torch.sigmoid(logits)
        choice = scores + expert_bias.to(scores.dtype) if expert_bias is not None else scores
        top_indices = torch.topk(choice, k=topk, dim=1).indices
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


_FP64_GDN = False


def _torch_l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6,
                  output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """FLA's `l2norm` (`fla.modules.l2norm`, also transformers' Qwen3.5 `l2norm`) in PyTorch:
    x * rsqrt(sum(x^2) + eps) over `dim`, computed in float32 or wider, returned in x's dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    y = x.to(acc)
    y = y * torch.rsqrt((y * y).sum(dim=dim, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


def _chunk_gated_delta_rule_fp64(q, k, v, g, beta, chunk_size=64, initial_state=None,
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
        q, k = _torch_l2norm(q), _torch_l2norm(k)
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
    apply()  # on CPU the delta-rule choice of entry 6 must be in place before it is wrapped
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
                return _chunk_gated_delta_rule_fp64(q, k, v, g, beta, *args, **kwargs)
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


def _apply_without_transformer_engine() -> None:
    """Adaptations needed wherever TransformerEngine is not importable (CPU, or a GPU without TE).

    3. HybridStack.__init__ builds its final norm with TENorm unconditionally. Why: TENorm needs
       TransformerEngine. Unchanged: WrappedTorchNorm builds torch's RMSNorm with the same eps and
       the same parameter name (`final_norm.weight`). (7: the zero-centred variant, below.)
    """
    from megatron.core.extensions.transformer_engine import HAVE_TE

    if HAVE_TE:
        return
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    # 7. The same final norm for models with `layernorm_zero_centered_gamma` (Qwen3.5/3.6:
    #    y = x / rms(x) * (1 + weight)). Why: WrappedTorchNorm asserts the flag is off (torch's
    #    RMSNorm has no zero-centred gain), while TENorm supports it. Unchanged: the local
    #    `ZeroCenteredRMSNorm` (models/qwen36/spec.py) computes TE's zero-centred RMSNorm formula
    #    with the same eps and parameter name (`final_norm.weight`); models without the flag still
    #    get WrappedTorchNorm. On a GPU without TE as on the CPU.
    def final_norm(config, hidden_size, eps=1e-5, **kwargs):
        if config.layernorm_zero_centered_gamma and config.normalization == "RMSNorm":
            from megatron_longstraw.models.qwen36.spec import ZeroCenteredRMSNorm

            return ZeroCenteredRMSNorm(config=config, hidden_size=hidden_size, eps=eps)
        return WrappedTorchNorm(config=config, hidden_size=hidden_size, eps=eps, **kwargs)

    hybrid_block.TENorm = final_norm


def apply() -> None:
    """Install the adaptations once per process (idempotent): the TransformerEngine-absent one
    wherever TE is missing, the CPU ones only when CUDA is unavailable."""
    global _APPLIED
    if _APPLIED:
        return
    _APPLIED = True
    _apply_without_transformer_engine()
    if has_cuda():
        return

    # 1. torch.cuda.current_device(), used by Megatron as a tensor device (RotaryEmbedding.__init__,
    #    MoE router/dispatcher buffers, schedules, clip_grads, DDP buffers). Why: it initialises CUDA
    #    and fails without a driver. Unchanged: without CUDA every tensor lives on the CPU anyway.
    torch.cuda.current_device = lambda: "cpu"

    # 2. The CUDA RNG tracker (tensor_parallel.random.initialize_rng_tracker / get_cuda_rng_tracker).
    #    Why: CudaRNGStatesTracker calls torch.cuda.get_rng_state. Unchanged: see CPURNGStatesTracker.
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._CUDA_RNG_STATE_TRACKER = CPURNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # 2b. tensor_parallel.random._get_cuda_rng_state / _set_cuda_rng_state, which Megatron's
    #     activation recompute (CheckpointFunction) saves and restores around each recomputed
    #     chunk. Why: they read the CUDA generator. Unchanged: on the CPU the generator that drives
    #     dropout and initialisation is the CPU one; saving and restoring it is the same contract.
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)


    # 4. CUDA streams and events: MoEAlltoAllTokenDispatcher.__init__ creates `torch.cuda.Stream()`
    #    and `_maybe_dtoh_and_synchronize` moves routing metadata to the host on it; DDP and the
    #    page prefetch use side streams too. Why: creating a stream initialises CUDA. Unchanged: on the
    #    CPU all work runs in program order, so a single no-op stream gives the same ordering.
    torch.cuda.Stream = _CPUStream
    torch.cuda.Event = _CPUEvent  # a class, so annotations like `torch.cuda.Event | None` still work
    torch.cuda.current_stream = lambda *args, **kwargs: _CPU_STREAM
    torch.cuda.default_stream = lambda *args, **kwargs: _CPU_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *args, **kwargs: None

    # 5. moe_utils.maybe_move_tensor_to_cpu, used by MoEAlltoAllTokenDispatcher to turn the
    #    all-to-all split sizes into host arrays: it converts only CUDA tensors, so on the CPU the
    #    splits stay tensors and ProcessGroup.all_to_all_single rejects them. Unchanged: the same
    #    values as a NumPy array, exactly what the CUDA path produces.
    from megatron.core.transformer.moe import token_dispatcher

    original_move = token_dispatcher.maybe_move_tensor_to_cpu

    def move_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = move_to_cpu

    # 6. Gated DeltaNet's FLA Triton kernels (megatron.core.ssm.gated_delta_net): `common.l2norm`,
    #    called by `_GDNBase._prepare_input_for_gated_delta_rule` on q and k, and
    #    `gdn.chunk_gated_delta_rule`, which `GatedDeltaNet._setup_variant_attrs` picks unless
    #    `deterministic_mode`. Why: Triton kernels need a GPU ("0 active drivers"). Unchanged: the
    #    l2norm is FLA's formula x * rsqrt(sum(x^2) + 1e-6) (transformers' too) in float32 or wider,
    #    and the delta rule becomes `torch_chunk_gated_delta_rule`, Megatron's own PyTorch
    #    implementation of the same rule (its deterministic mode), in float32 like FLA's kernel.
    from megatron.core.ssm.gated_delta_net import common as gdn_common
    from megatron.core.ssm.gated_delta_net import gdn as gdn_module

    if gdn_common.HAVE_FLA:
        gdn_common.l2norm = _torch_l2norm
        gdn_module.chunk_gated_delta_rule = gdn_common.torch_chunk_gated_delta_rule
