"""What the model-family config dataclasses share: YAML/dict loading with a clear error on unknown
fields, and the Megatron TransformerConfig settings every LongStraw model uses."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import yaml


class ConfigFiles:
    """Mixin for a family config dataclass; `FAMILY` names it in error messages."""

    FAMILY = "model"

    @classmethod
    def from_dict(cls, values: dict):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"Unknown {cls.FAMILY} config fields {unknown}; known fields: "
                             f"{sorted(known)}.")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path):
        """Load the `model:` section of an example YAML (or a flat mapping)."""
        data = yaml.safe_load(Path(path).read_text())
        return cls.from_dict(data.get("model", data))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def longstraw_transformer_settings(params_dtype: torch.dtype, init_std: float) -> dict:
    """TransformerConfig fields common to every LongStraw model."""
    return dict(
        init_method_std=init_std,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # The loss carries every divisor itself (grpo.py); finalize.py sums.
        calculate_per_token_loss=True,
        # LongStraw checkpoints whole decoder layers itself (replay.py).
        recompute_granularity=None,
    )
