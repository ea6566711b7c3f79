"""Part 8 of tools/device_check.py (issue #15): streamed capture of GLM-5.2 at full width (the
reduced-depth model of part 6) at P and 2P on one device, its measured device peak beside the
planner's capture lines for the same setup.

Per prompt length: `capture_prompt` alone (pages offloaded to host memory) under
`memory.LiveBytesMeter(exclude_host=True)` (CUDA: `max_memory_allocated` above what was allocated
before, pinned host memory never counted; CPU: the allocator's events, host storage left out),
and the planner (`planner.plan`, CP 1, the model's dtype for activations, latents and index keys,
the capture's blocks) for the same model: its capture phases' totals on top of the static state
and its host lines. Streamed capture holds one token block, one key window and one layer's
weights on the device, so the measured peak should barely move from P to 2P; the planner's only
prompt-sized device line is the positions table (8 B per token). Without CUDA the same code runs
on the tiny GLM-5.2 in fp32 (what the tests run)."""

from __future__ import annotations

import torch

from .common import RESULTS, say


def _tiny():
    from megatron_longstraw.distributed import parallel
    from megatron_longstraw.runtime import precision
    from megatron_longstraw.models.registry import get_family

    from .common import REPO

    glm52 = get_family("glm52")
    parallel.initialize(context_parallel_size=1, expert_parallel_size=1)
    precision.use_dtype(torch.float32)
    cfg = glm52.config_class.from_yaml(REPO / glm52.tiny_config)
    return cfg, glm52.build_model(cfg, params_dtype=torch.float32)


def capacity(args, lengths: tuple[int, ...] | None = None, model_and_config=None) -> dict:
    """Streamed capture at each of `lengths` (default: --start-prompt-len and twice it on a GPU,
    257 and 641 on the CPU's tiny model: several token blocks each): measured device peak vs the
    planner's."""
    from megatron_longstraw import planner
    from megatron_longstraw.context.capture import capture_prompt
    from megatron_longstraw.config.settings import LongStrawConfig
    from megatron_longstraw.runtime.memory import LiveBytesMeter

    gpu = torch.cuda.is_available()
    if model_and_config is not None:
        cfg, model = model_and_config
    elif gpu:
        from .steps import _build_model

        cfg, model = _build_model()
    else:
        cfg, model = _tiny()
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    b = torch.empty((), dtype=dtype).element_size()
    lengths = lengths or ((args.start_prompt_len, 2 * args.start_prompt_len) if gpu else (257, 641))
    blocks = (dict(token_block=8192, query_block=1024, key_block=4096) if gpu else
              dict(token_block=128, query_block=32, key_block=128))
    ls = LongStrawConfig.of(group_size=2, offload_pages=True, kernels=getattr(args, "kernels", "auto"),
                         **blocks)
    out = {"device": str(device), "dtype": str(dtype).replace("torch.", ""), "blocks": blocks,
           "points": []}
    for prompt_len in lengths:
        ids = torch.randint(0, cfg.vocab_size, (prompt_len,), device=device,
                            generator=torch.Generator(device=device).manual_seed(prompt_len))
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        with LiveBytesMeter(device.type, exclude_host=True) as meter:
            captured = capture_prompt(model, ids, ls)
        spec = planner.PlanSpec(family="glm52", model=cfg, prompt_len=prompt_len, group_size=2,
                                response_len=16, weight_bytes=b, act_bytes=b, latent_bytes=b,
                                index_key_bytes=b, page_tokens=ls.capture.page_tokens, **blocks)
        plan = planner.plan(spec, search_max=False)
        capture = {name: planner.phase_bytes(items) for name, items in plan.phases.items()
                   if name.startswith("capture")}   # transient, on top of the static state
        point = {"prompt_len": prompt_len, "measured_device_peak_bytes": meter.peak_bytes,
                 "measured_host_peak_bytes": meter.host_peak_bytes,
                 "page_bytes": captured.pages.nbytes(allocated=True),
                 "planned_capture_bytes": capture,
                 "planned_host_bytes": {i.name: i.bytes for i in plan.host_items
                                        if i.name.startswith("capture")},
                 "capture_seconds": captured.seconds}
        out["points"].append(point)
        say(f"  P = {prompt_len:8d}: capture {captured.seconds:6.1f} s | device peak "
            f"{meter.peak_bytes / 2**20:9.1f} MiB (planner: "
            + ", ".join(f"{k.split('(')[-1].rstrip(')')} {v / 2**20:.1f} MiB"
                        for k, v in capture.items())
            + f") | host: pages {point['page_bytes'] / 2**20:.1f} MiB + capture buffers "
            f"{sum(point['planned_host_bytes'].values()) / 2**20:.1f} MiB planned, "
            f"{meter.host_peak_bytes / 2**20:.1f} MiB measured")
        del captured
    first, last = out["points"][0], out["points"][-1]
    growth = last["measured_device_peak_bytes"] - first["measured_device_peak_bytes"]
    planned = 8 * (last["prompt_len"] - first["prompt_len"])
    out["device_peak_growth_bytes"] = growth
    out["planned_growth_bytes"] = planned
    # One token block's and one window's scratch is the same at both lengths; allow the CUDA
    # allocator's rounding (blocks of up to 2 MiB) on top of the planned positions table.
    slack = 2 * 2**20 if device.type == "cuda" else 0
    ok = growth <= planned + slack
    say(f"  {'ok  ' if ok else 'FAIL'} device peak growth P={first['prompt_len']} -> "
        f"{last['prompt_len']}: {growth} B (planner: {planned} B, the positions table; allowed "
        f"+{slack} B allocator rounding)")
    if not ok:
        RESULTS["failures"].append("capacity: device peak grows with P")
    out["ok"] = ok
    return out
