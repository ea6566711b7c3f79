"""Qwen3.6-27B (Qwen3.5-style Gated-DeltaNet hybrid) configuration and its mapping onto Megatron-Core.

Field names follow transformers' `Qwen3_5TextConfig` so that a checkpoint's `config.json` maps
one-to-one (`rope_theta` and `partial_rotary_factor` live in `rope_parameters` there).
`hybrid_layer_pattern()` gives the `HybridModel` pattern: every decoder layer is one mixer symbol
(`G` = Gated DeltaNet, `*` = gated full attention) followed by one dense FFN symbol (`-`); every
`full_attention_interval`-th layer is full attention (`G-G-G-*-` per 4 layers).
`to_transformer_config()` builds Megatron-Core's `TransformerConfig`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

import torch.nn.functional as F

from megatron_longstraw.models.config_files import ConfigFiles, longstraw_transformer_settings


def decoder_layer_index(layer_number: int) -> int:
    """0-based decoder layer of a HybridStack mixer symbol. The pattern alternates one mixer and one
    FFN symbol (`G-` / `*-`) and HybridStack numbers symbols from 1, so mixer symbol n belongs to
    decoder layer (n - 1) // 2. Pages are keyed by decoder layer (replay prefetches by it)."""
    return (layer_number - 1) // 2


@dataclass
class Qwen36Config(ConfigFiles):
    """Qwen3.6-27B architecture. Defaults are the full-size model (64 layers: 48 GDN + 16 full)."""

    FAMILY = "Qwen3.6"

    vocab_size: int = 248320
    """Vocabulary size (rows of the embedding and of the output layer)."""
    hidden_size: int = 5120
    """Residual stream width."""
    intermediate_size: int = 17408
    """Width of the dense SwiGLU FFN of every layer."""
    num_hidden_layers: int = 64
    """Decoder layers; each is a GDN or a gated full-attention mixer followed by the FFN."""
    num_attention_heads: int = 24
    """Query heads of the full-attention layers."""
    num_key_value_heads: int = 4
    """K/V heads of the full-attention layers (GQA: num_attention_heads / num_key_value_heads
    consecutive query heads share one K/V head)."""
    head_dim: int = 256
    """Per-head dimension of the full-attention layers (query, key, value and output gate)."""
    linear_conv_kernel_dim: int = 4
    """Width of the GDN causal depthwise convolution over [q; k; v]."""
    linear_key_head_dim: int = 128
    """GDN query/key head dimension (d_k)."""
    linear_value_head_dim: int = 128
    """GDN value head dimension (d_v)."""
    linear_num_key_heads: int = 16
    """GDN query/key heads."""
    linear_num_value_heads: int = 48
    """GDN value heads (H_v); each query/key head serves H_v / linear_num_key_heads value heads."""
    full_attention_interval: int = 4
    """Every `full_attention_interval`-th layer (1-based) is full attention, the others GDN."""
    partial_rotary_factor: float = 0.25
    """Fraction of each full-attention head's dims rotated by RoPE (the first ones, half-split)."""
    rope_theta: float = 10_000_000.0
    """RoPE base."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm (all zero-centred: output * (1 + weight))."""
    max_position_embeddings: int = 262144
    """Longest position the checkpoint was trained for (informational; RoPE is computed on the fly)."""
    tie_word_embeddings: bool = False
    """Share the embedding and output-layer weights."""
    init_std: float = 0.02
    """Standard deviation of the random initialisation (tests, demos)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int, "float", float) and value <= 0:
                raise ValueError(f"Qwen36Config.{f.name} must be positive, got {value}.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads}).")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a "
                             f"multiple of linear_num_key_heads ({self.linear_num_key_heads}).")
        rotary = self.rotary_dim()
        if not 0 < self.partial_rotary_factor <= 1 or rotary % 2 or rotary == 0:
            raise ValueError(f"partial_rotary_factor ({self.partial_rotary_factor}) x head_dim "
                             f"({self.head_dim}) must give an even number of rotary dims > 0.")
        if self.linear_conv_kernel_dim < 2:
            raise ValueError("linear_conv_kernel_dim must be >= 2 (the conv tail is kernel - 1 rows).")

    # ---- derived structure -------------------------------------------------------------------

    def rotary_dim(self) -> int:
        """Dims of each full-attention head that RoPE rotates (transformers: int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_full_attention(self, layer_idx: int) -> bool:
        return (layer_idx + 1) % self.full_attention_interval == 0

    def layer_types(self) -> list[str]:
        """Per layer 'linear_attention' (GDN) or 'full_attention', transformers' `layer_types`."""
        return ["full_attention" if self.is_full_attention(i) else "linear_attention"
                for i in range(self.num_hidden_layers)]

    def num_full_attention_layers(self) -> int:
        return sum(self.is_full_attention(i) for i in range(self.num_hidden_layers))

    def hybrid_layer_pattern(self) -> str:
        """Megatron `HybridModel` pattern: `G-` per GDN layer, `*-` per full-attention layer."""
        return "".join("*-" if self.is_full_attention(i) else "G-"
                       for i in range(self.num_hidden_layers))

    def conv_dim(self) -> int:
        """Channels of the GDN causal conv: [q; k; v] = 2 * H_k * d_k + H_v * d_v."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    def page_bytes_per_token(self, kv_bytes: float = 2) -> float:
        """Captured state per prompt token (docs/design.md section 9): one K and one V row (after QK norm;
        K after RoPE) per full-attention layer. `kv_bytes`: bytes per element (bf16: 2)."""
        return (self.num_full_attention_layers() * 2 * self.num_key_value_heads * self.head_dim
                * kv_bytes)

    def gdn_state_bytes(self, state_bytes: float = 4, conv_bytes: float = 2) -> float:
        """Fixed-size captured state per GDN layer, whatever the prompt length: the recurrent state
        [H_v, d_k, d_v] (fp32 in every GDN kernel: `state_bytes` 4) and the conv tail
        [kernel - 1, conv_dim] (the model's dtype: bf16 `conv_bytes` 2)."""
        state = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
        tail = (self.linear_conv_kernel_dim - 1) * self.conv_dim()
        return state * state_bytes + tail * conv_bytes

    # ---- Megatron-Core ----------------------------------------------------------------------

    def to_transformer_config(self, params_dtype: torch.dtype = torch.float32, **overrides):
        """Megatron-Core `TransformerConfig` for this architecture.

        `overrides` passes parallel settings (context_parallel_size, ...). RoPE's base and fraction
        are not TransformerConfig fields (HybridModel takes them as arguments); the spec passes them
        to the attention modules (`spec.qwen36_stack_spec`).
        """
        from megatron.core.transformer.transformer_config import TransformerConfig

        kwargs = dict(
            num_layers=2 * self.num_hidden_layers,  # one mixer + one FFN symbol per layer
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_key_value_heads,
            kv_channels=self.head_dim,
            ffn_hidden_size=self.intermediate_size,
            normalization="RMSNorm",
            layernorm_zero_centered_gamma=True,  # Qwen3.5 norms: x / rms(x) * (1 + weight)
            layernorm_epsilon=self.rms_norm_eps,
            qk_layernorm=True,
            attention_output_gate=True,          # o * sigmoid(gate), gate rows in linear_qkv
            add_bias_linear=False,
            gated_linear_unit=True,
            activation_func=F.silu,
            linear_conv_kernel_dim=self.linear_conv_kernel_dim,
            linear_key_head_dim=self.linear_key_head_dim,
            linear_value_head_dim=self.linear_value_head_dim,
            linear_num_key_heads=self.linear_num_key_heads,
            linear_num_value_heads=self.linear_num_value_heads,
            **longstraw_transformer_settings(params_dtype, self.init_std),
        )
        kwargs.update(overrides)
        return TransformerConfig(**kwargs)
