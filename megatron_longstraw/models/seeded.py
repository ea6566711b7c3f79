"""A family's model on the local spec with reproducible, non-trivial weights: the small-scale
evidence tools' model (tools/evidence.py, tools/gradient_bias.py). Megatron's initialisation leaves
the routers' correction bias at zero and the norm gains at one; here both are drawn from the seed
(as a trained checkpoint would have them), so that the comparisons exercise them."""

from __future__ import annotations

import torch

from megatron_longstraw.models.registry import get_family
from megatron_longstraw.runtime import precision
from megatron_longstraw.runtime.platform import manual_seed


def build_seeded_model(dtype: torch.dtype, seed: int, config, family: str = "glm52"):
    """(model config, model): `family`'s model from the YAML at `config` (its record's
    `build_model`: the local spec, no kernel selection) in `dtype`, initialised from `seed`, with
    the routers' `expert_bias` ~ 0.1 N(0, 1) and the norm gains scaled by 1 + 0.1 N(0, 1) (seed + 1)."""
    manual_seed(seed)
    precision.use_dtype(dtype)
    entry = get_family(family)
    cfg = entry.config_class.from_yaml(config)
    model = entry.build_model(cfg, params_dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen, dtype=buf.dtype))
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.mul_(1 + 0.1 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
    return cfg, model
