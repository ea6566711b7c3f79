"""SavedTensorMeter: counts what autograd saves, and releases it when autograd does.
LiveBytesMeter: live tensor bytes from the allocator, exact, per phase, inside checkpoint frames too."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from megatron_longstraw.runtime.memory import LiveBytesMeter, PhasePeak, SavedTensorMeter


def test_meter_counts_saved_bytes_and_releases_them():
    x = torch.randn(1000, requires_grad=True)
    with SavedTensorMeter() as meter:
        y = x.exp()                          # exp saves its output: 4000 B
        assert meter.live_bytes == 4000
        y.sum().backward()
        del y
    assert meter.live_bytes == 0 and meter.peak_bytes == 4000


def test_meter_does_not_keep_saved_outputs_of_unused_branches_alive():
    """A saved output held with its grad_fn would be a reference cycle nobody frees (the graph of a
    discarded branch, e.g. the delta rule's unused final-state update): the meter would then count
    it forever and the memory would leak across GRPO members."""
    x = torch.randn(1000, requires_grad=True)
    with SavedTensorMeter() as meter:
        for _ in range(3):
            unused = x.exp() * 3             # exp's saved output, never backpropagated
            del unused
        assert meter.live_bytes == 0
    assert meter.peak_bytes == 4000


def test_parameters_are_not_counted():
    layer = torch.nn.Linear(100, 10)
    with SavedTensorMeter(layer) as meter:
        out = layer(torch.randn(3, 100))      # saves the input (1200 B), not the weight
        assert meter.live_bytes == 3 * 100 * 4
        del out


# ---- LiveBytesMeter --------------------------------------------------------------------------------
# On CPU the sizes are the requested bytes (the CPU allocator does not round), so every comparison
# below is exact unless it says otherwise.

def test_live_meter_sees_a_known_allocation_exactly():
    with LiveBytesMeter("cpu") as meter:
        block = torch.empty(12345, dtype=torch.uint8)
        del block
        kept = torch.empty(1000, dtype=torch.float64)       # outlives the block: shows in end_bytes
    assert (meter.peak_bytes, meter.end_bytes) == (12345, 8000)
    del kept


def test_live_meter_ignores_blocks_allocated_before_it_even_at_reused_addresses():
    """The CPU allocator's profiler reporter remembers sizes of blocks it saw allocated; a block freed
    while no profiler ran leaves a stale entry, and a later block at the same address, made before the
    meter and freed inside it, is reported as a free of the stale size. The meter counts a free only
    for a block allocated while it is active, so figures never go below the baseline."""
    with LiveBytesMeter("cpu"):
        earlier = [torch.empty(4096, dtype=torch.uint8) for _ in range(50)]
    earlier_ptrs = {t.data_ptr() for t in earlier}
    del earlier                                              # freed with no profiler running
    before = [torch.empty(4096, dtype=torch.uint8) for _ in range(50)]
    if not any(t.data_ptr() in earlier_ptrs for t in before):
        pytest.skip("malloc reused no address: the stale-size case does not arise here")
    with LiveBytesMeter("cpu") as meter:
        del before
        block = torch.empty(100, dtype=torch.uint8)
        del block
    assert (meter.peak_bytes, meter.end_bytes) == (100, 0)


def test_live_meter_sees_recomputation_inside_a_checkpoint_frame_that_saved_tensor_meter_misses():
    """Backward of checkpoint(use_reentrant=False) recomputes x.repeat(64) and its exp, 256000 B
    each: both live at once in the backward phase. SavedTensorMeter's hooks are not the innermost
    there (the checkpoint's are), so it sees only what is saved outside the frame."""
    x = torch.randn(1000, requires_grad=True)
    intermediate_bytes = 64 * 1000 * 4
    with LiveBytesMeter("cpu") as live, SavedTensorMeter() as saved:
        loss = checkpoint(lambda t: t.repeat(64).exp().sum(), x, use_reentrant=False)
        with live.phase("backward"):
            loss.backward()
    assert live.phase_peaks["backward"] >= 2 * intermediate_bytes
    assert saved.peak_bytes < intermediate_bytes


def _full(n: int) -> torch.Tensor:
    """Live memory O(n): the whole [n, 256] block and its exp at once."""
    return torch.randn(n, 256).exp().sum()


def _blockwise(n: int, block: int = 64) -> torch.Tensor:
    """Live memory O(block): each [block, 256] slab is freed before the next is made."""
    total = torch.zeros(())
    for _ in range(0, n, block):
        total += torch.randn(block, 256).exp().sum()
    return total


def _peak(fn, n: int) -> int:
    with LiveBytesMeter("cpu") as meter:
        fn(n)
    return meter.peak_bytes


def test_live_meter_peak_scales_with_live_memory_not_with_work():
    n = 256
    full_n, full_4n = _peak(_full, n), _peak(_full, 4 * n)
    assert full_n >= 2 * n * 256 * 4                          # the block and its exp
    assert full_4n == pytest.approx(4 * full_n, rel=0.01)     # scalars (the sum) are the 1%
    block_bytes = 64 * 256 * 4
    blockwise_n, blockwise_4n = _peak(_blockwise, n), _peak(_blockwise, 4 * n)
    assert abs(blockwise_4n - blockwise_n) <= block_bytes
    assert blockwise_4n < full_n


def test_live_meter_attributes_peaks_to_their_phases():
    with LiveBytesMeter("cpu") as meter:
        held = torch.empty(500, dtype=torch.uint8)          # before any phase, held through them
        with meter.phase("small"):
            block = torch.empty(1000, dtype=torch.uint8)
            del block
        with meter.phase("large"):
            block = torch.empty(5000, dtype=torch.uint8)
            del block
        with meter.phase("small"):                          # repeated: phase_peaks keeps the largest
            block = torch.empty(2000, dtype=torch.uint8)
            del block
        with meter.phase("outer"):                          # nested: the outer peak includes the inner
            with meter.phase("inner"):
                block = torch.empty(3000, dtype=torch.uint8)
                del block
        block = torch.empty(7000, dtype=torch.uint8)        # outside every phase
        del block, held
    assert meter.phase_peaks == {"small": 2500, "large": 5500, "outer": 3500, "inner": 3500}
    assert meter.phases[1] == PhasePeak("large", start_bytes=500, peak_bytes=5500, end_bytes=500)
    assert (meter.peak_bytes, meter.end_bytes) == (7500, 0)


def test_live_meter_with_nothing_allocated_and_its_refusals():
    with LiveBytesMeter("cpu") as meter:
        with meter.phase("idle"):
            pass
    assert (meter.peak_bytes, meter.end_bytes, meter.phase_peaks) == (0, 0, {"idle": 0})

    with LiveBytesMeter("cpu") as outer:
        with pytest.raises(RuntimeError, match="do not nest"):
            with LiveBytesMeter("cpu"):
                pass
        block = torch.empty(64, dtype=torch.uint8)          # the outer meter still counts
        del block
    assert outer.peak_bytes == 64
    with pytest.raises(RuntimeError, match="outside"):
        with outer.phase("late"):
            pass
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with pytest.raises(RuntimeError, match="another torch profiler"):
            with LiveBytesMeter("cpu"):
                pass

    with outer:                                              # a meter can be entered again: fresh figures
        block = torch.empty(32, dtype=torch.uint8)
        del block
    assert (outer.peak_bytes, outer.end_bytes) == (32, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA allocator's counters need a GPU")
def test_live_meter_on_cuda_reads_the_caching_allocator():
    # Sizes are multiples of 512 B, which the caching allocator does not round further.
    mib = 1 << 20
    with LiveBytesMeter("cuda") as meter:
        with meter.phase("small"):
            block = torch.empty(mib, dtype=torch.uint8, device="cuda")
            del block
        with meter.phase("large"):
            block = torch.empty(4 * mib, dtype=torch.uint8, device="cuda")
            del block
        kept = torch.empty(2 * mib, dtype=torch.uint8, device="cuda")
    assert meter.phase_peaks == {"small": mib, "large": 4 * mib}
    assert (meter.peak_bytes, meter.end_bytes) == (4 * mib, 2 * mib)
    del kept


class _FakeCudaAllocator:
    """The three counters LiveBytesMeter reads on CUDA, driven by hand."""

    def __init__(self, allocated: int):
        self.allocated = self.high = allocated

    def alloc(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.high = max(self.high, self.allocated)

    def free(self, nbytes: int) -> None:
        self.allocated -= nbytes


def test_live_meter_cuda_bookkeeping_folds_peaks_into_open_phases(monkeypatch):
    """The CUDA path's phase logic without a GPU: every phase boundary resets the device's peak
    counter, so the peak since the last reset must reach the meter and every phase still open."""
    fake = _FakeCudaAllocator(allocated=10_000)              # held before entry: the baseline
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: fake.allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: fake.high)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: setattr(fake, "high", fake.allocated))
    with LiveBytesMeter("cuda") as meter:
        fake.alloc(512)                                       # held through the phases
        with meter.phase("outer"):
            fake.alloc(4096)
            fake.free(4096)
            with meter.phase("inner"):
                fake.alloc(1024)
                fake.free(1024)
            fake.alloc(2048)                                  # after inner: outer only
            fake.free(2048)
        fake.alloc(8192)
        fake.free(8192)
        fake.free(10_000)                                     # a block from before entry: counts on CUDA
    assert meter.phases == [PhasePeak("outer", 512, 4608, 512), PhasePeak("inner", 512, 1536, 512)]
    assert (meter.peak_bytes, meter.end_bytes) == (8704, -9488)


def test_live_meter_sees_the_frees_of_gloo_collectives():
    """On gloo a collective runs on a worker thread that releases the tensors a moment after the
    caller's wait returns; without `collective_frees_on_this_thread` a caller's drop in that moment
    left the free to the worker, unseen by the CPU meter (a few percent of calls, every
    collective). Under the meter: 60 calls of each collective the capture path uses, tensors made
    and dropped inside, every meter ends at 0 and every result is right (2 gloo processes)."""
    import dist_workers
    from distributed import run_ranks

    for unseen, right in run_ranks(dist_workers.collective_frees_worker, 2, repeats=60):
        assert all(right.values()), right
        assert not any(unseen.values()), unseen
