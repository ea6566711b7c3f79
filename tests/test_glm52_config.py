"""GLM-5.2 structure from the config: IndexShare rule, layer pattern, page bytes."""

import pytest

from megatron_longstraw.models.glm52.config import GLM52Config


def test_full_size_indexshare_has_21_full_layers_of_78():
    cfg = GLM52Config()  # full size defaults
    types = cfg.indexer_types()
    assert len(types) == 78 and types.count("full") == 21 and types.count("shared") == 57
    # Worked by hand from max(i - 3 + 1, 0) % 4 == 0: layers 0, 1, 2 then 6, 10, ..., 74.
    assert [i for i, t in enumerate(types) if t == "full"] == [0, 1, 2] + list(range(6, 78, 4))
    assert cfg.topk_source_layer(5) == 2 and cfg.topk_source_layer(9) == 6


def test_pattern_matches_megatron_hybrid_notation():
    cfg = GLM52Config()
    assert cfg.hybrid_layer_pattern() == "D-D-D-" + "DE" * 75


def test_indexshare_rule_matches_transformers_and_megatron():
    from megatron.core.transformer.experimental_attention_variant.dsa import is_dsa_skip_topk_layer
    from transformers import GlmMoeDsaConfig

    cfg = GLM52Config()
    hf = GlmMoeDsaConfig(index_topk_freq=4, index_skip_topk_offset=3)
    assert hf.indexer_types == cfg.indexer_types()
    megatron = ["shared" if is_dsa_skip_topk_layer(i + 1, 3, 4) else "full" for i in range(78)]
    assert megatron == cfg.indexer_types()


def test_design_bytes_per_token():
    # docs/design.md section 9: 78 x 576 bf16 latents + 21 x 128 fp8 keys with an fp32 scale per row.
    cfg = GLM52Config()
    assert cfg.page_bytes_per_token(2, 1 + 4 / 128) == 78 * 576 * 2 + 21 * (128 + 4)


def test_bad_config_values_are_rejected():
    with pytest.raises(ValueError, match="hidden_size"):
        GLM52Config(hidden_size=0)
    with pytest.raises(ValueError, match="n_group"):
        GLM52Config(n_routed_experts=10, n_group=4)
    with pytest.raises(ValueError, match="Unknown"):
        GLM52Config.from_dict({"hiden_size": 8})
