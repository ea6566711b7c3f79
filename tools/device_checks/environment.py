"""Part 1 of tools/device_check.py: torch, CUDA, GPU, flash-linear-attention, and why each kernel
backend is or is not usable here."""

from __future__ import annotations

import torch

from megatron_longstraw.kernels import select

from .common import say


def environment() -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, capability=f"SM{props.major}{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1))
    info["flash_linear_attention"] = fla_version()
    for key, value in info.items():
        say(f"  {key}: {value}")
    info["backends"] = select.describe()
    for name, reason in info["backends"].items():
        say(f"  backend {name:9s} {'usable' if reason is None else 'not usable: ' + reason}")
    return info


def fla_version() -> str:
    """flash-linear-attention's version, or why Megatron's GatedDeltaNet cannot use it here."""
    try:
        from megatron.core.ssm.gated_delta_net import common as gdn_common
    except ImportError as exc:
        return f"not checked: megatron-core does not import ({exc})"
    if not gdn_common.HAVE_FLA:
        return "not installed (pip install flash-linear-attention); Qwen3.6's GDN layers need it"
    import fla

    return getattr(fla, "__version__", "installed")
