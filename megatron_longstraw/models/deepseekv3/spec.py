"""DeepSeek-V3 HybridStack spec: the MLA + MoE stack of `models/mla_spec.py` (what it swaps in
Megatron-Core's own specs is said there) with DeepSeek-V3's own pieces:
- the mixer slot is `mla_layer`, its module `LongStrawMLADenseAttention`;
- `mla_layer.self_attention.submodules.core_attention`: `TEDotProductAttention` -> `IdentityOp`
  (the attention math is `blockwise_attention` over the latents; there are no weights to hold);
- spec param `yarn` (RoPE with YaRN's frequencies; not a TransformerConfig switch here);
- `q_layernorm` / `kv_layernorm` are real RMSNorms here, where Megatron's TE spec fuses them into
  the up projections (`IdentityOp`).
"""

from __future__ import annotations

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_longstraw.models.deepseekv3.attention import LongStrawMLADenseAttention
from megatron_longstraw.models.mla_spec import mla_moe_stack_spec


def deepseekv3_stack_spec(backend=None, latent_norm_eps: float = 1e-6,
                          yarn: bool = False) -> ModuleSpec:
    """HybridStack spec for DeepSeek-V3 (`+-` / `+E` layers); `yarn`: the mixers rotate with YaRN's
    frequencies (a spec param, as RoPE is not Megatron's here: DeepseekV3Config.to_transformer_config)."""
    return mla_moe_stack_spec(backend or LocalSpecProvider(), "mla_layer",
                              LongStrawMLADenseAttention, IdentityOp, latent_norm_eps, yarn=yarn)
