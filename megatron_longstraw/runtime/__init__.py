"""The ground floor: what every other wing may use and nothing here may build on.

`platform` (Megatron-Core on CPU with gloo: every CPU-only adaptation, in one place), `patches/`
(Megatron-Core internals adapted on every machine, one module each with its header), `precision`
(float64 reference precision), `norms` (the local norms the CPU specs and the fp64 switches use),
`errors` (user errors and how an entry point reports them), `memory` (the saved-tensor and
live-bytes meters) and `parent_watch` (a torchrun worker stops when torchrun is gone). Imports: nothing from the package."""
