"""Process groups and what crosses ranks (docs/design.md sections 3 and 4): `parallel` (CP and EP
folded on the same ranks: initialisation, sizes, gradient groups), `cp_layout` (where a sequence's
rows live over CP), `collectives` (gathers, the global top-k merge, the LSE merge with its
reduce-scatter, the rows <-> heads exchange), `expert_names` (EP-local experts under global names),
`agreement` (the one place ranks check they agree, or fail together) and `finalize` (the corrected
gradient finalisation). Imports: runtime, kernels."""
