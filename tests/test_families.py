"""The family registry (megatron_longstraw/models/registry.py): every record is complete and agrees with
its own config, examples, planner and the entry points' choices."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from helpers import ROOT
from megatron_longstraw.adapters import lora as adapters
from megatron_longstraw.training import arguments
from megatron_longstraw import planner
from megatron_longstraw.models.registry import FAMILIES, check_parallel_sizes, get_family
from megatron_longstraw.models import qwen36
from megatron_longstraw.models.common import MIXERS


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_record_matches_its_config_and_examples(name):
    family = get_family(name)
    for path in (family.tiny_config, family.full_config):
        cfg = family.config_class.from_yaml(str(ROOT / path))
        pattern = cfg.hybrid_layer_pattern()
        assert set(pattern) <= set(family.layer_symbols), (path, pattern)
        assert set(pattern) & MIXERS                     # capture/replay find its mixers
        assert family.num_routed_experts(cfg) >= 1
        assert family.describe(cfg)
    assert all(field in {f.name for f in dataclasses.fields(family.config_class)}
               for field, _ in family.from_megatron.values())
    assert family.lora_targets and family.planner.cp >= 1 and family.planner.ep >= 1
    assert planner.FAMILIES[name] is family.planner.footprint


def test_entry_points_offer_the_registry():
    parser = arguments.add_longstraw_args(argparse.ArgumentParser())
    action = next(a for a in parser._actions if a.dest == "longstraw_family")
    assert sorted(action.choices) == sorted(FAMILIES)
    assert set(planner.FAMILIES) == set(FAMILIES)
    with pytest.raises(ValueError, match="known"):
        get_family("nope")


def test_expert_parallel_limit():
    check_parallel_sizes(get_family("glm52"), 8)
    with pytest.raises(ValueError, match="no MoE layers"):
        check_parallel_sizes(get_family("qwen36"), 2)


def test_lora_default_is_qwen36_targets():
    """adapters.LoRAConfig's default targets are Megatron's own linear names, Qwen3.6's targets
    (tests rely on LoRAConfig(rank=...) wrapping Qwen3.6's linears)."""
    assert adapters.LoRAConfig().targets == qwen36.FAMILY.lora_targets
