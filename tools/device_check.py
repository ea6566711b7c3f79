"""Check the kernel backends on this machine, and run one LongStraw step of a reduced-depth,
full-width GLM-5.2 on one GPU (under 8 minutes on an H100/H200).

    python tools/device_check.py [--kernels auto] [--budget-s 420] [--json out.json]

1. environment: torch, CUDA, GPU, and why each kernel backend is or is not usable here;
2. the Triton sparse-MLA kernels in Triton's CPU interpreter (tiny shape; runs everywhere);
   without CUDA the script says so and stops here (exit 0 when that passed);
3. parity: each usable backend against its reference on fresh random inputs at GLM-5.2 shapes
   (relative error against an fp64 reference, tolerance by dtype: kernels/parity.py);
4. timing: each backend and its reference, median of repeats after warm-up;
5. one LongStraw GRPO step (capture, scoring, replay with backward) of GLM-5.2 with 4 layers at the
   real widths (1 dense + 3 MoE layers, 16 routed experts) in bf16, at prompt lengths doubling from
   --start-prompt-len until memory or the time budget runs out: peak torch.cuda.max_memory_allocated,
   capture tokens/s, replay time per step.
Each part reports its own failure with the traceback and the script goes on; the exit status is 1
when any part failed.
"""

from __future__ import annotations

import argparse
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

from megatron_longstraw.kernels import parity, refs, select  # noqa: E402

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
    for key, value in info.items():
        say(f"  {key}: {value}")
    info["backends"] = select.describe()
    for name, reason in info["backends"].items():
        say(f"  backend {name:9s} {'usable' if reason is None else 'not usable: ' + reason}")
    return info


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


# ---- 5. one LongStraw step -----------------------------------------------------------------------

def _patch_final_norm_without_te() -> None:
    """HybridStack builds its final norm with TENorm whatever the spec says; megatron_longstraw's
    platform.apply() swaps in WrappedTorchNorm only when CUDA is absent. On a GPU without
    TransformerEngine we do the same swap here (same parameter, same math) so the step can run."""
    if select.unusable_reason("te") is None:
        return
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    hybrid_block.TENorm = WrappedTorchNorm
    say("  note: TransformerEngine missing; HybridStack's final TENorm replaced by WrappedTorchNorm")


def _build_model():
    from megatron_longstraw import parallel
    from megatron_longstraw.models.glm52.config import GLM52Config
    from megatron_longstraw.models.glm52.model import build_glm52_model

    parallel.initialize(context_parallel_size=1, expert_parallel_size=1)
    _patch_final_norm_without_te()
    cfg = GLM52Config(num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=16)
    try:  # initialise on the GPU directly (CPU initialisation of ~4.6B parameters is slow)
        model = build_glm52_model(cfg, params_dtype=torch.bfloat16, use_cpu_initialization=False)
    except Exception:  # noqa: BLE001
        say("  GPU initialisation failed; building on the CPU:\n" + traceback.format_exc())
        model = build_glm52_model(cfg, params_dtype=torch.bfloat16)
    model = model.cuda()
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


def model_step(args) -> dict:
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

    prompt_len = args.start_prompt_len
    while prompt_len <= args.max_prompt_len:
        elapsed = time.perf_counter() - START
        last = out["steps"][-1]["step_seconds"] if out["steps"] else None
        # Capture is linear in P, the indexer's causal top-k quadratic: a doubling costs <= 4x.
        if last is not None and elapsed + 4 * last > args.budget_s:
            say(f"  stopping before P = {prompt_len}: the time budget ({args.budget_s} s) would run out")
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
        step = {"prompt_len": prompt_len, "step_seconds": seconds,
                "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                "capture_tokens_per_s": (prompt_len - 1) / max(phases.get("capture", math.nan), 1e-9),
                "capture_s": phases.get("capture"), "scoring_s": phases.get("scoring"),
                "replay_s": phases.get("replay"), "page_gib": result.page_bytes / 2**30,
                "loss": result.loss, "response_lens": [int(r.numel()) for r in group.response_ids]}
        out["steps"].append(step)
        say(f"  P = {prompt_len:8d}: step {seconds:7.1f} s | capture {step['capture_s']:6.1f} s "
            f"({step['capture_tokens_per_s']:9.0f} tok/s) | scoring {step['scoring_s']:5.1f} s | "
            f"replay {step['replay_s']:5.1f} s | max_memory_allocated "
            f"{step['max_memory_allocated_gib']:6.1f} GiB | pages {step['page_gib']:.2f} GiB (host)")
        prompt_len *= 2
    if out["steps"]:
        out["longest_prompt"] = out["steps"][-1]["prompt_len"]
        say(f"  longest prompt run: {out['longest_prompt']} tokens "
            f"({out.get('stopped', 'reached --max-prompt-len')})")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", default="auto", help="--longstraw-kernels spec for the step")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="Wall-clock budget for the whole script (stops growing the prompt)")
    parser.add_argument("--start-prompt-len", type=int, default=8192)
    parser.add_argument("--max-prompt-len", type=int, default=1 << 20)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--skip-step", action="store_true", help="Kernel checks only")
    parser.add_argument("--json", type=str, default=None, help="Write the results here")
    args = parser.parse_args(argv)

    run_section("environment", environment)
    run_section("triton sparse MLA in the CPU interpreter", triton_interpreter)
    if not torch.cuda.is_available():
        say("\nNo CUDA device here: the GPU parity checks, the timings and the model step were NOT "
            "run. Only the CPU-checkable part (the Triton interpreter check above) ran.")
        RESULTS["gpu"] = False
    else:
        RESULTS["gpu"] = True
        torch.manual_seed(0)
        run_section("sparse MLA parity (GPU)", sparse_mla_parity)
        run_section("sparse MLA timing (GPU)", sparse_mla_timing)
        run_section("indexer parity and timing (GPU)", indexer_parity_and_timing)
        run_section("TransformerEngine, apex, DeepEP", te_and_apex)
        if not args.skip_step:
            run_section("LongStraw step, GLM-5.2 4 layers full width", lambda: model_step(args))
    RESULTS["seconds"] = time.perf_counter() - START
    say(f"\nfailures: {RESULTS['failures'] or 'none'}; total {RESULTS['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(RESULTS, indent=2, default=str))
    return 1 if RESULTS["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
