"""Shared builders for the tests: the tiny GLM-5.2 example config, models with reproducible random
weights (router correction bias included), and the comparison of scoring against the full-sequence
reference (`full_sequence_logprobs`, megatron_longstraw/models/reference.py: no capture, no
replay), which the tests import from here."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_longstraw.runtime import precision
from megatron_longstraw.models.glm52.config import GLM52Config
from megatron_longstraw.models.reference import full_sequence_logprobs  # noqa: F401
from megatron_longstraw.runtime.platform import manual_seed

ROOT = Path(__file__).resolve().parents[1]
TINY_GLM = ROOT / "examples" / "glm52" / "tiny.yaml"
TINY_QWEN = ROOT / "examples" / "qwen36" / "tiny.yaml"


def tiny_glm_config(**overrides) -> GLM52Config:
    cfg = GLM52Config.from_yaml(TINY_GLM)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def build_tiny_glm(dtype=torch.float64, seed: int = 0, **overrides):
    from megatron_longstraw.models.glm52.model import build_glm52_model

    manual_seed(seed)
    precision.use_dtype(dtype)
    cfg = tiny_glm_config(**overrides)
    model = build_glm52_model(cfg, params_dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):  # non-trivial routing correction, as in a checkpoint
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen, dtype=buf.dtype))
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.mul_(1 + 0.1 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
    return cfg, model


def build_tiny_qwen(dtype=torch.float64, seed: int = 0):
    """The tiny Qwen3.6 example model with non-trivial zero-centred norms and slow GDN decays (so the
    recurrent state carries many prompt tokens; Megatron's default A in [1, 16] forgets within a
    few tokens)."""
    from megatron_longstraw.models.qwen36.config import Qwen36Config
    from megatron_longstraw.models.qwen36.model import build_qwen36_model

    manual_seed(seed)
    precision.use_dtype(dtype)
    cfg = Qwen36Config.from_yaml(TINY_QWEN)
    model = build_qwen36_model(cfg, params_dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen, dtype=dtype))
            elif name.endswith("A_log"):
                param.copy_(torch.empty_like(param).uniform_(0.02, 0.5, generator=gen).log())
    return cfg, model


def scoring_vs_full_sequence(model, group, captured, ls) -> tuple[float, list[dict]]:
    """Pre-step scoring of every member over `captured` against a plain full-sequence forward of
    [prompt; response] (no autograd): (max |d logp| over all members and tokens, the selections
    each member's scoring returned)."""
    from megatron_longstraw.step.replay import score_member

    worst, selections = 0.0, []
    with torch.no_grad():
        for response in group.response_ids:
            logp, used = score_member(model, captured, response, ls)
            ref = full_sequence_logprobs(model, group.prompt_ids, response)
            assert logp.shape == ref.shape
            worst = max(worst, (logp - ref).abs().max().item())
            selections.append(used)
    return worst, selections


class LongObservations:
    """A test environment whose every call returns `length` ids (a different run of them per
    call and per member, from the turn's tokens), never done: observations long enough to cross
    DSA key windows and selections and GDN chunks when fed in blocks (rollout/decode.py)."""

    stop_ids = ()

    def __init__(self, length: int, vocab_size: int, salt: int = 0):
        self.length, self.vocab_size, self.salt, self.calls = length, vocab_size, salt, 0

    def step(self, turn_ids):
        from megatron_longstraw.rollout.env import EnvStep

        self.calls += 1
        start = sum(turn_ids) + 7 * self.salt + 13 * self.calls
        return EnvStep(observation=[(start + 5 * i) % self.vocab_size for i in range(self.length)])
