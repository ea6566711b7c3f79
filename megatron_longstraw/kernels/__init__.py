"""Kernel backends: `refs` (pure PyTorch, always available) and one module per GPU backend.
`select.kernels()` returns the active set."""
