"""Functions run on each rank by tests/test_deepseekv3_distributed.py (importable for spawn)."""

from __future__ import annotations

import os

import torch

from dist_workers import groups_for, step
from test_deepseekv3 import build_tiny_deepseekv3


def layout_worker(rank, cp, ep, state_path, prompt_len, lens, repeat=1):
    """DeepSeek-V3 on CP ranks with EP folded on them: one optimizer step from the saved weights
    (twice with repeat=2), and this rank's captured latent pages with their global positions."""
    from megatron.core import parallel_state as ps

    from megatron_longstraw.distributed import parallel, expert_names
    from megatron_longstraw.context.capture import capture_prompt
    from dist_workers import longstraw_cfg

    parallel.initialize(context_parallel_size=cp, expert_parallel_size=ep,
                        init_method=os.environ["LONGSTRAW_TEST_INIT"])
    cfg, model = build_tiny_deepseekv3(torch.float64)
    full = torch.load(state_path)
    group = groups_for(cfg, 1, prompt_len=prompt_len, lens=lens)[0]
    runs = []
    for _ in range(repeat):
        expert_names.load_full_state_dict(model, full, cfg.n_routed_experts)
        runs.append(step(model, cfg, [group], 1))
    expert_names.load_full_state_dict(model, full, cfg.n_routed_experts)  # the step's starting weights
    captured = capture_prompt(model, group.prompt_ids, longstraw_cfg(len(lens)))
    pages = {layer: captured.pages.fetch(layer, "latent").clone()
             for layer in captured.pages.layers()}
    return {"runs": runs, "pages": pages, "positions": captured.positions,
            "cp_rank": ps.get_context_parallel_rank(),
            "ep_rank": ps.get_expert_model_parallel_rank()}
