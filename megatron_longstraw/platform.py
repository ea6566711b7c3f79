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


def apply() -> None:
    """Install the CPU adaptations once per process when CUDA is unavailable (idempotent)."""
    global _APPLIED
    if _APPLIED or has_cuda():
        return
    _APPLIED = True

    # 1. torch.cuda.current_device(), used by Megatron as a tensor device (RotaryEmbedding.__init__,
    #    MoE router/dispatcher buffers, schedules, clip_grads, DDP buffers). Why: it initialises CUDA
    #    and fails without a driver. Unchanged: without CUDA every tensor lives on the CPU anyway.
    torch.cuda.current_device = lambda: "cpu"

    # 2. The CUDA RNG tracker (tensor_parallel.random.initialize_rng_tracker / get_cuda_rng_tracker).
    #    Why: CudaRNGStatesTracker calls torch.cuda.get_rng_state. Unchanged: see CPURNGStatesTracker.
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._CUDA_RNG_STATE_TRACKER = CPURNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    # 3. HybridStack.__init__ builds its final norm with TENorm unconditionally. Why: TENorm needs
    #    TransformerEngine. Unchanged: WrappedTorchNorm builds torch's RMSNorm with the same eps and
    #    the same parameter name (`final_norm.weight`).
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    hybrid_block.TENorm = WrappedTorchNorm

    # 4. CUDA streams and events: MoEAlltoAllTokenDispatcher.__init__ creates `torch.cuda.Stream()`
    #    and `_maybe_dtoh_and_synchronize` moves routing metadata to the host on it; DDP and the
    #    page prefetch use side streams too. Why: creating a stream initialises CUDA. Unchanged: on the
    #    CPU all work runs in program order, so a single no-op stream gives the same ordering.
    torch.cuda.Stream = _CPUStream
    torch.cuda.Event = lambda *args, **kwargs: _CPUEvent()
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
