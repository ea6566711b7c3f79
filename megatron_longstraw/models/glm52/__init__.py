"""GLM-5.2 (config, specs, state-aware attention, transformers interop); `FAMILY` is its registry
record (family.py)."""

from megatron_longstraw.models.glm52.family import FAMILY

__all__ = ["FAMILY"]
