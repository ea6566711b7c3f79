"""GLM-5.2 HybridStack spec, built from Megatron-Core's own specs by swapping submodules.

Starting point: `megatron.core.models.hybrid.hybrid_layer_specs.hybrid_stack_spec` (its `dsa_layer`,
`mlp_layer` and `moe_layer`) and `get_dsa_module_spec_for_backend`. Swaps:
- `dsa_layer.self_attention.module`: `MLASelfAttention` -> `LongStrawMLASelfAttention` (same
  submodules and parameters; the capture/replay-aware forward);
- `dsa_layer.self_attention.submodules.core_attention`: `DSAttention` -> `DSAIndexHolder` (holds
  Megatron's `DSAIndexer`; IndexShare layers hold none);
- TransformerEngine modules -> the local backend (`LocalSpecProvider`: ColumnParallelLinear,
  RowParallelLinear, torch norms, SequentialMLP experts) when TE is not importable. The GPU backend
  swaps TE back in (kernels/te.py).
"""

from __future__ import annotations

from functools import partial

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.post_training.modelopt.layers import Linear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexer,
    DSAIndexerSubmodules,
    DSAttentionSubmodules,
)
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

from megatron_longstraw.models.glm52.attention import DSAIndexHolder, LongStrawMLASelfAttention


class _LocalBackend(LocalSpecProvider):
    """Megatron's local backend plus the plain duplicated `linear()` that the DSA spec asks for
    (LocalSpecProvider has none in 0.19.2)."""

    def linear(self) -> type:
        return Linear


def _fixed_eps_norm(norm_builder, eps: float):
    """A norm builder that uses `eps` whatever epsilon the caller passes (MLASelfAttention passes
    `layernorm_epsilon` to its latent norms; GLM-5.2's checkpoints use their own)."""

    def build(hidden_size, config, eps_from_caller=None, **kwargs):
        kwargs.pop("eps", None)
        return norm_builder(config=config, hidden_size=hidden_size, eps=eps, **kwargs)

    return build


def glm52_stack_spec(backend=None, latent_norm_eps: float = 1e-6) -> ModuleSpec:
    """HybridStack spec for GLM-5.2 (`D-`/`DE` layers)."""
    backend = backend or _LocalBackend()
    rms_norm = backend.layer_norm(rms_norm=True)
    latent_norm = _fixed_eps_norm(rms_norm, latent_norm_eps)
    attention = ModuleSpec(
        module=LongStrawMLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=backend.column_parallel_linear(),
            linear_q_down_proj=backend.column_parallel_linear(),
            linear_q_up_proj=backend.column_parallel_linear(),
            linear_kv_down_proj=backend.column_parallel_linear(),
            linear_kv_up_proj=backend.column_parallel_linear(),
            core_attention=ModuleSpec(
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
            ),
            linear_proj=backend.row_parallel_linear(),
            q_layernorm=latent_norm,
            kv_layernorm=latent_norm,
        ),
    )
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            dsa_layer=ModuleSpec(
                module=TransformerLayer,
                submodules=TransformerLayerSubmodules(
                    input_layernorm=rms_norm,
                    self_attention=attention,
                    self_attn_bda=get_bias_dropout_add,
                ),
            ),
            mlp_layer=ModuleSpec(
                module=MLPLayer,
                submodules=TransformerLayerSubmodules(
                    pre_mlp_layernorm=rms_norm,
                    mlp=partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(
                        linear_fc1=backend.column_parallel_linear(),
                        linear_fc2=backend.row_parallel_linear())),
                    mlp_bda=get_bias_dropout_add,
                ),
            ),
            moe_layer=ModuleSpec(
                module=MoETransformerLayer,
                submodules=TransformerLayerSubmodules(
                    pre_mlp_layernorm=rms_norm,
                    mlp=get_moe_module_spec_for_backend(backend=backend, num_experts=8,
                                                        moe_grouped_gemm=False),
                    mlp_bda=get_bias_dropout_add,
                ),
            ),
        ),
    )
