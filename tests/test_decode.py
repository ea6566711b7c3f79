"""Generation from the captured state (decode.py, mode `decode`): the log-probs it returns equal
what scoring (`replay.score_member`, the training path, itself tested against full-sequence
forwards) computes for the same tokens, for the three families (fp64, <= 1e-9); sampling
controls against hand-computed distributions; stop ids, seeds and bad parameters."""

import math

import pytest
import torch

from helpers import build_tiny_glm, build_tiny_qwen
from megatron_longstraw.context.capture import capture_prompt
from megatron_longstraw.config.settings import LongStrawConfig
from megatron_longstraw.rollout.decode import _sampling_logprobs, generate
from megatron_longstraw.config.sampling import SamplingParams
from megatron_longstraw.step.replay import score_member

pytestmark = pytest.mark.usefixtures("single_process")


def _build(family):
    if family == "deepseekv3":
        from test_deepseekv3 import build_tiny_deepseekv3

        return build_tiny_deepseekv3(torch.float64)
    return (build_tiny_glm if family == "glm52" else build_tiny_qwen)(torch.float64)


def _cfg(members):
    return LongStrawConfig.of(group_size=members, query_block=7, key_block=23, token_block=19,
                           max_response_len=64)


# GLM-5.2's prompt is several times its top-k (DSA selects; IndexShare layers reuse); a one-token
# prompt (nothing captured: the member starts from zero state) once.
@pytest.mark.parametrize("family,prompt_len", [("glm52", 90), ("glm52", 1), ("qwen36", 50),
                                               ("deepseekv3", 40)])
def test_decoded_logprobs_equal_scoring_of_the_same_tokens(family, prompt_len):
    cfg, model = _build(family)
    prompt = torch.randint(0, cfg.vocab_size, (prompt_len,),
                           generator=torch.Generator().manual_seed(4))
    ls = _cfg(3)
    captured = capture_prompt(model, prompt, ls)
    outs = generate(model, captured, 3, SamplingParams(max_new_tokens=9, seed=7), ls)
    assert len({tuple(o.token_ids.tolist()) for o in outs}) > 1   # members sample on their own
    worst = 0.0
    for out in outs:
        assert out.token_ids.numel() == 9 and not out.stopped
        scored, _ = score_member(model, captured, out.token_ids, ls)
        worst = max(worst, float((scored.double() - out.logprobs).abs().max()))
        # temperature 1, no truncation: the sampling distribution is the model's
        assert torch.allclose(out.sample_logprobs, out.logprobs, rtol=0, atol=1e-12)
    print(f"{family} P={prompt_len}: decode vs scoring max |d logp| {worst:.1e}")
    assert worst <= 1e-9


def test_stop_ids_end_a_member_and_the_seed_fixes_the_samples():
    cfg, model = _build("glm52")
    prompt = torch.randint(0, cfg.vocab_size, (60,), generator=torch.Generator().manual_seed(1))
    ls = _cfg(4)
    captured = capture_prompt(model, prompt, ls)
    params = SamplingParams(max_new_tokens=6, seed=3)
    first = generate(model, captured, 4, params, ls)
    again = generate(model, captured, 4, params, ls)
    assert all(torch.equal(a.token_ids, b.token_ids) for a, b in zip(first, again))
    other = generate(model, captured, 4, SamplingParams(max_new_tokens=6, seed=4), ls)
    assert any(not torch.equal(a.token_ids, b.token_ids) for a, b in zip(first, other))
    # Stop at the token member 0 sampled second: it ends there (the stop id kept), and the
    # members that do not meet it run to max_new_tokens with the same samples before it.
    stop = int(first[0].token_ids[1])
    stopped = generate(model, captured, 4, SamplingParams(max_new_tokens=6, seed=3,
                                                          stop_ids=(stop,)), ls)
    for full, cut in zip(first, stopped):
        hits = (full.token_ids == stop).nonzero().flatten()
        end = int(hits[0]) + 1 if hits.numel() else 6
        assert torch.equal(cut.token_ids, full.token_ids[:end]) and cut.stopped == bool(hits.numel())
    assert stopped[0].token_ids.numel() <= 2 and stopped[0].stopped
    greedy = generate(model, captured, 2, SamplingParams(max_new_tokens=4, temperature=0), ls)
    assert torch.equal(greedy[0].token_ids, greedy[1].token_ids)
    assert torch.equal(greedy[0].sample_logprobs, torch.zeros(4, dtype=torch.float64))


def test_sampling_distribution_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]], dtype=torch.float64))
    # temperature 0.5: p^2 renormalised
    got = _sampling_logprobs(logits, SamplingParams(max_new_tokens=1, temperature=0.5)).exp()
    want = torch.tensor([0.25, 0.0625, 0.0225, 0.01]) / 0.345
    assert torch.allclose(got[0], want.double(), atol=1e-12)
    # top-k 2: {0.5, 0.25} renormalised
    got = _sampling_logprobs(logits, SamplingParams(max_new_tokens=1, top_k=2)).exp()
    assert torch.allclose(got[0], torch.tensor([2 / 3, 1 / 3, 0, 0], dtype=torch.float64))
    # top-p 0.7: 0.5 < 0.7, 0.5 + 0.25 >= 0.7 -> the two most likely
    got = _sampling_logprobs(logits, SamplingParams(max_new_tokens=1, top_p=0.7)).exp()
    assert torch.allclose(got[0], torch.tensor([2 / 3, 1 / 3, 0, 0], dtype=torch.float64))
    # top-p 0.76: needs the third (0.75 < 0.76)
    got = _sampling_logprobs(logits, SamplingParams(max_new_tokens=1, top_p=0.76)).exp()
    assert torch.allclose(got[0], torch.tensor([0.5, 0.25, 0.15, 0], dtype=torch.float64) / 0.9)
    assert math.isclose(float(got.sum()), 1.0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=1, temperature=-1), "temperature"),
    (dict(max_new_tokens=1, top_p=0), "top_p"), (dict(max_new_tokens=1, top_k=-2), "top_k")])
def test_bad_sampling_parameters_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("world,cases", [
    (2, [("glm52", 2, 2, 90), ("qwen36", 2, 1, 50), ("deepseekv3", 2, 2, 40)])])
def test_decode_under_cp_and_ep_equals_one_process(tmp_path, world, cases):
    """Real gloo ranks: every rank samples the same tokens as one process, with the same
    log-probs (fp64, <= 1e-9): the shards' partial attentions, the merged DSA top-k, GDN's
    heads and EP's experts give one process's distribution."""
    import dist_workers
    from distributed import run_ranks

    references, jobs = [], []
    for family, cp, ep, prompt_len in cases:
        cfg, model = _build(family)
        path = tmp_path / f"{family}.pt"
        torch.save({k: v.clone() for k, v in model.state_dict().items()
                    if not k.endswith("_extra_state")}, path)
        prompt = torch.randint(0, cfg.vocab_size, (prompt_len,),
                               generator=torch.Generator().manual_seed(4))
        ls = _cfg(3)
        captured = capture_prompt(model, prompt, ls)
        references.append(generate(model, captured, 3, SamplingParams(max_new_tokens=6, seed=7), ls))
        jobs.append((family, cp, ep, str(path), prompt_len))
    outs = run_ranks(dist_workers.decode_worker, world, cases=jobs)
    for case, (family, cp, ep, _) in enumerate(cases):
        worst = 0.0
        for out in outs:
            for (tokens, logps), ref in zip(out[case], references[case]):
                assert torch.equal(tokens, ref.token_ids), (family, tokens, ref.token_ids)
                worst = max(worst, float((logps - ref.logprobs).abs().max()))
        print(f"{family} CP{cp}/EP{ep}: decode vs one process max |d logp| {worst:.1e}")
        assert worst <= 1e-9


# ---- long responses: the generated rows are pages, read a window or a selection at a time ------

def _paged_cfg(members):
    """Pages of 4 rows and key windows of 5: a response of 13 tokens spans 4 pages and 3 windows,
    and a window straddles the prompt's last rows and the first generated ones."""
    return LongStrawConfig.of(group_size=members, query_block=7, key_block=5, token_block=19,
                           page_tokens=4, max_response_len=64)


@pytest.mark.parametrize("family,prompt_len", [("glm52", 30), ("qwen36", 22), ("deepseekv3", 22)])
def test_a_response_over_several_pages_and_key_windows_decodes_as_scoring(family, prompt_len):
    """fp64, <= 1e-9 as above: the members' generated rows, appended to their pages one per step
    and read back a key window (dense attention, DSA's top-k) or a selection (MLA's latent rows)
    at a time, give scoring's log-probs. GLM-5.2's top-k (16) is below the 43 keys of the last
    step, so its selections are sparse over the prompt's and the generated rows."""
    cfg, model = _build(family)
    prompt = torch.randint(0, cfg.vocab_size, (prompt_len,),
                           generator=torch.Generator().manual_seed(5))
    ls = _paged_cfg(2)
    captured = capture_prompt(model, prompt, ls)
    outs = generate(model, captured, 2, SamplingParams(max_new_tokens=13, seed=11), ls)
    worst = 0.0
    for out in outs:
        assert out.token_ids.numel() == 13
        scored, _ = score_member(model, captured, out.token_ids, ls)
        worst = max(worst, float((scored.double() - out.logprobs).abs().max()))
    print(f"{family} P={prompt_len}, 13 tokens over pages of 4: max |d logp| {worst:.1e}")
    assert worst <= 1e-9


@pytest.mark.parametrize("family", ["glm52", "qwen36"])
def test_decode_device_bytes_do_not_grow_with_the_tokens_generated(family):
    """Live bytes on the device (CPU meter, host storage left out: `memory.note_host` names the
    pages, the members' branch pages included; `PageStore.device_copies`: prompt reads copy, as
    to a device) at their peak over a whole generation of N = 8 and of 4N = 32 tokens (two
    members, pages of 4 rows, key windows of 4), so the late steps of the long one and everything
    held between steps are in it. A step reads one key window of a layer's rows (dense
    attention, DSA's top-k) and one selection of at most top-k latent rows (MLA), whatever the
    tokens generated; so the peaks may differ by less than one key window of one layer's rows of
    every kind (the bound). A cache of the members' generated rows on the device (the previous
    `DecodeCache`: buffers of max_new_tokens rows per member, layer and kind) grows by
    3N x members x (row bytes over layers and kinds), far above the bound (asserted too)."""
    from megatron_longstraw.runtime.memory import LiveBytesMeter
    from megatron_longstraw.state.pages import PageStore

    cfg, model = _build(family)
    prompt = torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(6))
    ls = LongStrawConfig.of(group_size=2, query_block=8, key_block=4, token_block=32, page_tokens=4,
                         max_response_len=64)
    captured = capture_prompt(model, prompt, ls)
    pages, fixed = captured.pages, set(captured.pages.fixed_kinds())
    row_bytes = pages.bytes_per_token()           # one token's rows over every layer and kind
    layer_row_bytes = max(sum(pages.nbytes(layer, kind) for kind in pages.kinds(layer)
                              if kind not in fixed)
                          for layer in pages.layers()) // captured.prefix_len
    num_new = 8
    peaks = []
    PageStore.device_copies = True
    try:
        for tokens in (num_new, 4 * num_new):
            with LiveBytesMeter("cpu", exclude_host=True) as meter:
                outs = generate(model, captured, 2, SamplingParams(max_new_tokens=tokens, seed=7),
                                ls)
            assert all(out.token_ids.numel() == tokens for out in outs)
            peaks.append(meter.peak_bytes)
    finally:
        PageStore.device_copies = False
    bound = ls.capture.key_block * layer_row_bytes      # one key window of one layer, every kind
    device_cache_growth = 3 * num_new * 2 * row_bytes
    print(f"{family}: peak live bytes {peaks[0]} ({num_new} tokens) vs {peaks[1]} "
          f"({4 * num_new}); bound on the growth {bound} B; a device cache would grow by "
          f"{device_cache_growth:.0f} B")
    assert device_cache_growth > 10 * bound
    assert peaks[1] - peaks[0] < bound
