"""Sparse MLA attention over selected latent rows, forward and backward, in Triton (replay).

FlashMLA's sparse prefill is forward-only (no sparse backward on Hopper), so replay, which needs
gradients, uses these kernels. Same contract as `refs.sparse_mla_attention`:

    query [s, h, d_qk], latents [t, d_qk] rows `[c_kv; k_pe]`, indices [s, k] (-1 = skip)
    out[s, h]  = softmax_{j valid}(query[s, h] . latents[indices[s, j]] * scale) @ latents[.., :v_dim]
    lse[s, h]  = natural log-sum-exp of those logits (float32; -inf and out = 0 when no index is valid)

Forward: one program per (query, block of heads); it walks the query's k selected rows in tiles,
gathers each tile once (the value part `[:v_dim]` serves both q.k and p@v, as in FlashMLA), and keeps
an online softmax (base 2 inside, lse stored in natural log).
Backward: the same programs recompute p from lse, accumulate dq in registers, and add each tile's
latent-row gradient into a float32 [t, d_qk] buffer with `tl.atomic_add` (several queries select the
same row). Atomic float adds make the order of that sum, and hence the last bits of d latents,
vary between runs on a GPU; every other output is deterministic.

dtypes: float32, bfloat16, float16 (float32 dots use IEEE precision, not TF32). float64 tensors take
the reference path. CPU tensors run only in Triton's interpreter, which must be switched on
(`TRITON_INTERPRET=1`) before this module is imported; otherwise they take the reference path too.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from megatron_longstraw.kernels import refs

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
"""Kernels were decorated in interpreter mode (CPU tensors run through them)."""

_LOG2E = 1.4426950408889634
_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in float32. UPCAST (interpreter only): its numpy dot mishandles bf16/fp16,
    so operands go to float32 first; products of bf16/fp16 values are exact in float32, so the result
    is what the GPU's low-precision dot with float32 accumulation computes, up to summation order."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _sparse_mla_fwd_kernel(
    q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr,
    stride_qs, stride_qh, stride_kvt, stride_is, stride_os, stride_oh, stride_ls,
    num_heads, num_selected, scale_log2,
    V_DIM: tl.constexpr, R_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)   # row offsets s * stride can pass 2^31
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_v = tl.arange(0, BLOCK_V)
    offs_r = tl.arange(0, BLOCK_R)
    mask_h, mask_v, mask_r = offs_h < num_heads, offs_v < V_DIM, offs_r < R_DIM

    q_row = q_ptr + s * stride_qs + offs_h[:, None] * stride_qh
    q_v = tl.load(q_row + offs_v[None, :], mask=mask_h[:, None] & mask_v[None, :], other=0.0)
    q_r = tl.load(q_row + V_DIM + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    for k0 in range(0, num_selected, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_ptr + s * stride_is + offs_k, mask=offs_k < num_selected, other=-1)
        valid = idx >= 0
        row = kv_ptr + idx[:, None] * stride_kvt
        rows_v = tl.load(row + offs_v[None, :], mask=valid[:, None] & mask_v[None, :], other=0.0)
        rows_r = tl.load(row + V_DIM + offs_r[None, :], mask=valid[:, None] & mask_r[None, :],
                         other=0.0)
        logits = _dot(q_v, tl.trans(rows_v), PRECISION, UPCAST)
        logits += _dot(q_r, tl.trans(rows_r), PRECISION, UPCAST)
        logits = tl.where(valid[None, :], logits * scale_log2, float("-inf"))   # [H, K], base 2
        m_new = tl.maximum(m_i, tl.max(logits, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # no valid key yet: keep p = 0
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(logits - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(rows_v.dtype), rows_v, PRECISION, UPCAST)
        m_i = m_new

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    log2_sum = m_i + tl.log2(tl.where(empty, 1.0, l_i))
    lse = tl.where(empty, float("-inf"), log2_sum * 0.6931471805599453)   # natural: * ln 2
    o_row = out_ptr + s * stride_os + offs_h[:, None] * stride_oh
    tl.store(o_row + offs_v[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_h[:, None] & mask_v[None, :])
    tl.store(lse_ptr + s * stride_ls + offs_h, lse, mask=mask_h)


@triton.jit
def _sparse_mla_bwd_kernel(
    q_ptr, kv_ptr, idx_ptr, lse_ptr, do_ptr, delta_ptr, dq_ptr, dkv_ptr,
    stride_qs, stride_qh, stride_kvt, stride_is, stride_ls, stride_dos, stride_doh,
    stride_dqs, stride_dqh, stride_dkvt,
    num_heads, num_selected, scale,
    V_DIM: tl.constexpr, R_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, WRITE_DKV: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)   # row offsets s * stride can pass 2^31
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_v = tl.arange(0, BLOCK_V)
    offs_r = tl.arange(0, BLOCK_R)
    mask_h, mask_v, mask_r = offs_h < num_heads, offs_v < V_DIM, offs_r < R_DIM
    mask_hv = mask_h[:, None] & mask_v[None, :]
    mask_hr = mask_h[:, None] & mask_r[None, :]

    q_row = q_ptr + s * stride_qs + offs_h[:, None] * stride_qh
    q_v = tl.load(q_row + offs_v[None, :], mask=mask_hv, other=0.0)
    q_r = tl.load(q_row + V_DIM + offs_r[None, :], mask=mask_hr, other=0.0)
    do = tl.load(do_ptr + s * stride_dos + offs_h[:, None] * stride_doh + offs_v[None, :],
                 mask=mask_hv, other=0.0)
    lse = tl.load(lse_ptr + s * stride_ls + offs_h, mask=mask_h, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse) * 1.4426950408889634   # base 2; empty rows: p = 0
    # delta = rowsum(dout * out) - dlse: d logit = p * (dp - delta) covers both outputs.
    delta = tl.load(delta_ptr + s * stride_ls + offs_h, mask=mask_h, other=0.0)

    dq_v = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    dq_r = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for k0 in range(0, num_selected, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_ptr + s * stride_is + offs_k, mask=offs_k < num_selected, other=-1)
        valid = idx >= 0
        row = kv_ptr + idx[:, None] * stride_kvt
        rows_v = tl.load(row + offs_v[None, :], mask=valid[:, None] & mask_v[None, :], other=0.0)
        rows_r = tl.load(row + V_DIM + offs_r[None, :], mask=valid[:, None] & mask_r[None, :],
                         other=0.0)
        logits = _dot(q_v, tl.trans(rows_v), PRECISION, UPCAST)
        logits += _dot(q_r, tl.trans(rows_r), PRECISION, UPCAST)
        logits = tl.where(valid[None, :], logits * (scale * 1.4426950408889634), float("-inf"))
        p = tl.exp2(logits - lse[:, None])                                       # [H, K]
        p = tl.where(mask_h[:, None], p, 0.0)
        dp = _dot(do, tl.trans(rows_v), PRECISION, UPCAST)            # [H, K]
        ds = p * (dp - delta[:, None]) * scale                                   # d (q.k)
        ds_lo = ds.to(rows_v.dtype)
        dq_v += _dot(ds_lo, rows_v, PRECISION, UPCAST)
        dq_r += _dot(ds_lo, rows_r, PRECISION, UPCAST)
        if WRITE_DKV:
            dkv_v = _dot(tl.trans(p.to(do.dtype)), do, PRECISION, UPCAST)
            dkv_v += _dot(tl.trans(ds_lo), q_v, PRECISION, UPCAST)   # [K, V]
            dkv_r = _dot(tl.trans(ds_lo), q_r, PRECISION, UPCAST)    # [K, R]
            d_row = dkv_ptr + idx[:, None] * stride_dkvt
            tl.atomic_add(d_row + offs_v[None, :], dkv_v, mask=valid[:, None] & mask_v[None, :])
            tl.atomic_add(d_row + V_DIM + offs_r[None, :], dkv_r,
                          mask=valid[:, None] & mask_r[None, :])

    dq_row = dq_ptr + s * stride_dqs + offs_h[:, None] * stride_dqh
    tl.store(dq_row + offs_v[None, :], dq_v.to(dq_ptr.dtype.element_ty), mask=mask_hv)
    tl.store(dq_row + V_DIM + offs_r[None, :], dq_r.to(dq_ptr.dtype.element_ty), mask=mask_hr)


# Tile sizes (BLOCK_H, BLOCK_K, num_warps). BLOCK_H is the M side of every dot (>= 16 for tensor
# cores); the value part of a row (kv_lora_rank = 512 for GLM-5.2) is held whole, like FlashMLA, so
# float32 takes half the key tile of 16-bit types. Tunable; tools/device_check.py times them.
FWD_TILES = {2: (16, 32, 8), 4: (16, 16, 8)}    # by element size
BWD_TILES = {2: (16, 16, 8), 4: (16, 16, 8)}


def _blocks(d_qk: int, v_dim: int) -> tuple[int, int, int]:
    rest = d_qk - v_dim
    return rest, max(16, triton.next_power_of_2(v_dim)), max(16, triton.next_power_of_2(max(rest, 1)))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _forward(query, latents, indices, scale, v_dim):
    num_queries, num_heads, d_qk = query.shape
    rest, block_v, block_r = _blocks(d_qk, v_dim)
    out = torch.empty(num_queries, num_heads, v_dim, dtype=query.dtype, device=query.device)
    lse = torch.empty(num_queries, num_heads, dtype=torch.float32, device=query.device)
    if num_queries == 0:
        return out, lse
    block_h, block_k, warps = FWD_TILES[query.element_size()]
    grid = (num_queries, triton.cdiv(num_heads, block_h))
    _sparse_mla_fwd_kernel[grid](
        query, latents, indices, out, lse,
        query.stride(0), query.stride(1), latents.stride(0), indices.stride(0),
        out.stride(0), out.stride(1), lse.stride(0),
        num_heads, indices.shape[1], scale * _LOG2E,
        V_DIM=v_dim, R_DIM=rest, BLOCK_H=block_h, BLOCK_K=block_k, BLOCK_V=block_v,
        BLOCK_R=block_r, PRECISION=_precision(query.dtype), UPCAST=INTERPRET, num_warps=warps)
    return out, lse


def _backward(query, latents, indices, out, lse, dout, dlse, scale, v_dim, need_dkv):
    num_queries, num_heads, d_qk = query.shape
    rest, block_v, block_r = _blocks(d_qk, v_dim)
    delta = (dout.float() * out.float()).sum(-1)                       # [s, h]
    if dlse is not None:
        delta = delta - dlse.float().masked_fill(torch.isneginf(lse), 0.0)
    delta = delta.contiguous()
    dout = dout.contiguous()
    dq = torch.empty_like(query)
    dkv = torch.zeros(latents.shape, dtype=torch.float32, device=latents.device) if need_dkv else None
    if num_queries:
        block_h, block_k, warps = BWD_TILES[query.element_size()]
        grid = (num_queries, triton.cdiv(num_heads, block_h))
        _sparse_mla_bwd_kernel[grid](
            query, latents, indices, lse, dout, delta, dq, dkv if need_dkv else dq,
            query.stride(0), query.stride(1), latents.stride(0), indices.stride(0), lse.stride(0),
            dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1),
            dkv.stride(0) if need_dkv else 0,
            num_heads, indices.shape[1], scale,
            V_DIM=v_dim, R_DIM=rest, BLOCK_H=block_h, BLOCK_K=block_k, BLOCK_V=block_v,
            BLOCK_R=block_r, PRECISION=_precision(query.dtype), UPCAST=INTERPRET, WRITE_DKV=need_dkv,
            num_warps=warps)
    return dq, (dkv.to(latents.dtype) if need_dkv else None)


class SparseMLAFunction(torch.autograd.Function):
    """Autograd wrapper: Triton forward, Triton backward (gradients for query and latents; lse is
    differentiable too, which the context-parallel LSE merge needs)."""

    @staticmethod
    def forward(ctx, query, latents, indices, scale: float, v_dim: int):
        out, lse = _forward(query, latents, indices, scale, v_dim)
        ctx.save_for_backward(query, latents, indices, out, lse)
        ctx.scale, ctx.v_dim = scale, v_dim
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        query, latents, indices, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dkv = _backward(query, latents, indices, out, lse, dout, dlse, ctx.scale, ctx.v_dim,
                            need_dkv=ctx.needs_input_grad[1])
        return (dq if ctx.needs_input_grad[0] else None), dkv, None, None, None


def supports(query: torch.Tensor, latents: torch.Tensor) -> bool:
    """Whether these tensors run through the Triton kernels (else the reference path)."""
    return (query.dtype in _SUPPORTED and latents.dtype == query.dtype
            and query.device == latents.device and (query.is_cuda or INTERPRET))


def sparse_mla_attention(query: torch.Tensor, latents: torch.Tensor, indices: torch.Tensor,
                         scale: float, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton sparse MLA attention; the contract of `refs.sparse_mla_attention`.

    query: [s, h, d_qk] fp32/bf16/fp16 (CUDA, or CPU under TRITON_INTERPRET=1)
    latents: [t, d_qk] same dtype; rows `[c_kv; k_pe]` with c_kv = the first v_dim columns
    indices: [s, k] int, into latents, -1 = skip
    returns (out [s, h, v_dim] query dtype, lse [s, h] float32, natural log)
    Differentiable w.r.t. query and latents (Triton backward). Other dtypes/devices: refs.
    """
    if not supports(query, latents):
        return refs.sparse_mla_attention(query, latents, indices, scale, v_dim)
    if not 0 < v_dim <= query.shape[-1] or latents.shape[-1] != query.shape[-1]:
        raise ValueError(f"sparse_mla_attention: v_dim {v_dim} and latent width "
                         f"{latents.shape[-1]} must fit query width {query.shape[-1]}.")
    query = query if query.stride(-1) == 1 else query.contiguous()
    latents = latents if latents.stride(-1) == 1 else latents.contiguous()
    indices = indices.to(torch.int64).contiguous()
    return SparseMLAFunction.apply(query, latents, indices, float(scale), int(v_dim))

