"""FP8 index-key pages (`PageStore(formats=...)`, `CaptureSettings.index_key_pages`): the format
(DeepGEMM's per-token cast, d + 4 bytes a row, the `(values, scales)` pair `fp8_mqa_logits` takes
as views), exact page bytes against the planner, every read path agreeing, and the fidelity
against model-dtype pages measured on the tiny and a wider GLM-5.2: top-k recall and scored
log-prob differences (printed; run with -s to see them)."""

import argparse
import sys

import pytest
import torch

from helpers import ROOT, TINY_GLM, build_tiny_glm
from megatron_longstraw.training import arguments
from megatron_longstraw.kernels import fp8
from megatron_longstraw import planner
from megatron_longstraw.context.capture import capture_prompt
from megatron_longstraw.config.settings import LongStrawConfig
from megatron_longstraw.config.choices import PromptGrad
from megatron_longstraw.rollout.decode import generate
from megatron_longstraw.config.sampling import SamplingParams
from megatron_longstraw.models.glm52.attention import INDEX_KEY
from megatron_longstraw.models.mla import LATENT
from megatron_longstraw.state.pages import PageStore
from megatron_longstraw.step.replay import score_member

pytestmark = pytest.mark.usefixtures("single_process")

FULL_GLM = ROOT / "examples" / "glm52" / "full.yaml"


def _fp8_capture(model, prompt, ls: LongStrawConfig, **kw):
    """capture_prompt into a store in `ls`'s page formats (what capture builds from the config)."""
    pages = PageStore(page_tokens=ls.capture.page_tokens, formats=ls.capture.page_formats())
    return capture_prompt(model, prompt, ls, pages=pages, **kw)


# ---- the format --------------------------------------------------------------------------------


def test_fp8_pages_hold_deepgemm_rows_and_read_back_dequantised():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(21, 2, 8, generator=gen) * torch.logspace(-3, 2, 21)[:, None, None]
    x[4] = 0.0                                                  # an all-zero row: scale 1e-4 / 448
    store = PageStore(page_tokens=8, formats={"k": "fp8"})
    store.append(0, "k", x[:5])
    store.append(0, "k", x[5:])
    store.append(0, "plain", x)
    # DeepGEMM's per-token cast (its README / tests: amax / 448, amax >= 1e-4), by hand.
    flat = x.reshape(21, 16)
    scales = flat.abs().amax(1).clamp(min=1e-4) / 448
    values = (flat / scales[:, None]).to(torch.float8_e4m3fn)
    expected = (values.float() * scales[:, None]).view_as(x)
    # d + 4 bytes a row, logical and in whole pages (3 pages of 8 rows).
    assert store.nbytes(0, "k") == 21 * (16 + 4)
    assert store.nbytes(0, "k", allocated=True) == 3 * 8 * (16 + 4)
    assert store.bytes_per_token(["k"]) == 20.0
    assert torch.equal(store.fetch(0, "k"), expected)
    assert torch.equal(store.window(0, "k", 3, 19), expected[3:19])
    index = torch.tensor([20, 0, 9, 8, 3, 3])
    assert torch.equal(store.gather(0, "k", index), expected[index])
    assert torch.equal(store.fetch(0, "k", dtype=torch.float64),
                       (values.double() * scales.double()[:, None]).view_as(x))
    assert torch.equal(store.fetch(0, "plain"), x)                   # other kinds as stored
    # e4m3 rounding: |x - read| <= max(2^-4 |x|, 2^-10 scale) (+ float32 rounding of the scale).
    bound = torch.maximum(fp8.E4M3_REL * flat.abs(), fp8.E4M3_SUBNORMAL_HALF * scales[:, None])
    assert ((expected.reshape(21, 16) - flat).abs() <= bound * (1 + 1e-6)).all()
    # Rows of one page: views of the page's bytes, contiguous (fp8_mqa_logits' k, k_scale).
    v, s = store.window_fp8(0, "k", 9, 15)
    page = store._seq[0]["k"].pages[1]
    assert v.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert v.is_contiguous() and s.is_contiguous()
    assert v.data_ptr() == page.data_ptr() + 1 * 16
    assert s.data_ptr() == page.data_ptr() + 8 * 16 + 1 * 4
    assert torch.equal(v.view(torch.uint8), values[9:15].view(torch.uint8))
    assert torch.equal(s, scales[9:15])
    v, s = store.window_fp8(0, "k", 2, 21)                              # across pages: copies
    assert torch.equal(v.view(torch.uint8), values[2:].view(torch.uint8))
    assert torch.equal(s, scales[2:])
    # The exact gradient's buffers, as capture keeps them: the other kinds', none for index keys.
    store.keep_grads(["plain"])
    assert store.grad(0, "k") is None and store.grad(0, "plain").shape == x.shape
    store.zero_()
    assert not store.fetch(0, "k").any() and not store.fetch(0, "plain").any()
    assert torch.equal(store.round_trip("k", x), expected) and store.round_trip("plain", x) is x


def test_fp8_pages_refuse_what_they_cannot_hold():
    with pytest.raises(ValueError, match="page format"):
        PageStore(formats={"k": "fp4"})
    store = PageStore(page_tokens=3, formats={"k": "fp8"})
    with pytest.raises(ValueError, match="fixed-size"):
        store.put(0, "k", torch.zeros(4))
    with pytest.raises(ValueError, match="floating-point"):
        store.append(0, "k", torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="4-byte"):
        store.append(1, "k", torch.zeros(2, 5))                          # 3 x 5 bytes of values
    store.append(2, "plain", torch.zeros(2, 4))
    with pytest.raises(ValueError, match="not stored in the fp8 format"):
        store.window_fp8(2, "plain", 0, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_deepgemm_requantises_fp8_pages_to_the_stored_rows(dtype):
    """What an fp8 page reads back, cast again by DeepGEMM's indexer (`kernels/deepgemm.py`, the
    GPU default of `auto`), gives exactly the stored values and scales: under that kernel fp8
    pages change nothing it scores (the differences measured below are the reference path's)."""
    gen = torch.Generator().manual_seed(1)
    keys = torch.nn.functional.layer_norm(torch.randn(4096, 128, generator=gen), (128,))
    keys = (keys * torch.rand(4096, 1, generator=gen) * 4).to(dtype)
    store = PageStore(page_tokens=1024, formats={INDEX_KEY: "fp8"})
    store.append(0, INDEX_KEY, keys)
    values, scales = store.window_fp8(0, INDEX_KEY, 0, 4096)
    again_values, again_scales = fp8.quantize_rows(store.fetch(0, INDEX_KEY))
    assert torch.equal(again_values.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(again_scales, scales)


# ---- the switch and the planner -----------------------------------------------------------------


def test_switch_config_flag_and_yaml():
    assert LongStrawConfig().capture.index_key_pages == "model"
    assert LongStrawConfig().capture.page_formats() == {}
    assert LongStrawConfig.of(index_key_pages="fp8").capture.page_formats() == {INDEX_KEY: "fp8"}
    with pytest.raises(ValueError, match="--longstraw-index-key-pages"):
        LongStrawConfig.of(index_key_pages="bf16")
    parser = arguments.add_longstraw_args(argparse.ArgumentParser())
    args = parser.parse_args(["--longstraw-config", str(TINY_GLM),
                              "--longstraw-index-key-pages", "fp8"])
    assert arguments.longstraw_config_from_args(args).capture.index_key_pages == "fp8"
    assert LongStrawConfig.from_yaml(TINY_GLM).capture.index_key_pages == "model"
    assert LongStrawConfig.from_yaml(FULL_GLM).capture.index_key_pages == "fp8"


def test_plan_memory_follows_the_config():
    sys.path.insert(0, str(ROOT / "tools"))
    import plan_memory

    def index_key_bytes(*argv):
        return plan_memory.build_spec(plan_memory.parse_args(list(argv))).index_key_bytes

    assert index_key_bytes() == 1 + 4 / 128                             # full.yaml: fp8
    assert index_key_bytes("--index-key-dtype", "bf16") == 2
    assert index_key_bytes("--config", str(TINY_GLM)) == 2              # tiny.yaml: model = bf16
    assert index_key_bytes("--config", str(TINY_GLM), "--latent-dtype", "fp32") == 4
    assert index_key_bytes("--config", str(TINY_GLM), "--index-key-dtype", "fp8") == 1 + 4 / 16


def test_capture_builds_its_pages_in_the_config_formats():
    cfg, model = build_tiny_glm(torch.float32)
    prompt = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(0))
    captured = capture_prompt(model, prompt, LongStrawConfig.of(index_key_pages="fp8"))
    assert captured.pages.nbytes(0, INDEX_KEY) == 19 * (16 + 4)


@pytest.mark.parametrize("prompt_len", [100, 300])
def test_fp8_capture_has_exactly_the_planner_page_bytes(prompt_len):
    cfg, model = build_tiny_glm(torch.float32)
    prompt = torch.randint(0, cfg.vocab_size, (prompt_len,),
                           generator=torch.Generator().manual_seed(prompt_len))
    ls = LongStrawConfig.of(page_tokens=64, token_block=50, index_key_pages="fp8")
    captured = _fp8_capture(model, prompt, ls)
    # 8 layers x (32 + 8) fp32 latent values; 4 full indexer layers x (16 e4m3 values + a scale).
    rows = prompt_len - 1
    assert captured.pages.nbytes(kind=INDEX_KEY) == 4 * rows * (16 + 4)
    assert captured.pages.nbytes(kind=LATENT) == 8 * rows * 40 * 4
    spec = planner.PlanSpec(family="glm52", model=cfg, prompt_len=prompt_len, group_size=2,
                            response_len=8, weight_bytes=4, act_bytes=4, latent_bytes=4,
                            index_key_bytes=1 + 4 / 16, page_tokens=64)
    plan = planner.plan(spec, search_max=False)
    assert plan.host_page_bytes_per_rank_logical == captured.pages.nbytes()
    assert plan.host_page_bytes_per_rank == captured.pages.nbytes(allocated=True)
    assert plan.page_bytes_per_token == captured.pages.bytes_per_token()


# ---- every read agrees --------------------------------------------------------------------------


def test_fp8_pages_read_the_same_in_every_path():
    """fp64: streamed capture (index keys read back from the pages by windows) and whole capture
    (keys round-tripped through the format) store the same pages and select the same keys;
    decoding from fp8 pages gives the log-probs scoring gives (<= 1e-9, as with model pages in
    test_decode.py: both read the same dequantised prompt keys)."""
    cfg, model = build_tiny_glm(torch.float64)
    prompt = torch.randint(0, cfg.vocab_size, (150,), generator=torch.Generator().manual_seed(4))
    # test_capture_streamed.py's blocks (streamed capture equals whole capture bitwise with them)
    blocks = dict(key_block=32, query_block=16, token_block=64, index_key_pages="fp8",
                  max_response_len=64)
    streamed = _fp8_capture(model, prompt, LongStrawConfig.of(**blocks), prompt_grad=PromptGrad.EXACT)
    whole = _fp8_capture(model, prompt, LongStrawConfig.of(capture="whole", **blocks),
                         prompt_grad=PromptGrad.EXACT)
    for layer in streamed.pages.layers():
        for kind in streamed.pages.kinds(layer):
            assert torch.equal(streamed.pages.fetch(layer, kind), whole.pages.fetch(layer, kind))
    assert streamed.backward.selections.keys() == whole.backward.selections.keys()
    for layer, selection in streamed.backward.selections.items():
        assert torch.equal(selection, whole.backward.selections[layer])
    ls = LongStrawConfig.of(group_size=2, **blocks)
    outs = generate(model, streamed, 2, SamplingParams(max_new_tokens=4, seed=7), ls)
    for out in outs:
        scored, _ = score_member(model, streamed, out.token_ids, ls)
        assert (scored.double() - out.logprobs).abs().max() <= 1e-9


# ---- fidelity against model-dtype pages ---------------------------------------------------------

WIDE = dict(hidden_size=256, num_hidden_layers=3, num_attention_heads=4, q_lora_rank=64,
            kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
            intermediate_size=512, first_k_dense_replace=3, index_n_heads=8, index_head_dim=128,
            index_topk=128)
"""A wider GLM-5.2: GLM-5.2's index-key width (128) and a top-k of 128 over a 2K-token prompt
(16x), 8 index heads, hidden 256, 3 dense layers (all full indexer layers)."""


def _recall(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Per query row of two selections [s, k] (global positions, -1 = none): the fraction of the
    reference's selected keys the other keeps (rows that select nothing are left out)."""
    out = []
    for ref_row, other_row in zip(reference.tolist(), other.tolist()):
        ref_set = {p for p in ref_row if p >= 0}
        if ref_set:
            out.append(len(ref_set & {p for p in other_row if p >= 0}) / len(ref_set))
    return torch.tensor(out, dtype=torch.float64)


# Measured (bf16; docs/usage.md "Conventions worth knowing", index-key pages): per-layer mean recall 0.936-0.981 over six seeds of
# the tiny model (k = 16 of 256 keys) and 0.959-0.982 over two seeds of the wide one (k = 128 of
# 2048; 0.957-0.978 at P = 4097); the first full indexer layer of capture, where queries and keys
# differ only by the page format, 0.977-0.982. Each later layer also sees the earlier layers'
# changed selections, hence its lower recall. Log-probs: max |d| 1.3e-2 - 2.3e-2, mean 2.9e-3 -
# 6.2e-3. The recall bounds sit under the worst measured value by more than ten times the spread
# over seeds (~0.003) and above what a broken format gives: each scale applied to the next row,
# 0.72-0.87; the value bytes read as e5m2, 0.04-0.18 (chance: k / P = 0.06). The log-prob
# bounds are loose checks only: a random-weight model's log-probs hardly depend on the prompt
# (zeroing every page moves them by at most 5e-2 on the tiny model, 0.14-0.20 on the wide one).
MIN_LAYER_RECALL = 0.90
MIN_FIRST_LAYER_RECALL = 0.95
MAX_LOGP_DIFF = 0.05
MAX_MEAN_LOGP_DIFF = 0.01


@pytest.mark.parametrize("name,overrides,prompt_len", [("tiny", {}, 257), ("wide", WIDE, 2049)])
def test_fp8_index_key_fidelity(name, overrides, prompt_len):
    cfg, model = build_tiny_glm(torch.bfloat16, **overrides)
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=gen)
    response = torch.randint(0, cfg.vocab_size, (32,), generator=gen)
    runs = {}
    for pages in ("model", "fp8"):
        ls = LongStrawConfig.of(page_tokens=1024, index_key_pages=pages)
        captured = _fp8_capture(model, prompt, ls, prompt_grad=PromptGrad.EXACT)
        with torch.no_grad():
            logp, used = score_member(model, captured, response, ls)
        runs[pages] = (captured, logp.double(), used)
    (model_pages, model_logp, model_used), (fp8_pages, fp8_logp, fp8_used) = runs.values()
    full_layers = sorted(model_used)
    head_dim = cfg.index_head_dim
    for layer in full_layers:      # bf16 model pages: 2 B a value; fp8: 1 B + one fp32 scale
        assert model_pages.pages.nbytes(layer, INDEX_KEY) == (prompt_len - 1) * head_dim * 2
        assert fp8_pages.pages.nbytes(layer, INDEX_KEY) == (prompt_len - 1) * (head_dim + 4)
    # Capture: every prompt query of every full indexer layer; scoring: every response query.
    capture_recall = {layer: _recall(model_pages.backward.selections[layer],
                                     fp8_pages.backward.selections[layer]) for layer in full_layers}
    score_recall = {layer: _recall(model_used[layer], fp8_used[layer]) for layer in full_layers}
    diff = (fp8_logp - model_logp).abs()
    model_pages.pages.zero_()      # scale: how much the log-probs depend on the prompt at all
    with torch.no_grad():
        blind, _ = score_member(model, model_pages, response, LongStrawConfig.of(page_tokens=1024))
    prompt_effect = (blind.double() - model_logp).abs()
    print(f"\n{name} GLM-5.2 (index_head_dim {head_dim}, top-k {cfg.index_topk}, P {prompt_len}, "
          f"R {response.numel()}, bf16): index-key page bytes per token and full indexer layer "
          f"{fp8_pages.pages.nbytes(0, INDEX_KEY) // (prompt_len - 1)} (fp8) vs "
          f"{model_pages.pages.nbytes(0, INDEX_KEY) // (prompt_len - 1)} (bf16)")
    for what, recalls in (("capture", capture_recall), ("scoring", score_recall)):
        print(f"  {what} top-k recall per layer (mean / min): " + ", ".join(
            f"L{layer} {r.mean():.4f} / {r.min():.4f}" for layer, r in recalls.items()))
    print(f"  scored log-probs: max |d| {diff.max():.2e}, mean {diff.mean():.2e} (zeroed prompt "
          f"pages: max {prompt_effect.max():.2e}, mean {prompt_effect.mean():.2e})")
    assert not torch.equal(fp8_logp, model_logp)               # the quantisation is real
    assert capture_recall[full_layers[0]].mean() >= MIN_FIRST_LAYER_RECALL
    for recalls in (capture_recall, score_recall):
        assert all(r.mean() >= MIN_LAYER_RECALL for r in recalls.values())
    assert diff.max() <= MAX_LOGP_DIFF and diff.mean() <= MAX_MEAN_LOGP_DIFF
