"""Memory accounting, three ways, each answering a different question.

* `SavedTensorMeter` counts the bytes autograd saves for backward (saved_tensors_hooks). It is
  independent of the allocator and cheap, but sees only saved tensors, and nothing inside a
  `checkpoint(use_reentrant=False)` frame: only the innermost saved_tensors_hooks run there.
* `LiveBytesMeter` counts every tensor allocation and free on one device, from the allocator: the
  peak of live tensor bytes, per named phase, including recomputation inside checkpoint frames and
  temporaries that autograd never saves. Exact on CPU (torch.profiler's memory events) and on CUDA
  (the caching allocator's counters); use it for receipts of what a phase held.
* `peak_rss_bytes` / `current_rss_bytes`: resident set size of the process, reported beside them,
  since glibc fragmentation inflates RSS on CPU (`MALLOC_MMAP_THRESHOLD_=1048576` removes most of
  that drift).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import os
import resource
import sys
import time
from typing import ClassVar, Iterator

import torch
import torch.distributed as dist


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
    is the largest set of activation bytes the graph held at once. Tensors saved inside a
    `checkpoint(use_reentrant=False)` region, and their recomputation in backward, are not seen (the
    checkpoint's own hooks take them); `LiveBytesMeter` sees them.
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


@dataclasses.dataclass
class PhasePeak:
    """Live bytes over one `LiveBytesMeter.phase`, all measured from the meter's baseline at entry."""

    name: str
    start_bytes: int
    """Live bytes when the phase began (what earlier phases still hold)."""
    peak_bytes: int
    """The most live bytes at any moment inside the phase; `peak_bytes - start_bytes` is the phase's own."""
    end_bytes: int
    """Live bytes when the phase ended."""


class LiveBytesMeter:
    """Peak of live tensor bytes on one device while active, from the allocator, with named phases.

        with LiveBytesMeter() as meter:
            with meter.phase("replay"): ...
            with meter.phase("prompt_backward"): ...
        meter.peak_bytes, meter.phase_peaks["replay"], meter.end_bytes

    Every figure is live bytes relative to the baseline at entry: bytes allocated while the meter
    is active minus bytes freed while it is active, so 0 means "no more than at entry". `peak_bytes`
    is its maximum over time, `end_bytes` its value at exit (> 0: tensors made inside outlived the
    block). The results are filled in on exit.

    CPU (exact, byte for byte): torch.profiler's memory events, one per allocation and free with its
    requested size and pointer, in order (the event tree torch's own memory timeline reads; only
    user-scope ops are recorded, so ops cost nothing extra; each allocation or free costs about
    10 us of processing on exit). The CPU allocator does not know the size of a block made
    before the meter started, so freeing such a block inside is not seen: on CPU the figure is the
    live bytes of blocks allocated since entry, never below 0. Allocations on other Python threads
    are not seen (the profiler reports memory per thread); so that the collectives' tensors are
    freed on this one, the CPU meter runs inside `collective_frees_on_this_thread` (gloo).
    Cannot run under another profiler.

    CUDA: `memory_allocated` and `max_memory_allocated`, exact for the blocks the caching allocator
    hands out: a request rounded up to 512 B, and a large request served from a cached block may take
    up to 1 MiB more (a remainder too small to split off). Frees of blocks made before entry count, so
    figures can go below 0; the two devices agree when nothing made before entry is freed inside.
    The meter resets the device's peak counters (`reset_peak_memory_stats`) at entry and at each
    phase boundary.

    Phases may be sequential, repeated (`phase_peaks` keeps the largest peak of a name) or nested
    (an outer phase's peak includes its inner phases'). One meter is active at a time: the device's
    peak counter, and on CPU the profiler, are process-wide.

    Host storage (`exclude_host=True`): on a GPU machine the pages, the residual stream between
    layers and the other prompt-sized buffers live in pinned host memory, which the CUDA counters
    never see. On CPU both share one allocator, so the owners of such buffers name them with
    `note_host(tensor)` right after allocating them, and the CPU meter then leaves their blocks
    out of every figure (`host_peak_bytes` keeps their own peak): the figures are what a device
    would hold, on either machine.
    """

    _active: ClassVar["LiveBytesMeter | None"] = None

    def __init__(self, device: torch.device | str | None = None, exclude_host: bool = False):
        """`device`: whose allocator to read; default CUDA's current device if available, else CPU.
        `exclude_host`: leave out the blocks named by `note_host` (CPU; CUDA never counts them)."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"LiveBytesMeter reads the CPU or the CUDA allocator, not {self.device.type}")
        self.exclude_host = exclude_host
        self.peak_bytes = 0
        self.end_bytes = 0
        self.host_peak_bytes = 0
        self.phases: list[PhasePeak] = []
        self._source: _CpuAllocationEvents | _CudaCounters | None = None

    @property
    def phase_peaks(self) -> dict[str, int]:
        """Peak live bytes of each phase name (from the meter's baseline), the largest if repeated."""
        peaks: dict[str, int] = {}
        for phase in self.phases:
            peaks[phase.name] = max(peaks.get(phase.name, phase.peak_bytes), phase.peak_bytes)
        return peaks

    @property
    def own_peaks(self) -> dict[str, int]:
        """Each phase name's own peak: its peak minus what was live when it began (what earlier
        phases still held), the largest if repeated."""
        own: dict[str, int] = {}
        for phase in self.phases:
            own[phase.name] = max(own.get(phase.name, 0), phase.peak_bytes - phase.start_bytes)
        return own

    def __enter__(self) -> "LiveBytesMeter":
        if LiveBytesMeter._active is not None:
            raise RuntimeError("a LiveBytesMeter is already active: meters do not nest (the peak "
                               "counter is process-wide); use meter.phase(name) for a sub-range")
        self.peak_bytes, self.end_bytes, self.phases = 0, 0, []
        self._source = (_CudaCounters(self.device) if self.device.type == "cuda"
                        else _CpuAllocationEvents(self.exclude_host))
        self._source.start()
        LiveBytesMeter._active = self
        return self

    def __exit__(self, *exc) -> None:
        LiveBytesMeter._active = None
        self.peak_bytes, self.end_bytes, self.phases = self._source.stop()
        self.host_peak_bytes = getattr(self._source, "host_peak_bytes", 0)
        self._source = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute the live bytes inside this block to `name` (see `phases`, `phase_peaks`)."""
        if LiveBytesMeter._active is not self:
            raise RuntimeError(f"phase({name!r}) outside its LiveBytesMeter's `with` block")
        with self._source.phase(name):
            yield


class _CpuAllocationEvents:
    """CPU allocations and frees from the profiler's memory events; phases are user-scope ranges;
    `note_host` marks (a user-scope range named by the block's address) which allocations are host
    storage: the latest allocation at that address before the mark."""

    _MARKER = "LiveBytesMeter.phase#"
    _HOST = "LiveBytesMeter.host#"

    def __init__(self, exclude_host: bool = False):
        self.exclude_host = exclude_host
        self.host_peak_bytes = 0

    def start(self) -> None:
        # torch's private profiler entry points, the ones torch.profiler.profile calls: the public
        # class cannot restrict the recorded scopes. Imported here so that a torch which moves them
        # breaks this meter only, not the module's other meters.
        from torch._C._autograd import _disable_profiler, _enable_profiler, _prepare_profiler, _profiler_enabled
        from torch._C._profiler import (ProfilerActivity, ProfilerConfig, ProfilerState, RecordScope,
                                        _ExperimentalConfig)
        # Kineto logs a start / stop line per profiler session (and, without CUDA, a failed GPU
        # count) on stderr: one of each per step and rank would bury the launcher's output. Its
        # own level variable silences them unless the user set one (read at its first use).
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        if _profiler_enabled():
            raise RuntimeError("LiveBytesMeter on CPU reads the profiler's memory events and cannot run "
                               "while another torch profiler is active")
        self._disable = _disable_profiler
        self.phase_names: list[str] = []
        config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
        _prepare_profiler(config, {ProfilerActivity.CPU})
        # Only user-scope ranges (the phase markers) are recorded beside the memory events: aten
        # ops are not, which keeps the overhead to the allocations themselves.
        _enable_profiler(config, {ProfilerActivity.CPU}, {RecordScope.USER_SCOPE})
        self._collectives = collective_frees_on_this_thread()
        self._collectives.__enter__()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.phase_names.append(name)
        with torch.profiler.record_function(f"{self._MARKER}{len(self.phase_names) - 1}"):
            yield

    def note_host(self, tensor: torch.Tensor) -> None:
        if self.exclude_host and tensor.device.type == "cpu" and tensor.numel():
            with torch.profiler.record_function(f"{self._HOST}{tensor.untyped_storage().data_ptr()}"):
                pass

    def stop(self) -> tuple[int, int, list[PhasePeak]]:
        self._collectives.__exit__(None, None, None)
        events, spans, marks = self._read_events()
        host = self._host_allocations(events, marks)
        times, live_after = [], []                         # live bytes after each event
        live, block_bytes = 0, {}                          # ptr -> bytes, of blocks allocated since entry
        host_live, host_blocks = 0, set()                  # the host storage's, apart
        for i, (time_ns, ptr, nbytes) in enumerate(events):
            if nbytes > 0 and ptr in block_bytes:
                # An address handed out again was freed: its free went unrecorded (the profiler
                # records this thread's events; a free on another thread, e.g. a collective
                # called outside `collective_frees_on_this_thread`, is not seen).
                if ptr in host_blocks:
                    host_blocks.discard(ptr)
                    host_live -= block_bytes.pop(ptr)
                else:
                    live -= block_bytes.pop(ptr)
            if nbytes > 0 and i in host:
                host_blocks.add(ptr)
                host_live += nbytes
                self.host_peak_bytes = max(self.host_peak_bytes, host_live)
                block_bytes[ptr] = nbytes
                continue
            if nbytes <= 0 and ptr in host_blocks:
                host_blocks.discard(ptr)
                host_live -= block_bytes.pop(ptr)
                continue
            if nbytes > 0:
                block_bytes[ptr] = nbytes
                live += nbytes
            elif ptr in block_bytes:                       # else a block from before entry: skipped
                live -= block_bytes.pop(ptr)
            times.append(time_ns)
            live_after.append(live)

        phases = []
        for idx, name in enumerate(self.phase_names):
            start_ns, end_ns = spans[idx]
            first = bisect.bisect_left(times, start_ns)
            start_bytes = live_after[first - 1] if first else 0
            inside = live_after[first:bisect.bisect_right(times, end_ns)]
            end_bytes = inside[-1] if inside else start_bytes
            phases.append(PhasePeak(name, start_bytes, max([start_bytes, *inside]), end_bytes))
        return max([0, *live_after]), live, phases

    @staticmethod
    def _host_allocations(events, marks) -> set[int]:
        """Indices of the allocation events that `note_host` marked: for each mark, the latest
        allocation at its address at or before the mark's time."""
        allocs: dict[int, list[tuple[int, int]]] = {}
        for i, (time_ns, ptr, nbytes) in enumerate(events):
            if nbytes > 0:
                allocs.setdefault(ptr, []).append((time_ns, i))
        host = set()
        for time_ns, ptr in marks:
            found = allocs.get(ptr, [])
            j = bisect.bisect_right(found, (time_ns, len(events))) - 1
            if j >= 0:
                host.add(found[j][1])
        return host

    def _read_events(self) -> tuple[list[tuple[int, int, int]], dict[int, tuple[int, int]],
                                    list[tuple[int, int]]]:
        """Stop the profiler; (time_ns, ptr, signed bytes) of each CPU allocation and free in time
        order, (start_ns, end_ns) of each phase by index, and (time_ns, ptr) of each host mark."""
        from torch._C._profiler import _EventType
        events, spans, marks = [], {}, []
        stack = list(reversed(self._disable().experimental_event_tree()))
        while stack:                                       # pre-order: ties keep the recorded order
            node = stack.pop()
            tag, fields = node.typed
            if tag == _EventType.Allocation:
                if fields.device.type == "cpu":
                    events.append((node.start_time_ns, fields.ptr, fields.alloc_size))
                continue
            if node.name.startswith(self._MARKER):
                spans[int(node.name[len(self._MARKER):])] = (node.start_time_ns, node.end_time_ns)
            elif node.name.startswith(self._HOST):
                marks.append((node.start_time_ns, int(node.name[len(self._HOST):])))
            stack.extend(reversed(node.children))
        events.sort(key=lambda event: event[0])
        return events, spans, marks


class _CudaCounters:
    """The CUDA caching allocator's counters; a phase boundary folds the running peak into every
    phase still open, then resets it."""

    def __init__(self, device: torch.device):
        self.device = device

    def start(self) -> None:
        self.base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.peak = 0
        self.phases: list[PhasePeak] = []
        self.open: list[PhasePeak] = []

    def _now(self) -> int:
        return torch.cuda.memory_allocated(self.device) - self.base

    def _fold_peak(self) -> None:
        high = torch.cuda.max_memory_allocated(self.device) - self.base
        self.peak = max(self.peak, high)
        for phase in self.open:
            phase.peak_bytes = max(phase.peak_bytes, high)
        torch.cuda.reset_peak_memory_stats(self.device)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._fold_peak()
        now = self._now()
        phase = PhasePeak(name, now, now, now)
        self.phases.append(phase)
        self.open.append(phase)
        try:
            yield
        finally:
            self._fold_peak()
            phase.end_bytes = self._now()
            self.open.remove(phase)

    def stop(self) -> tuple[int, int, list[PhasePeak]]:
        self._fold_peak()
        return self.peak, self._now(), self.phases


# Blocking collectives of torch.distributed (the names that exist in the installed torch are
# wrapped), and the two that Megatron-Core's tensor_parallel.mappings binds at import.
_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all",
                "all_to_all_single", "broadcast", "gather", "reduce", "reduce_scatter",
                "reduce_scatter_tensor", "scatter", "_all_gather_base", "_reduce_scatter_base")
_MEGATRON_ALIASES = ("dist_all_gather_func", "dist_reduce_scatter_func")
_RELEASE_TIMEOUT_S = 5.0


def _tensor_args(args, kwargs) -> list[torch.Tensor]:
    found = []
    for arg in (*args, *kwargs.values()):
        for item in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(item, torch.Tensor) and item.layout == torch.strided:
                found.append(item)
    return found


def _references(tensor: torch.Tensor, storage) -> tuple[int, int, int, int]:
    """What holds `tensor` and its storage: the C++ use counts of both and the reference counts of
    their Python objects (torch keeps a Python object alive while C++ holds it, so the backend's
    last release is of the Python object, under the GIL)."""
    return (tensor._use_count(), torch._C._storage_Use_Count(storage._cdata),
            sys.getrefcount(tensor), sys.getrefcount(storage))


def _returning_after_release(fn):
    """`fn`, a blocking collective, returning only once the backend has dropped the references it
    took to the tensors passed in (`_references` back to their values at the call), or after
    `_RELEASE_TIMEOUT_S`. Calls with async_op=True pass through."""
    @functools.wraps(fn)
    def collective(*args, **kwargs):
        if kwargs.get("async_op"):
            return fn(*args, **kwargs)
        held = [(t, t.untyped_storage()) for t in _tensor_args(args, kwargs)]
        before = [_references(t, storage) for t, storage in held]
        result = fn(*args, **kwargs)
        deadline = time.monotonic() + _RELEASE_TIMEOUT_S
        while (any(any(now > then for now, then in zip(_references(t, storage), counts))
                   for (t, storage), counts in zip(held, before))
               and time.monotonic() < deadline):
            time.sleep(0)                             # releases the GIL the backend's thread needs
        return result
    return collective


@contextlib.contextmanager
def collective_frees_on_this_thread() -> Iterator[None]:
    """While active, every blocking torch.distributed collective returns only once the process
    group has released the tensors passed to it; the CPU `LiveBytesMeter` runs inside it.

    Why: gloo runs a collective on a worker thread, which releases its references (the work, its
    future, and the tensors' Python objects that torch kept alive for them) a moment after the
    caller's wait returns. A caller that drops a tensor in that moment leaves the last reference
    to the worker, which frees the block where the profiler records nothing: the CPU meter would
    count it live until its address is handed out again (a buffer of a GDN exchange, a gathered
    key window). Waiting for the release makes the caller's own drop the free, on this thread,
    recorded: the meter sees every collective's frees where the program makes them.

    Results unchanged: each collective is the original function called with the same arguments,
    and its return value is returned; it has completed (the backend signalled it) before the
    wrapper waits, and the wrapper keeps no tensor past its return. Only the return is delayed,
    by the microseconds the worker takes to release (at most `_RELEASE_TIMEOUT_S`, after which it
    returns anyway and the meter's address-reuse fallback applies). What is patched: the
    attributes `_COLLECTIVES` of `torch.distributed` (Megatron-Core and this package look them up
    at call time) and Megatron-Core's import-time aliases `_MEGATRON_ALIASES`, restored on exit.
    Calls with async_op=True are not covered (the caller's work handle holds the tensors).
    A no-op where torch.distributed is unavailable."""
    if not dist.is_available():
        yield
        return
    targets = [(dist, name) for name in _COLLECTIVES if hasattr(dist, name)]
    mappings = sys.modules.get("megatron.core.tensor_parallel.mappings")
    targets += [(mappings, name) for name in _MEGATRON_ALIASES if hasattr(mappings, name)]
    saved = [(owner, name, getattr(owner, name)) for owner, name in targets]
    for owner, name, fn in saved:
        setattr(owner, name, _returning_after_release(fn))
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def note_host(tensor: torch.Tensor) -> torch.Tensor:
    """Name `tensor` (just allocated) host storage for the active `LiveBytesMeter(exclude_host=
    True)` on CPU (see its docstring); a no-op otherwise. Returns `tensor`."""
    meter = LiveBytesMeter._active
    if meter is not None and isinstance(meter._source, _CpuAllocationEvents):
        meter._source.note_host(tensor)
    return tensor


def phase(name: str):
    """The active `LiveBytesMeter`'s `phase(name)`, or nothing when no meter is active: how the
    schedule marks its phases (capture, scoring, replay) without knowing whether anyone measures."""
    meter = LiveBytesMeter._active
    return meter.phase(name) if meter is not None else contextlib.nullcontext()


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
