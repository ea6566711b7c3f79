"""Megatron-Core internals adapted on every machine (CPU-only adaptations: platform.py). Each
module names the Megatron-Core 0.19.2 function it covers, why, and why results are unchanged."""
