"""megatron_longstraw: GRPO post-training at million-token prompts, as a Megatron-Core plugin.

The package is a few wings, listed in import order: a module imports only from its own wing or
one listed before it (also inside functions; tests/test_floors.py reads every import).

    config/         the run's settings, one field per setting, and the choices they take
    runtime/        CPU adaptations of Megatron-Core, its patches, precision, errors, memory meters
    kernels/        pure-PyTorch references, GPU backends and their selection, FP8 / NF4 formats
    distributed/    CP x EP folded process groups, collectives, agreement checks, finalize
    data/           the JSONL group format, tokenizers, the dataset, the group record
    state/          the paged store of captured state and the attention pass mixers read
    models/         the families (GLM-5.2, Qwen3.6, DeepSeek-V3), the mixer protocol, CP, registry
    adapters/       LoRA / QLoRA and the frozen FP8 base
    context/        the shared prompt: capture, and the exact prompt gradient
    rollout/        decoding from a capture, rewards, the online loop's rollout
    grpo/           the GRPO loss and the off-policy correction
    step/           the GRPO step: scoring, replay, routing replay, evaluation, the schedule
    checkpointing/  the model format on disk and atomic training checkpoints
    training/       the launcher: its loop, flags, data, receipts and guards
    planner/        the memory planner (reads the families' formulas through the registry)

Entry points: `examples/pretrain_gpt.py --longstraw` (training/train.py) and `tools/*.py`.

The public API, for use from Python (`from megatron_longstraw import train_step`; README.md,
"Using it from Python"), is the names in `__all__`: set-up (`initialize`: torch.distributed and
Megatron's CP x EP groups; `use_dtype`: call with torch.float64 before building a float64
model), a family's model (`get_family(name)`, whose record builds it with the selected kernels,
or a family's config class and builder directly), the step's settings (`LongStrawConfig`), a group
(`GRPOGroup`), one training step (`train_step` -> `StepResult`), and the phases on their own:
`capture_prompt` (-> `CapturedPrompt`), `generate` from a capture (`SamplingParams` ->
`Generation`s) and `iter_scores` (per-token log-probs of a group's responses). Each name is
imported from its wing on first use (PEP 562 `__getattr__`), so `import megatron_longstraw` and
`import megatron_longstraw.runtime.parent_watch`, the launcher's first statement, import neither
torch nor Megatron. The package root is the floor above every wing: no wing imports these names
from it (tests/test_floors.py).
"""

from __future__ import annotations

import importlib

_EXPORTS: dict[str, str] = {
    # set-up
    "initialize": "megatron_longstraw.distributed.parallel",
    "use_dtype": "megatron_longstraw.runtime.precision",
    # the families
    "get_family": "megatron_longstraw.models.registry",
    "Family": "megatron_longstraw.models.family",
    "GLM52Config": "megatron_longstraw.models.glm52.config",
    "build_glm52_model": "megatron_longstraw.models.glm52.model",
    "Qwen36Config": "megatron_longstraw.models.qwen36.config",
    "build_qwen36_model": "megatron_longstraw.models.qwen36.model",
    "DeepseekV3Config": "megatron_longstraw.models.deepseekv3.config",
    "build_deepseekv3_model": "megatron_longstraw.models.deepseekv3.model",
    # settings and data
    "LongStrawConfig": "megatron_longstraw.config.settings",
    "SamplingParams": "megatron_longstraw.config.sampling",
    "GRPOGroup": "megatron_longstraw.data.group",
    # the phases and the step
    "capture_prompt": "megatron_longstraw.context.capture",
    "CapturedPrompt": "megatron_longstraw.context.capture",
    "generate": "megatron_longstraw.rollout.decode",
    "Generation": "megatron_longstraw.rollout.decode",
    "iter_scores": "megatron_longstraw.step.scoring",
    "train_step": "megatron_longstraw.step.schedule",
    "StepResult": "megatron_longstraw.step.schedule",
}
"""Public name -> the module that defines it (imported on first access)."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value   # later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
