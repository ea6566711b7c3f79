"""TransformerEngine layers for the dense parts of GLM-5.2 (projections, norms, experts' linears):
the backend spec provider for `models/glm52/spec.py::glm52_stack_spec(backend=...)`.

Megatron-Core 0.19.2 ships it as `megatron.core.extensions.transformer_engine_spec_provider.
TESpecProvider` (`linear` -> TELinear, `column/row_parallel_linear` -> TEColumn/RowParallelLinear,
`layer_norm` -> TENorm, grouped experts -> TEGroupedMLP). The DSA indexer's key norm stays a
LayerNorm under TE: `DSAIndexer` builds it with a config copy whose `normalization` is "LayerNorm".
The reference for this part is the local backend (`spec.py`'s `_LocalBackend`): same parameters and
math, torch kernels.
"""

from __future__ import annotations

from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

from megatron_longstraw.kernels import packages


class LongStrawTESpecProvider(TESpecProvider):
    """Megatron's TE spec provider; constructing it fails with install instructions when
    TransformerEngine is missing (Megatron's own TE modules would fail later, at build time)."""

    def __init__(self) -> None:
        packages.require("transformer_engine")
        super().__init__()


def spec_provider() -> LongStrawTESpecProvider:
    """The provider to pass as `glm52_stack_spec(backend=...)`."""
    return LongStrawTESpecProvider()
