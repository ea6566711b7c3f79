"""NVIDIA apex fused optimizer (https://github.com/NVIDIA/apex; never the PyPI `apex`).

Upstream: `apex.optimizers.FusedAdam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999),
eps=1e-8, adam_w_mode=True, weight_decay=0.0, ...)` (adam_w_mode=True: decoupled weight decay, i.e.
torch.optim.AdamW's update). It needs apex built with its CUDA extensions (`APEX_CUDA_EXT=1`).
The reference is `torch.optim.AdamW` (same arguments, same math).
"""

from __future__ import annotations

from megatron_longstraw.kernels import packages


def cuda_extension_problem() -> str | None:
    """None when apex's CUDA extensions (which FusedAdam needs) are built, else the problem."""
    try:
        from apex.multi_tensor_apply import multi_tensor_applier

        if multi_tensor_applier.available:
            return None
    except Exception:  # noqa: BLE001
        pass
    return "NVIDIA apex is installed without its CUDA extensions (FusedAdam needs `amp_C`)"


def _require_cuda_extensions():
    apex = packages.require("apex")
    problem = cuda_extension_problem()
    if problem is not None:
        raise packages.MissingKernelPackage(problem, "apex")
    return apex


def optimizer_class() -> type:
    """`apex.optimizers.FusedAdam` (AdamW mode by default). Takes the same `lr`, `betas`, `eps`,
    `weight_decay` keywords as torch.optim.AdamW."""
    _require_cuda_extensions()
    from apex.optimizers import FusedAdam

    return FusedAdam
