"""Memory accounting that does not depend on the allocator: bytes held by autograd (saved tensors),
and peak resident set size of the process (reported beside it, since glibc fragmentation inflates RSS
on CPU; `MALLOC_MMAP_THRESHOLD_=1048576` removes most of that drift)."""

from __future__ import annotations

import resource
import sys

import torch


class _Saved:
    __slots__ = ("tensor", "meter", "nbytes")

    def __init__(self, tensor: torch.Tensor, meter: "SavedTensorMeter", nbytes: int):
        self.tensor, self.meter, self.nbytes = tensor, meter, nbytes
        meter.live_bytes += nbytes
        meter.peak_bytes = max(meter.peak_bytes, meter.live_bytes)

    def __del__(self):
        self.meter.live_bytes -= self.nbytes


class SavedTensorMeter:
    """Live and peak bytes of tensors that autograd saves for backward while the meter is active.

    Parameters (and views of them) are not counted: they are weights, not activations. Each saved
    tensor is counted by its own bytes when packed and released when autograd frees it, so the peak
    is the largest set of activation bytes the graph held at once.
    """

    def __init__(self, model: torch.nn.Module | None = None):
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()} if model else set()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._hooks = None

    def _pack(self, tensor: torch.Tensor):
        if tensor.untyped_storage().data_ptr() in self._param_ptrs:
            return tensor
        # Held detached: a saved *output* kept with its grad_fn would form a cycle (tensor ->
        # grad_fn -> this record -> tensor) that nothing frees, e.g. an unused branch of a graph.
        # Backward formulas only read the values, which the detached view shares.
        return _Saved(tensor.detach(), self, tensor.numel() * tensor.element_size())

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def current_rss_bytes() -> int:
    """Current resident set size of this process (bytes), from /proc when available."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return peak_rss_bytes()
