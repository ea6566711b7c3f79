"""How the online loop samples (`SamplingParams`, used by rollout/decode.py) and its controls
(`CONTROLS`, rollout/online.py): what `LongStrawConfig` validates against."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How `generate` picks each next token. `temperature` 0 is greedy; `top_k` 0 and `top_p` 1
    keep every token; a member stops at `max_new_tokens` or after emitting one of `stop_ids`
    (kept in its response, as engines return EOS)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: generate at least 1 token.")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature={self.temperature}: use a finite value >= 0 "
                             "(0 = greedy).")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: use a value in (0, 1] (1 keeps every token).")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: use 0 (off) or a positive count.")


CONTROLS = ("none", "zeros", "blind")
