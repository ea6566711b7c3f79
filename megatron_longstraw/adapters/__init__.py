"""LoRA / QLoRA adapters on Megatron-Core linear layers (`lora`) and the frozen FP8 base
(`fp8_base`). Imports: every wing below."""
