"""megatron_longstraw: GRPO post-training at million-token prompts, as a Megatron-Core plugin.

The package is a few wings, listed in import order: a module imports only from its own wing or
one listed before it (also inside functions; tests/test_floors.py reads every import).

    runtime/        CPU adaptations of Megatron-Core, its patches, precision, errors, memory meters
    kernels/        pure-PyTorch references, GPU backends and their selection, FP8 / NF4 formats
    distributed/    CP x EP folded process groups, collectives, agreement checks, finalize
    data/           the JSONL group format, tokenizers, the dataset, the group record
    state/          the paged store of captured state and the attention pass mixers read
    config/         the run's settings and the choices they validate against
    models/         the families (GLM-5.2, Qwen3.6, DeepSeek-V3), the mixer protocol, CP, registry
    adapters/       LoRA / QLoRA and the frozen FP8 base
    context/        the shared prompt: capture, and the exact prompt gradient
    rollout/        decoding from a capture, rewards, the online loop's rollout
    grpo/           the GRPO loss and the off-policy correction
    checkpointing/  the model format on disk and atomic training checkpoints
    training/       scoring and replay, the step, the launcher's loop, its flags and receipts
    planner/        the memory planner (reads the families' formulas through the registry)

Entry points: `examples/pretrain_gpt.py --longstraw` (training/train.py) and `tools/*.py`.
"""
