"""Parts 2-4 of tools/device_check.py: the Triton sparse-MLA kernels in Triton's CPU interpreter
(tiny shape; runs everywhere); on the GPU, parity of each usable backend (Triton and FlashMLA
sparse MLA, the DeepGEMM indexer and FP8 GEMM, TransformerEngine, apex) against its reference at
GLM-5.2 shapes, and timing of each against its reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from megatron_longstraw.kernels import fp8
from megatron_longstraw.kernels import parity, refs, select

from .common import REPO, RESULTS, check, median_ms, say


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


def fp8_gemm_parity_and_timing() -> dict:
    """DeepGEMM's fp8_gemm_nt (the `fp8_gemm` part) against fp8.linear at a GLM-5.2 expert's
    linear_fc1 shape ([4096, 6144] block-FP8 weight, 2048 tokens). Against the reference on the
    same FP8 activations the kernel differs only by its fp32 accumulation and bf16 output (2^-9
    relative per element): tolerance 1e-2; against the unquantised activations add e4m3's
    rounding of x (reported)."""
    reason = select.unusable_reason("deepgemm")
    if reason is not None or torch.cuda.get_device_capability()[0] != 9:
        why = reason or "fp8_gemm_nt takes fp32 block scales unchanged on SM90 only"
        say(f"  skipped: deepgemm fp8_gemm {why}")
        return {"skipped": why}
    from megatron_longstraw.kernels import deepgemm

    q, s = fp8.quantize(0.02 * torch.randn(4096, 6144, device="cuda"))
    x = torch.randn(2048, 6144, device="cuda").bfloat16()
    x_fp8, sx = deepgemm.per_token_cast_to_fp8(x)
    x_dq = x_fp8.float() * sx.repeat_interleave(128, dim=1)
    out = deepgemm.fp8_linear(x, q, s)
    result = check("deepgemm fp8_gemm_nt vs fp8.linear (same fp8 activations)",
                   {"out": parity.relative_error(out, fp8.linear(x_dq.double(), q, s))}, 1e-2)
    result["vs_unquantised_x"] = parity.relative_error(out, fp8.linear(x.double(), q, s))
    for name, fn in (("ref", fp8.linear), ("deepgemm", deepgemm.fp8_linear)):
        result[f"{name}_ms"] = median_ms(lambda: fn(x, q, s))
    say(f"    relative error vs unquantised activations {result['vs_unquantised_x']:.2e}; "
        f"ref {result['ref_ms']:.2f} ms, deepgemm {result['deepgemm_ms']:.2f} ms "
        "(2048 x 6144 @ 6144 x 4096)")
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
