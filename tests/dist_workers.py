"""Functions run on each rank by the distributed tests (importable for spawn)."""

from __future__ import annotations

import os

import torch

from helpers import build_tiny_glm, build_tiny_qwen


def _group(cfg, prompt_len, lens, seed):
    from megatron_longstraw.data.group import GRPOGroup

    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=gen)
    responses = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lens]
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, -1.0][:len(lens)], dtype=torch.float64)
    return GRPOGroup(prompt_ids=prompt, response_ids=responses, rewards=rewards)


def groups_for(cfg, num_groups, prompt_len=200, lens=(1, 6, 17)):
    return [_group(cfg, prompt_len, lens, seed=100 + g) for g in range(num_groups)]


def longstraw_cfg(group_size):
    from megatron_longstraw.config.settings import LongStrawConfig

    return LongStrawConfig.of(group_size=group_size, query_block=29, key_block=37, token_block=50,
                           max_response_len=64, clip_eps_high=0.28)


def step(model, cfg, groups_here, num_groups_total, lr=1e-3):
    """One optimizer step over this rank's groups; returns (logps, grads, params, selections)."""
    from megatron_longstraw.distributed.finalize import finalize_longstraw_grads, grad_norm
    from megatron_longstraw.distributed.expert_names import global_name
    from megatron_longstraw.distributed.cp_layout import CPLayout
    from megatron_longstraw.step.replay import gather_selections
    from megatron_longstraw.step.schedule import forward_backward_longstraw

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    optimizer.zero_grad(set_to_none=True)
    logps, selections = [], []
    for group in groups_here:
        result = forward_backward_longstraw(model, group, longstraw_cfg(len(group.response_ids)),
                                            loss_scale=1.0 / num_groups_total)
        logps.append([lp.clone() for lp in result.logps])
        ls = longstraw_cfg(len(group.response_ids))
        selections.append([gather_selections(sel, int(r.numel()), ls, CPLayout.current())
                           for sel, r in zip(result.selections, group.response_ids)])
    finalize_longstraw_grads(model)
    norm = grad_norm(model)
    name = lambda n: global_name(n, getattr(cfg, "n_routed_experts", 0))
    grads = {name(n): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    params = {name(n): p.detach().clone() for n, p in model.named_parameters()}
    return {"logps": logps, "grads": grads, "params": params, "selections": selections,
            "grad_norm": norm}


def layout_worker(rank, cp, ep, state_path, num_groups_total, repeat=1):
    from megatron.core import parallel_state as ps

    from megatron_longstraw.distributed import parallel, expert_names

    parallel.initialize(context_parallel_size=cp, expert_parallel_size=ep,
                        init_method=os.environ["LONGSTRAW_TEST_INIT"])
    cfg, model = build_tiny_glm(torch.float64)
    full = torch.load(state_path)
    outs = []
    for _ in range(repeat):
        expert_names.load_full_state_dict(model, full, cfg.n_routed_experts)
        groups = groups_for(cfg, num_groups_total)
        dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        mine = groups[dp_rank::dp_size]
        outs.append(step(model, cfg, mine, num_groups_total))
    return {"runs": outs, "dp_rank": ps.get_data_parallel_rank(),
            "cp_rank": ps.get_context_parallel_rank(), "ep_rank": ps.get_expert_model_parallel_rank()}


def layouts_worker(rank, layouts, state_path, num_groups_total):
    """`layout_worker` for several (cp, ep, repeat) layouts of the same world, one after the
    other in the same processes (one spawn)."""
    return [layout_worker(rank, cp, ep, state_path, num_groups_total, repeat)
            for cp, ep, repeat in layouts]


def failing_capture_worker(rank, cp, failing_rank):
    """Rank `failing_rank` raises in the middle of capture; the others must not hang."""
    from megatron_longstraw.distributed import parallel

    parallel.initialize(context_parallel_size=cp, expert_parallel_size=cp, timeout_s=120,
                        init_method=os.environ["LONGSTRAW_TEST_INIT"])
    cfg, model = build_tiny_glm(torch.float32)
    if rank == failing_rank:
        layer = model.decoder.layers[4]
        def boom(*args, **kwargs):
            raise RuntimeError(f"injected failure on rank {rank} in capture")
        layer.register_forward_pre_hook(boom)
    group = groups_for(cfg, 1)[0]
    from megatron_longstraw.step.schedule import forward_backward_longstraw
    forward_backward_longstraw(model, group, longstraw_cfg(3))
    return "finished"


def mismatch_worker(rank, what):
    """Ranks disagree on the group: detected before any work."""
    from megatron_longstraw.distributed import parallel
    from megatron_longstraw.step.schedule import forward_backward_longstraw

    parallel.initialize(context_parallel_size=2, expert_parallel_size=2,
                        init_method=os.environ["LONGSTRAW_TEST_INIT"])
    cfg, model = build_tiny_glm(torch.float32)
    group = groups_for(cfg, 1)[0]
    if rank == 1 and what == "prompt":
        group.prompt_ids = group.prompt_ids[:-5]
    if rank == 1 and what == "group_size":
        group.response_ids = group.response_ids[:2]
        group.rewards = group.rewards[:2]
    forward_backward_longstraw(model, group, longstraw_cfg(len(group.response_ids)))
    return "finished"


def stock_finalize_worker(rank, state_path):
    """The same CP2/EP2 step finished by Megatron-Core's stock DDP + finalize_model_grads, against
    finalize_longstraw_grads in the same process: returns the per-parameter ratios stock / ours."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from megatron_longstraw.distributed import parallel, expert_names
    from megatron_longstraw.distributed.finalize import finalize_longstraw_grads, is_expert_param
    from megatron_longstraw.step.schedule import forward_backward_longstraw

    parallel.initialize(context_parallel_size=2, expert_parallel_size=2,
                        init_method=os.environ["LONGSTRAW_TEST_INIT"])
    cfg, model = build_tiny_glm(torch.float64)
    expert_names.load_full_state_dict(model, torch.load(state_path), cfg.n_routed_experts)
    group = groups_for(cfg, 1)[0]
    forward_backward_longstraw(model, group, longstraw_cfg(3))
    finalize_longstraw_grads(model)
    ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    ratios = {}
    for per_token in (False, True):
        for p in model.parameters():
            p.grad = None
        # Megatron's default (average over DP x CP), then its per-token-loss mode with the token
        # count its schedules pass.
        model.config.calculate_per_token_loss = per_token
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
        ddp.zero_grad_buffer()
        forward_backward_longstraw(model, group, longstraw_cfg(3))
        local_tokens = sum(r.numel() for r in group.response_ids) // 2  # this rank's share
        finalize_model_grads([ddp], num_tokens=torch.tensor(local_tokens) if per_token else None)
        ratios[per_token] = {
            ("expert" if expert else "dense"):
                sorted({round(float(p.main_grad.norm() / ours[n].norm()), 7)
                        for n, p in model.named_parameters()
                        if n in ours and ours[n].norm() > 0 and is_expert_param(p) == expert})
            for expert in (False, True)}
        ratios[per_token]["num_tokens"] = local_tokens
        model = ddp.module
    return ratios


def short_prompt_worker(rank, state_path, prompt_len):
    """CP2/EP2 scoring of a prompt whose shards hold fewer keys than the DSA top-k."""
    from megatron_longstraw.distributed import parallel, expert_names
    from megatron_longstraw.step.schedule import forward_backward_longstraw

    parallel.initialize(context_parallel_size=2, expert_parallel_size=2,
                        init_method=os.environ["LONGSTRAW_TEST_INIT"])
    cfg, model = build_tiny_glm(torch.float64)
    expert_names.load_full_state_dict(model, torch.load(state_path), cfg.n_routed_experts)
    group = groups_for(cfg, 1, prompt_len=prompt_len)[0]
    result = forward_backward_longstraw(model, group, longstraw_cfg(3))
    return {"logps": [lp.clone() for lp in result.logps], "plain_forward": _plain_forward(model)}


def _plain_forward(model) -> str:
    """A plain Megatron forward of a model built for CP > 1: must refuse (it has no layout)."""
    try:
        model(torch.arange(8)[None], None, None)
    except ValueError as exc:
        return str(exc)
    return "no error"


def qwen_layout_worker(rank, cp, state_path, prompt_len, lens, repeat=1):
    """Qwen3.6 on CP ranks: one optimizer step (twice from the same weights with repeat=2), and the
    GDN pages this rank captured for the group's prompt."""
    from megatron_longstraw.distributed import parallel
    from megatron_longstraw.context.capture import capture_prompt

    parallel.initialize(context_parallel_size=cp, expert_parallel_size=1,
                        init_method=os.environ["LONGSTRAW_TEST_INIT"])
    cfg, model = build_tiny_qwen(torch.float64)
    full = torch.load(state_path)
    group = groups_for(cfg, 1, prompt_len=prompt_len, lens=lens)[0]
    runs = []
    for _ in range(repeat):
        model.load_state_dict(full, strict=False)
        runs.append(step(model, cfg, [group], 1))
    model.load_state_dict(full, strict=False)  # the pages of the weights before the step
    captured = capture_prompt(model, group.prompt_ids, longstraw_cfg(len(lens)))
    pages = {(layer, kind): captured.pages.fetch(layer, kind).clone()
             for layer in captured.pages.layers() for kind in captured.pages.kinds(layer)}
    return {"runs": runs, "pages": pages, "positions": captured.positions,
            "plain_forward": _plain_forward(model)}


def _case_model(family, cp, ep, state_path):
    """A case's tiny fp64 model on CP (x EP) ranks, with the test's weights (this rank's experts).
    -> (config, model, number of routed experts)"""
    from megatron_longstraw.distributed import parallel, expert_names

    parallel.initialize(context_parallel_size=cp, expert_parallel_size=ep,
                        init_method=os.environ["LONGSTRAW_TEST_INIT"])
    if family == "deepseekv3":
        from test_deepseekv3 import build_tiny_deepseekv3 as build
    else:
        build = build_tiny_glm if family == "glm52" else build_tiny_qwen
    cfg, model = build(torch.float64)
    experts = getattr(cfg, "n_routed_experts", 0) or 0
    expert_names.load_full_state_dict(model, torch.load(state_path), experts)
    return cfg, model, experts


def exact_gradient_worker(rank, cases, lens, loss_masks=None, settings=None):
    """Groups with the exact prompt gradient on CP (x EP) ranks, one case after the other in the
    same processes (`cases`: (family, cp, ep, weights path, prompt length)): each case's finalized
    gradients by global name (fp64), for the test to compare with full-sequence autograd.
    `loss_masks`: the members' loss masks (agent trajectories); `settings`: LongStrawConfig
    overrides (one dict for every case, or a list: one per case)."""
    from megatron_longstraw.config.settings import LongStrawConfig
    from megatron_longstraw.distributed.finalize import finalize_longstraw_grads
    from megatron_longstraw.distributed.expert_names import global_name
    from megatron_longstraw.step.schedule import forward_backward_longstraw
    from megatron_longstraw.data.group import GRPOGroup

    outs = []
    per_case = settings if isinstance(settings, list) else [settings] * len(cases)
    for (family, cp, ep, state_path, prompt_len), settings in zip(cases, per_case):
        cfg, model, experts = _case_model(family, cp, ep, state_path)
        gen = torch.Generator().manual_seed(11)
        group = GRPOGroup(
            prompt_ids=torch.randint(0, cfg.vocab_size, (prompt_len,), generator=gen),
            response_ids=[torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lens],
            rewards=torch.tensor([1.0, 0.0, 0.5][:len(lens)], dtype=torch.float64),
            loss_masks=loss_masks)
        ls = LongStrawConfig.of(group_size=len(lens), query_block=29, key_block=37, token_block=50,
                             max_response_len=64, clip_eps_high=0.28,
                             **{"prompt_grad": "exact", **(settings or {})})
        model.zero_grad(set_to_none=True)
        forward_backward_longstraw(model, group, ls)
        finalize_longstraw_grads(model)
        outs.append({global_name(n, experts): p.grad.clone()
                     for n, p in model.named_parameters() if p.grad is not None})
    return outs


def capture_reuse_worker(rank, cases, lens, rewards, updates, settings, drift_every=0):
    """`updates` optimizer steps (SGD, lr 0.3) over one capture per case on CP (x EP) ranks
    (`cases`: (family, cp, ep, weights path, prompt length); step.schedule.train_on_capture, G =
    len(lens) / updates): per case the members' log-probs and the statistics of every update
    (`drift_every`: the drift measured, staleness.py) and this rank's parameters after the last,
    by global name (fp64)."""
    from megatron_longstraw.config.settings import LongStrawConfig
    from megatron_longstraw.distributed.expert_names import global_name
    from megatron_longstraw.step.schedule import train_on_capture
    from megatron_longstraw.data.group import GRPOGroup

    outs = []
    for family, cp, ep, state_path, prompt_len in cases:
        cfg, model, experts = _case_model(family, cp, ep, state_path)
        gen = torch.Generator().manual_seed(0)
        group = GRPOGroup(torch.randint(cfg.vocab_size, (prompt_len,), generator=gen),
                          [torch.randint(cfg.vocab_size, (n,), generator=gen) for n in lens],
                          rewards=torch.tensor(rewards, dtype=torch.float64))
        ls = LongStrawConfig.of(**settings)
        results = train_on_capture(model, torch.optim.SGD(model.parameters(), lr=0.3), group, ls,
                                   updates=updates, drift_every=drift_every)
        outs.append({"logps": [[lp.detach() for lp in r.logps] for r in results],
                     "stats": [r.stats for r in results],
                     "params": {global_name(n, experts): p.detach().clone()
                                for n, p in model.named_parameters()}})
    return outs


def decode_worker(rank, cases, envs=False):
    """Generation from a capture on CP (x EP) ranks (`cases`: (family, cp, ep, weights path,
    prompt length)): every case's (token ids, log-probs) per member, for the test to compare
    with one process. `envs`: 2 members with `helpers.LongObservations` environments
    (observations of 30 and 17 ids fed in blocks of 16 rows, turns of 3 tokens, 3 calls), each
    member's (token ids, log-probs, loss mask, this rank's environment calls)."""
    from helpers import LongObservations
    from megatron_longstraw.context.capture import capture_prompt
    from megatron_longstraw.config.settings import LongStrawConfig
    from megatron_longstraw.rollout.decode import generate
    from megatron_longstraw.rollout.env import EnvLimits
    from megatron_longstraw.config.sampling import SamplingParams

    members, new_tokens = (2, 72) if envs else (3, 6)
    outs = []
    for family, cp, ep, state_path, prompt_len in cases:
        cfg, model, experts = _case_model(family, cp, ep, state_path)
        prompt = torch.randint(0, cfg.vocab_size, (prompt_len,),
                               generator=torch.Generator().manual_seed(4))
        ls = LongStrawConfig.of(group_size=members, query_block=7, key_block=23, token_block=19,
                             max_response_len=64)
        captured = capture_prompt(model, prompt, ls)
        params = SamplingParams(max_new_tokens=new_tokens, seed=7)
        if not envs:
            outs.append([(g.token_ids, g.logprobs)
                         for g in generate(model, captured, members, params, ls)])
            continue
        tools = [LongObservations(30 - 13 * m, cfg.vocab_size, salt=m) for m in range(members)]
        gens = generate(model, captured, members, params, ls, envs=tools,
                        env_limits=EnvLimits(max_turns=3, turn_tokens=3, prefill_block=16))
        outs.append([(g.token_ids, g.logprobs, g.loss_mask, env.calls)
                     for g, env in zip(gens, tools)])
    return outs


def streamed_capture_worker(rank, cases, blocks):
    """Capture on CP (x EP) ranks (`cases`: (family, cp, ep, weights path, prompt lengths)), per
    case: at the first length, the whole-shard and the streamed capture with the exact gradient's
    inputs (every page, layer input and selection); at every later length, the streamed and the
    whole capture's device and host peaks (live-bytes meter, host storage left out) and page
    bytes."""
    from megatron_longstraw.context.capture import capture_prompt
    from megatron_longstraw.config.settings import LongStrawConfig
    from megatron_longstraw.config.choices import PromptGrad
    from megatron_longstraw.runtime.memory import LiveBytesMeter

    def capture(model, ids, mode, exact):
        ls = LongStrawConfig.of(group_size=2, capture=mode, page_tokens=64, **blocks)
        return capture_prompt(model, ids, ls,
                              prompt_grad=PromptGrad.EXACT if exact else PromptGrad.DETACHED)

    def contents(captured):
        pages = captured.pages
        return {"pages": {(layer, kind): pages.fetch(layer, kind).clone()
                          for layer in pages.layers() for kind in pages.kinds(layer)},
                "layer_inputs": [x.clone() for x in captured.backward.layer_inputs],
                "selections": {k: v.clone() for k, v in captured.backward.selections.items()},
                "positions": captured.positions.clone()}

    outs = []
    for family, cp, ep, state_path, lengths in cases:
        cfg, model, _ = _case_model(family, cp, ep, state_path)
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
                   for n in lengths]
        out = {mode: contents(capture(model, prompts[0], mode, exact=True))
               for mode in ("whole", "streamed")}
        capture(model, prompts[1], "streamed", exact=False)        # warm-up
        out["peaks"] = {"whole": [], "streamed": []}
        for mode, peaks in out["peaks"].items():
            for ids in prompts[1:]:
                with LiveBytesMeter("cpu", exclude_host=True) as meter:
                    captured = capture(model, ids, mode, exact=False)
                peaks.append({"device": meter.peak_bytes, "host": meter.host_peak_bytes,
                              "pages": captured.pages.nbytes(allocated=True),
                              "local_rows": captured.positions.numel()})
                if mode == "streamed" and ids is prompts[1]:
                    pages = captured.pages               # blocks aligned with one process's
                    out["aligned"] = {
                        "positions": captured.positions.clone(),
                        "pages": {(layer, kind): pages.fetch(layer, kind).clone()
                                  for layer in pages.layers() for kind in pages.kinds(layer)}}
                del captured
        outs.append(out)
    return outs


def collective_frees_worker(rank, repeats):
    """Each collective the capture path calls (plain gloo group of 2), `repeats` times, on tensors
    made and dropped inside a CPU `LiveBytesMeter`: per collective, how many meters ended above
    0 (a free they did not see) and whether the results were right."""
    import torch.distributed as dist

    from megatron_longstraw.runtime.memory import LiveBytesMeter

    dist.init_process_group("gloo", init_method=os.environ["LONGSTRAW_TEST_INIT"], rank=rank,
                            world_size=2)
    unseen, right = {}, {}
    for name in ("all_to_all_single", "broadcast", "all_gather", "all_gather_into_tensor",
                 "all_reduce"):
        unseen[name], right[name] = 0, True
        for i in range(repeats):
            n = 500 + 2 * i                               # a new size each time: no reused block
            with LiveBytesMeter("cpu") as meter:
                x = torch.full((n,), float(rank + 1), dtype=torch.float64)
                if name == "all_to_all_single":
                    out = torch.empty_like(x)
                    dist.all_to_all_single(out, x)
                    ok = torch.equal(out, torch.cat([torch.full((n // 2,), 1.0),
                                                     torch.full((n // 2,), 2.0)]).double())
                elif name == "broadcast":
                    dist.broadcast(x, src=0)
                    ok = bool((x == 1).all())
                elif name == "all_gather":
                    out = [torch.empty_like(x) for _ in range(2)]
                    dist.all_gather(out, x)
                    ok = all(bool((o == r + 1).all()) for r, o in enumerate(out))
                elif name == "all_gather_into_tensor":
                    out = x.new_empty(2 * n)
                    dist.all_gather_into_tensor(out, x)
                    ok = bool((out[:n] == 1).all() and (out[n:] == 2).all())
                else:
                    dist.all_reduce(x)
                    ok = bool((x == 3).all())
                del x
                out = None
            unseen[name] += meter.end_bytes != 0
            right[name] = right[name] and ok
    dist.destroy_process_group()
    return unseen, right


def phase_peaks_worker(rank, cases, blocks):
    """One GRPO step per prompt length on CP (x EP) ranks (`cases`: (family, cp, ep, weights
    path, prompt lengths)), two members of 16 tokens, the pages copied on every read as to a
    device (`PageStore.device_copies`): each phase's own peak (live-bytes meter, host storage
    left out) per length, after a warm-up step."""
    from megatron_longstraw.config.settings import LongStrawConfig
    from megatron_longstraw.runtime.memory import LiveBytesMeter
    from megatron_longstraw.state.pages import PageStore
    from megatron_longstraw.step.schedule import forward_backward_longstraw

    def peaks(model, cfg, prompt_len):
        group = _group(cfg, prompt_len, (16, 16), seed=prompt_len)
        ls = LongStrawConfig.of(group_size=2, max_response_len=16, **blocks)
        with LiveBytesMeter("cpu", exclude_host=True) as meter:
            forward_backward_longstraw(model, group, ls)
        return meter.own_peaks

    PageStore.device_copies = True
    outs = []
    for family, cp, ep, state_path, lengths in cases:
        cfg, model, _ = _case_model(family, cp, ep, state_path)
        peaks(model, cfg, 64)                                         # warm-up
        outs.append([peaks(model, cfg, n) for n in lengths])
    return outs


def blockwise_worker(rank, cases, lens, settings):
    """One GRPO group per (case, setting) on CP (x EP) ranks (`cases`: (family, cp, ep, weights
    path, prompt length); `settings`: LongStrawConfig overrides, e.g. response_block and
    prompt_grad): per case and setting the finalized gradients by global name, the members'
    log-probs and the loss (fp64), for the test to compare blockwise with whole-branch runs."""
    from megatron_longstraw.config.settings import LongStrawConfig
    from megatron_longstraw.distributed.finalize import finalize_longstraw_grads
    from megatron_longstraw.distributed.expert_names import global_name
    from megatron_longstraw.step.schedule import forward_backward_longstraw
    from megatron_longstraw.data.group import GRPOGroup

    outs = []
    for family, cp, ep, state_path, prompt_len in cases:
        cfg, model, experts = _case_model(family, cp, ep, state_path)
        gen = torch.Generator().manual_seed(5)
        group = GRPOGroup(
            prompt_ids=torch.randint(0, cfg.vocab_size, (prompt_len,), generator=gen),
            response_ids=[torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lens],
            rewards=torch.tensor([1.0, 0.0, 0.25][:len(lens)], dtype=torch.float64))
        runs = []
        for overrides in settings:
            ls = LongStrawConfig.of(group_size=len(lens), query_block=13, key_block=37,
                                 token_block=50, max_response_len=128, clip_eps_high=0.28,
                                 **overrides)
            model.zero_grad(set_to_none=True)
            result = forward_backward_longstraw(model, group, ls)
            finalize_longstraw_grads(model)
            runs.append({"grads": {global_name(n, experts): p.grad.clone()
                                   for n, p in model.named_parameters() if p.grad is not None},
                         "logps": result.logps, "logps_old": result.logps_old,
                         "loss": result.loss, "stats": result.stats})
        outs.append(runs)
    return outs


def response_peaks_worker(rank, cases, settings, lengths, blocks):
    """One GRPO step per response length and setting on CP (x EP) ranks (`cases`: (family, cp,
    ep, weights path)), a prompt of 32 tokens and two members of each length: each phase's own
    peak (live-bytes meter, host storage left out), after a warm-up step (the last setting)."""
    from megatron_longstraw.config.settings import LongStrawConfig
    from megatron_longstraw.runtime.memory import LiveBytesMeter
    from megatron_longstraw.step.schedule import forward_backward_longstraw

    def peaks(model, cfg, response_len, overrides):
        group = _group(cfg, 32, (response_len, response_len), seed=response_len)
        ls = LongStrawConfig.of(group_size=2, max_response_len=response_len, **blocks, **overrides)
        with LiveBytesMeter("cpu", exclude_host=True) as meter:
            forward_backward_longstraw(model, group, ls)
        return meter.own_peaks

    outs = []
    for family, cp, ep, state_path in cases:
        cfg, model, _ = _case_model(family, cp, ep, state_path)
        peaks(model, cfg, lengths[0], settings[-1])                   # warm-up
        runs = [[peaks(model, cfg, n, overrides) for n in lengths] for overrides in settings]
        outs.append(runs)
    return outs
