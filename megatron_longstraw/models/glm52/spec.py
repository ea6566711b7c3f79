"""GLM-5.2 HybridStack spec: the MLA + MoE stack of `models/mla_spec.py` (what it swaps in
Megatron-Core's own specs is said there) with GLM-5.2's own pieces:
- the mixer slot is `dsa_layer`, its module `LongStrawMLASelfAttention`;
- `dsa_layer.self_attention.submodules.core_attention`: `DSAttention` -> `DSAIndexHolder` (holds
  Megatron's `DSAIndexer`, from `get_dsa_module_spec_for_backend`; IndexShare layers hold none);
- the local backend is `LocalSpecProvider` plus the plain `linear()` the DSA indexer spec asks
  for. The GPU backend swaps TE back in (kernels/te.py).
"""

from __future__ import annotations

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.post_training.modelopt.layers import Linear
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexer,
    DSAIndexerSubmodules,
    DSAttentionSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_longstraw.models.glm52.attention import DSAIndexHolder, LongStrawMLASelfAttention
from megatron_longstraw.models.mla_spec import mla_moe_stack_spec


class _LocalBackend(LocalSpecProvider):
    """Megatron's local backend plus the plain duplicated `linear()` that the DSA spec asks for
    (LocalSpecProvider has none in 0.19.2)."""

    def linear(self) -> type:
        return Linear


def glm52_stack_spec(backend=None, latent_norm_eps: float = 1e-6) -> ModuleSpec:
    """HybridStack spec for GLM-5.2 (`D-`/`DE` layers)."""
    backend = backend or _LocalBackend()
    core_attention = ModuleSpec(
        module=DSAIndexHolder,
        submodules=DSAttentionSubmodules(
            indexer=ModuleSpec(
                module=DSAIndexer,
                submodules=DSAIndexerSubmodules(
                    linear_wq_b=backend.linear(),
                    linear_wk=backend.linear(),
                    k_norm=backend.layer_norm(rms_norm=False, for_qk=True),
                    linear_weights_proj=backend.linear(),
                ),
            )
        ),
    )
    return mla_moe_stack_spec(backend, "dsa_layer", LongStrawMLASelfAttention, core_attention,
                              latent_norm_eps)
