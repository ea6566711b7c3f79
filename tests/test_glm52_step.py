"""The GLM-5.2 LongStraw step on one process: response-operator fidelity, gradients, memory, pages,
bad input. References are plain full-sequence Megatron forwards of `[prompt; response]`, built
without the capture/replay code (tests/helpers.py)."""

import dataclasses

import pytest
import torch

from helpers import build_tiny_glm, full_sequence_logprobs, scoring_vs_full_sequence
from megatron_longstraw.context.capture import capture_prompt
from megatron_longstraw.config.settings import LongStrawConfig
from megatron_longstraw.config.choices import PromptGrad
from megatron_longstraw.grpo.loss import grpo_loss
from megatron_longstraw.config.loss import GRPOLossConfig
from megatron_longstraw.models.common import decoder_groups, embed, run_group
from megatron_longstraw.step.replay import score_member
from megatron_longstraw.step.schedule import forward_backward_longstraw
from megatron_longstraw.data.group import GRPOGroup
from megatron_longstraw.state.attention_pass import AttentionPass

pytestmark = pytest.mark.usefixtures("single_process")

PROMPT_LEN = 300          # index_topk is 16: the prompt is ~19x longer than the selection
RESPONSE_LENS = (1, 6, 17)


def _group(vocab: int, prompt_len: int = PROMPT_LEN, lens=RESPONSE_LENS, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=gen)
    responses = [torch.randint(0, vocab, (n,), generator=gen) for n in lens]
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, -1.0, 0.25, 0.0, 1.5][:len(lens)], dtype=torch.float64)
    return GRPOGroup(prompt_ids=prompt, response_ids=responses, rewards=rewards)


def _small_blocks(**kw) -> LongStrawConfig:
    # Blocks that do not divide the lengths, so block boundaries fall inside every phase.
    kw.setdefault("group_size", len(RESPONSE_LENS))
    return LongStrawConfig.of(query_block=29, key_block=37, token_block=50, max_response_len=64, **kw)


# fp64: the two paths differ only in summation order (blockwise top-k / attention, chunked
# projections), so agreement is at rounding level; 1e-9 leaves ~6 orders of margin. fp32: 1e-5.
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-5)])
def test_replay_logprobs_equal_full_sequence(dtype, tol):
    cfg, model = build_tiny_glm(dtype)
    group = _group(cfg.vocab_size)
    ls = _small_blocks()
    worst, _ = scoring_vs_full_sequence(model, group, capture_prompt(model, group.prompt_ids, ls), ls)
    assert worst <= tol


def test_indexshare_and_indexer_replay_use_the_reference_selection():
    cfg, model = build_tiny_glm(torch.float64)
    assert {"full", "shared"} <= set(cfg.indexer_types())
    group = _group(cfg.vocab_size, lens=(9,))
    ls = _small_blocks()
    response = group.response_ids[0]
    ids = torch.cat([group.prompt_ids, response])

    reference_used: dict = {}
    state = AttentionPass(mode="full", positions=torch.arange(ids.numel()), query_block=29,
                          key_block=37, used_selections=reference_used)
    with torch.no_grad():
        hidden = embed(model, ids)
        for group_layers in decoder_groups(model):
            hidden = run_group(group_layers, hidden, state)

    captured = capture_prompt(model, group.prompt_ids, ls)
    _, scored = score_member(model, captured, response, ls)
    rows = slice(group.prompt_ids.numel() - 1, ids.numel() - 1)
    for layer in range(cfg.num_hidden_layers):
        source = cfg.topk_source_layer(layer)
        # IndexShare: every layer attends with its source layer's selection, in the reference too.
        assert torch.equal(reference_used[layer], reference_used[source])
        # Scoring picks exactly the reference's top-k for the response rows (indices < P - 1 are
        # prompt pages; the rest are the branch's own tokens, same positions in both).
        assert torch.equal(scored[source], reference_used[source][rows])
    # The selections really are sparse over a long prompt.
    assert scored[0].shape[1] == cfg.index_topk < group.prompt_ids.numel()
    # Kept compact while all G members wait for replay: int32, in host memory when pages are.
    assert all(sel.dtype == torch.int32 for sel in scored.values())

    # Replay reuses the scoring selections (indexer replay): the layers attend with them.
    used: dict = {}
    from megatron_longstraw.step import replay as replay_mod
    branch = replay_mod.make_branch(captured, response)
    state = dataclasses.replace(replay_mod._pass(captured, branch, ls, selections=scored),
                                used_selections=used)
    with torch.no_grad():
        replay_mod._run_branch(model, captured, branch, state, checkpoint_layers=False)
    for layer in range(cfg.num_hidden_layers):
        assert torch.equal(used[layer], scored[cfg.topk_source_layer(layer)])


def _reference_grads(model, group, trainable, detach_prompt_state):
    loss_cfg = GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.28)
    for p in model.parameters():
        p.grad = None
    logps = [full_sequence_logprobs(model, group.prompt_ids, r, detach_prompt_state)
             for r in group.response_ids]
    olds = [lp.detach() for lp in logps]
    grpo_loss(logps, olds, group.rewards, loss_cfg).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()
            if n in trainable and p.grad is not None}


def _longstraw_grads(model, group, trainable, **kw):
    for p in model.parameters():
        p.grad = None
    ls = _small_blocks(clip_eps_high=0.28, **kw)
    forward_backward_longstraw(model, group, ls)
    return {n: p.grad.clone() for n, p in model.named_parameters()
            if n in trainable and p.grad is not None}


def _assert_close(got, ref, rel):
    """Relative error per parameter, ||got - ref|| / ||ref||."""
    assert got.keys() == ref.keys() and got
    worst = 0.0
    for name in ref:
        err = float((got[name] - ref[name]).norm() / ref[name].norm().clamp_min(1e-300))
        worst = max(worst, err)
        assert err <= rel, f"{name}: relative error {err:.3e} > {rel}"
    print(f"worst relative gradient error {worst:.3e}")


def test_gradients_post_attention_params_equal_full_autograd():
    """Only the final norm and output layer train: LongStraw's gradient is the exact GRPO gradient."""
    cfg, model = build_tiny_glm(torch.float64)
    trainable = {"decoder.final_norm.weight", "output_layer.weight"}
    for name, p in model.named_parameters():
        p.requires_grad_(name in trainable)
    group = _group(cfg.vocab_size)
    ref = _reference_grads(model, group, trainable, detach_prompt_state=False)
    got = _longstraw_grads(model, group, trainable)
    _assert_close(got, ref, rel=1e-9)
    assert all(g.abs().sum() > 0 for g in got.values())


@pytest.mark.parametrize("checkpoint_layers", [True, False])
def test_gradients_all_params_equal_autograd_with_detached_prompt_state(checkpoint_layers):
    cfg, model = build_tiny_glm(torch.float64)
    trainable = {n for n, _ in model.named_parameters()}
    group = _group(cfg.vocab_size)
    ref = _reference_grads(model, group, trainable, detach_prompt_state=True)
    got = _longstraw_grads(model, group, trainable, checkpoint_layers=checkpoint_layers)
    # Same parameters receive gradients in both; the indexer in neither (it only selects).
    assert not any("indexer" in n for n in got)
    _assert_close(got, ref, rel=1e-9)
    assert any("experts" in n and g.abs().sum() > 0 for n, g in got.items())


def test_detached_prompt_state_is_an_approximation():
    """The detached gradient differs from the full one for parameters that shape the prompt state:
    the comparison above is not vacuous."""
    cfg, model = build_tiny_glm(torch.float64)
    name = "decoder.layers.0.self_attention.linear_kv_down_proj.weight"
    group = _group(cfg.vocab_size)
    exact = _reference_grads(model, group, {name}, detach_prompt_state=False)[name]
    detached = _reference_grads(model, group, {name}, detach_prompt_state=True)[name]
    assert (exact - detached).abs().max() > 1e-6 * exact.abs().max()


def test_the_member_loss_is_computed_once_per_member_in_replay(monkeypatch):
    """A training step calls member_loss once per member, in replay under autograd, and reports
    those calls' loss (equal to grpo_loss of the returned log-probs); forward_only calls it once
    per member on scoring's log-probs."""
    from megatron_longstraw.grpo.loss import member_loss
    from megatron_longstraw.step import schedule

    cfg, model = build_tiny_glm(torch.float64)
    group = _group(cfg.vocab_size, prompt_len=64)
    ls = _small_blocks()
    calls = []

    def counted(logp, *args, **kw):
        calls.append(logp.requires_grad)
        return member_loss(logp, *args, **kw)

    monkeypatch.setattr(schedule, "member_loss", counted)
    result = forward_backward_longstraw(model, group, ls)
    assert calls == [True] * len(RESPONSE_LENS)
    expected = float(grpo_loss(result.logps, result.logps_old, group.rewards, ls.loss_config()))
    assert abs(result.loss - expected) <= 1e-12   # fp64 terms of size ~1: summation order only
    calls.clear()
    forward_backward_longstraw(model, group, ls, forward_only=True)
    assert calls == [False] * len(RESPONSE_LENS)


def test_page_bytes_per_token_match_design_count():
    cfg, model = build_tiny_glm(torch.float32)
    group = _group(cfg.vocab_size, prompt_len=257)
    captured = capture_prompt(model, group.prompt_ids, LongStrawConfig())
    # Hand count for the tiny config: 8 layers x (32 + 8) latent values + 4 full indexer layers x
    # 16 key values, fp32.
    assert captured.pages.bytes_per_token() == 8 * 40 * 4 + 4 * 16 * 4
    assert captured.pages.bytes_per_token() == cfg.page_bytes_per_token(4, 4)
    assert captured.pages.nbytes() == 256 * (8 * 40 + 4 * 16) * 4
    assert sorted(captured.pages.layers()) == list(range(8))


@pytest.mark.parametrize("mutate,needle", [
    (lambda g: g.response_ids.__setitem__(1, torch.tensor([], dtype=torch.long)), "member 1"),
    (lambda g: g.response_ids.__setitem__(0, torch.zeros(65, dtype=torch.long)), "max-response-len"),
    (lambda g: g.rewards.__setitem__(2, float("nan")), "member"),
    (lambda g: g.rewards.__setitem__(0, float("inf")), "member"),
    (lambda g: g.response_ids.__setitem__(2, torch.tensor([3, 512])), "vocabulary"),
    (lambda g: g.__setattr__("prompt_ids", torch.tensor([-1, 2, 3])), "vocabulary"),
])
def test_bad_input_rejected_before_any_work(monkeypatch, mutate, needle):
    cfg, model = build_tiny_glm(torch.float32)
    group = _group(cfg.vocab_size)
    mutate(group)

    def no_capture(*a, **k):
        raise AssertionError("work started before validation")

    monkeypatch.setattr("megatron_longstraw.step.schedule.capture_prompt", no_capture)
    with pytest.raises(ValueError, match=needle):
        forward_backward_longstraw(model, group, _small_blocks())


def test_attention_mask_is_a_pass_or_none():
    """The pass travels as Megatron's attention_mask (state/attention_pass.py): a pass and None
    (the plain full-sequence pass) give the same logits; a tensor mask is refused, not ignored."""
    cfg, model = build_tiny_glm(torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(ids, None, None)
        given = model(ids, None, attention_mask=AttentionPass(mode="full",
                                                              positions=torch.arange(12)))
        assert torch.equal(plain, given)
        with pytest.raises(ValueError, match="takes an AttentionPass"):
            model(ids, None, attention_mask=torch.ones(1, 1, 12, 12, dtype=torch.bool))


def test_group_of_one_rejected():
    cfg, model = build_tiny_glm(torch.float32)
    group = _group(cfg.vocab_size, lens=(5,))
    group.rewards = group.rewards[:1]
    with pytest.raises(ValueError, match="group of one|at least two"):
        forward_backward_longstraw(model, group, _small_blocks(group_size=2))
    with pytest.raises(ValueError, match="group_size"):
        LongStrawConfig.of(group_size=1)


def test_prompt_state_gradients_on_request():
    """Exact prompt gradient: with `PromptGrad.EXACT`, replay adds d loss / d latent pages
    to the store's buffers (one gradient per captured row, non-zero only on rows some query selected)."""
    cfg, model = build_tiny_glm(torch.float64)
    group = _group(cfg.vocab_size, lens=(7,))
    ls = _small_blocks()
    captured = capture_prompt(model, group.prompt_ids, ls)
    response = group.response_ids[0]
    from megatron_longstraw.step import replay as replay_mod
    branch = replay_mod.make_branch(captured, response)
    state = replay_mod._pass(captured, branch, ls, selections=None, prompt_grad=PromptGrad.EXACT)
    captured.pages.keep_grads()
    logp = replay_mod._run_branch(model, captured, branch, state, checkpoint_layers=True)
    logp.sum().backward()
    grads = [captured.pages.grad(layer, "latent") for layer in range(cfg.num_hidden_layers)]
    assert all(g is not None and g.shape == (group.prompt_ids.numel() - 1, 40) for g in grads)
    # Only the selected rows can receive gradient: at most R * k rows per layer are non-zero.
    nonzero_rows = (grads[3].abs().sum(-1) > 0).sum().item()
    assert 0 < nonzero_rows <= response.numel() * cfg.index_topk
