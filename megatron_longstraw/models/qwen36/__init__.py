"""Qwen3.6 (config, Gated DeltaNet + gated attention specs, transformers interop); `FAMILY` is its
registry record (family.py)."""

from megatron_longstraw.models.qwen36.family import FAMILY

__all__ = ["FAMILY"]
