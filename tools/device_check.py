"""Check the kernel backends on this machine, and run one LongStraw step of a reduced-depth,
full-width GLM-5.2 and Qwen3.6 on one GPU (under 8 minutes on an H100/H200).

    python tools/device_check.py [--kernels auto] [--budget-s 420] [--steps glm52,qwen36] [--json out.json]

1. environment: torch, CUDA, GPU, flash-linear-attention, and why each kernel backend is or is not
   usable here;
2. the Triton sparse-MLA kernels in Triton's CPU interpreter (tiny shape; runs everywhere);
3. parity: each usable backend against its reference on fresh random inputs at GLM-5.2 shapes
   (relative error against an fp64 reference, tolerance by dtype: kernels/parity.py);
4. timing: each backend and its reference, median of repeats after warm-up;
5. Qwen3.6 Gated DeltaNet: FLA's Triton `chunk_gated_delta_rule` (what Megatron's GatedDeltaNet
   runs on a GPU) and Megatron's `torch_chunk_gated_delta_rule` in fp32 against the same algorithm
   in fp64, at Qwen3.6 head shapes (48 value heads, 16 QK heads expanded to 48, d_k = d_v = 128):
   output and final state from zero and from a nonzero initial state, and the split property
   capture and replay rely on (tokens [0, n) then [n, N) from the carried state equal [0, N) in one
   call); gradients; timing. Without CUDA or FLA only the torch rule runs, at a tiny shape;
6. one LongStraw GRPO step (capture, scoring, replay with backward) of GLM-5.2 with 4 layers at the
   real widths (1 dense + 3 MoE layers, 16 routed experts) in bf16, at prompt lengths doubling from
   --start-prompt-len until memory or its share of the time budget runs out: peak
   torch.cuda.max_memory_allocated, capture tokens/s, replay time per step;
7. the same for Qwen3.6 with 4 layers at the full.yaml widths (`G-G-G-*`: 3 Gated DeltaNet + 1
   gated full attention), also reporting the fixed GDN state bytes against the per-token K/V page
   bytes, and at the first prompt length the replay log-probs against a full-sequence forward.
Without CUDA the script runs parts 1, 2 and the CPU part of 5, says what it did not run, and stops
(exit 0 when those passed). Each part reports its own failure with the traceback and the script
goes on; the exit status is 1 when any part failed. --budget-s bounds the whole run: the GDN part
and the Qwen3.6 step are skipped when too little is left for them, and each model step gets a
share of what is left (GLM-5.2 half, Qwen3.6 the rest) and stops doubling the prompt when the
next length would not fit in it.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from megatron_longstraw.families import get_family  # noqa: E402
from megatron_longstraw.kernels import parity, refs, select  # noqa: E402
from megatron_longstraw.kernels.parity import (  # noqa: E402
    GDN_GRAD_TOLERANCE, GDN_TOLERANCE, gdn_case, gdn_errors, gdn_grad_errors, gdn_run,
)

RESULTS: dict = {"sections": {}, "failures": []}
START = time.perf_counter()


def say(msg: str = "") -> None:
    print(msg, flush=True)


def run_section(name: str, fn) -> None:
    """One report section: a failure prints its traceback and is recorded; the script goes on."""
    say(f"\n== {name} " + "=" * max(0, 70 - len(name)))
    t0 = time.perf_counter()
    try:
        RESULTS["sections"][name] = fn()
    except Exception:  # noqa: BLE001 - report and go on
        RESULTS["failures"].append(name)
        RESULTS["sections"][name] = {"error": traceback.format_exc()}
        say(f"FAILED: {name}\n{traceback.format_exc()}")
    say(f"-- {name}: {time.perf_counter() - t0:.1f} s")


def check(name: str, errors: dict, tolerance: float) -> dict:
    worst = max(errors.values())
    ok = worst <= tolerance
    say(f"  {'ok  ' if ok else 'FAIL'} {name}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
        + f"  (tolerance {tolerance:.0e})")
    if not ok:
        RESULTS["failures"].append(name)
    return {"errors": errors, "tolerance": tolerance, "ok": ok}


def median_ms(fn, warmup: int = 3, repeats: int = 10) -> float:
    """Median wall time of fn() in ms (CUDA events), after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# ---- 1. environment ----------------------------------------------------------------------------

def environment() -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, capability=f"SM{props.major}{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1))
    info["flash_linear_attention"] = _fla_version()
    for key, value in info.items():
        say(f"  {key}: {value}")
    info["backends"] = select.describe()
    for name, reason in info["backends"].items():
        say(f"  backend {name:9s} {'usable' if reason is None else 'not usable: ' + reason}")
    return info


def _fla_version() -> str:
    """flash-linear-attention's version, or why Megatron's GatedDeltaNet cannot use it here."""
    try:
        from megatron.core.ssm.gated_delta_net import common as gdn_common
    except ImportError as exc:
        return f"not checked: megatron-core does not import ({exc})"
    if not gdn_common.HAVE_FLA:
        return "not installed (pip install flash-linear-attention); Qwen3.6's GDN layers need it"
    import fla

    return getattr(fla, "__version__", "installed")


# ---- 2. Triton interpreter (CPU) ---------------------------------------------------------------

def triton_interpreter() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "megatron_longstraw.kernels.parity"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"interpreter run failed:\n{proc.stderr[-4000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for dtype, entry in report.items():
        check(f"triton interpreter {dtype} (6 queries, 20 heads)", entry["errors"], entry["tolerance"])
    return report


# ---- 3 + 4. parity and timing on the GPU ---------------------------------------------------------

GLM_ATTENTION = dict(num_heads=64, d_qk=576, v_dim=512)   # absorbed MLA: kv_lora_rank 512 + rope 64


def _sparse_mla_args(case):
    return case["query"], case["latents"], case["indices"], case["scale"], case["v_dim"]


def sparse_mla_parity() -> dict:
    out = {}
    for dtype, num_queries in ((torch.bfloat16, 128), (torch.float32, 16)):
        case = parity.sparse_mla_case(num_queries=num_queries, num_keys=8192, topk=2048,
                                      dtype=dtype, device="cuda", **GLM_ATTENTION)
        tag = str(dtype).replace("torch.", "")
        if select.unusable_reason("triton") is None:
            from megatron_longstraw.kernels import triton_sparse_mla

            errors = parity.sparse_mla_errors(triton_sparse_mla.sparse_mla_attention, case)
            out[f"triton {tag}"] = check(f"triton sparse_mla fwd+bwd {tag}", errors,
                                         parity.TOLERANCE[dtype])
        if dtype == torch.bfloat16 and select.unusable_reason("flashmla") is None:
            from megatron_longstraw.kernels import flashmla

            errors = parity.sparse_mla_errors(flashmla.sparse_mla_attention, case, backward=False)
            out["flashmla bf16"] = check("flashmla sparse_mla fwd bf16", errors,
                                         parity.TOLERANCE[dtype])
    return out


def sparse_mla_timing() -> dict:
    out = {}
    case = parity.sparse_mla_case(num_queries=1024, num_keys=65536, topk=2048,
                                  dtype=torch.bfloat16, device="cuda", **GLM_ATTENTION)
    args = _sparse_mla_args(case)
    query, latents = case["query"], case["latents"]
    fns = {"ref": refs.sparse_mla_attention}
    if select.unusable_reason("triton") is None:
        from megatron_longstraw.kernels import triton_sparse_mla
        fns["triton"] = triton_sparse_mla.sparse_mla_attention
    if select.unusable_reason("flashmla") is None:
        from megatron_longstraw.kernels import flashmla
        fns["flashmla"] = flashmla.sparse_mla_attention
    say("  sparse_mla, 1024 queries x 64 heads, top-2048 of 65536 latent rows, bf16 (median ms):")
    for name, fn in fns.items():
        with torch.no_grad():
            fwd = median_ms(lambda: fn(*args))
        entry = {"forward_ms": fwd}
        if name != "flashmla":
            q, lat = query.detach().requires_grad_(), latents.detach().requires_grad_()
            grad_out = torch.randn(query.shape[0], query.shape[1], case["v_dim"], device="cuda",
                                   dtype=query.dtype)

            def fwd_bwd():
                out, _ = fn(q, lat, *args[2:])
                torch.autograd.grad(out, (q, lat), grad_out)

            entry["forward_backward_ms"] = median_ms(fwd_bwd, warmup=2, repeats=5)
        out[name] = entry
        say(f"    {name:9s} " + ", ".join(f"{k} {v:8.2f}" for k, v in entry.items()))
    return out


def indexer_parity_and_timing() -> dict:
    if select.unusable_reason("deepgemm") is not None:
        say(f"  skipped: deepgemm {select.unusable_reason('deepgemm')}")
        return {"skipped": select.unusable_reason("deepgemm")}
    from megatron_longstraw.kernels import deepgemm

    case = parity.indexer_case(num_queries=1024, num_keys=16384, device="cuda")   # GLM: 32 x 128
    scores = deepgemm.indexer_scores(case["q"], case["weights"], case["keys"], case["scale"], True)
    ref = refs.indexer_scores(case["q"].double(), case["weights"].double(), case["keys"].double(),
                              case["scale"], True)
    # FP8 (3 mantissa bits): see tests/test_kernels.py for the tolerance and recall bounds.
    result = {"scores": check("deepgemm indexer scores (fp8)",
                              {"scores": parity.relative_error(scores, ref)}, 6e-2)}
    args = (case["q"], case["weights"], case["keys"], case["query_positions"], case["key_positions"],
            2048, case["scale"], True)
    idx, _ = deepgemm.indexer_topk(*args)
    ref_idx, _ = refs.indexer_topk(*args)
    recall = parity.topk_recall(idx, ref_idx)
    say(f"  {'ok  ' if recall >= 0.85 else 'FAIL'} deepgemm top-2048 recall of the reference "
        f"selection: {recall:.4f} (bound 0.85)")
    if recall < 0.85:
        RESULTS["failures"].append("deepgemm recall")
    result["recall"] = recall
    for name, fn in (("ref", refs.indexer_topk), ("deepgemm", deepgemm.indexer_topk)):
        result[f"{name}_topk_ms"] = median_ms(lambda: fn(*args), warmup=2, repeats=5)
        say(f"    indexer_topk {name:9s} {result[f'{name}_topk_ms']:8.2f} ms "
            "(1024 queries, 16384 keys, 32 heads x 128)")
    return result


def te_and_apex() -> dict:
    out = {}
    reason = select.unusable_reason("te")
    if reason is None:
        import transformer_engine.pytorch as te

        x = torch.randn(4096, 6144, device="cuda", dtype=torch.bfloat16)
        linear = te.Linear(6144, 2048, bias=False, params_dtype=torch.bfloat16, device="cuda")
        norm = te.RMSNorm(6144, eps=1e-5, params_dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            ref_linear = x.double() @ linear.weight.double().T
            ref_norm = torch.nn.functional.rms_norm(x.double(), (6144,), norm.weight.double(), 1e-5)
            errors = {"linear": parity.relative_error(linear(x), ref_linear),
                      "rmsnorm": parity.relative_error(norm(x), ref_norm)}
        out["te"] = check("TransformerEngine Linear/RMSNorm bf16", errors,
                          parity.TOLERANCE[torch.bfloat16])
        out["te"]["linear_ms"] = median_ms(lambda: linear(x))
        out["te"]["torch_linear_ms"] = median_ms(lambda: x @ linear.weight.T)
        say(f"    TE Linear {out['te']['linear_ms']:.3f} ms, "
            f"torch {out['te']['torch_linear_ms']:.3f} ms (4096 x 6144 @ 6144 x 2048, bf16)")
    else:
        say(f"  skipped: te {reason}")
    reason = select.unusable_reason("apex")
    if reason is None:
        from megatron_longstraw.kernels import nvidia_apex

        params = [torch.randn(4_000_000, device="cuda") for _ in range(8)]
        grads = [torch.randn_like(p) for p in params]
        finals, times = [], []
        for cls in (nvidia_apex.optimizer_class(), torch.optim.AdamW):
            ps = [torch.nn.Parameter(p.clone()) for p in params]
            opt = cls(ps, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
            for p, g in zip(ps, grads):
                p.grad = g
            times.append(median_ms(opt.step, warmup=1, repeats=5))
            finals.append(torch.cat([p.detach().flatten() for p in ps]))
        out["apex"] = check("apex FusedAdam vs torch AdamW (6 steps, fp32)",
                            {"params": parity.relative_error(finals[0], finals[1])}, 1e-5)
        out["apex"].update(fused_adam_ms=times[0], adamw_ms=times[1])
        say(f"    FusedAdam step {times[0]:.2f} ms, AdamW {times[1]:.2f} ms (32M params)")
    else:
        say(f"  skipped: apex {reason}")
    reason = select.unusable_reason("deepep")
    say("  skipped: deepep " + (reason or "needs TP x EP > 1 (two or more ranks); this check uses "
                                           "one GPU"))
    return out


# ---- 5. Qwen3.6 Gated DeltaNet kernel ----------------------------------------------------------

QWEN_GDN = dict(num_key_heads=16, num_value_heads=48, head_dim=128)   # examples/qwen36/full.yaml
TINY_GDN = dict(num_key_heads=2, num_value_heads=6, head_dim=16)      # CPU: the torch rule only

# What the GPU part needs at most: FLA autotunes and compiles its Triton kernels at first use (a
# cost paid once per process: the Qwen3.6 step runs the same kernels at the same head shapes).
GDN_SECONDS = 120.0


def _gdn_checks(label: str, rule, case: dict, dtype, split_at, tolerance: float) -> dict:
    out = {}
    for name, errors in gdn_errors(rule, case, dtype, split_at).items():
        out[name] = check(f"{label}: {name}", errors, tolerance)
    return out


def qwen36_gdn_parity(deadline: float | None = None) -> dict:
    """FLA's chunk kernel (GPU) and Megatron's torch rule in fp32 against the fp64 reference at
    Qwen3.6 shapes: from zero state, from a nonzero initial state, split runs; gradients; timing.
    Without CUDA or FLA: the torch rule alone at a tiny shape (checks this harness), FLA skipped."""
    from megatron.core.ssm.gated_delta_net import common as gdn_common

    if torch.cuda.is_available():
        fla_reason = None if gdn_common.HAVE_FLA else _fla_version()
        shape, num_tokens, device = QWEN_GDN, 4096, "cuda"
        if deadline is not None and time.perf_counter() + GDN_SECONDS > deadline:
            say(f"  skipped: fewer than {GDN_SECONDS:.0f} s of the time budget left")
            return {"skipped": "time budget"}
    else:
        fla_reason = "no CUDA device (FLA's chunk kernel is Triton, GPU only)"
        shape, num_tokens, device = TINY_GDN, 200, "cpu"
    # One chunk-aligned split (FLA and the torch rule work in chunks of 64 tokens) and one inside
    # a chunk: replay starts at any prefix length, capture's last block ends anywhere.
    aligned = 64 * (num_tokens // 128)
    split_at = (aligned, aligned + 37)
    say(f"  {num_tokens} tokens, {shape['num_value_heads']} value heads ({shape['num_key_heads']} "
        f"QK heads expanded), d_k = d_v = {shape['head_dim']}, on {device}; reference: Megatron's "
        "torch_chunk_gated_delta_rule in fp64; splits at " + " and ".join(map(str, split_at)))
    result = {"shape": dict(shape, num_tokens=num_tokens)}
    cases = {"zero state": gdn_case(num_tokens, **shape, device=device),
             "initial state": gdn_case(num_tokens, **shape, device=device, initial_state=True)}
    torch_rule = gdn_common.torch_chunk_gated_delta_rule
    for case_name, case in cases.items():
        result[f"torch fp32, {case_name}"] = _gdn_checks(
            f"torch rule fp32, {case_name}", torch_rule, case, torch.float32, split_at,
            GDN_TOLERANCE[torch.float32])
    result["torch fp32, gradients"] = check(
        "torch rule fp32, initial state: gradients",
        gdn_grad_errors(torch_rule, cases["initial state"], torch.float32),
        GDN_GRAD_TOLERANCE[torch.float32])
    if fla_reason is not None:
        say(f"  skipped: FLA chunk_gated_delta_rule: {fla_reason}")
        result["fla"] = {"skipped": fla_reason}
        return result

    fla_rule = gdn_common.chunk_gated_delta_rule
    for case_name, case in cases.items():
        result[f"fla bf16, {case_name}"] = _gdn_checks(
            f"FLA chunk_gated_delta_rule bf16, {case_name}", fla_rule, case, None, split_at,
            GDN_TOLERANCE[torch.bfloat16])
    result["fla bf16, gradients"] = check(
        "FLA chunk_gated_delta_rule bf16, initial state: gradients",
        gdn_grad_errors(fla_rule, cases["initial state"]), GDN_GRAD_TOLERANCE[torch.bfloat16])
    result["timing"] = _gdn_timing(fla_rule, torch_rule)
    return result


def _gdn_timing(fla_rule, torch_rule) -> dict:
    out = {}
    say("  Gated DeltaNet forward, 48 value heads x 128, from an initial state (median ms):")
    for num_tokens in (4096, 65536):
        case = gdn_case(num_tokens, **QWEN_GDN, device="cuda", initial_state=True)
        rules = {"fla bf16": (fla_rule, None)}
        if num_tokens == 4096:
            rules["torch fp32"] = (torch_rule, torch.float32)
        for name, (rule, dtype) in rules.items():
            with torch.no_grad():
                ms = median_ms(lambda: gdn_run(rule, case, dtype), warmup=2, repeats=5)
            out[f"{name}, {num_tokens} tokens"] = {"forward_ms": ms,
                                                   "tokens_per_s": num_tokens / ms * 1e3}
            say(f"    {name:10s} {num_tokens:6d} tokens: {ms:8.2f} ms "
                f"({num_tokens / ms * 1e3:11.0f} tokens/s per layer)")
    return out


# ---- 6 + 7. one LongStraw step -------------------------------------------------------------------

QWEN_FULL = REPO / get_family("qwen36").full_config
# Replay vs a full-sequence forward of the bf16 Qwen3.6 step, max |log-prob difference| in nats.
# Both compute the same function with different blocking (FLA chunks restart at the replayed
# prefix, capture's token blocks, attention's key blocks), so they differ by rounding alone:
# every layer's output is rounded to bf16 (2^-9 relative) and the logits come out of the output
# layer in bf16, where one ulp at |logit| in [2, 4) is 2^-6 = 1.6e-2. A few ulps of the largest
# logits: 1e-1. For scale the check also reports how much dropping the prompt changes the
# log-probs (a replay that lost the prompt state would be off by about that much).
QWEN_LOGP_TOLERANCE = 1e-1
QWEN_STEP_MIN_SECONDS = 60.0   # building the 4.1B-parameter model, the first step and its checks


def _build_on_gpu(build):
    """build(**overrides) -> model on the GPU, initialised there directly (CPU initialisation of
    billions of parameters is slow); on the CPU if that fails."""
    try:
        model = build(use_cpu_initialization=False)
    except Exception:  # noqa: BLE001
        say("  GPU initialisation failed; building on the CPU:\n" + traceback.format_exc())
        model = build()
    return model.cuda()


def _build_model():
    from megatron_longstraw import parallel, precision

    glm52 = get_family("glm52")
    parallel.initialize(context_parallel_size=1, expert_parallel_size=1)
    precision.use_dtype(torch.bfloat16)
    cfg = glm52.config_class(num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=16)
    model = _build_on_gpu(lambda **kw: glm52.build_model(cfg, params_dtype=torch.bfloat16, **kw))
    num_params = sum(p.numel() for p in model.parameters())
    say(f"  GLM-5.2, {cfg.num_hidden_layers} layers ({cfg.hybrid_layer_pattern()}), hidden "
        f"{cfg.hidden_size}, {cfg.num_attention_heads} heads, {cfg.n_routed_experts} experts: "
        f"{num_params / 1e9:.2f}B parameters, bf16")
    return cfg, model


def _group(cfg, prompt_len: int, response_len: int, seed: int):
    from megatron_longstraw.data import synthetic_group

    group = synthetic_group(cfg.vocab_size, prompt_len, group_size=2, response_len=response_len,
                            seed=seed)
    group.prompt_ids = group.prompt_ids.cuda()
    group.response_ids = [r.cuda() for r in group.response_ids]
    return group


def share_of_budget(args, fraction: float) -> float:
    """A deadline (time.perf_counter()) `fraction` of the way from now to the end of --budget-s."""
    now = time.perf_counter()
    return now + fraction * max(0.0, START + args.budget_s - now)


def _prompt_sweep(model, cfg, ls, args, deadline: float, out: dict, on_first_step=None) -> None:
    """One LongStraw step per prompt length, doubling from --start-prompt-len until memory,
    --max-prompt-len or `deadline` (time.perf_counter()) runs out; per step its peak
    torch.cuda.max_memory_allocated, phase times and page bytes go to out["steps"].
    `on_first_step(result, group)` runs after the first step (checks at the smallest length)."""
    from megatron_longstraw.schedule import forward_backward_longstraw

    prompt_len = args.start_prompt_len
    while prompt_len <= args.max_prompt_len:
        now = time.perf_counter()
        last = out["steps"][-1]["step_seconds"] if out["steps"] else None
        # Capture is linear in P, attention (GLM-5.2's indexer top-k, Qwen3.6's full attention)
        # quadratic: a doubling costs <= 4x.
        if now >= deadline or (last is not None and now + 4 * last > deadline):
            say(f"  stopping before P = {prompt_len}: this step's share of the time budget "
                f"({args.budget_s:.0f} s in all) would run out")
            out["stopped"] = "time budget"
            break
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        group = _group(cfg, prompt_len, args.response_len, seed=prompt_len)
        try:
            t0 = time.perf_counter()
            result = forward_backward_longstraw(model, group, ls)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        except torch.cuda.OutOfMemoryError:
            say(f"  P = {prompt_len}: out of memory; the longest prompt that fit is the previous one")
            out["stopped"] = f"out of memory at P = {prompt_len}"
            del group
            break
        phases = result.phase_seconds
        fixed = sum(n for k, n in result.page_bytes_by_kind.items() if k in result.fixed_page_kinds)
        step = {"prompt_len": prompt_len, "step_seconds": seconds,
                "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                "capture_tokens_per_s": (prompt_len - 1) / max(phases.get("capture", math.nan), 1e-9),
                "capture_s": phases.get("capture"), "scoring_s": phases.get("scoring"),
                "replay_s": phases.get("replay"), "page_gib": result.page_bytes / 2**30,
                "page_bytes_by_kind": result.page_bytes_by_kind, "fixed_page_bytes": fixed,
                "loss": result.loss, "response_lens": [int(r.numel()) for r in group.response_ids]}
        out["steps"].append(step)
        fixed_note = (f" | fixed state {fixed / 2**20:.1f} MiB + per-token pages "
                      f"{(result.page_bytes - fixed) / 2**30:.3f} GiB" if fixed else "")
        say(f"  P = {prompt_len:8d}: step {seconds:7.1f} s | capture {step['capture_s']:6.1f} s "
            f"({step['capture_tokens_per_s']:9.0f} tok/s) | scoring {step['scoring_s']:5.1f} s | "
            f"replay {step['replay_s']:5.1f} s | max_memory_allocated "
            f"{step['max_memory_allocated_gib']:6.1f} GiB | pages {step['page_gib']:.2f} GiB (host)"
            + fixed_note)
        if on_first_step is not None and len(out["steps"]) == 1:
            on_first_step(result, group)
        prompt_len *= 2
    if out["steps"]:
        out["longest_prompt"] = out["steps"][-1]["prompt_len"]
        say(f"  longest prompt run: {out['longest_prompt']} tokens "
            f"({out.get('stopped', 'reached --max-prompt-len')})")


def model_step(args, deadline: float) -> dict:
    from megatron_longstraw.config import LongStrawConfig
    from megatron_longstraw.schedule import forward_backward_longstraw

    cfg, model = _build_model()
    ls = LongStrawConfig(group_size=2, max_response_len=args.response_len, kernels=args.kernels,
                         token_block=8192, query_block=1024, key_block=4096, offload_pages=True)
    out = {"kernels": args.kernels, "steps": []}

    # Kernels vs reference, end to end: scoring log-probs of one small group (forward only).
    try:
        group = _group(cfg, 4096, min(64, args.response_len), seed=1)
        logps = {}
        for spec in ("ref", args.kernels):
            result = forward_backward_longstraw(model, group, LongStrawConfig(
                **{**ls.__dict__, "kernels": spec}), forward_only=True)
            logps[spec] = torch.cat(result.logps).float()
        diff = (logps["ref"] - logps[args.kernels]).abs().max().item()
        out["logp_max_diff_vs_ref"] = diff
        say(f"  scoring log-probs, kernels {args.kernels!r} ({select.choices()}) vs ref, P = 4096: "
            f"max |diff| {diff:.3e} (bf16 model; FP8 indexer selections may differ at near-ties)")
    except Exception:  # noqa: BLE001
        RESULTS["failures"].append("model step: kernels vs ref")
        say("FAILED: kernels vs ref log-probs\n" + traceback.format_exc())

    _prompt_sweep(model, cfg, ls, args, deadline, out)
    return out


# Qwen3.6 ------------------------------------------------------------------------------------------

def _build_qwen36(args):
    """Qwen3.6 with 4 decoder layers (`G-G-G-*`) at the full.yaml widths, bf16, on the GPU, with
    the dense backend of --kernels, and slow GDN decays."""
    from megatron_longstraw import parallel, precision

    qwen36 = get_family("qwen36")
    parallel.initialize(context_parallel_size=1, expert_parallel_size=1)
    precision.use_dtype(torch.bfloat16)
    cfg = dataclasses.replace(qwen36.config_class.from_yaml(QWEN_FULL), num_hidden_layers=4)
    select.use(args.kernels)
    backend = select.dense_spec_provider()

    def build(backend):
        return _build_on_gpu(lambda **kw: qwen36.build_model(
            cfg, params_dtype=torch.bfloat16, backend=backend, **kw))

    try:
        model = build(backend)
    except Exception:  # noqa: BLE001
        if backend is None:
            raise
        RESULTS["failures"].append("qwen36 build with dense=te")
        say("FAILED: Qwen3.6 with TransformerEngine's linear layers; building with dense=ref\n"
            + traceback.format_exc())
        model = build(None)
    # Megatron initialises A in [1, 16]: every head forgets within a few tokens, so the GDN state
    # would carry almost nothing from the prompt into the responses. A in [0.02, 0.5] (as
    # tests/helpers.build_tiny_qwen) keeps it carrying.
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(0.02, 0.5, generator=gen).log())
    num_params = sum(p.numel() for p in model.parameters())
    say(f"  Qwen3.6, {cfg.num_hidden_layers} layers ({cfg.hybrid_layer_pattern()}), hidden "
        f"{cfg.hidden_size}, GDN {cfg.linear_num_value_heads} value / {cfg.linear_num_key_heads} "
        f"QK heads x {cfg.linear_key_head_dim}, attention {cfg.num_attention_heads} / "
        f"{cfg.num_key_value_heads} heads x {cfg.head_dim}: {num_params / 1e9:.2f}B parameters, "
        f"bf16, dense={select.choices()['dense']}")
    num_full = cfg.num_full_attention_layers()
    num_gdn = cfg.num_hidden_layers - num_full
    say(f"  captured state per prompt: GDN {num_gdn * cfg.gdn_state_bytes() / 2**20:.1f} MiB "
        f"({num_gdn} layers, fixed) + K/V {cfg.page_bytes_per_token() / 2**10:.0f} KiB per token "
        f"({num_full} layer, bf16)")
    return cfg, model


def _full_sequence_logprobs(model, prompt: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    """Log-probs [R] of `response` after `prompt` from one plain forward of [prompt; response]
    (no LongStraw pass: GDN from zero state in one kernel call, attention over the whole
    sequence), as tests/helpers.full_sequence_logprobs; only the response rows are normalised."""
    ids = torch.cat([prompt, response])
    with torch.no_grad():
        logits = model(ids[None], None, None)[0]                        # [S, V]
    start = prompt.numel() - 1
    rows = logits[start:start + response.numel()].float()
    return torch.log_softmax(rows, dim=-1).gather(-1, response[:, None]).squeeze(-1)


def _replay_vs_full_sequence(model, result, group, out: dict) -> None:
    """Replay (and scoring) log-probs of the step against a full-sequence forward per member."""
    diffs = {"replay": 0.0, "scoring": 0.0}
    prompt_effect = 0.0
    for i, response in enumerate(group.response_ids):
        full = _full_sequence_logprobs(model, group.prompt_ids, response)
        for name, logp in (("replay", result.logps[i]), ("scoring", result.logps_old[i])):
            diffs[name] = max(diffs[name],
                              (logp.detach().to(full) - full).abs().max().item())
        alone = _full_sequence_logprobs(model, group.prompt_ids[-1:], response)
        prompt_effect = max(prompt_effect, (alone - full).abs().max().item())
    out["logps_vs_full_sequence"] = check(
        f"qwen36 log-probs vs a full-sequence forward, P = {group.prompt_ids.numel()} (bf16, "
        "max |diff| in nats)", diffs, QWEN_LOGP_TOLERANCE)
    out["logps_vs_full_sequence"]["prompt_effect"] = prompt_effect
    say(f"    for scale: dropping the prompt changes the log-probs by up to {prompt_effect:.3e}"
        + ("" if prompt_effect > QWEN_LOGP_TOLERANCE else "; NOTE: no more than the tolerance, so "
           "this check cannot tell a lost prompt state from rounding"))


def qwen36_step(args, deadline: float) -> dict:
    """One LongStraw GRPO step of a 4-layer, full-width Qwen3.6 at doubling prompt lengths."""
    if not torch.cuda.is_available():
        say("  skipped: no CUDA device")
        return {"skipped": "no CUDA device"}
    from megatron.core.ssm.gated_delta_net import common as gdn_common

    if not gdn_common.HAVE_FLA:
        reason = f"flash-linear-attention {_fla_version()}"
        say(f"  skipped: {reason}")
        return {"skipped": reason}
    if deadline - time.perf_counter() < QWEN_STEP_MIN_SECONDS:
        say(f"  skipped: fewer than {QWEN_STEP_MIN_SECONDS:.0f} s of the time budget left")
        return {"skipped": "time budget"}
    from megatron_longstraw.config import LongStrawConfig

    gc.collect()                  # the GLM-5.2 model of the previous section
    torch.cuda.empty_cache()
    cfg, model = _build_qwen36(args)
    ls = dataclasses.replace(LongStrawConfig.from_yaml(QWEN_FULL), group_size=2,
                             max_response_len=args.response_len, kernels=args.kernels,
                             offload_pages=True)
    say(f"  blocks from full.yaml: token {ls.token_block}, query {ls.query_block}, key "
        f"{ls.key_block}; deadline in {deadline - time.perf_counter():.0f} s")
    out = {"kernels": args.kernels, "steps": []}

    def first_step(result, group):
        try:
            _replay_vs_full_sequence(model, result, group, out)
        except Exception:  # noqa: BLE001
            RESULTS["failures"].append("qwen36 log-probs vs full sequence")
            say("FAILED: qwen36 log-probs vs full sequence\n" + traceback.format_exc())

    _prompt_sweep(model, cfg, ls, args, deadline, out, on_first_step=first_step)
    if out["steps"]:
        fixed = {s["prompt_len"]: s["fixed_page_bytes"] for s in out["steps"]}
        out["gdn_state_fixed"] = len(set(fixed.values())) == 1
        say(f"  GDN state bytes per prompt length: {fixed} "
            f"({'fixed' if out['gdn_state_fixed'] else 'NOT fixed'})")
        if not out["gdn_state_fixed"]:
            RESULTS["failures"].append("qwen36 GDN state not fixed-size")
    return out


# The families (registry names) with a model step here; each step is written for its family.
STEPS = ("glm52", "qwen36")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", default="auto", help="--longstraw-kernels spec for the steps")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="Wall-clock budget for the whole script (shared by the model steps, "
                             "which stop growing the prompt when their share runs out)")
    parser.add_argument("--start-prompt-len", type=int, default=8192)
    parser.add_argument("--max-prompt-len", type=int, default=1 << 20)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--steps", default=",".join(STEPS),
                        help=f"Comma-separated model steps to run, from {', '.join(STEPS)}")
    parser.add_argument("--skip-step", action="store_true", help="Kernel checks only")
    parser.add_argument("--json", type=str, default=None, help="Write the results here")
    args = parser.parse_args(argv)
    steps = [] if args.skip_step else [s for s in args.steps.split(",") if s]
    if set(steps) - set(STEPS):
        parser.error(f"--steps {args.steps}: choose from {', '.join(STEPS)}")

    run_section("environment", environment)
    run_section("triton sparse MLA in the CPU interpreter", triton_interpreter)
    RESULTS["gpu"] = torch.cuda.is_available()
    if RESULTS["gpu"]:
        torch.manual_seed(0)
        run_section("sparse MLA parity (GPU)", sparse_mla_parity)
        run_section("sparse MLA timing (GPU)", sparse_mla_timing)
        run_section("indexer parity and timing (GPU)", indexer_parity_and_timing)
        run_section("TransformerEngine, apex, DeepEP", te_and_apex)
    run_section("qwen36 GDN kernel parity",
                lambda: qwen36_gdn_parity(deadline=START + args.budget_s))
    # Each model step gets an equal share of what is left when it starts (GLM-5.2 half of it,
    # Qwen3.6 all that remains after), and stops doubling the prompt before its share runs out.
    if "glm52" in steps and RESULTS["gpu"]:
        run_section("LongStraw step, GLM-5.2 4 layers full width",
                    lambda: model_step(args, share_of_budget(args, 1 / len(steps))))
    if "qwen36" in steps:
        run_section("qwen36 step", lambda: qwen36_step(args, share_of_budget(args, 1.0)))
    if not RESULTS["gpu"]:
        say("\nNo CUDA device here: the GPU parity checks, the timings, FLA's GDN kernel and the "
            "model steps were NOT run. Only the CPU-checkable parts ran: the Triton interpreter "
            "check and the GDN checks of Megatron's torch rule at a tiny shape.")
    RESULTS["seconds"] = time.perf_counter() - START
    say(f"\nfailures: {RESULTS['failures'] or 'none'}; total {RESULTS['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(RESULTS, indent=2, default=str))
    return 1 if RESULTS["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
