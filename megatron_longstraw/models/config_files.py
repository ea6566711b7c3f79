"""What the model-family config dataclasses share: YAML/dict loading with a clear error on unknown
fields, the Megatron TransformerConfig settings every LongStraw model uses, and the
`MLATransformerConfig` settings of the MLA + MoE families (GLM-5.2, DeepSeek-V3)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml


class ConfigFiles:
    """Mixin for a family config dataclass; `FAMILY` names it in error messages."""

    FAMILY = "model"

    @classmethod
    def from_dict(cls, values: dict):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"Unknown {cls.FAMILY} config fields {unknown}; known fields: "
                             f"{sorted(known)}.")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path):
        """Load the `model:` section of an example YAML (or a flat mapping)."""
        data = yaml.safe_load(Path(path).read_text())
        return cls.from_dict(data.get("model", data))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def longstraw_transformer_settings(params_dtype: torch.dtype, init_std: float) -> dict:
    """TransformerConfig fields common to every LongStraw model."""
    return dict(
        init_method_std=init_std,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # The loss carries every divisor itself (grpo.py); finalize.py sums.
        calculate_per_token_loss=True,
        # LongStraw checkpoints whole decoder layers itself (replay.py).
        recompute_granularity=None,
    )


def mla_moe_transformer_settings(cfg, params_dtype: torch.dtype) -> dict:
    """`MLATransformerConfig` fields of an MLA + MoE model from its config (HF field names: GLM-5.2,
    DeepSeek-V3): one attention + one FFN symbol per decoder layer, MLA with plain RoPE in
    Megatron's terms (the mixers rotate themselves), SwiGLU FFNs, and the MoE routing by sigmoid
    scores with a fixed correction bias (`expert_bias`), scaled top-k weights and group-limited
    routing when `n_group > 1`; plus `longstraw_transformer_settings`."""
    grouped = cfg.n_group > 1
    return dict(
        num_layers=2 * cfg.num_hidden_layers,  # one attention + one FFN symbol per layer
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=cfg.intermediate_size,
        multi_latent_attention=True,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_head_dim=cfg.qk_nope_head_dim,
        qk_pos_emb_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rope_type="rope",
        rotary_base=cfg.rope_theta,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        num_moe_experts=cfg.n_routed_experts,
        moe_router_topk=cfg.num_experts_per_tok,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_shared_expert_intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,  # RL post-training keeps the balancing bias fixed
        moe_router_topk_scaling_factor=cfg.routed_scaling_factor,
        moe_router_pre_softmax=False,
        moe_router_num_groups=cfg.n_group if grouped else None,
        moe_router_group_topk=cfg.topk_group if grouped else None,
        moe_router_dtype="fp64" if params_dtype == torch.float64 else "fp32",
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_aux_loss_coeff=0.0,
        **longstraw_transformer_settings(params_dtype, cfg.init_std),
    )
