"""SavedTensorMeter: counts what autograd saves, and releases it when autograd does."""

import torch

from megatron_longstraw.memory import SavedTensorMeter


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
