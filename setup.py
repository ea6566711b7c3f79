from setuptools import find_packages, setup

setup(
    name="megatron_longstraw",
    version="0.1.0",
    description="Capture-once / replay-suffix GRPO at million-token prompts for Megatron-Core "
                "(GLM-5.2 MLA+DSA+MoE, Qwen3.6 Gated-DeltaNet hybrid)",
    packages=find_packages(include=["megatron_longstraw", "megatron_longstraw.*"]),
    python_requires=">=3.12",
    install_requires=[
        "torch",
        "megatron-core==0.19.2",
        "pyyaml",
        "tensorboard",
        "safetensors",  # checkpoints (model.safetensors) and Hugging Face conversion
        "flash-linear-attention",
    ],
    extras_require={
        "test": ["pytest", "pytest-timeout", "transformers",
                 "bitsandbytes>=0.47",
                 "peft"],  # tests/test_peft_export.py loads --to-peft adapters; not a runtime need
        "qlora": ["bitsandbytes>=0.47"],
        "bench": ["matplotlib"],  # tools/bench.py's plots  # NF4 base weights (adapters.py, quantize_base=True)
        "convert": ["transformers"],  # tools/convert_hf.py reads Hugging Face configs
        # The GPU kernels are not on the package registry in usable form (the registry's
        # flash-mla / deep-ep / deep-gemm are early-2025 snapshots without the APIs used here).
        # Install them from source on a GPU cluster: see README.md, "GPU backends".
        "gpu": [],
    },
)
