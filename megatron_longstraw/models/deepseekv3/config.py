"""DeepSeek-V3 (`deepseek_v3`: DeepSeek-V3, DeepSeek-R1, Kimi-K2) model configuration and its mapping
onto Megatron-Core.

Field names follow the Hugging Face `DeepseekV3Config`, so a checkpoint's `config.json` maps
one-to-one; the RoPE scaling entries of its `rope_parameters` (`rope_scaling` in older files) are
flat fields here (`rope_type`, `rope_factor`, `original_max_position_embeddings`, `beta_fast`,
`beta_slow`, `mscale`, `mscale_all_dim`). `to_transformer_config()` builds Megatron-Core's
`MLATransformerConfig`; `hybrid_layer_pattern()` gives the `HybridModel` pattern (`+` = MLA,
`-` = dense MLP, `E` = MoE): a decoder layer is one MLA symbol followed by one FFN symbol. The
attention is dense causal MLA (no DSA indexer), the MoE routes by sigmoid scores with a correction
bias, group-limited (`n_group` groups, `topk_group` of them per token).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megatron_longstraw.models.config_files import ConfigFiles, mla_moe_transformer_settings

ROPE_TYPES = ("default", "yarn")


def decoder_layer_index(layer_number: int) -> int:
    """0-based decoder layer of a HybridStack MLA symbol: the pattern alternates one `+` and one
    FFN symbol, numbered from 1, so symbol n belongs to decoder layer (n - 1) // 2."""
    return (layer_number - 1) // 2


@dataclass
class DeepseekV3Config(ConfigFiles):
    """DeepSeek-V3 architecture. Defaults are the full-size DeepSeek-V3 / R1 (671B total, 61
    layers)."""

    FAMILY = "DeepSeek-V3"

    vocab_size: int = 129280
    """Vocabulary size (rows of the embedding and of the output layer)."""
    hidden_size: int = 7168
    """Residual stream width."""
    num_hidden_layers: int = 61
    """Decoder layers; each is MLA attention followed by a dense MLP or an MoE."""
    num_attention_heads: int = 128
    """MLA query heads."""
    q_lora_rank: int = 1536
    """Rank of the query down-projection (`q_a_proj`)."""
    kv_lora_rank: int = 512
    """Rank of the compressed KV latent `c_kv` (the first part of a latent page row)."""
    qk_nope_head_dim: int = 128
    """Per-head query/key dimension without position encoding."""
    qk_rope_head_dim: int = 64
    """Per-head RoPE dimension; `k_pe` is shared by all heads (the second part of a latent row)."""
    v_head_dim: int = 128
    """Per-head value dimension."""
    intermediate_size: int = 18432
    """FFN width of the dense layers."""
    moe_intermediate_size: int = 2048
    """FFN width of each routed expert and of the shared expert."""
    n_routed_experts: int = 256
    """Routed experts per MoE layer."""
    num_experts_per_tok: int = 8
    """Experts each token is routed to."""
    n_shared_experts: int = 1
    """Shared experts per MoE layer (summed into one MLP of width n_shared * moe_intermediate)."""
    first_k_dense_replace: int = 3
    """The first layers use a dense MLP; the rest use MoE (0: every layer is MoE)."""
    routed_scaling_factor: float = 2.5
    """Scale applied to the normalised top-k routing weights."""
    n_group: int = 8
    """Expert groups for group-limited routing (1: no grouping)."""
    topk_group: int = 4
    """Groups each token may pick experts from (a group scores by its top
    num_experts_per_tok // topk_group experts)."""
    norm_topk_prob: bool = True
    """Normalise the selected sigmoid scores to sum to one before scaling."""
    rms_norm_eps: float = 1e-6
    """Epsilon of the residual-stream RMSNorms."""
    latent_norm_eps: float = 1e-6
    """Epsilon of the MLA latent RMSNorms (`q_a_layernorm`, `kv_a_layernorm`): transformers builds
    them with 1e-6 whatever `rms_norm_eps` is (Megatron would use `layernorm_epsilon`)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_type: str = "yarn"
    """`default` (plain RoPE) or `yarn` (`rope_parameters["rope_type"]`)."""
    rope_factor: float = 40.0
    """YaRN context-extension factor (`rope_parameters["factor"]`)."""
    original_max_position_embeddings: int = 4096
    """YaRN: the pre-training context the frequency ramp is measured against."""
    beta_fast: float = 32.0
    """YaRN: dimensions turning more than this often over the original context keep their
    frequency."""
    beta_slow: float = 1.0
    """YaRN: dimensions turning fewer times than this are interpolated by `rope_factor`."""
    mscale: float = 1.0
    """YaRN: RoPE cos/sin scale numerator mscale(factor, mscale) (0: unset)."""
    mscale_all_dim: float = 1.0
    """YaRN: cos/sin scale denominator and softmax scale mscale(factor, mscale_all_dim)^2 (0: unset,
    no softmax correction)."""
    max_position_embeddings: int = 163840
    """Longest position the checkpoint serves (informational; RoPE is computed on the fly)."""
    tie_word_embeddings: bool = False
    """Share the embedding and output-layer weights."""
    init_std: float = 0.02
    """Standard deviation of the random initialisation (tests, demos)."""

    def __post_init__(self) -> None:
        positive = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                    if f.type in ("int", int) and f.name != "first_k_dense_replace"}
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"DeepseekV3Config.{name} must be positive, got {value}.")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError("first_k_dense_replace must be in [0, num_hidden_layers], got "
                             f"{self.first_k_dense_replace}.")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}.")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError("num_experts_per_tok cannot exceed n_routed_experts.")
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_routed_experts ({self.n_routed_experts}) must be divisible by "
                             f"n_group ({self.n_group}).")
        if self.n_group > 1:
            per_group = self.n_routed_experts // self.n_group
            if not (self.topk_group <= self.n_group
                    and 1 <= self.num_experts_per_tok // self.topk_group <= per_group
                    and self.num_experts_per_tok <= self.topk_group * per_group):
                raise ValueError(
                    f"Group-limited routing needs topk_group <= n_group, 1 <= num_experts_per_tok "
                    f"// topk_group <= experts per group and num_experts_per_tok <= topk_group x "
                    f"experts per group; got n_group {self.n_group}, topk_group "
                    f"{self.topk_group}, {per_group} experts per group, "
                    f"top-{self.num_experts_per_tok}.")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}.")
        if self.rope_type == "yarn" and not (self.rope_factor >= 1 and self.beta_fast > 0
                                             and self.beta_slow > 0):
            raise ValueError("YaRN needs rope_factor >= 1 and positive beta_fast / beta_slow, got "
                             f"{self.rope_factor}, {self.beta_fast}, {self.beta_slow}.")

    # ---- derived structure -------------------------------------------------------------------

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace

    def page_bytes_per_token(self, latent_bytes: float = 2) -> float:
        """Captured state per prompt token (DESIGN section 9): one MLA latent row `[c_kv; k_pe]`
        per layer, nothing else (dense attention reads the latents only). `latent_bytes`: bytes per
        element (bf16: 2)."""
        return self.num_hidden_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * latent_bytes

    def hybrid_layer_pattern(self) -> str:
        """Megatron `HybridModel` pattern: `+-` per dense layer, `+E` per MoE layer."""
        return "".join("+E" if self.is_moe_layer(i) else "+-"
                       for i in range(self.num_hidden_layers))

    # ---- Megatron-Core ----------------------------------------------------------------------

    def to_transformer_config(self, params_dtype: torch.dtype = torch.float32, **overrides):
        """Megatron-Core `MLATransformerConfig` for this architecture: the MLA + MoE settings
        (`config_files.mla_moe_transformer_settings`) plus YaRN's fields.

        RoPE: the rotation runs in the mixer (`attention.py`; YaRN through `kernels/refs.py`
        `yarn_inv_freq`, switched on by the spec, `spec.deepseekv3_stack_spec(yarn=...)`), so
        Megatron's `rope_type` stays "rope": with "yarn" MLASelfAttention would build a
        `YarnRotaryEmbedding` that LongStraw never reads and whose constructor slices a cos/sin
        cache per CP rank with `.cuda()` (impossible on CPU). The YaRN fields are still set:
        Megatron's MLA computes `softmax_scale = mscale(rotary_scaling_factor, mscale_all_dim)^2
        / sqrt(qk_head_dim + rope)` whatever `rope_type` says, which is transformers'
        `yarn_apply_mscale`; plain RoPE passes factor 1 (scale 1/sqrt(d)).
        `overrides` passes parallel settings (context_parallel_size, expert_model_parallel_size, ...).
        """
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        yarn = self.rope_type == "yarn"
        kwargs = dict(
            **mla_moe_transformer_settings(self, params_dtype),
            # rope_type stays "rope": the mixer applies RoPE / YaRN itself (see above)
            rotary_scaling_factor=self.rope_factor if yarn else 1.0,
            original_max_position_embeddings=self.original_max_position_embeddings,
            beta_fast=self.beta_fast,
            beta_slow=self.beta_slow,
            mscale=self.mscale if yarn else 1.0,
            mscale_all_dim=self.mscale_all_dim if yarn else 0.0,
        )
        kwargs.update(overrides)
        return MLATransformerConfig(**kwargs)
