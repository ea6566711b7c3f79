"""Megatron-Core on CPU with gloo: every adaptation in one place (applied only without CUDA).

Nothing outside this file knows whether it runs on CPU. Each entry names the Megatron-Core 0.19.2
function it covers, why it is needed, and why results are unchanged. On a CUDA machine `apply()` does
nothing and Megatron runs unmodified. (The float64 reference-precision switches, which apply on any
device, are in precision.py.)
"""

from __future__ import annotations

import contextlib

import torch

from megatron_longstraw.runtime.norms import ZeroCenteredRMSNorm, l2norm

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


_SEED: int | None = None


def init_seed() -> int:
    """The seed of the last `manual_seed` (torch's initial seed before any): what
    models/expert_init.py derives each routed expert's generator from."""
    return _SEED if _SEED is not None else torch.initial_seed()


def manual_seed(seed: int) -> None:
    """Seed every RNG stream Megatron uses (replaces `model_parallel_cuda_manual_seed` on CPU).

    Same stream layout as Megatron: data-parallel seed = seed, tensor-parallel = seed + 2718 + tp_rank,
    expert = seed + 1024 + 100 * ep_rank + etp_rank.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    global _SEED
    _SEED = int(seed)
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
    #    `ZeroCenteredRMSNorm` (models/norms.py) computes TE's zero-centred RMSNorm formula
    #    with the same eps and parameter name (`final_norm.weight`); models without the flag still
    #    get WrappedTorchNorm. On a GPU without TE as on the CPU.
    def final_norm(config, hidden_size, eps=1e-5, **kwargs):
        if config.layernorm_zero_centered_gamma and config.normalization == "RMSNorm":
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
    #    l2norm (models/norms.py) is FLA's formula x * rsqrt(sum(x^2) + 1e-6) (transformers' too)
    #    in float32 or wider,
    #    and the delta rule becomes `torch_chunk_gated_delta_rule`, Megatron's own PyTorch
    #    implementation of the same rule (its deterministic mode), in float32 like FLA's kernel.
    from megatron.core.ssm.gated_delta_net import common as gdn_common
    from megatron.core.ssm.gated_delta_net import gdn as gdn_module

    if gdn_common.HAVE_FLA:
        gdn_common.l2norm = l2norm
        gdn_module.chunk_gated_delta_rule = gdn_common.torch_chunk_gated_delta_rule
