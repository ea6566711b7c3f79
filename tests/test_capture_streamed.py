"""Streamed capture (capture.py, one process): the same pages as capture over the whole prompt,
bitwise, with device memory flat in the prompt length.

Streamed capture runs every layer one token block at a time, the residual stream in a host
buffer, attention reading earlier key rows window by window from the pages (DSA: the index keys
scored window by window, only the selected latent rows read back), GDN continuing from the state
stored in the pages. `capture="whole"` is the earlier schedule (each layer over the whole prompt on
the device), kept as the reference.

Memory is measured from the allocator (memory.LiveBytesMeter with `exclude_host`: the pages, the
residual stream, the selections and the exact gradient's inputs are host storage, named by their
owners with `memory.note_host`, and left out, as the CUDA counters leave out pinned host memory).
What remains is what a device would hold. From P to 4P it grows by the rows' positions (int64, 8 B
per token: the planner's one prompt-sized device line); with the exact gradient's inputs at most
by the index tables (positions and token ids, 16 B per token); everything else is per block. The
whole-prompt schedule grows by layers of rows per token, and the same meter shows it."""

import pytest
import torch

from helpers import build_tiny_glm, build_tiny_qwen
from megatron_longstraw.context.capture import capture_prompt
from megatron_longstraw.config.settings import LongStrawConfig
from megatron_longstraw.config.choices import PromptGrad
from megatron_longstraw.runtime.memory import LiveBytesMeter

pytestmark = pytest.mark.usefixtures("single_process")

FAMILIES = ["glm52", "qwen36", "deepseekv3"]
BLOCKS = dict(key_block=32, query_block=16, token_block=64)
INDEX_TABLE_BYTES = 16   # per prompt token: positions and token ids, int64


def _build(family, dtype):
    if family == "deepseekv3":
        from test_deepseekv3 import build_tiny_deepseekv3

        return build_tiny_deepseekv3(dtype)
    return (build_tiny_glm if family == "glm52" else build_tiny_qwen)(dtype)


def _prompt(cfg, length):
    return torch.randint(0, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(0))


def _capture(model, ids, mode, exact=False):
    ls = LongStrawConfig.of(group_size=2, capture=mode, **BLOCKS)
    return capture_prompt(model, ids, ls,
                          prompt_grad=PromptGrad.EXACT if exact else PromptGrad.DETACHED)


@pytest.fixture(scope="module", params=FAMILIES)
def fp64_model(request):
    return request.param, *_build(request.param, torch.float64)


def test_streamed_capture_equals_whole_capture_bitwise(fp64_model):
    """fp64, a prompt of 197 tokens (4 token blocks, the last partial), with the exact gradient's
    inputs kept (what it keeps changes no page): every page (every layer and kind), every layer
    input, top-k selection and GDN block boundary, equal bitwise."""
    family, cfg, model = fp64_model
    ids = _prompt(cfg, 197)
    whole, streamed = (_capture(model, ids, mode, exact=True) for mode in ("whole", "streamed"))
    keys = [(layer, kind) for layer in whole.pages.layers() for kind in whole.pages.kinds(layer)]
    assert keys == [(layer, kind) for layer in streamed.pages.layers()
                    for kind in streamed.pages.kinds(layer)]
    for layer, kind in keys:
        assert torch.equal(whole.pages.fetch(layer, kind), streamed.pages.fetch(layer, kind)), \
            (family, layer, kind)
    a, b = whole.backward, streamed.backward
    assert len(a.layer_inputs) == len(b.layer_inputs) == cfg.num_hidden_layers
    assert all(torch.equal(x, y) for x, y in zip(a.layer_inputs, b.layer_inputs))
    assert sorted(a.selections) == sorted(b.selections)
    assert all(torch.equal(a.selections[k], b.selections[k]) for k in a.selections)
    assert torch.equal(a.token_ids, b.token_ids)
    assert (a.boundaries or {}).keys() == (b.boundaries or {}).keys()
    for layer in a.boundaries or {}:
        for x, y in zip(a.boundaries[layer], b.boundaries[layer], strict=True):
            for kind in x:
                assert (x[kind] is None and y[kind] is None) or torch.equal(x[kind], y[kind])


def test_streamed_capture_refuses_unknown_schedule():
    with pytest.raises(ValueError, match=r"capture must be one of \['streamed', 'whole'\], got 'ring'"):
        LongStrawConfig.of(group_size=2, capture="ring")


def _device_peak(model, ids, mode, exact=False, page_tokens=128):
    """(device peak, host peak, the capture) of one capture, the prompt made by the caller."""
    ls = LongStrawConfig.of(group_size=2, capture=mode, page_tokens=page_tokens, **BLOCKS)
    with LiveBytesMeter("cpu", exclude_host=True) as meter:
        captured = capture_prompt(model, ids, ls,
                                  prompt_grad=PromptGrad.EXACT if exact else PromptGrad.DETACHED)
    return meter.peak_bytes, meter.host_peak_bytes, captured


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_capture_device_bytes_flat_and_the_planner_lines(family):
    """fp32, P = 193 and 769 (token blocks of 64, pages of 128 rows):
    - streamed capture's device peak grows by exactly the planner's one prompt-sized device line,
      the positions table (8 B per added token), and the host peak is the pages (allocated) plus
      the planner's capture host lines (residual stream; DSA: the latest full layer's
      selection), exactly, at both lengths;
    - with the exact gradient's inputs kept (host), the device peak grows by at most the index
      tables (16 B per added token);
    - the whole-prompt schedule grows by far more (the meter tells them apart)."""
    from megatron_longstraw import planner

    cfg, model = _build(family, torch.float32)
    _capture(model, _prompt(cfg, 64), "streamed", exact=True)      # warm-up: one-time allocations
    lengths = (193, 769)
    added = lengths[1] - lengths[0]
    peaks, planned = {}, {}
    for prompt_len in lengths:
        device, host, captured = _device_peak(model, _prompt(cfg, prompt_len), "streamed")
        spec = planner.PlanSpec(family=family, model=cfg, prompt_len=prompt_len, group_size=2,
                                response_len=16, weight_bytes=4, act_bytes=4, latent_bytes=4,
                                index_key_bytes=4, page_tokens=128, **BLOCKS)
        plan = planner.plan(spec, search_max=False)
        capture_host = [i for i in plan.host_items if i.name.startswith("capture")]
        assert capture_host and all(i.measured for i in capture_host)
        assert plan.host_page_bytes_per_rank == captured.pages.nbytes(allocated=True)
        assert host == captured.pages.nbytes(allocated=True) + sum(i.bytes for i in capture_host)
        tables = {sum(i.bytes for i in items if i.name.startswith("capture positions"))
                  for name, items in plan.phases.items() if name.startswith("capture")}
        assert len(tables) == 1            # every capture phase holds the same table
        peaks[prompt_len], planned[prompt_len] = device, tables.pop()
        del captured
    growth = peaks[lengths[1]] - peaks[lengths[0]]
    print(f"{family}: streamed capture device peak {peaks[lengths[0]]} B at P={lengths[0]}, "
          f"{peaks[lengths[1]]} B at P={lengths[1]} (growth {growth} B, planned "
          f"{planned[lengths[1]] - planned[lengths[0]]} B)")
    assert growth == planned[lengths[1]] - planned[lengths[0]] == 8 * added

    exact = [_device_peak(model, _prompt(cfg, n), "streamed", exact=True)[0] for n in lengths]
    whole = [_device_peak(model, _prompt(cfg, n), "whole")[0] for n in lengths]
    print(f"{family}: exact {exact[0]} -> {exact[1]} B, whole capture {whole[0]} -> {whole[1]} B")
    assert exact[1] - exact[0] <= INDEX_TABLE_BYTES * added
    assert whole[1] - whole[0] > 10 * INDEX_TABLE_BYTES * added


LAYER_KINDS = {"glm52": ("attention", "MoE"), "deepseekv3": ("attention", "MoE"),
               "qwen36": ("attention", "GDN", "MLP")}
# The planner's capture phase per `hybrid_layer_pattern` symbol (mixers: common.MIXERS).
KIND_OF_SYMBOL = {"G": "GDN", "*": "attention", "D": "attention", "+": "attention", "E": "MoE",
                  "-": "MLP"}


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_peak_per_layer_kind_against_the_planner(family, monkeypatch):
    """fp32, P = 193 and 769: each layer kind's own peak in streamed capture (the meter's phase
    around each layer call: attention, GDN, the MoE or dense MLP) against the planner's capture
    phase for it, summed as the plan sums it (`phase_bytes`), less what a layer call does not
    allocate on CPU (the positions table, the block's input): never above the plan and, for
    GLM-5.2 and Qwen3.6, at least 75% of it (GLM-5.2's attention layer's selected rows grow with
    P up to query_block x topk distinct rows). Qwen3.6 is planned with the delta rule the CPU
    runs (`gdn_kernels="torch"`). DeepSeek-V3: an upper bound."""
    from megatron_longstraw.context import capture
    from megatron_longstraw.runtime import memory
    from megatron_longstraw import planner
    from megatron_longstraw.models import common

    run_layer = common.run_layer
    cfg, model = _build(family, torch.float32)
    kind_of = {id(layer): KIND_OF_SYMBOL[symbol]
               for symbol, layer in zip(model.decoder.layer_type_list, model.decoder.layers)}

    def metered(layer, hidden, state):
        with memory.phase(kind_of[id(layer)]):
            return run_layer(layer, hidden, state)

    monkeypatch.setattr(common, "run_layer", metered)
    monkeypatch.setattr(capture, "run_layer", metered)
    _capture(model, _prompt(cfg, 64), "streamed")                  # warm-up
    for prompt_len in (193, 769):
        ls = LongStrawConfig.of(group_size=2, page_tokens=128, **BLOCKS)
        with LiveBytesMeter("cpu", exclude_host=True) as meter:
            capture_prompt(model, _prompt(cfg, prompt_len), ls)
        own = meter.own_peaks
        spec = planner.PlanSpec(family=family, model=cfg, prompt_len=prompt_len, group_size=2,
                                response_len=16, weight_bytes=4, act_bytes=4, latent_bytes=4,
                                index_key_bytes=4, page_tokens=128, gdn_kernels="torch", **BLOCKS)
        plan = planner.plan(spec, search_max=False)
        # Outside a layer call's own peak: the positions table (allocated before the layers)
        # and the block's input (on CPU a view of the host residual stream; a device copy on GPU).
        outside = 8 * (prompt_len - 1) + BLOCKS["token_block"] * cfg.hidden_size * 4
        for kind in LAYER_KINDS[family]:
            items = plan.phases[f"capture ({kind} layer)"]
            assert family != "qwen36" or all(i.measured for i in items), kind
            planned = planner.phase_bytes(items) - outside
            ratio = own[kind] / planned
            print(f"{family} P={prompt_len}: capture {kind} layer own peak {own[kind]} B, planned "
                  f"{planned:.0f} B ({ratio:.3f})")
            assert ratio <= 1.0, (kind, own[kind], planned)
            if family != "deepseekv3":
                assert ratio >= 0.75, (kind, own[kind], planned)
