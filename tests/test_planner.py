"""The memory planner against measurement: captured page bytes (exact), replay saved-tensor bytes
(within 15%), parameter counts, CP shard sizes; and the CLI's JSON figures."""

import json
import math
import sys

import pytest
import torch

from helpers import ROOT, build_tiny_glm
from megatron_longstraw import planner
from megatron_longstraw.capture import capture_prompt
from megatron_longstraw.config import LongStrawConfig
from megatron_longstraw.memory import SavedTensorMeter
from megatron_longstraw.models.glm52.config import GLM52Config
from megatron_longstraw.parallel import CPLayout
from megatron_longstraw.schedule import GRPOGroup, forward_backward_longstraw

pytestmark = pytest.mark.usefixtures("single_process")


def _tiny_spec(cfg, prompt_len, response_len, group_size=2, **kw):
    # fp32 model: pages are stored in the model dtype, activations are fp32.
    return planner.PlanSpec(family="glm52", model=cfg, prompt_len=prompt_len, group_size=group_size,
                            response_len=response_len, weight_bytes=4, act_bytes=4, latent_bytes=4,
                            index_key_bytes=4, **kw)


def test_page_bytes_equal_captured_pages_exactly():
    cfg, model = build_tiny_glm(torch.float32)
    prompt = torch.randint(0, cfg.vocab_size, (1000,), generator=torch.Generator().manual_seed(0))
    captured = capture_prompt(model, prompt, LongStrawConfig(page_tokens=256))
    # Hand count: 999 captured rows x (8 layers x (32 + 8) latent values + 4 full indexer layers x
    # 16 key values) x 4 bytes; allocated in pages of 256 rows: 4 pages = 1024 rows per kind.
    logical, allocated = 999 * (8 * 40 + 4 * 16) * 4, 1024 * (8 * 40 + 4 * 16) * 4
    assert captured.pages.nbytes() == logical
    assert captured.pages.nbytes(allocated=True) == allocated
    plan = planner.plan(_tiny_spec(cfg, 1000, 16, page_tokens=256), search_max=False)
    assert plan.host_page_bytes_per_rank_logical == logical
    assert plan.host_page_bytes_per_rank == allocated
    assert plan.page_bytes_per_token == 8 * 40 * 4 + 4 * 16 * 4


def test_full_glm52_page_bytes_per_token():
    cfg = GLM52Config.from_yaml(ROOT / "examples" / "glm52" / "full.yaml")
    spec = planner.PlanSpec(family="glm52", model=cfg, prompt_len=2_100_000, group_size=8,
                            response_len=8192, cp=32, ep=32)
    plan = planner.plan(spec, search_max=False)
    # DESIGN section 9: 78 layers x 576 bf16 latent values + 21 full indexer layers x 128 fp8 key
    # values with one fp32 scale per row (132 bytes).
    assert plan.page_bytes_per_token == 78 * 576 * 2 + 21 * 132 == 92628
    rows = max(CPLayout(None, 32, r).prompt_positions(2_099_999).numel() for r in range(32))
    assert plan.host_page_bytes_per_rank_logical == rows * 92628
    # Pages of 65,536 rows: the busiest rank's ~65.6K rows need two pages per kind.
    assert plan.host_page_bytes_per_rank == math.ceil(rows / 65536) * 65536 * 92628


@pytest.mark.parametrize("length,cp", [(2_099_999, 32), (1000, 4), (17, 8), (4_459_999, 32)])
def test_local_prompt_rows_match_cp_layout(length, cp):
    expected = max(CPLayout(None, cp, r).prompt_positions(length).numel() for r in range(cp))
    assert planner.local_prompt_rows(length + 1, cp) == expected


def test_parameter_count_matches_model():
    cfg, model = build_tiny_glm(torch.float32)
    counted = sum(g.count for g in planner.glm52_params(cfg))
    assert counted == sum(p.numel() for p in model.parameters()) == 560320
    full = GLM52Config.from_yaml(ROOT / "examples" / "glm52" / "full.yaml")
    total = sum(g.count for g in planner.glm52_params(full))
    assert 740e9 < total < 750e9  # "744B total" (the example config's header)


PROMPT_LEN = 80  # index_topk is 16: the selection is sparse over the prompt


def _measured_saved_peak(model, response_len, checkpoint_layers):
    gen = torch.Generator().manual_seed(1)
    group = GRPOGroup(prompt_ids=torch.randint(0, 512, (PROMPT_LEN,), generator=gen),
                      response_ids=[torch.randint(0, 512, (response_len,), generator=gen)
                                    for _ in range(2)],
                      rewards=torch.tensor([0.0, 1.0], dtype=torch.float64))
    ls = LongStrawConfig(group_size=2, max_response_len=256, checkpoint_layers=checkpoint_layers)
    with SavedTensorMeter(model) as meter:
        forward_backward_longstraw(model, group, ls)
    return meter.peak_bytes


@pytest.mark.parametrize("response_len,checkpoint_layers", [(24, True), (61, False)])
def test_replay_activation_bytes_within_15_percent(response_len, checkpoint_layers):
    """Whole-layer checkpointing on: the meter sees the layer inputs, LM head and loss (the
    recomputed layer's tensors live in checkpoint frames it does not see). Off: every layer's
    saved tensors, i.e. the per-layer working set the planner charges once for the recompute."""
    cfg, model = build_tiny_glm(torch.float32)
    predicted = planner.glm52_replay_saved(cfg, rows=response_len, cp=1, prefix_len=PROMPT_LEN - 1,
                                           b=4)
    key = "checkpointed" if checkpoint_layers else "uncheckpointed"
    measured = _measured_saved_peak(model, response_len, checkpoint_layers)
    error = abs(predicted[key] - measured) / measured
    print(f"R={response_len} {key}: predicted {predicted[key]:.0f} measured {measured} ({error:.2%})")
    assert error <= 0.15
    # The layers' own tensors are most of the uncheckpointed bytes: a planner that dropped them
    # would fail the uncheckpointed case (not a vacuous comparison).
    assert predicted["uncheckpointed"] > 5 * predicted["checkpointed"]


def test_cli_json_figures(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    import plan_memory

    out = tmp_path / "plan.json"
    figures = plan_memory.main(["--prompt-len", "2.1M", "--cp", "32", "--ep", "32", "--gpu", "H20",
                                "--trainable", "lora", "--response-len", "1024",
                                "--weight-dtype", "fp8", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(figures))
    for key in ("page_bytes_per_token", "host_page_bytes_per_rank", "device_peak_bytes_per_rank",
                "max_prompt_len"):
        assert key in data
    assert data["page_bytes_per_token"] == 92628
    # The largest prompt fits and one more token than the device allows does not.
    spec = plan_memory.build_spec(plan_memory.parse_args(
        ["--cp", "32", "--ep", "32", "--trainable", "lora", "--response-len", "1024",
         "--weight-dtype", "fp8"]))
    limit = data["max_prompt_len_device"]
    assert limit and limit > 2_100_000
    for length, fits in ((limit, True), (limit + 1, False)):
        spec.prompt_len = length
        assert planner.plan(spec, search_max=False).device_fits is fits


def test_lora_count_matches_adapters():
    from megatron_longstraw.adapters import GLM52_TARGETS, LoRAConfig, apply_lora, trainable_parameters

    cfg, model = build_tiny_glm(torch.float32)
    apply_lora(model, LoRAConfig(rank=4, targets=GLM52_TARGETS, exclude=("*.experts.*",)))
    spec = _tiny_spec(cfg, 100, 8, trainable="lora", lora_rank=4)
    dense, expert = planner.trainable_count(spec, planner.glm52_params(cfg))
    # Hand count, r = 4: per layer the five MLA projections r(in + out) = 4 x 616, 8 layers;
    # 3 dense MLPs 4 x (320 + 192); 5 shared experts 4 x (128 + 96).
    assert dense == 8 * 4 * 616 + 3 * 4 * 512 + 5 * 4 * 224 == 30336
    assert expert == 0 and trainable_parameters(model) == dense
