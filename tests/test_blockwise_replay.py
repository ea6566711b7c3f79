"""Blockwise branches (step/replay.py, `response_block`): a response longer than a block is
scored and replayed block by block, its earlier blocks' state in host pages and the backward
walking the blocks in reverse. The same numbers as the whole branch: log-probs, DSA selections,
every parameter's gradient, detached and exact (fp64, three families, CP 1 here; CP 2 in
tests/test_blockwise_replay_cp.py); the exact mode also equals plain autograd over the full
sequences (models/reference.full_sequence_logprobs: no capture, no replay)."""

import pytest
import torch

from helpers import build_tiny_glm, build_tiny_qwen, full_sequence_logprobs
from megatron_longstraw.config.loss import GRPOLossConfig
from megatron_longstraw.config.settings import LongStrawConfig
from megatron_longstraw.context.capture import capture_prompt
from megatron_longstraw.data.group import GRPOGroup
from megatron_longstraw.grpo.loss import grpo_loss
from megatron_longstraw.step.replay import branch_blocks, score_member
from megatron_longstraw.step.schedule import forward_backward_longstraw

pytestmark = pytest.mark.usefixtures("single_process")

# GDN's chunked rule works in chunks of 64 tokens: blocks of 23 put boundaries at 23, 46, 69 and
# 92, inside chunks; GLM-5.2's top-k (16) then selects across them (checked below).
LENS = (5, 30, 97)
BLOCK = 23


def _build(family):
    if family == "deepseekv3":
        from test_deepseekv3 import build_tiny_deepseekv3

        return build_tiny_deepseekv3(torch.float64)
    return (build_tiny_glm if family == "glm52" else build_tiny_qwen)(torch.float64)


def _group(vocab, prompt_len):
    gen = torch.Generator().manual_seed(5)
    return GRPOGroup(prompt_ids=torch.randint(0, vocab, (prompt_len,), generator=gen),
                     response_ids=[torch.randint(0, vocab, (n,), generator=gen) for n in LENS],
                     rewards=torch.tensor([1.0, 0.0, 0.25], dtype=torch.float64))


def _config(block, mode="detached", **kw):
    return LongStrawConfig.of(group_size=len(LENS), query_block=13, key_block=37, token_block=50,
                           max_response_len=128, clip_eps_high=0.28, prompt_grad=mode,
                           response_block=block, **kw)


def _grads(model, group, ls):
    model.zero_grad(set_to_none=True)
    result = forward_backward_longstraw(model, group, ls)
    return result, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _worst(got, ref):
    assert got.keys() == ref.keys() and got
    return max(float((got[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-300)) for n in ref)


def test_blocks_cover_the_branch_and_round_to_the_cp_size():
    assert branch_blocks(97, 23, 1) == [(0, 23), (23, 46), (46, 69), (69, 92), (92, 97)]
    assert branch_blocks(97, 8192, 1) == [(0, 97)]
    # CP 4: blocks of 24 (23 rounded up), the last one padded to 4 rows a rank
    assert branch_blocks(97, 23, 4) == [(0, 24), (24, 48), (48, 72), (72, 96), (96, 100)]
    assert branch_blocks(5, 23, 4) == [(0, 8)]


@pytest.mark.parametrize("family,prompt_len", [("glm52", 40), ("qwen36", 40),
                                               ("deepseekv3", 40)])
def test_blockwise_scoring_equals_the_whole_branch(family, prompt_len):
    cfg, model = _build(family)
    group = _group(cfg.vocab_size, prompt_len)
    whole, blocks = _config(8192), _config(BLOCK)
    captured = capture_prompt(model, group.prompt_ids, whole)
    for response in group.response_ids:
        logp, selections = score_member(model, captured, response, whole)
        logp_b, selections_b = score_member(model, captured, response, blocks)
        assert float((logp_b - logp).abs().max()) <= 1e-12
        assert selections.keys() == selections_b.keys()
        for layer, sel in selections.items():
            # the same set of keys per query (a block with fewer keys than the top-k pads with -1)
            width = max(sel.shape[1], selections_b[layer].shape[1])
            pad = [torch.nn.functional.pad(s, (0, width - s.shape[1]), value=-1).sort(1).values
                   for s in (sel, selections_b[layer])]
            assert torch.equal(*pad), layer
    if family == "glm52":   # queries after a block boundary select keys of earlier blocks
        sel = selections[0][BLOCK:2 * BLOCK]
        branch_keys = (sel >= prompt_len - 1) & (sel < prompt_len - 1 + BLOCK)
        assert bool(branch_keys.any())


@pytest.mark.parametrize("family,mode", [("glm52", "detached"), ("glm52", "exact"),
                                         ("qwen36", "detached"), ("qwen36", "exact"),
                                         ("deepseekv3", "exact")])
def test_blockwise_replay_equals_whole_branch_replay(family, mode):
    cfg, model = _build(family)
    group = _group(cfg.vocab_size, 40)
    whole, whole_grads = _grads(model, group, _config(8192, mode))
    blocks, block_grads = _grads(model, group, _config(BLOCK, mode))
    worst = _worst(block_grads, whole_grads)
    print(f"{family} {mode}: blockwise vs whole-branch gradients {worst:.2e}")
    assert worst <= 1e-12
    assert abs(blocks.loss - whole.loss) <= 1e-12
    for a, b in zip(blocks.logps, whole.logps):
        assert float((a - b).abs().max()) <= 1e-12
    for key in ("clip_frac", "ratio_mean", "ratio_max", "ratio_min", "kl"):
        assert abs(blocks.stats[key] - whole.stats[key]) <= 1e-12, key


@pytest.mark.parametrize("family", ["glm52", "qwen36"])
def test_replay_over_the_pages_scoring_kept_equals_its_own_forward(family):
    """`reuse_branch_pages`: scoring's blocks' state serves replay (no forward of its own): the
    same gradients, log-probs and loss as replay's own forward (exact mode: prompt cotangents
    too)."""
    cfg, model = _build(family)
    group = _group(cfg.vocab_size, 40)
    own, own_grads = _grads(model, group, _config(BLOCK, "exact"))
    reused, reused_grads = _grads(model, group, _config(BLOCK, "exact", reuse_branch_pages=True))
    assert _worst(reused_grads, own_grads) <= 1e-12
    assert abs(reused.loss - own.loss) <= 1e-12
    for a, b in zip(reused.logps, own.logps):
        assert float((a - b).abs().max()) <= 1e-12


@pytest.mark.parametrize("family,checkpoint_layers", [("glm52", True), ("qwen36", False)])
def test_blockwise_exact_replay_equals_full_sequence_autograd(family, checkpoint_layers):
    cfg, model = _build(family)
    group = _group(cfg.vocab_size, 40)
    model.zero_grad(set_to_none=True)
    logps = [full_sequence_logprobs(model, group.prompt_ids, r) for r in group.response_ids]
    grpo_loss(logps, [lp.detach() for lp in logps], group.rewards,
              GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.28)).backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    _, exact = _grads(model, group, _config(BLOCK, "exact", checkpoint_layers=checkpoint_layers))
    worst = _worst(exact, reference)
    print(f"{family}: blockwise exact vs full autograd {worst:.2e}")
    assert worst <= 1e-9


def test_blockwise_under_cp_equals_whole_branch_and_full_autograd(tmp_path):
    """Real gloo ranks, CP 2 (x EP 2 for the MoE families): every block split into two shares
    (blocks of 23 rounded up to 24), attention over each rank's prompt shard, its rows of the
    earlier blocks and the block's gathered rows; GDN's rows <-> heads exchange per block. Blockwise
    equals the whole branch under CP (detached and exact), and the exact mode equals full-sequence
    autograd on one process, for every parameter; scoring's log-probs equal one process's."""
    import dist_workers
    from distributed import run_ranks

    settings = [dict(response_block=8192), dict(response_block=BLOCK),
                dict(response_block=8192, prompt_grad="exact"),
                dict(response_block=BLOCK, prompt_grad="exact")]
    cases, references, jobs = [("glm52", 2, 2), ("qwen36", 2, 1), ("deepseekv3", 2, 2)], [], []
    for family, cp, ep in cases:
        cfg, model = _build(family)
        path = tmp_path / f"{family}.pt"
        torch.save({k: v.clone() for k, v in model.state_dict().items()
                    if not k.endswith("_extra_state")}, path)
        group = _group(cfg.vocab_size, 40)
        model.zero_grad(set_to_none=True)
        logps = [full_sequence_logprobs(model, group.prompt_ids, r) for r in group.response_ids]
        grpo_loss(logps, [lp.detach() for lp in logps], group.rewards,
                  GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.28)).backward()
        references.append(({n: p.grad.clone() for n, p in model.named_parameters()
                            if p.grad is not None}, [lp.detach() for lp in logps]))
        jobs.append((family, cp, ep, str(path), 40))
    outs = run_ranks(dist_workers.blockwise_worker, 2, cases=jobs, lens=LENS, settings=settings)
    for case, (family, cp, ep) in enumerate(cases):
        reference, logps = references[case]
        for rank_out in outs:
            whole, blocks, whole_exact, blocks_exact = rank_out[case]
            for a, b in ((blocks, whole), (blocks_exact, whole_exact)):
                # experts live on their owners: compare the names this rank holds
                worst = max(float((a["grads"][n] - b["grads"][n]).norm()
                                  / b["grads"][n].norm().clamp_min(1e-300)) for n in b["grads"])
                assert a["grads"].keys() == b["grads"].keys()
                assert worst <= 1e-12, (family, worst)
                assert abs(a["loss"] - b["loss"]) <= 1e-12
            for got, want in zip(blocks["logps_old"], logps):
                assert float((got - want).abs().max()) <= 1e-9, family
        grads = [rank_out[case][3]["grads"] for rank_out in outs]
        assert set().union(*grads) == set(reference)
        worst = max(float((g[n] - reference[n]).norm() / reference[n].norm().clamp_min(1e-300))
                    for g in grads for n in g)
        print(f"{family} CP{cp}/EP{ep}: blockwise exact vs full autograd {worst:.2e}")
        assert worst <= 1e-9, (family, worst)
