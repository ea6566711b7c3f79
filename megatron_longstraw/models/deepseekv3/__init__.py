"""DeepSeek-V3 (config, specs, state-aware dense MLA, transformers interop, planner footprint);
`FAMILY` is its registry record (family.py)."""

from megatron_longstraw.models.deepseekv3.family import FAMILY

__all__ = ["FAMILY"]
