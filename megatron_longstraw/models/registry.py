"""The model families an entry point can build (`--longstraw-family`, tools' `--family`).

Each `models/<family>/` exports one `Family` record (`models/family.py` says what it holds: config
class, builder, Megatron flags, EP limit, LoRA targets, HF conversion, planner entry, example
configs); this module only collects them. Adding a family is one folder plus one line below.
Everything after the build (capture, replay, finalisation, checkpoints, receipts) is
family-independent.
"""

from __future__ import annotations

from megatron_longstraw.models import deepseekv3, glm52, qwen36
from megatron_longstraw.models.family import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (glm52.FAMILY, qwen36.FAMILY,
                                                    deepseekv3.FAMILY)}

__all__ = ["FAMILIES", "Family", "check_parallel_sizes", "family_of_config", "get_family"]


def get_family(name: str) -> Family:
    """The record of `name` (ValueError naming the known families otherwise)."""
    if name not in FAMILIES:
        raise ValueError(f"Unknown model family {name!r}; known: {sorted(FAMILIES)}.")
    return FAMILIES[name]


def family_of_config(model_values: dict) -> str | None:
    """The family whose config class has every field of a YAML's `model:` section (`model_values`),
    when exactly one has; None otherwise (no section, or fields every family or none knows)."""
    import dataclasses

    if not model_values:
        return None
    fits = [name for name, family in FAMILIES.items()
            if not set(model_values) - {f.name for f in dataclasses.fields(family.config_class)}]
    return fits[0] if len(fits) == 1 else None


def check_parallel_sizes(family: Family, expert_parallel_size: int) -> None:
    """Reject an expert-parallel size the family's model cannot use, before any process group
    starts."""
    limit = family.max_expert_parallel_size
    if limit is None or expert_parallel_size <= limit:
        return
    why = (" has no MoE layers (its FFN is dense), so there are no experts to shard" if limit == 1
           else f" uses at most {limit} expert-parallel ranks")
    raise ValueError(f"--expert-model-parallel-size {expert_parallel_size}: "
                     f"{family.config_class.FAMILY}{why}; use --expert-model-parallel-size "
                     f"{limit} and give the ranks to --context-parallel-size.")
