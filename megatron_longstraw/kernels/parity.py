"""Parity of the kernel backends with `refs`: random cases, error measures and tolerances, shared by
tests/test_kernels.py and tools/device_check.py.

Errors are relative to the largest magnitude of an fp64 reference computed from the same (rounded)
inputs: max|x - x_64| / max|x_64|. Measuring against fp64 rather than against the reference at the
kernel's own dtype separates the kernel's error from the reference's.

    python -m megatron_longstraw.kernels.parity   # with TRITON_INTERPRET=1: the Triton kernels on CPU
"""

from __future__ import annotations

import json
import os
import time

import torch

from megatron_longstraw.kernels import refs

# Tolerances on the relative error above, by the kernel's compute dtype. fp32: kernels and
# reference differ in summation order over at most a few thousand terms (~1e-6 measured); 1e-5
# leaves margin. bf16: inputs are exact, but p is rounded to bf16 before p @ V (as FlashAttention and
# the reference do) and outputs are rounded: a few bf16 ulps (2^-8 = 3.9e-3) of the largest value,
# 2e-2. fp16: 3 more mantissa bits, 5e-3.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max|x - ref| / max|ref| over finite entries; inf if the -inf pattern differs (empty rows)."""
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.equal(torch.isneginf(x), torch.isneginf(ref)):
        return float("inf")
    finite = torch.isfinite(ref)
    if not finite.any():
        return 0.0
    diff = (x[finite] - ref[finite]).abs().max().item()
    return diff / max(ref[finite].abs().max().item(), 1e-30)


def sparse_mla_case(num_queries: int = 6, num_heads: int = 20, d_qk: int = 48, v_dim: int = 32,
                    num_keys: int = 40, topk: int = 37, dtype=torch.float32, device="cpu",
                    seed: int = 0) -> dict:
    """Random query/latents/indices with skipped (-1) entries: every third index of query 0, all of
    query 1 (an empty row: out 0, lse -inf), and the tail of query 2 (fewer than k visible)."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(num_queries, num_heads, d_qk, generator=gen).to(dtype)
    latents = torch.randn(num_keys, d_qk, generator=gen).to(dtype)
    indices = torch.randint(0, num_keys, (num_queries, topk), generator=gen)
    indices[0, ::3] = -1
    if num_queries > 1:
        indices[1] = -1
    if num_queries > 2:
        indices[2, topk // 3:] = -1
    grad_out = torch.randn(num_queries, num_heads, v_dim, generator=gen, dtype=torch.float64)
    grad_lse = torch.randn(num_queries, num_heads, generator=gen, dtype=torch.float64)
    return {"query": query.to(device), "latents": latents.to(device), "indices": indices.to(device),
            "scale": d_qk ** -0.5, "v_dim": v_dim, "grad_out": grad_out.to(device),
            "grad_lse": grad_lse.to(device)}


def _run_sparse_mla(fn, case: dict, query, latents, backward: bool):
    query = query.detach().clone().requires_grad_(backward)
    latents = latents.detach().clone().requires_grad_(backward)
    with torch.set_grad_enabled(backward):
        out, lse = fn(query, latents, case["indices"], case["scale"], case["v_dim"])
    grads = (None, None)
    if backward:
        loss = (out.double() * case["grad_out"]).sum() + \
            (lse.double().nan_to_num(neginf=0.0) * case["grad_lse"]).sum()
        loss.backward()
        grads = (query.grad, latents.grad)
    return out.detach(), lse.detach(), *grads


def sparse_mla_errors(fn, case: dict, backward: bool = True) -> dict[str, float]:
    """Relative errors of `fn` (the `sparse_mla_attention` contract) against the fp64 reference:
    out, lse and (backward) the gradients w.r.t. query and latents of
    sum(out * grad_out) + sum(lse * grad_lse) (lse of empty rows excluded)."""
    got = _run_sparse_mla(fn, case, case["query"], case["latents"], backward)
    ref = _run_sparse_mla(refs.sparse_mla_attention, case, case["query"].double(),
                          case["latents"].double(), backward)
    names = ("out", "lse", "grad_query", "grad_latents")[:4 if backward else 2]
    return {name: relative_error(g, r) for name, g, r in zip(names, got, ref)}


def indexer_case(num_queries: int = 64, num_heads: int = 32, head_dim: int = 128,
                 num_keys: int = 1024, dtype=torch.bfloat16, device="cpu", seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"q": torch.randn(num_queries, num_heads, head_dim, generator=gen).to(dtype).to(device),
            "weights": torch.randn(num_queries, num_heads, generator=gen).to(device),
            "keys": torch.randn(num_keys, head_dim, generator=gen).to(dtype).to(device),
            "query_positions": torch.arange(num_keys - num_queries, num_keys, device=device),
            "key_positions": torch.arange(num_keys, device=device),
            "scale": head_dim ** -0.5}


def topk_recall(idx: torch.Tensor, ref_idx: torch.Tensor) -> float:
    """Fraction of the reference's selected (valid) keys that `idx` also selects."""
    hits, total = 0, 0
    for row, ref_row in zip(idx.cpu(), ref_idx.cpu()):
        ref_set = set(ref_row[ref_row >= 0].tolist())
        hits += len(ref_set & set(row[row >= 0].tolist()))
        total += len(ref_set)
    return hits / max(total, 1)


def triton_interpreter_report() -> dict:
    """The Triton sparse-MLA kernels on CPU (needs TRITON_INTERPRET=1 before triton is imported):
    forward and backward errors against the fp64 reference, fp32 and bf16."""
    from megatron_longstraw.kernels import triton_sparse_mla

    if not triton_sparse_mla.INTERPRET:
        raise RuntimeError("TRITON_INTERPRET=1 must be set before triton is imported.")
    report = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        start = time.perf_counter()
        errors = sparse_mla_errors(triton_sparse_mla.sparse_mla_attention,
                                   sparse_mla_case(dtype=dtype))
        report[name] = {"errors": errors, "tolerance": TOLERANCE[dtype],
                        "seconds": time.perf_counter() - start}
    return report


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    print(json.dumps(triton_interpreter_report()))
