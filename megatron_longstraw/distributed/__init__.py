"""Process groups and collectives: CP and EP folded on the same ranks (docs/design.md
section 3), the collectives the schedule needs, cross-rank agreement checks, and the corrected
gradient finalisation (section 4). Imports: runtime, kernels."""
