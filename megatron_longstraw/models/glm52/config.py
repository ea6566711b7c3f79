"""GLM-5.2 (`glm_moe_dsa`) model configuration and its mapping onto Megatron-Core.

Field names follow the Hugging Face `GlmMoeDsaConfig` so that a checkpoint's `config.json` maps
one-to-one. `to_transformer_config()` builds Megatron-Core's `MLATransformerConfig`;
`hybrid_layer_pattern()` gives the `HybridModel` pattern (`D` = DSA/MLA attention, `-` = dense MLP,
`E` = MoE): a GLM-5.2 decoder layer is one attention symbol followed by one FFN symbol.

Where Megatron's DSA and the serving convention of the GLM-5.2 checkpoints differ, the difference is a
switch here and the default is what transformers' `GlmMoeDsaForCausalLM` does:
`indexer_score_relu` (ReLU on each indexer head's q.k before the weighted head sum) and
`indexer_rope_interleaved` (the indexer's RoPE rotates interleaved pairs, like MLA's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megatron_longstraw.models.config_files import ConfigFiles, mla_moe_transformer_settings


def has_own_indexer(layer_idx: int, topk_freq: int, skip_topk_offset: int) -> bool:
    """IndexShare rule for 0-based decoder layer `layer_idx`: the layer runs its own DSA indexer iff
    max(layer_idx - skip_topk_offset + 1, 0) % topk_freq == 0; otherwise it reuses the top-k of the
    previous layer that does (and has no indexer weights). Same rule as transformers'
    `indexer_types` and Megatron's `is_dsa_skip_topk_layer` (1-based there)."""
    return max(layer_idx - skip_topk_offset + 1, 0) % max(topk_freq, 1) == 0


@dataclass
class GLM52Config(ConfigFiles):
    """GLM-5.2 architecture. Defaults are the full-size model (744B total, 78 layers)."""

    FAMILY = "GLM-5.2"

    vocab_size: int = 154880
    """Vocabulary size (rows of the embedding and of the output layer)."""
    hidden_size: int = 6144
    """Residual stream width."""
    num_hidden_layers: int = 78
    """Decoder layers; each is MLA+DSA attention followed by a dense MLP or an MoE."""
    num_attention_heads: int = 64
    """MLA query heads."""
    q_lora_rank: int = 2048
    """Rank of the query down-projection (`q_a_proj`)."""
    kv_lora_rank: int = 512
    """Rank of the compressed KV latent `c_kv` (the first part of an MLA latent page row)."""
    qk_nope_head_dim: int = 192
    """Per-head query/key dimension without position encoding."""
    qk_rope_head_dim: int = 64
    """Per-head RoPE dimension; `k_pe` is shared by all heads (the second part of a latent row)."""
    v_head_dim: int = 256
    """Per-head value dimension."""
    intermediate_size: int = 12288
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
    """The first layers use a dense MLP; the rest use MoE."""
    routed_scaling_factor: float = 2.5
    """Scale applied to the normalised top-k routing weights."""
    n_group: int = 1
    """Expert groups for group-limited routing (1: no grouping)."""
    topk_group: int = 1
    """Groups each token may pick experts from."""
    norm_topk_prob: bool = True
    """Normalise the selected sigmoid scores to sum to one before scaling."""
    index_n_heads: int = 32
    """DSA indexer heads."""
    index_head_dim: int = 128
    """DSA indexer head dimension (also the width of an index-key page row)."""
    index_topk: int = 2048
    """Tokens each query attends to (DSA top-k)."""
    index_topk_freq: int = 4
    """IndexShare: one full indexer layer per `index_topk_freq` layers after the offset."""
    index_skip_topk_offset: int = 3
    """IndexShare: the first layers before this offset all have their own indexer."""
    indexer_score_relu: bool = True
    """ReLU on each indexer head's scaled q.k before weighting (transformers; Megatron's switch
    `dsa_indexer_scoring_relu`)."""
    indexer_rope_interleaved: bool = True
    """The indexer's RoPE rotates interleaved pairs (transformers' GLM-5.2) instead of half-split
    pairs (DeepSeek-V3.2; Megatron's `dsa_indexer_rope_interleaved=False`)."""
    rms_norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    indexer_norm_eps: float = 1e-6
    """Epsilon of the indexer's key LayerNorm."""
    latent_norm_eps: float = 1e-6
    """Epsilon of the MLA latent RMSNorms (`q_a_layernorm`, `kv_a_layernorm`): transformers'
    GLM-5.2 builds them with 1e-6 whatever `rms_norm_eps` is (Megatron would use
    `layernorm_epsilon`)."""
    rope_theta: float = 1_000_000.0
    """RoPE base."""
    max_position_embeddings: int = 202752
    """Longest position the checkpoint was trained for (informational; RoPE is computed on the fly)."""
    tie_word_embeddings: bool = False
    """Share the embedding and output-layer weights."""
    init_std: float = 0.02
    """Standard deviation of the random initialisation (tests, demos)."""

    def __post_init__(self) -> None:
        positive = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                    if f.type in ("int", int) and f.name not in ("index_skip_topk_offset",)}
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"GLM52Config.{name} must be positive, got {value}.")
        if self.index_skip_topk_offset < 0:
            raise ValueError("GLM52Config.index_skip_topk_offset must be >= 0, "
                             f"got {self.index_skip_topk_offset}.")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError("qk_rope_head_dim must be even and <= index_head_dim (the indexer "
                             f"rotates its first qk_rope_head_dim dims), got {self.qk_rope_head_dim}.")
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_routed_experts ({self.n_routed_experts}) must be divisible by "
                             f"n_group ({self.n_group}).")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError("num_experts_per_tok cannot exceed n_routed_experts.")
        if self.first_k_dense_replace > self.num_hidden_layers:
            raise ValueError("first_k_dense_replace cannot exceed num_hidden_layers.")

    # ---- derived structure -------------------------------------------------------------------

    def has_own_indexer(self, layer_idx: int) -> bool:
        """See `has_own_indexer`."""
        return has_own_indexer(layer_idx, self.index_topk_freq, self.index_skip_topk_offset)

    def indexer_types(self) -> list[str]:
        """Per-layer 'full' (own indexer) or 'shared' (reuses the previous full layer's top-k)."""
        return ["full" if self.has_own_indexer(i) else "shared"
                for i in range(self.num_hidden_layers)]

    def topk_source_layer(self, layer_idx: int) -> int:
        """The full indexer layer whose selection layer `layer_idx` uses (itself when full)."""
        while not self.has_own_indexer(layer_idx):
            layer_idx -= 1
        return layer_idx

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace

    def num_full_indexer_layers(self) -> int:
        return sum(self.has_own_indexer(i) for i in range(self.num_hidden_layers))

    def page_bytes_per_token(self, latent_bytes: float = 2, index_key_bytes: float = 2) -> float:
        """Captured state per prompt token (docs/design.md section 9): one MLA latent row
        `[c_kv; k_pe]` per layer plus one index-key row per full indexer layer.
        `latent_bytes` / `index_key_bytes` are bytes per element (bf16: 2; fp8 keys with one fp32
        scale per row: 1 + 4 / index_head_dim)."""
        latent = self.num_hidden_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * latent_bytes
        index = self.num_full_indexer_layers() * self.index_head_dim * index_key_bytes
        return latent + index

    def hybrid_layer_pattern(self) -> str:
        """Megatron `HybridModel` pattern: `D-` per dense layer, `DE` per MoE layer."""
        return "".join("DE" if self.is_moe_layer(i) else "D-"
                       for i in range(self.num_hidden_layers))

    # ---- Megatron-Core ----------------------------------------------------------------------

    def to_transformer_config(self, params_dtype: torch.dtype = torch.float32, **overrides):
        """Megatron-Core `MLATransformerConfig` for this architecture: the MLA + MoE settings
        (`config_files.mla_moe_transformer_settings`) plus Megatron's DSA indexer.

        `overrides` passes parallel settings (context_parallel_size, expert_model_parallel_size, ...).
        """
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        kwargs = dict(
            **mla_moe_transformer_settings(self, params_dtype),
            experimental_attention_variant="dsa",
            dsa_indexer_n_heads=self.index_n_heads,
            dsa_indexer_head_dim=self.index_head_dim,
            dsa_indexer_topk=self.index_topk,
            dsa_indexer_topk_freq=self.index_topk_freq,
            dsa_indexer_skip_topk_offset=self.index_skip_topk_offset,
            dsa_indexer_scoring_relu=self.indexer_score_relu,
            dsa_indexer_rope_interleaved=self.indexer_rope_interleaved,
            dsa_indexer_rotate_activation=False,
            dsa_indexer_k_norm_epsilon=self.indexer_norm_eps,
            # Megatron validates DSA + CP against its all-gather path; LongStraw's attention does
            # its own CP exchange (parallel.py) and never calls Megatron's.
            cp_comm_type="allgather",
        )
        kwargs.update(overrides)
        return MLATransformerConfig(**kwargs)
