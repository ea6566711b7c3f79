"""Qwen3.6 HybridStack spec, built from Megatron-Core's own specs by swapping submodules.

Starting point: `megatron.core.models.hybrid.hybrid_layer_specs.hybrid_stack_spec` (its `gdn_layer`,
`attention_layer` and `mlp_layer`), `get_gated_delta_net_module_spec` and
`get_mlp_module_spec_for_backend`. Swaps:
- `gdn_layer.self_attention.module`: `GatedDeltaNet` -> `LongStrawGatedDeltaNet` (same submodules
  and parameters; the capture/replay-aware forward);
- `attention_layer.self_attention.module`: `SelfAttention` -> `LongStrawGatedSelfAttention` (same
  submodules and parameters, `attention_output_gate` rows in `linear_qkv`; RoPE base and fraction
  as spec params, since they are not TransformerConfig fields); its `core_attention` is an
  `IdentityOp` (the attention runs in `BlockwiseAttention`; Megatron's local DotProductAttention
  has no weights and refuses context parallelism);
- every norm -> `ZeroCenteredRMSNorm` (models/norms.py; Qwen3.5 norms are zero-centred;
  Megatron's local `WrappedTorchNorm` refuses `layernorm_zero_centered_gamma`, TENorm would
  honour it);
- TransformerEngine modules -> the local backend (`LocalSpecProvider`: ColumnParallelLinear,
  RowParallelLinear, DotProductAttention), with the input norm unfused from `in_proj` /
  `linear_qkv` (TE's LayerNormColumnParallelLinear) into the layer's `input_layernorm`.
"""

from __future__ import annotations

import dataclasses

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
    get_gated_delta_net_module_spec,
)
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_longstraw.runtime.norms import ZeroCenteredRMSNorm
from megatron_longstraw.models.qwen36.attention import LongStrawGatedSelfAttention
from megatron_longstraw.models.qwen36.gdn import LongStrawGatedDeltaNet


def _mixer_layer(mixer: ModuleSpec, norm) -> ModuleSpec:
    """A `G` / `*` symbol: input norm, the mixer, residual (HybridStack's mixer-only layer)."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm, self_attention=mixer, self_attn_bda=get_bias_dropout_add),
    )


def qwen36_stack_spec(config, rotary_base: float, rotary_percent: float,
                      backend=None) -> ModuleSpec:
    """HybridStack spec for Qwen3.6 (`G-` / `*-` layers). `config`: the TransformerConfig."""
    backend = backend or LocalSpecProvider()
    norm = ZeroCenteredRMSNorm

    gdn = get_gated_delta_net_module_spec(config, backend=backend)   # Megatron's own GDN spec
    gdn = dataclasses.replace(
        gdn, module=LongStrawGatedDeltaNet, metainfo={"fuse_input_layernorm": False},
        submodules=dataclasses.replace(gdn.submodules, in_proj=backend.column_parallel_linear(),
                                       out_norm=norm))
    attention = ModuleSpec(
        module=LongStrawGatedSelfAttention,
        params={"attn_mask_type": AttnMaskType.causal, "rotary_base": rotary_base,
                "rotary_percent": rotary_percent},
        submodules=SelfAttentionSubmodules(
            linear_qkv=backend.column_parallel_linear(),
            core_attention=IdentityOp,  # the attention math is BlockwiseAttention (no weights)
            linear_proj=backend.row_parallel_linear(),
            q_layernorm=norm,
            k_layernorm=norm,
        ),
    )
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            gdn_layer=_mixer_layer(gdn, norm),
            attention_layer=_mixer_layer(attention, norm),
            mlp_layer=ModuleSpec(
                module=MLPLayer,
                submodules=TransformerLayerSubmodules(
                    pre_mlp_layernorm=norm,
                    mlp=get_mlp_module_spec_for_backend(backend=backend),
                    mlp_bda=get_bias_dropout_add,
                ),
            ),
        ),
    )
