"""The Qwen3.6 LongStraw step on one process: response-operator fidelity, the captured GDN state,
fixed-size GDN state, gradients, replay memory. References are plain full-sequence Megatron forwards
of `[prompt; response]` (tests/helpers.py) and, for the GDN state, the delta rule written out token
by token below."""

import pytest
import torch
import torch.nn.functional as F

from helpers import build_tiny_qwen, full_sequence_logprobs, scoring_vs_full_sequence
from megatron_longstraw.context.capture import capture_prompt
from megatron_longstraw.config.settings import LongStrawConfig
from megatron_longstraw.config.choices import PromptGrad
from megatron_longstraw.grpo.loss import grpo_loss
from megatron_longstraw.config.loss import GRPOLossConfig
from megatron_longstraw.models.qwen36.config import Qwen36Config
from megatron_longstraw.models.qwen36.gdn import CONV_TAIL, GDN_STATE, LongStrawGatedDeltaNet
from megatron_longstraw.step.replay import score_member
from megatron_longstraw.step.schedule import forward_backward_longstraw
from megatron_longstraw.data.group import GRPOGroup

pytestmark = pytest.mark.usefixtures("single_process")

PROMPT_LEN = 150          # > 2 delta-rule chunks (64) and 3 capture token blocks (50)
RESPONSE_LENS = (1, 6, 17)


def _group(vocab: int, prompt_len: int = PROMPT_LEN, lens=RESPONSE_LENS, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=gen)
    responses = [torch.randint(0, vocab, (n,), generator=gen) for n in lens]
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0][:len(lens)], dtype=torch.float64)
    return GRPOGroup(prompt_ids=prompt, response_ids=responses, rewards=rewards)


def _small_blocks(**kw) -> LongStrawConfig:
    # Blocks that do not divide the lengths, so block boundaries fall inside every phase.
    kw.setdefault("group_size", len(RESPONSE_LENS))
    return LongStrawConfig.of(query_block=29, key_block=37, token_block=50, max_response_len=64, **kw)


# fp64: replay and the full forward differ only in summation order (delta-rule chunk boundaries,
# capture token blocks, attention key blocks), so they agree to rounding (observed ~1e-15); 1e-9
# leaves ~6 orders of margin while a wrong conv tail or state shifts log-probs by >1e-4.
# fp32: 1e-5 (observed ~5e-7).
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-5)])
def test_replay_logprobs_equal_full_sequence(dtype, tol):
    cfg, model = build_tiny_qwen(dtype)
    group = _group(cfg.vocab_size)
    ls = _small_blocks()
    captured = capture_prompt(model, group.prompt_ids, ls)
    worst, _ = scoring_vs_full_sequence(model, group, captured, ls)
    with torch.no_grad():
        # Not vacuous: the replayed log-probs depend on every kind of captured state (halving one
        # layer's state moves them by >1e-4, ten times the loosest tolerance).
        response = group.response_ids[1]
        base, _ = score_member(model, captured, response, ls)
        for kind in (GDN_STATE, CONV_TAIL, "key", "value") if dtype == torch.float64 else ():
            layer = next(l for l in captured.pages.layers() if kind in captured.pages.kinds(l))
            rows = captured.pages.fetch(layer, kind)            # the stored tensor (CPU: a view)
            saved = rows.clone()
            rows.mul_(0.5)
            changed, _ = score_member(model, captured, response, ls)
            rows.copy_(saved)
            assert (changed - base).abs().max() > 1e-4, kind
    print(f"{dtype}: worst |replay - full| = {worst:.3e}")
    assert worst <= tol


def _reference_state(module: LongStrawGatedDeltaNet, x: torch.Tensor):
    """Gated DeltaNet over x [n, hidden] (the layer's input after its input norm) from zero state,
    written out token by token from the module's weights. Returns (state [H_v, d_k, d_v], the last
    kernel - 1 conv inputs [kernel - 1, conv_dim])."""
    num_k, num_v = module.num_key_heads, module.num_value_heads
    d_k, d_v, kernel = module.key_head_dim, module.value_head_dim, module.conv_kernel_dim
    q, k, v, z, b, a = (x @ module.in_proj.weight.T).split(list(module.in_proj_split_sections), -1)
    qkv = torch.cat([q, k, v], dim=-1)                                   # conv inputs [n, conv_dim]
    padded = torch.cat([qkv.new_zeros(kernel - 1, qkv.shape[1]), qkv])
    weight = module.conv1d.weight[:, 0]                                  # [conv_dim, kernel]
    conv = sum(padded[j:j + x.shape[0]] * weight[:, j] for j in range(kernel))
    q, k, v = F.silu(conv).split([num_k * d_k, num_k * d_k, num_v * d_v], dim=-1)
    l2 = lambda t: t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    q = l2(q.view(-1, num_k, d_k)).repeat_interleave(num_v // num_k, dim=1)
    k = l2(k.view(-1, num_k, d_k)).repeat_interleave(num_v // num_k, dim=1)
    v = v.view(-1, num_v, d_v)
    decay = torch.exp(-module.A_log.exp() * F.softplus(a + module.dt_bias))   # [n, H_v]
    beta = torch.sigmoid(b)
    state = x.new_zeros(num_v, d_k, d_v)
    for t in range(x.shape[0]):
        state = state * decay[t, :, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", state, k[t])) * beta[t, :, None]
        state = state + torch.einsum("hk,hv->hkv", k[t], delta)
    return state, qkv[-(kernel - 1):]


def test_captured_gdn_state_equals_reference_recurrence():
    """Capture keeps, per GDN layer, exactly the state and conv tail a full-sequence run reaches
    after the captured prefix: fp64, compared with the token-by-token recurrence on the inputs of
    a plain full forward of prompt[:-1]."""
    cfg, model = build_tiny_qwen(torch.float64)
    group = _group(cfg.vocab_size)
    captured = capture_prompt(model, group.prompt_ids, _small_blocks())
    gdn_layers = [m for m in model.modules() if isinstance(m, LongStrawGatedDeltaNet)]
    assert len(gdn_layers) == 6
    inputs = {}
    hooks = [m.register_forward_pre_hook(
        lambda mod, args, kwargs: inputs.__setitem__(mod.layer_idx, (args or (kwargs["hidden_states"],))[0]),
        with_kwargs=True) for m in gdn_layers]
    try:
        with torch.no_grad():
            model(group.prompt_ids[:-1][None], None, None)
    finally:
        for hook in hooks:
            hook.remove()
    worst = 0.0
    for module in gdn_layers:
        with torch.no_grad():
            state, tail = _reference_state(module, inputs[module.layer_idx][:, 0])
        got_state = captured.pages.fetch(module.layer_idx, GDN_STATE)
        got_tail = captured.pages.fetch(module.layer_idx, CONV_TAIL)
        assert got_state.shape == (12, 16, 16) and got_tail.shape == (3, 320)
        # Rounding differs (chunked vs token-by-token rule, capture blocks): ~1e-15 observed.
        assert (got_state - state).abs().max() <= 1e-11 * state.abs().max(), module.layer_idx
        assert (got_tail - tail).abs().max() <= 1e-11 * tail.abs().max(), module.layer_idx
        assert state.abs().max() > 1e-2  # a state worth comparing
        worst = max(worst, float((got_state - state).abs().max() / state.abs().max()))
    print(f"captured GDN state vs token-by-token recurrence: worst relative error {worst:.3e}")


def test_gdn_state_is_fixed_size_as_the_prompt_doubles():
    cfg, model = build_tiny_qwen(torch.float32)
    sizes = {}
    for prompt_len in (129, 257):
        captured = capture_prompt(model, _group(cfg.vocab_size, prompt_len).prompt_ids,
                                  LongStrawConfig.of(token_block=64))
        sizes[prompt_len] = {kind: captured.pages.bytes_by_kind()[kind]
                             for kind in (GDN_STATE, CONV_TAIL, "key", "value")}
    print(f"captured bytes by kind: {sizes}")
    # Hand count, fp32 model (the delta rule keeps its state in fp32 too): 6 GDN layers x
    # (12 x 16 x 16 state + 3 x 320 conv tail: [q; k; v] = 4 x 16 + 4 x 16 + 12 x 16) x 4 B,
    # whatever P.
    for prompt_len in sizes:
        assert sizes[prompt_len][GDN_STATE] == 6 * 12 * 16 * 16 * 4
        assert sizes[prompt_len][CONV_TAIL] == 6 * 3 * 320 * 4
        assert sizes[prompt_len][GDN_STATE] + sizes[prompt_len][CONV_TAIL] == 6 * cfg.gdn_state_bytes(4, 4)
        # K/V pages grow with P: 2 full-attention layers x 2 K/V heads x 32, per captured token.
        assert sizes[prompt_len]["key"] == (prompt_len - 1) * 2 * 2 * 32 * 4
    assert cfg.page_bytes_per_token(4) == 2 * 2 * 2 * 32 * 4
    # docs/design.md section 9 at full size: 64 KiB of bf16 K/V per token, ~3 MiB of GDN state per layer.
    full = Qwen36Config()
    assert full.page_bytes_per_token(2) == 64 * 1024
    assert full.gdn_state_bytes(4, 2) == 3 * 2**20 + 3 * 10240 * 2


def _reference_grads(model, group, trainable):
    for p in model.parameters():
        p.grad = None
    logps = [full_sequence_logprobs(model, group.prompt_ids, r) for r in group.response_ids]
    olds = [lp.detach() for lp in logps]
    grpo_loss(logps, olds, group.rewards, GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.28)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()
            if n in trainable and p.grad is not None}


def _longstraw_grads(model, group, trainable, **kw):
    for p in model.parameters():
        p.grad = None
    forward_backward_longstraw(model, group, _small_blocks(clip_eps_high=0.28, **kw))
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
    """Only the final norm and output layer train: LongStraw's gradient is the exact GRPO gradient
    (fp64, relative 1e-9: rounding only)."""
    cfg, model = build_tiny_qwen(torch.float64)
    trainable = {"decoder.final_norm.weight", "output_layer.weight"}
    for name, p in model.named_parameters():
        p.requires_grad_(name in trainable)
    group = _group(cfg.vocab_size)
    ref = _reference_grads(model, group, trainable)
    got = _longstraw_grads(model, group, trainable)
    _assert_close(got, ref, rel=1e-9)
    assert all(g.abs().sum() > 0 for g in got.values())


@pytest.mark.parametrize("checkpoint_layers", [True, False])
def test_gradients_all_params_with_a_one_token_prompt(checkpoint_layers):
    """With a one-token prompt nothing is captured, so replay is the whole sequence and every
    parameter's gradient (GDN, gated attention incl. the blockwise attention backward, FFN, norms)
    equals full autograd (fp64, relative 1e-9)."""
    cfg, model = build_tiny_qwen(torch.float64)
    trainable = {n for n, _ in model.named_parameters()}
    group = _group(cfg.vocab_size, prompt_len=1, lens=(30, 7, 19))
    ref = _reference_grads(model, group, trainable)
    got = _longstraw_grads(model, group, trainable, checkpoint_layers=checkpoint_layers)
    _assert_close(got, ref, rel=1e-9)
    assert any("A_log" in n and g.abs().sum() > 0 for n, g in got.items())
    assert any("linear_qkv" in n and g.abs().sum() > 0 for n, g in got.items())


def test_prompt_state_gradients_on_request():
    """Exact prompt gradient: with `PromptGrad.EXACT`, replay adds d loss / d state on the
    store's buffers for every kind (GDN state and conv tail, K/V pages), and it is the true derivative: a
    central finite difference along a random direction agrees (fp64: relative 1e-6, plus the
    difference quotient's own rounding error, a few ulps of the scored sum over 2 eps; truncation
    is O(eps^2), negligible. The rounding term matters where the directional derivative is small:
    K pages of layer 3, ~1.5e-3, whose quotient is off by ~3e-9 on some CPUs' kernels)."""
    from megatron_longstraw.step import replay as replay_mod

    cfg, model = build_tiny_qwen(torch.float64)
    group = _group(cfg.vocab_size, lens=(7,))
    ls = _small_blocks()
    captured = capture_prompt(model, group.prompt_ids, ls)
    response = group.response_ids[0]
    branch = replay_mod.make_branch(captured, response)
    state = replay_mod._pass(captured, branch, ls, selections=None, prompt_grad=PromptGrad.EXACT)
    captured.pages.keep_grads()
    logp = replay_mod._run_branch(model, captured, branch, state, checkpoint_layers=True)
    logp.sum().backward()
    pages = captured.pages
    for layer in pages.layers():
        for kind in pages.kinds(layer):
            grad = pages.grad(layer, kind)
            assert grad is not None and grad.shape == pages.fetch(layer, kind).shape, (layer, kind)
            assert grad.abs().sum() > 0, (layer, kind)

    gen = torch.Generator().manual_seed(5)
    for layer, kind in ((4, GDN_STATE), (4, CONV_TAIL), (3, "key")):
        rows = pages.fetch(layer, kind)
        direction = torch.randn(rows.shape, generator=gen, dtype=rows.dtype)
        saved, eps, values = rows.clone(), 2e-6, []
        with torch.no_grad():
            for sign in (1, -1):
                rows.copy_(saved + sign * eps * direction)
                values.append(score_member(model, captured, response, ls)[0].sum())
        rows.copy_(saved)
        numeric = float(values[0] - values[1]) / (2 * eps)
        analytic = float((pages.grad(layer, kind) * direction).sum())
        rounding = 8 * torch.finfo(torch.float64).eps * float(values[0].abs()) / (2 * eps)
        assert abs(numeric - analytic) <= 1e-6 * abs(analytic) + rounding, (
            layer, kind, numeric, analytic, rounding)


def test_all_param_gradients_at_fixed_prompt_state_match_finite_differences():
    """Every parameter at a 150-token prompt: replay's gradient is d loss / d theta at the captured
    prompt state (docs/design.md section 7). Check: the directional derivative along a random direction
    over all parameters equals a central finite difference of scoring with the pages held fixed
    (fp64, relative 1e-6; the quotient's own error is ~1e-8), and the gradient touches every kind
    of parameter (GDN, gated attention, FFN, norms, embedding, head)."""
    from megatron_longstraw.step.replay import replay_member

    cfg, model = build_tiny_qwen(torch.float64)
    group = _group(cfg.vocab_size, lens=(9,))
    ls = _small_blocks()
    captured = capture_prompt(model, group.prompt_ids, ls)
    response = group.response_ids[0]
    for p in model.parameters():
        p.grad = None
    replay_member(model, captured, response, None, ls, lambda logp, tokens: (logp.sum(), {}))
    params = dict(model.named_parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params.values()), \
        [n for n, p in params.items() if p.grad is None or p.grad.abs().sum() == 0]

    gen = torch.Generator().manual_seed(11)
    direction = {n: torch.randn(p.shape, generator=gen, dtype=p.dtype) * p.detach().abs().mean()
                 .clamp_min(1e-3) for n, p in params.items()}
    analytic = float(sum((p.grad * direction[n]).sum() for n, p in params.items()))
    saved = {n: p.detach().clone() for n, p in params.items()}
    eps, values = 1e-6, []
    with torch.no_grad():
        for sign in (1, -1):
            for n, p in params.items():
                p.copy_(saved[n] + sign * eps * direction[n])
            values.append(score_member(model, captured, response, ls)[0].sum())
        for n, p in params.items():
            p.copy_(saved[n])
    numeric = float(values[0] - values[1]) / (2 * eps)
    print(f"directional derivative: analytic {analytic:.10e}, finite difference {numeric:.10e}")
    assert abs(numeric - analytic) <= 1e-6 * abs(analytic)
