"""The HybridStack spec of an MLA + MoE model (GLM-5.2, DeepSeek-V3), built from Megatron-Core's own
specs by swapping submodules; a family passes its mixer, its `core_attention` and the layer slot.

Starting point: `megatron.core.models.hybrid.hybrid_layer_specs.hybrid_stack_spec` (its
`dsa_layer` / `mla_layer`, `mlp_layer` and `moe_layer`). What every such family swaps:
- `<slot>.self_attention.module`: `MLASelfAttention` -> the family's state-aware mixer (same
  submodules and parameters; the capture/replay-aware forward);
- `q_layernorm` / `kv_layernorm` -> RMSNorms with a fixed `latent_norm_eps`, as transformers'
  `q_a_layernorm` / `kv_a_layernorm` (Megatron would pass `layernorm_epsilon`);
- TransformerEngine modules -> the given backend (the local `LocalSpecProvider` by default:
  ColumnParallelLinear, RowParallelLinear, torch norms, SequentialMLP experts; the GPU backend
  swaps TE back in, kernels/te.py);
- the MoE layer's experts builder -> the same builder kept off the init stream
  (models/expert_init.py: initial weights independent of the EP size).
"""

from __future__ import annotations

import dataclasses
from functools import partial

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

from megatron_longstraw.models.expert_init import experts_off_stream


def fixed_eps_norm(norm_builder, eps: float):
    """A norm builder that uses `eps` whatever epsilon the caller passes (MLASelfAttention passes
    `layernorm_epsilon` to its latent norms; the checkpoints use their own)."""

    def build(hidden_size, config, eps_from_caller=None, **kwargs):
        kwargs.pop("eps", None)
        return norm_builder(config=config, hidden_size=hidden_size, eps=eps, **kwargs)

    return build


def mla_moe_stack_spec(backend, slot: str, mixer: type, core_attention, latent_norm_eps: float,
                       **mixer_params) -> ModuleSpec:
    """HybridStack spec: `slot` (`dsa_layer`, `mla_layer`) is an input RMSNorm and `mixer` (causal,
    with `mixer_params`) over `MLASelfAttention`'s submodules with `core_attention`;
    `mlp_layer` the dense gated MLP, `moe_layer` Megatron's MoE (router, experts, shared
    experts), each after a pre-MLP RMSNorm."""
    rms_norm = backend.layer_norm(rms_norm=True)
    latent_norm = fixed_eps_norm(rms_norm, latent_norm_eps)
    attention = ModuleSpec(
        module=mixer,
        params={"attn_mask_type": AttnMaskType.causal, **mixer_params},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=backend.column_parallel_linear(),
            linear_q_down_proj=backend.column_parallel_linear(),
            linear_q_up_proj=backend.column_parallel_linear(),
            linear_kv_down_proj=backend.column_parallel_linear(),
            linear_kv_up_proj=backend.column_parallel_linear(),
            core_attention=core_attention,
            linear_proj=backend.row_parallel_linear(),
            q_layernorm=latent_norm,
            kv_layernorm=latent_norm,
        ),
    )
    mixer_layer = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=rms_norm,
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
        ),
    )
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            **{slot: mixer_layer},
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
                    mlp=_moe_spec(backend),
                    mlp_bda=get_bias_dropout_add,
                ),
            ),
        ),
    )


def _moe_spec(backend):
    """Megatron's MoE spec for `backend` (SequentialMLP experts) with the experts' builder kept off
    the init stream (models/expert_init.py: initial weights independent of the EP size)."""
    moe = get_moe_module_spec_for_backend(backend=backend, num_experts=8, moe_grouped_gemm=False)
    submodules = moe.keywords["submodules"]
    submodules = dataclasses.replace(submodules,
                                     experts=experts_off_stream(submodules.experts))
    return partial(moe.func, *moe.args, **{**moe.keywords, "submodules": submodules})
