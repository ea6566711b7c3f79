"""The norms LongStraw computes itself, in pure PyTorch (no family, no Megatron internals).

`ZeroCenteredRMSNorm` is the norm of every Qwen3.6 layer (models/qwen36/spec.py) and, where
TransformerEngine is absent, the final norm of any zero-centred model (platform.py entry 7);
`l2norm` is FLA's q/k normalisation, used by platform.py entry 6 on CPU and by the float64
delta rule (precision.py). Kept here, below both, so that neither imports a model family.
"""

from __future__ import annotations

import torch


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm with a zero-centred gain (TE's `zero_centered_gamma`, transformers' `Qwen3_5RMSNorm`):

        y = x / sqrt(mean(x^2) + eps) * (1 + weight),   weight initialised to 0,

    over the last dim, computed in float32 or wider and returned in x's dtype. Built like Megatron's
    norms (`config=`, `hidden_size=`, `eps=`); the parameter is `weight`."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused_kwargs):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = torch.promote_types(x.dtype, torch.float32)
        y = x.to(acc)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.to(acc))).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, zero_centered"


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6,
           output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """FLA's `l2norm` (`fla.modules.l2norm`, also transformers' Qwen3.5 `l2norm`) in PyTorch:
    x * rsqrt(sum(x^2) + eps) over `dim`, computed in float32 or wider, returned in x's dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    y = x.to(acc)
    y = y * torch.rsqrt((y * y).sum(dim=dim, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)
