"""DeepSeek-V3 HybridStack spec, built from Megatron-Core's own specs by swapping submodules.

Starting point: `megatron.core.models.hybrid.hybrid_layer_specs.hybrid_stack_spec` (its `mla_layer`,
`mlp_layer` and `moe_layer`). Swaps:
- `mla_layer.self_attention.module`: `MLASelfAttention` -> `LongStrawMLADenseAttention` (same
  submodules and parameters; the capture/replay-aware forward);
- `mla_layer.self_attention.submodules.core_attention`: `TEDotProductAttention` -> `IdentityOp`
  (the attention math is `blockwise_attention` over the latents; there are no weights to hold);
- spec param `yarn` (RoPE with YaRN's frequencies; not a TransformerConfig switch here);
- `q_layernorm` / `kv_layernorm`: `IdentityOp` (Megatron's TE spec fuses them into the up
  projections) -> RMSNorms with `latent_norm_eps`, as transformers' `q_a_layernorm` /
  `kv_a_layernorm`;
- TransformerEngine modules -> the local backend (`LocalSpecProvider`: ColumnParallelLinear,
  RowParallelLinear, torch norms, SequentialMLP experts) by default; the GPU backend swaps TE back
  in (kernels/te.py).
"""

from __future__ import annotations

from functools import partial

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

from megatron_longstraw.models.deepseekv3.attention import LongStrawMLADenseAttention


def _fixed_eps_norm(norm_builder, eps: float):
    """A norm builder that uses `eps` whatever epsilon the caller passes (MLASelfAttention passes
    `layernorm_epsilon` to its latent norms; the checkpoints use their own)."""

    def build(hidden_size, config, eps_from_caller=None, **kwargs):
        kwargs.pop("eps", None)
        return norm_builder(config=config, hidden_size=hidden_size, eps=eps, **kwargs)

    return build


def deepseekv3_stack_spec(backend=None, latent_norm_eps: float = 1e-6,
                          yarn: bool = False) -> ModuleSpec:
    """HybridStack spec for DeepSeek-V3 (`+-` / `+E` layers); `yarn`: the mixers rotate with YaRN's
    frequencies (a spec param, as RoPE is not Megatron's here: DeepseekV3Config.to_transformer_config)."""
    backend = backend or LocalSpecProvider()
    rms_norm = backend.layer_norm(rms_norm=True)
    latent_norm = _fixed_eps_norm(rms_norm, latent_norm_eps)
    attention = ModuleSpec(
        module=LongStrawMLADenseAttention,
        params={"attn_mask_type": AttnMaskType.causal, "yarn": yarn},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=backend.column_parallel_linear(),
            linear_q_down_proj=backend.column_parallel_linear(),
            linear_q_up_proj=backend.column_parallel_linear(),
            linear_kv_down_proj=backend.column_parallel_linear(),
            linear_kv_up_proj=backend.column_parallel_linear(),
            core_attention=IdentityOp,
            linear_proj=backend.row_parallel_linear(),
            q_layernorm=latent_norm,
            kv_layernorm=latent_norm,
        ),
    )
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            mla_layer=ModuleSpec(
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
