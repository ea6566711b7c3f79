"""The GRPO loss's settings (`GRPOLossConfig`; its options `LOSS_AGGREGATIONS`,
`check_loss_options`) and the off-policy correction's choices (`TIS_MODES`, `check_tis`): what
`LongStrawConfig` validates against; grpo/ computes with them."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GRPOLossConfig:
    """Hyper-parameters of the GRPO loss.

    clip_eps_low/high: ratio clip range ``[1-clip_eps_low, 1+clip_eps_high]``, each in [0, 1).
    kl_coef: ``beta`` of the k3 KL penalty against the reference policy (0 disables it).
    adv_eps: added to the reward std in the advantage denominator (> 0).
    std_unbiased: False (default) uses the population std (divide by G); True divides by G-1.
    aggregation: how token terms become the group loss (`LOSS_AGGREGATIONS`; grpo/loss.py states
        each formula): "sequence_mean" (default: (1/G) sum_i (1/R_i) sum_t), "token_mean" (DAPO:
        (1/sum_i R_i) sum_i sum_t, over the group's tokens) or "constant" (Dr. GRPO:
        (1/G) sum_i (1/C) sum_t with C = `norm_constant`).
    norm_constant: C of "constant" (a positive token count, e.g. the longest response allowed).
    dual_clip: c > 1 of the dual clip (None: off): for A < 0 the surrogate is
        max(min(rho A, clip(rho) A), c A), so a token's policy loss is at most c |A|.
    log_ratio_clamp: None (off) or d > 0: rho = exp(clamp(logp - logp_old, -d, d)).
    kl_clamp: None (off) or k > 0: each token's k3 estimate is min(k3, k).
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0
    adv_eps: float = 1e-6
    std_unbiased: bool = False
    aggregation: str = "sequence_mean"
    norm_constant: int | None = None
    dual_clip: float | None = None
    log_ratio_clamp: float | None = None
    kl_clamp: float | None = None

    def __post_init__(self) -> None:
        for name in ("clip_eps_low", "clip_eps_high"):
            v = getattr(self, name)
            if not (0.0 <= v < 1.0):
                raise ValueError(f"GRPOLossConfig.{name}={v!r} must be in [0, 1) (e.g. 0.2).")
        if not (self.kl_coef >= 0.0 and math.isfinite(self.kl_coef)):
            raise ValueError(f"GRPOLossConfig.kl_coef={self.kl_coef!r} must be finite and >= 0 (0 disables KL).")
        if not (self.adv_eps > 0.0 and math.isfinite(self.adv_eps)):
            raise ValueError(f"GRPOLossConfig.adv_eps={self.adv_eps!r} must be finite and > 0 (e.g. 1e-6).")
        check_loss_options(self.aggregation, self.norm_constant, self.dual_clip,
                           self.log_ratio_clamp, self.kl_clamp)
        if self.aggregation == "constant" and self.norm_constant is None:
            raise ValueError("GRPOLossConfig.aggregation='constant' needs norm_constant (C, the "
                             "token count every member's sum is divided by).")


LOSS_AGGREGATIONS = ("sequence_mean", "token_mean", "constant")
"""How the GRPO loss aggregates token terms (grpo/loss.py): per-sequence mean (default), token mean
over the group (DAPO), a constant normaliser (Dr. GRPO)."""


def _is_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def check_loss_options(aggregation, norm_constant, dual_clip, log_ratio_clamp, kl_clamp) -> None:
    """ValueError naming the setting (YAML key and flag) when a loss option is not usable."""
    if aggregation not in LOSS_AGGREGATIONS:
        raise ValueError(f"longstraw loss_aggregation (--longstraw-loss-aggregation) must be one "
                         f"of {list(LOSS_AGGREGATIONS)}, got {aggregation!r}.")
    if norm_constant is not None and (isinstance(norm_constant, bool)
                                      or not isinstance(norm_constant, int) or norm_constant < 1):
        raise ValueError(f"longstraw loss_constant (--longstraw-loss-constant) must be a positive "
                         f"integer (tokens), got {norm_constant!r}.")
    if dual_clip is not None and not (_is_number(dual_clip) and dual_clip > 1.0):
        raise ValueError(f"longstraw dual_clip (--longstraw-dual-clip) must be a number > 1 (c of "
                         f"the dual clip, e.g. 3.0), got {dual_clip!r}.")
    for name, value in (("log_ratio_clamp", log_ratio_clamp), ("kl_clamp", kl_clamp)):
        if value is not None and not (_is_number(value) and value > 0):
            raise ValueError(f"longstraw {name} (--longstraw-{name.replace('_', '-')}) must be a "
                             f"number > 0, got {value!r}.")


TIS_MODES = ("off", "truncate", "mask")


def check_tis(mode: str, cap) -> None:
    """ValueError naming the setting when `mode` or `cap` is not usable."""
    if mode not in TIS_MODES:
        raise ValueError(f"longstraw tis (--longstraw-tis) must be one of {list(TIS_MODES)}, got "
                         f"{mode!r}.")
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) \
            or cap < 1.0:
        raise ValueError(f"longstraw tis_cap (--longstraw-tis-cap) must be a finite number >= 1 "
                         f"(the largest pi_old / pi_engine weight, e.g. 2.0), got {cap!r}.")
