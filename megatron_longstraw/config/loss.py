"""The GRPO loss's settings (`GRPOLossConfig`) and the off-policy correction's choices (`TIS_MODES`,
`check_tis`): what `LongStrawConfig` validates against; grpo/ computes with them."""

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
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0
    adv_eps: float = 1e-6
    std_unbiased: bool = False

    def __post_init__(self) -> None:
        for name in ("clip_eps_low", "clip_eps_high"):
            v = getattr(self, name)
            if not (0.0 <= v < 1.0):
                raise ValueError(f"GRPOLossConfig.{name}={v!r} must be in [0, 1) (e.g. 0.2).")
        if not (self.kl_coef >= 0.0 and math.isfinite(self.kl_coef)):
            raise ValueError(f"GRPOLossConfig.kl_coef={self.kl_coef!r} must be finite and >= 0 (0 disables KL).")
        if not (self.adv_eps > 0.0 and math.isfinite(self.adv_eps)):
            raise ValueError(f"GRPOLossConfig.adv_eps={self.adv_eps!r} must be finite and > 0 (e.g. 1e-6).")


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
