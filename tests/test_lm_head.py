"""The chunked LM head (models/common.py `head_logprobs`): the log-probs of the targets and their
gradients equal the unchunked `log_softmax(head_logits)` gather, for an untied, a tied and a
zero-centred-norm (Qwen3.6) head and a LoRA-wrapped output layer, and forward + backward hold the
[rows, vocab] logits of one chunk only, measured from the allocator (memory.LiveBytesMeter)."""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import build_tiny_glm, build_tiny_qwen
from megatron_longstraw.models.common import head_logits, head_logprobs, head_logprobs_entropy
from megatron_longstraw.runtime.memory import LiveBytesMeter

pytestmark = pytest.mark.usefixtures("single_process")

ROWS, CHUNK = 37, 8          # 8 does not divide 37: the last chunk has 5 rows
# fp64 throughout: chunking changes only which rows share a matmul / softmax call, so the two
# paths differ by a few ulps of values of size ~10 (log-probs) and ~1 (gradients); 1e-12 is far
# above that and far below any real difference (a row or a chunk's gradient missing or doubled).
TOL = 1e-12


def unchunked_logprobs(model, hidden, targets):
    """The head as it was: all rows' logits at once."""
    logprobs = F.log_softmax(head_logits(model, hidden), dim=-1)
    return logprobs.gather(-1, targets[:, None]).squeeze(-1)


def _inputs(cfg, rows, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, 1, cfg.hidden_size, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, cfg.vocab_size, (rows,), generator=gen)
    return hidden.requires_grad_(), targets


def _logprobs_and_grads(model, head, hidden, targets):
    """Log-probs (detached) and the gradients of a weighted sum of them (weights not all equal, so
    a gradient routed to the wrong row shows) w.r.t. the hidden rows and every trainable
    parameter."""
    model.zero_grad(set_to_none=True)
    hidden = hidden.detach().requires_grad_()
    logprobs = head(model, hidden, targets)
    weights = torch.linspace(-1.0, 2.0, len(targets), dtype=logprobs.dtype)
    (logprobs * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), hidden.grad, grads


def _assert_same_head(model, cfg, expected_params):
    hidden, targets = _inputs(cfg, ROWS)
    chunked = _logprobs_and_grads(
        model, lambda m, h, t: head_logprobs(m, h, t, chunk_rows=CHUNK), hidden, targets)
    full = _logprobs_and_grads(model, unchunked_logprobs, hidden, targets)
    assert chunked[0].shape == (ROWS,) and chunked[0].dtype == torch.float64
    torch.testing.assert_close(chunked[0], full[0], rtol=0, atol=TOL)
    torch.testing.assert_close(chunked[1], full[1], rtol=0, atol=TOL)
    assert set(chunked[2]) == set(full[2]) == expected_params
    for name in expected_params:
        assert chunked[2][name].abs().max() > 0, name
        torch.testing.assert_close(chunked[2][name], full[2][name], rtol=0, atol=TOL, msg=name)


def _head_only(model):
    """Train the head only: the decoder layers get no gradient from the head anyway; freezing them
    keeps the expected parameter sets short."""
    model.requires_grad_(False)
    for name, param in model.named_parameters():
        if name.startswith(("decoder.final_norm", "output_layer", "embedding.word_embeddings")):
            param.requires_grad_(True)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_glm_chunked_head_matches_unchunked_values_and_gradients(tied):
    cfg, model = build_tiny_glm(torch.float64, tie_word_embeddings=tied)
    assert model.share_embeddings_and_output_weights == tied
    weight = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
    _head_only(model)
    if not tied:   # the embedding gets no gradient from the head when untied
        model.embedding.word_embeddings.weight.requires_grad_(False)
    _assert_same_head(model, cfg, {"decoder.final_norm.weight", weight})


def test_qwen_chunked_head_matches_unchunked_values_and_gradients():
    cfg, model = build_tiny_qwen(torch.float64)
    _head_only(model)
    model.embedding.word_embeddings.weight.requires_grad_(cfg.tie_word_embeddings)
    tied = cfg.tie_word_embeddings
    weight = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
    _assert_same_head(model, cfg, {"decoder.final_norm.weight", weight})


def test_lora_wrapped_output_layer_gets_the_same_adapter_gradients():
    """The output layer can be a LoRA target ("output_layer" names a ColumnParallelLinear); each
    chunk runs the wrapper itself, so its adapters get their gradients like any other layer's."""
    from megatron_longstraw.adapters.lora import LoRAConfig, apply_lora

    cfg, model = build_tiny_glm(torch.float64)
    summary = apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=("output_layer",)))
    assert summary.wrapped == ["output_layer"]
    with torch.no_grad():   # B = 0 at the start would leave A without a gradient
        model.output_layer.lora_B.normal_(generator=torch.Generator().manual_seed(5))
    _assert_same_head(model, cfg, {"output_layer.lora_A", "output_layer.lora_B"})


def test_entropy_and_no_grad_path():
    """The entropy of each row's distribution, from the chunk's own log-softmax (no autograd), and
    the no-grad path (scoring: no checkpoint) give the unchunked values; asking for the entropy
    under autograd leaves the log-probs' gradient unchanged (the recompute in the backward does
    not compute it again)."""
    cfg, model = build_tiny_glm(torch.float64)
    hidden, targets = _inputs(cfg, ROWS, seed=1)
    with torch.no_grad():
        full = F.log_softmax(head_logits(model, hidden), dim=-1)
        expected_entropy = -(full.exp() * full).sum(-1)
        expected = full.gather(-1, targets[:, None]).squeeze(-1)
        scored = head_logprobs(model, hidden, targets, chunk_rows=CHUNK)
    torch.testing.assert_close(scored, expected, rtol=0, atol=TOL)

    logprobs, entropy = head_logprobs_entropy(model, hidden, targets, CHUNK, with_entropy=True)
    assert entropy.shape == (ROWS,) and entropy.grad_fn is None and logprobs.grad_fn is not None
    torch.testing.assert_close(entropy, expected_entropy, rtol=0, atol=TOL)
    assert (entropy > 0).all() and (entropy <= math.log(cfg.vocab_size)).all()
    grad, = torch.autograd.grad(logprobs.sum(), hidden)
    expected_grad, = torch.autograd.grad(unchunked_logprobs(model, hidden, targets).sum(), hidden)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=TOL)
    assert head_logprobs_entropy(model, hidden, targets, CHUNK)[1] is None
    with pytest.raises(ValueError, match="chunk_rows"):
        head_logprobs(model, hidden, targets, chunk_rows=0)


def _head_peak_bytes(model, cfg, rows, head) -> int:
    """Peak live bytes (allocator, CPU: exact) of the head's forward + backward on `rows` rows,
    over what was live before (the inputs, the weights)."""
    hidden, targets = _inputs(cfg, rows, seed=rows)
    model.zero_grad(set_to_none=True)   # both runs allocate their weight gradients afresh
    with LiveBytesMeter("cpu") as meter:
        head(model, hidden, targets).sum().backward()
    return meter.peak_bytes


def test_head_memory_grows_with_rows_times_hidden_not_rows_times_vocab():
    """From s to 4s rows the chunked head's peak grows by the O(s x h) tensors only (the hidden
    gradient and its per-chunk pieces), not by [3s, vocab] logits; the unchunked head's peak grows
    by about three [3s, vocab] tensors (logits, log-softmax saved, its gradient), so the bound,
    a quarter of one [3s, vocab] tensor, separates the two."""
    cfg, model = build_tiny_glm(torch.float64, vocab_size=4096)
    h, vocab, s = cfg.hidden_size, cfg.vocab_size, 32
    chunked = [_head_peak_bytes(model, cfg, rows,
                                lambda m, x, t: head_logprobs(m, x, t, chunk_rows=CHUNK))
               for rows in (s, 4 * s)]
    unchunked = [_head_peak_bytes(model, cfg, rows, unchunked_logprobs) for rows in (s, 4 * s)]
    bound = 3 * s * vocab * 8 / 4
    hidden_rows = 3 * s * h * 8                          # the added [3s, 1, h] rows, fp64
    print(f"peak growth s={s} -> {4 * s} rows (vocab {vocab}, h {h}): chunked "
          f"{chunked[1] - chunked[0]} B, unchunked {unchunked[1] - unchunked[0]} B, "
          f"bound {bound:.0f} B, added hidden rows {hidden_rows} B")
    assert chunked[1] - chunked[0] < bound
    assert chunked[1] - chunked[0] <= 2 * hidden_rows
    assert unchunked[1] - unchunked[0] > bound
