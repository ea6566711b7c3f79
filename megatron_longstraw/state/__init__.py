"""What a pass reads and writes: the paged store of captured state (`pages`) and the
attention pass (`attention_pass`: mode, positions, pages, selections) handed explicitly to every
state-aware mixer. Imports: config, runtime, kernels, distributed, data."""
