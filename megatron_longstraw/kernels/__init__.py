"""Kernel backends and the number formats they compute on: `refs` (pure PyTorch, always available)
and one thin module per GPU backend (`flashmla`, `triton_sparse_mla`, `deepgemm`, `deepep`, `te`,
`nvidia_apex`). `select.kernels()` returns the active set; `packages` knows where each optional
package comes from; `parity` holds the shared backend-vs-reference checks. `fp8` (DeepSeek-style
block FP8: the format and its reference GEMM) and `nf4` (QLoRA's NF4 storage). Imports: runtime."""
