"""FlashMLA sparse MLA prefill (`flash_mla.flash_mla_sparse_fwd`) behind `sparse_mla_attention`
(capture and scoring: forward only; FlashMLA has no sparse backward on Hopper).

Upstream API (deepseek-ai/FlashMLA, `flash_mla/flash_mla_interface.py`):

    flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, ...)
        q: [s_q, h_q, d_qk] bf16, kv: [s_kv, h_kv = 1, d_qk] bf16,
        indices: [s_q, h_kv = 1, topk] int32 (-1 or >= s_kv = invalid)
        -> (out [s_q, h_q, d_v] bf16, max_logits [s_q, h_q] fp32, lse [s_q, h_q] fp32)

Mapping from ours: query -> q, latents[:, None] -> kv, indices[:, None] -> indices, scale ->
sm_scale, v_dim -> d_v. Kernel limits (FlashMLA README, support matrix): h_q in {64, 128}, d_qk in
{512, 576}, d_v = 512, bf16, SM90/SM100. We pad heads up to 64/128 with zero queries (or run
128-head slices) and top-k up to a multiple of 128 with -1; other shapes and dtypes take the
reference path (logged once).

The LSE base differs between FlashMLA versions: the September-2025 release returns a base-2 lse
(its README's `log2sumexp2`, logits scaled by log2(e)), later versions the natural one (`tests/ref.py`
uses `torch.logsumexp`), and rows with no valid index get -inf in one, +inf in the other. We measure
the base once per device on a probe whose answer is known (all logits 0 over 128 keys: lse = ln 128
or log2 128) and return natural lse with -inf for empty rows, as `refs.sparse_mla_attention`.
"""

from __future__ import annotations

import logging
import math

import torch

from megatron_longstraw.kernels import packages, refs

logger = logging.getLogger(__name__)

_HEAD_SIZES = (64, 128)
_QK_DIMS = (512, 576)
_V_DIM = 512
_TOPK_MULTIPLE = 128
_LSE_TO_NATURAL: dict[str, float] = {}   # device -> factor (1 or ln 2)
_WARNED: set[str] = set()


def _sparse_fwd():
    return packages.require("flash_mla").flash_mla_sparse_fwd


def _on_gpu(x: torch.Tensor) -> bool:
    return x.is_cuda


def supports(query: torch.Tensor, latents: torch.Tensor, v_dim: int) -> str | None:
    """None when FlashMLA can run this call, else why not."""
    if not (_on_gpu(query) and _on_gpu(latents)):
        return "tensors are not on a CUDA device"
    if query.dtype != torch.bfloat16 or latents.dtype != torch.bfloat16:
        return f"dtype {query.dtype} (FlashMLA sparse prefill is bf16 only)"
    if query.shape[-1] not in _QK_DIMS or v_dim != _V_DIM:
        return f"d_qk {query.shape[-1]}, v_dim {v_dim} (FlashMLA: d_qk in {_QK_DIMS}, d_v = 512)"
    return None


def _lse_to_natural(device: torch.device, d_qk: int) -> float:
    """Factor turning FlashMLA's lse into a natural log-sum-exp (measured once per device)."""
    key = str(device)
    if key not in _LSE_TO_NATURAL:
        num_keys = 128
        q = torch.zeros(1, 64, d_qk, dtype=torch.bfloat16, device=device)
        kv = torch.zeros(num_keys, 1, d_qk, dtype=torch.bfloat16, device=device)
        idx = torch.arange(num_keys, dtype=torch.int32, device=device).view(1, 1, num_keys)
        lse = float(_sparse_fwd()(q, kv, idx, 1.0, _V_DIM)[2][0, 0])
        if math.isclose(lse, math.log(num_keys), rel_tol=1e-3):
            _LSE_TO_NATURAL[key] = 1.0
        elif math.isclose(lse, math.log2(num_keys), rel_tol=1e-3):
            _LSE_TO_NATURAL[key] = math.log(2.0)
        else:
            raise RuntimeError(f"FlashMLA probe: lse over {num_keys} zero logits is {lse}, neither "
                               f"ln({num_keys}) nor log2({num_keys}); unknown FlashMLA convention.")
        logger.info("FlashMLA sparse prefill returns %s lse", "natural" if _LSE_TO_NATURAL[key] == 1.0
                    else "base-2")
    return _LSE_TO_NATURAL[key]


def _pad_to(x: torch.Tensor, dim: int, size: int, value) -> torch.Tensor:
    if x.shape[dim] == size:
        return x
    shape = list(x.shape)
    shape[dim] = size - x.shape[dim]
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def sparse_mla_attention(query: torch.Tensor, latents: torch.Tensor, indices: torch.Tensor,
                         scale: float, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA sparse prefill with the contract of `refs.sparse_mla_attention` (forward only).

    query: [s, h, d_qk] bf16 CUDA (d_qk 512 or 576), latents: [t, d_qk] bf16, indices: [s, k]
    (-1 = skip), v_dim = 512 -> (out [s, h, 512] bf16, lse [s, h] float32, natural log; out = 0
    and lse = -inf where a query has no valid index). Not differentiable: calls that need
    gradients go to the `sparse_mla_grad` backend (select.py).
    """
    reason = supports(query, latents, v_dim)
    if reason is not None:
        if reason not in _WARNED:
            _WARNED.add(reason)
            logger.warning("flashmla sparse_mla_attention: %s; using the reference path.", reason)
        return refs.sparse_mla_attention(query, latents, indices, scale, v_dim)
    fwd = _sparse_fwd()
    num_queries, num_heads, d_qk = query.shape
    k = indices.shape[1]
    if k == 0 or num_queries == 0:
        return (query.new_zeros(num_queries, num_heads, v_dim),
                torch.full((num_queries, num_heads), float("-inf"), device=query.device))
    factor = _lse_to_natural(query.device, d_qk)
    k_padded = -(-k // _TOPK_MULTIPLE) * _TOPK_MULTIPLE
    idx = _pad_to(indices.to(torch.int32), 1, k_padded, -1).unsqueeze(1).contiguous()  # [s, 1, k']
    kv = latents.contiguous().unsqueeze(1)                                             # [t, 1, d_qk]
    outs, lses = [], []
    for start in range(0, num_heads, 128):
        q = query[:, start:start + 128]
        width = q.shape[1]
        padded = next(size for size in _HEAD_SIZES if size >= width)
        q = _pad_to(q, 1, padded, 0.0).contiguous()
        out, _, lse = fwd(q, kv, idx, float(scale), v_dim)[:3]
        outs.append(out[:, :width])
        lses.append(lse[:, :width].float() * factor)
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    lse = torch.cat(lses, dim=1) if len(lses) > 1 else lses[0]
    empty = (indices < 0).all(dim=1)                                                   # [s]
    out = out.masked_fill(empty[:, None, None], 0.0)
    lse = lse.masked_fill(empty[:, None], float("-inf"))
    return out, lse
