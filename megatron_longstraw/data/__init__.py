"""What a step reads: the JSONL group format, local tokenizers, the indexed dataset and its
per-epoch order, and the group record every later wing passes around. Imports: runtime,
kernels, distributed."""
