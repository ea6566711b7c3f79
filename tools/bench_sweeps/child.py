"""One point of tools/bench.py, in its child process (`bench.py --one`): a method (LongStraw,
LongStraw with the exact prompt gradient, conventional GRPO, the no-grad forward) at one P, G and
R on the same seeded model and data, measured (peak RSS, saved and live tensor bytes, phase
seconds, CPU seconds of capture and of the forward) and returned as one JSON-able dict."""

from __future__ import annotations

import contextlib
import time


def _checkpoint_layers(model) -> str:
    """Full activation recompute of every HybridStack layer. Megatron-Core's own recompute
    (recompute_granularity=full, method=uniform, num_layers=1) when it runs here; otherwise
    torch.utils.checkpoint around each layer (the same granularity). Returns which."""
    import functools

    import torch
    from torch.utils.checkpoint import checkpoint

    try:
        ids = torch.zeros(4, dtype=torch.long)
        model(ids[None], None, None)[0].float().sum().backward()
        model.zero_grad(set_to_none=True)
        return "megatron-core recompute (full, uniform, 1 layer)"
    except RuntimeError as exc:
        model.zero_grad(set_to_none=True)
        model.config.recompute_granularity = None
        model.config.recompute_method = None
        model.config.recompute_num_layers = None
        for layer in model.decoder.layers:
            layer.forward = functools.partial(
                lambda fn, *a, **k: checkpoint(fn, *a, use_reentrant=False, **k), layer.forward)
        reason = str(exc).splitlines()[0][:80]
        return f"torch.utils.checkpoint per layer (Megatron recompute failed here: {reason})"


def _conventional(model, group, cfg) -> dict:
    """Conventional GRPO (tools/bench.py's docstring): per-member log-probs of one plain forward
    over [prompt; response] (models/reference.py `full_sequence_logprobs`, float32 or wider), the
    old ones without autograd, then one forward-backward per member."""
    import torch

    from megatron_longstraw.grpo.loss import grpo_loss
    from megatron_longstraw.models.reference import full_sequence_logprobs

    logprobs = lambda response: full_sequence_logprobs(model, group.prompt_ids, response)
    timings = {}
    start = time.perf_counter()
    with torch.no_grad():
        olds = [logprobs(r) for r in group.response_ids]
    timings["old_logprobs"] = time.perf_counter() - start
    start = time.perf_counter()
    loss_cfg = cfg.loss_config()
    logps = []
    for i, response in enumerate(group.response_ids):
        logp = logprobs(response)
        # grpo_loss over the group with member i live and the others constant: its gradient is
        # member i's share (1/(G R_i) included); summed over i it is the group gradient.
        members = [logp if j == i else olds[j] for j in range(len(olds))]
        grpo_loss(members, olds, group.rewards, loss_cfg).backward()
        logps.append(logp.detach())
    timings["forward_backward"] = time.perf_counter() - start
    return {"logps": logps, "phase_seconds": timings,
            "loss": float(grpo_loss(logps, olds, group.rewards, loss_cfg)), "page_bytes": 0}


def run_one(args) -> dict:
    """`args.method` at one point (`args.prompt_len`, `args.group_size`, every response
    `args.response_len` tokens) in this process, measured: what `bench.py --one` prints after
    BENCH_JSON."""
    import torch

    torch.set_num_threads(1)
    from megatron_longstraw.distributed import parallel
    from megatron_longstraw.runtime import platform, precision
    from megatron_longstraw.config.settings import LongStrawConfig
    from megatron_longstraw.config.choices import PromptGrad
    from megatron_longstraw.data.groups import synthetic_group
    from megatron_longstraw.models.registry import get_family
    from megatron_longstraw.runtime.memory import (
        LiveBytesMeter,
        SavedTensorMeter,
        current_rss_bytes,
        peak_rss_bytes,
    )
    from megatron_longstraw.step.schedule import forward_backward_longstraw

    parallel.initialize(seed=args.seed)
    family = get_family(args.family)
    cfg = family.config_class.from_yaml(args.config)
    platform.manual_seed(args.seed)
    precision.use_dtype(torch.float32)
    model = family.build_model(cfg, params_dtype=torch.float32)
    # The blocks of the plain forward's implicit full pass (state.AttentionPass defaults), so both
    # methods hold the same indexer-score scratch.
    ls = LongStrawConfig.from_yaml(args.config).replace(
        group_size=args.group_size, max_response_len=args.response_len,
        reuse_branch_pages=args.reuse_branch_pages, query_block=1024, key_block=4096,
        **({"response_block": args.response_block} if args.response_block else {}),
        **({"prompt_grad": PromptGrad.EXACT} if args.method == "longstraw-exact" else {}))
    group = synthetic_group(cfg.vocab_size, args.prompt_len, args.group_size, args.response_len,
                            seed=args.seed)
    # Every response R tokens long (synthetic_group varies them in [R/2, R]): the extra tokens are
    # seeded per member, so the first members of G=8 are the members of G=2, rewards unchanged.
    pad = lambda i, n: torch.randint(0, cfg.vocab_size, (n,),
                                     generator=torch.Generator().manual_seed(args.seed + i))
    group.response_ids = [torch.cat([r, pad(i, args.response_len - r.numel())])
                          for i, r in enumerate(group.response_ids)]
    recompute = "whole-decoder-layer checkpointing in replay (replay.py)"
    if args.method == "conventional":
        model.config.recompute_granularity = "full"
        model.config.recompute_method = "uniform"
        model.config.recompute_num_layers = 1
        recompute = _checkpoint_layers(model)
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    base_rss = current_rss_bytes()
    start = time.perf_counter()
    # This process's CPU seconds (user + sys; one thread) of the forward and of capture, next to
    # their wall seconds: the ratio that other load on the machine does not move.
    cpu_seconds: dict[str, float] = {}
    live_meter = contextlib.nullcontext() if args.no_live_meter else LiveBytesMeter(
        "cpu", exclude_host=args.live_exclude_host)
    with SavedTensorMeter(model) as meter, live_meter as live:
        if args.method == "forward":
            cpu = time.process_time()
            with torch.no_grad():
                model(group.prompt_ids[None], None, None)
            cpu_seconds["forward"] = time.process_time() - cpu
            out = {"logps": [], "phase_seconds": {"forward": time.perf_counter() - start},
                   "loss": 0.0, "page_bytes": 0}
        elif args.method.startswith("longstraw"):
            from megatron_longstraw.step import schedule

            def timed_capture(*a, _capture=schedule.capture_prompt, **k):
                cpu = time.process_time()
                try:
                    return _capture(*a, **k)
                finally:
                    cpu_seconds["capture"] = time.process_time() - cpu

            schedule.capture_prompt = timed_capture
            result = forward_backward_longstraw(model, group, ls)
            out = {"logps": result.logps, "phase_seconds": result.phase_seconds,
                   "loss": result.loss, "page_bytes": result.page_bytes}
        else:
            out = _conventional(model, group, ls)
    seconds = time.perf_counter() - start
    grad_norm = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()
                    if p.grad is not None) ** 0.5
    return {
        "method": args.method, "prompt_len": args.prompt_len, "group_size": args.group_size,
        "response_len": args.response_len,
        "response_lens": [int(r.numel()) for r in group.response_ids], "recompute": recompute,
        "peak_rss_bytes": peak_rss_bytes(), "base_rss_bytes": base_rss,
        "saved_peak_bytes": meter.peak_bytes, "page_bytes": out["page_bytes"],
        "live_peak_bytes": None if live is None else live.peak_bytes,
        "live_phase_bytes": None if live is None else live.phase_peaks,
        "live_excludes_host": bool(args.live_exclude_host),
        "live_host_peak_bytes": None if live is None else live.host_peak_bytes,
        "step_seconds": seconds, "phase_seconds": out["phase_seconds"], "loss": out["loss"],
        "cpu_seconds": cpu_seconds,
        "logps": [lp.double().tolist() for lp in out["logps"]], "grad_norm": grad_norm,
        "capture_blocks": {"token_block": ls.capture.token_block, "query_block": ls.capture.query_block,
                           "key_block": ls.capture.key_block, "capture": ls.capture.mode},
        "response_block": ls.replay.response_block,
        "param_checksum": checksum, "threads": torch.get_num_threads(),
    }
