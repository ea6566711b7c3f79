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
from megatron_longstraw.training.replay import score_member

pytestmark = pytest.mark.usefixtures("single_process")


def _build(family):
    if family == "deepseekv3":
        from test_deepseekv3 import build_tiny_deepseekv3

        return build_tiny_deepseekv3(torch.float64)
    return (build_tiny_glm if family == "glm52" else build_tiny_qwen)(torch.float64)


def _cfg(members):
    return LongStrawConfig(group_size=members, query_block=7, key_block=23, token_block=19,
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
