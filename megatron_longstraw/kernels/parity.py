"""Parity of the kernel backends with `refs`: random cases, error measures and tolerances, shared by
tests/test_kernels.py and tools/device_check.py.

Errors are relative to the largest magnitude of an fp64 reference computed from the same (rounded)
inputs: max|x - x_64| / max|x_64|. Measuring against fp64 rather than against the reference at the
kernel's own dtype separates the kernel's error from the reference's.

    python -m megatron_longstraw.kernels.parity   # with TRITON_INTERPRET=1: the Triton kernels on CPU
"""

from __future__ import annotations

import json
import math
import os
import time

import torch
import torch.nn.functional as F

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


# ---- Qwen3.6 Gated DeltaNet (tools/device_check.py, tests/test_kernels.py) ----------------------

# Tolerances on relative_error (max|x - x_64| / max|x_64|) against the fp64 reference.
# fp32 (Megatron's torch rule): same algorithm, fp32 rounding compounded over the N/64 chunk
# steps of the state recurrence and the 64-step forward substitution inside each chunk. Measured
# at the Qwen3.6 shape, 4096 tokens, on CPU: out <= 1.6e-6, state <= 8.2e-7 (a split inside a
# chunk against one call included; a chunk-aligned split is bitwise equal to one call), so
# TOLERANCE[fp32] = 1e-5 holds with ~6x margin.
# bf16 (FLA): inputs are exact, but FLA stores the WY factors w and u, the per-chunk states h and
# v_new in the input dtype (chunk_gated_delta_rule_fwd_h: `h = k.new_empty(...)`) and rounds the
# output: several bf16 roundings (2^-9 each) per element, more than attention's p @ V
# (TOLERANCE[bf16] = 2e-2); 5e-2. A kernel that ignores the initial state, swaps the
# state's [d_k, d_v] layout or misapplies the decay is off by O(1).
GDN_TOLERANCE = {torch.float32: TOLERANCE[torch.float32], torch.bfloat16: 5e-2}
# Gradients (q, k, v, g, beta, initial state). fp32: measured at the Qwen3.6 shape on CPU <= 1.3e-6,
# so 1e-5 again. bf16 (FLA's backward): do, dh and dv are rounded to bf16 too, and dg sums
# products over d_k x d_v; not yet measured on a GPU, so 2e-1 only catches a wrong gradient
# (O(1)), and the measured values are recorded for a tighter bound.
GDN_GRAD_TOLERANCE = {torch.float32: TOLERANCE[torch.float32], torch.bfloat16: 2e-1}
GDN_FIELDS = ("q", "k", "v", "g", "beta")
def gdn_case(num_tokens: int, num_key_heads: int, num_value_heads: int, head_dim: int,
             dtype=torch.bfloat16, device="cpu", initial_state: bool = False,
             seed: int = 0) -> dict:
    """Random delta-rule inputs as Megatron's GatedDeltaNet passes them to its kernel
    (`_prepare_input_for_gated_delta_rule`, `_compute_g_and_beta`):
    q, k [1, N, H_v, d] in `dtype`: l2-normalised per QK head, then each QK head repeated for its
    H_v / H_k value heads (repeat_interleave); v [1, N, H_v, d] in `dtype`; g [1, N, H_v] float32,
    the log decay -A * softplus(alpha) with A log-uniform in [1e-3, 8] per head, from heads that
    forget at once to heads that carry the state across thousands of tokens; beta [1, N, H_v]
    sigmoid in `dtype`; initial_state [1, H_v, d, d] float32 (what capture stores; FLA returns its
    final state in float32) or None."""
    gen = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, device=device)  # noqa: E731
    qk = randn(1, num_tokens, 2 * num_key_heads, head_dim)
    qk = qk * torch.rsqrt((qk * qk).sum(-1, keepdim=True) + 1e-6)
    repeat = num_value_heads // num_key_heads
    q, k = (x.repeat_interleave(repeat, dim=2) for x in qk.chunk(2, dim=2))
    decay_rate = torch.empty(num_value_heads, device=device).uniform_(
        math.log(1e-3), math.log(8.0), generator=gen).exp()
    return {"q": q.to(dtype), "k": k.to(dtype),
            "v": randn(1, num_tokens, num_value_heads, head_dim).to(dtype),
            "g": -decay_rate * F.softplus(randn(1, num_tokens, num_value_heads)),
            "beta": randn(1, num_tokens, num_value_heads).sigmoid().to(dtype),
            "initial_state": (randn(1, num_value_heads, head_dim, head_dim) if initial_state
                              else None)}


def _gdn_tokens(case: dict, start: int, end: int | None, initial_state) -> dict:
    return {**{name: case[name][:, start:end] for name in GDN_FIELDS},
            "initial_state": initial_state}


def gdn_run(rule, case: dict, dtype=None):
    """`rule` called as LongStraw's GDN calls Megatron's kernel (gdn.py `_mix`), on `case` as given
    (dtype None) or with every input cast to `dtype`. Returns (out [1, N, H_v, d], final state)."""
    cast = (lambda x: x) if dtype is None else (lambda x: None if x is None else x.to(dtype))
    q, k, v, g, beta = (cast(case[name]) for name in GDN_FIELDS)
    return rule(q, k, v, g=g, beta=beta, initial_state=cast(case["initial_state"]),
                output_final_state=True, use_qk_l2norm_in_kernel=False)


def gdn_reference(q, k, v, g, beta, **kwargs):
    """Megatron-Core's `torch_chunk_gated_delta_rule` with every step in float64 (precision.py's
    copy, the one `precision.enable_fp64_gdn` installs)."""
    from megatron_longstraw.runtime.precision import chunk_gated_delta_rule_fp64

    return chunk_gated_delta_rule_fp64(q, k, v, g, beta, **kwargs)


def gdn_errors(rule, case: dict, dtype=None, split_at=()) -> dict[str, dict[str, float]]:
    """Relative errors of `rule` (the delta-rule contract of Megatron's `torch_chunk_gated_delta_rule`
    and FLA's `chunk_gated_delta_rule`) on `case` (inputs cast to `dtype` unless None) against the
    fp64 reference over all N tokens in one call: `one call` (out, final state), and for each n in
    `split_at`, `split at n`: tokens [0, n), then [n, N) starting from the first call's final
    state (capture carries the state block to block, replay starts from the captured one): the
    joined out and the last state against the reference and against `rule`'s own one call."""
    ref_out, ref_state = gdn_run(gdn_reference, case, torch.float64)
    out, state = gdn_run(rule, case, dtype)
    errors = {"one call": {"out": relative_error(out, ref_out),
                           "state": relative_error(state, ref_state)}}
    num_tokens = case["q"].shape[1]
    for n in split_at:
        if not 0 < n < num_tokens:
            raise ValueError(f"split point {n} must lie inside the {num_tokens} tokens")
        first_out, carried = gdn_run(rule, _gdn_tokens(case, 0, n, case["initial_state"]), dtype)
        second_out, final = gdn_run(rule, _gdn_tokens(case, n, None, carried), dtype)
        joined = torch.cat([first_out, second_out], dim=1)
        errors[f"split at {n}"] = {
            "out": relative_error(joined, ref_out),
            "state": relative_error(final, ref_state),
            "out vs one call": relative_error(joined, out),
            "state vs one call": relative_error(final, state)}
    return errors


def gdn_grad_errors(rule, case: dict, dtype=None, seed: int = 1) -> dict[str, float]:
    """Relative errors of the gradients of sum(out * grad_out) + sum(state * grad_state) w.r.t.
    q, k, v, g, beta and the initial state (replay's backward; the initial state's gradient is the
    exact prompt-gradient mode's) against the fp64 reference's."""
    device = case["v"].device
    gen = torch.Generator(device=device).manual_seed(seed)
    grad_out, grad_state = (torch.randn(x.shape, generator=gen, dtype=torch.float64, device=device)
                            for x in (case["v"], case["initial_state"]))
    names = GDN_FIELDS + ("initial_state",)
    grads = []
    for fn, cast in ((rule, dtype), (gdn_reference, torch.float64)):
        leaves = {n: (case[n] if cast is None else case[n].to(cast)).detach().requires_grad_()
                  for n in names}
        out, state = gdn_run(fn, leaves)
        loss = (out.double() * grad_out).sum() + (state.double() * grad_state).sum()
        grads.append(torch.autograd.grad(loss, [leaves[n] for n in names]))
    return {f"d{n}": relative_error(g, r) for n, g, r in zip(names, *grads)}
