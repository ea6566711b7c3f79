"""Rank functions of tests/test_init_layout.py (importable for the forkserver)."""

from __future__ import annotations

import os

import torch


def initial_weights_worker(rank, family, layouts, seed):
    """The launcher's build (the family record's `build`) at each (cp, ep) of `layouts` in these
    processes: the full (EP = 1 names) state dict gathered on rank 0, None elsewhere."""
    from megatron_longstraw.checkpointing import model_format
    from megatron_longstraw.distributed import parallel
    from megatron_longstraw.models.registry import get_family
    from megatron_longstraw.runtime import precision

    entry = get_family(family)
    out = []
    for cp, ep in layouts:
        parallel.initialize(context_parallel_size=cp, expert_parallel_size=ep, seed=seed,
                            init_method=os.environ["LONGSTRAW_TEST_INIT"])
        precision.use_dtype(torch.float32)
        cfg = entry.config_class.from_yaml(entry.tiny_config)
        model = entry.build(cfg, torch.float32, ep)
        full = model_format.full_state_dict(model)
        out.append(None if full is None else {n: t.clone() for n, t in full.items()})
    return out
