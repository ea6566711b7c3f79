"""The model families and what they share: one folder per family (`glm52`, `qwen36`, `deepseekv3`)
exporting one `Family` record (`family.py` says what it holds), collected by `registry`; the mixer
protocol (`mixer`), the dense attention modes Qwen3.6 and DeepSeek-V3 share (`dense_attention`),
context parallelism applied from outside (`context_parallel`), the shared MLA pieces, the HF
conversion helpers, the memory planner's vocabulary (`footprint`, `mla_footprint`; each family's
formulas in its folder's `planner.py`), a family's model with reproducible non-trivial weights
for the small-scale evidence tools (`seeded`), and the plain full-sequence forward's log-probs
that the tests, the evidence, the bench and the device check compare against (`reference`).
Imports: config, runtime, kernels, distributed, data, state."""
