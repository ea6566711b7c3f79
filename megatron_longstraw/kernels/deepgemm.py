"""DeepGEMM behind two kernel parts: the FP8 lightning-indexer scores (`deep_gemm.fp8_mqa_logits`)
behind `indexer_topk`, and the FP8 base's GEMM (`deep_gemm.fp8_gemm_nt`) behind `fp8_linear`.

Upstream API (deepseek-ai/DeepGEMM: README "V3.2 MQA kernels for the indexer", `csrc/apis/
attention.hpp`, `tests/test_attention.py`):

    fp8_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=True,
                   max_seqlen_k=0) -> logits [s, t] float32
        q: [s, h, d] float8_e4m3fn (d in {64, 128}), kv: (k [t, d] float8_e4m3fn, k_scale [t] fp32),
        weights: [s, h] fp32, cu_seq_len_k_start/end: [s] int32 (key range of each query)
        logits[i, j] = sum_h relu(q[i, h] . (k[j] * k_scale[j])) * weights[i, h]  for j in range,
    SM90: h in {32, 64}; SM100: h <= 128, h % 4 == 0.

Mapping from `refs.indexer_scores(q, weights, keys, scale, relu=True)`: keys are quantised per row
(k_scale = amax / 448), queries per (token, head) with scale sq; relu(x) is positively homogeneous,
so relu(q.k * scale) = sq * scale * relu(q_fp8 . k), and sq * scale folds into the head weights.
The key range is the whole block; the causal mask and the running top-k are the reference's
(`running_topk`, same tie rule). FP8 scores are approximate: selections can differ from the
reference where scores nearly tie (the device check reports logit error and top-k recall).
Calls the kernel cannot take (relu=False, CPU tensors, unsupported head count/dim) use
`refs.indexer_scores` (logged once).

FP8 GEMM (`fp8_linear`, the `fp8_gemm` part; reference `fp8.linear`). Upstream (deepseek-ai/DeepGEMM
`csrc/apis/gemm.hpp`, `csrc/apis/layout.hpp`, `tests/test_fp8_fp4.py`, `deep_gemm/utils/math.py`):

    fp8_gemm_nt(a, b, d, c=None, recipe=None, recipe_a=None, recipe_b=None, compiled_dims="nk",
                disable_ue8m0_cast=False)          # alias of fp8_fp4_gemm_nt; d = c + a @ b.T
        a: (x_fp8 [m, k] float8_e4m3fn, K-major; sfa [m, ceil(k / 128)] fp32: per 1 x 128 group)
        b: (w_fp8 [n, k] float8_e4m3fn, K-major; sfb [ceil(n / 128), ceil(k / 128)] fp32: per
            128 x 128 block, contiguous: exactly a block-FP8 checkpoint's `weight_scale_inv`)
        d: [m, n] bf16 (the SM90 1D2D kernel writes bf16 and takes no c)

With fp32 scales the default recipe is (1, 128, 128). On SM90 the library makes sfa TMA-aligned
and MN-major itself (`get_mn_major_tma_aligned_tensor`) and takes sfb as it is. On SM100 it casts
fp32 scales to UE8M0 (powers of two, `disable_ue8m0_cast` must stay False there): a checkpoint's
arbitrary fp32 block scales would be rounded, so this wrapper runs on SM90 only. Activations are
quantised here per token and 128-column group (amax / 448, DeepGEMM's `per_token_cast_to_fp8`):
the only numerical change against the reference (which multiplies x in its own precision), and why
`auto` never picks this part (kernels/select.py). The backward (dL/dx in replay) stays the
reference's (fp8.grad_input). Calls it cannot take (not SM90, x not bf16, k not a multiple of 128,
n not a multiple of 64, row parts whose scale grid is not one 128 x 128 grid) use `fp8.linear`
(logged once).
"""

from __future__ import annotations

import logging

import torch

from megatron_longstraw.kernels import fp8
from megatron_longstraw.kernels import packages, refs

logger = logging.getLogger(__name__)

_FP8_MAX = 448.0
_WARNED: set[str] = set()


def _sm_major(x: torch.Tensor) -> int | None:
    """Compute capability major of x's GPU (None: not on a GPU)."""
    return torch.cuda.get_device_capability(x.device)[0] if x.is_cuda else None


def supports(q: torch.Tensor, relu: bool) -> str | None:
    """None when `fp8_mqa_logits` can score these queries, else why not."""
    if not relu:
        return "relu=False (fp8_mqa_logits always applies ReLU)"
    major = _sm_major(q)
    if major is None:
        return "tensors are not on a CUDA device"
    num_heads, head_dim = q.shape[1], q.shape[2]
    if head_dim not in (32, 64, 128):
        return f"index head dim {head_dim} (fp8_mqa_logits: 32, 64 or 128)"
    if major == 9 and num_heads not in (32, 64):
        return f"{num_heads} index heads (fp8_mqa_logits on SM90: 32 or 64)"
    if num_heads % 4 or num_heads > 128:
        return f"{num_heads} index heads (fp8_mqa_logits: a multiple of 4, at most 128)"
    return None


def _fp8_queries(q: torch.Tensor, weights: torch.Tensor, scale: float):
    """q -> (q_fp8 [s, h, d], head weights [s, h] fp32 with the query scales and `scale` folded in)."""
    q_fp8, q_scale = fp8.quantize_rows(q)                           # [s, h, d], [s, h]
    return q_fp8.contiguous(), (weights.float() * q_scale * scale).contiguous()


def _fp8_logits(q_fp8: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    deep_gemm = packages.require("deep_gemm")
    num_queries, num_keys = q_fp8.shape[0], keys.shape[0]
    k_fp8, k_scale = fp8.quantize_rows(keys)                        # [t, d], [t]
    start = torch.zeros(num_queries, dtype=torch.int32, device=keys.device)
    end = torch.full((num_queries,), num_keys, dtype=torch.int32, device=keys.device)
    return deep_gemm.fp8_mqa_logits(q_fp8, (k_fp8.contiguous(), k_scale.contiguous()), w,
                                    start, end, clean_logits=False)


def _score_fn(q, weights, scale, relu):
    """keys block -> scores [s, n]: DeepGEMM when it can take the call, else the reference."""
    reason = supports(q, relu)
    if reason is None:
        q_fp8, w = _fp8_queries(q, weights, scale)
        return lambda keys: _fp8_logits(q_fp8, w, keys)
    if reason not in _WARNED:
        _WARNED.add(reason)
        logger.warning("deepgemm indexer: %s; using the reference scores.", reason)
    return lambda keys: refs.indexer_scores(q, weights, keys, scale, relu)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float,
                   relu: bool) -> torch.Tensor:
    """`refs.indexer_scores` computed by `deep_gemm.fp8_mqa_logits` (FP8 inputs, fp32 output).

    q: [s, h_i, d_i], weights: [s, h_i], keys: [t, d_i] -> [s, t] float32
    = sum_h w[s,h] * relu(q[s,h].k[t] * scale).
    """
    return _score_fn(q, weights, scale, relu)(keys)


def running_topk(score_block, q: torch.Tensor, keys: torch.Tensor, query_positions: torch.Tensor,
                 key_positions: torch.Tensor, topk: int,
                 key_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's blockwise causal top-k (`refs.indexer_topk`) over scores from
    `score_block(keys_block) -> [s, n]`. Same outputs and tie rule; no [s, t] matrix."""
    num_queries, num_keys = q.shape[0], keys.shape[0]
    k = min(topk, num_keys)
    best_scores = torch.empty(num_queries, 0, dtype=torch.float32, device=q.device)
    best_idx = torch.empty(num_queries, 0, dtype=torch.long, device=q.device)
    last_query = int(query_positions.max()) if num_queries else -1
    for start in range(0, num_keys, key_block):
        end = min(start + key_block, num_keys)
        block_pos = key_positions[start:end]
        if int(block_pos.min()) > last_query:
            continue  # entirely in the future of every query
        scores = score_block(keys[start:end])
        best_scores = best_scores.to(scores.dtype)
        scores = scores.masked_fill(block_pos[None, :] > query_positions[:, None], float("-inf"))
        idx = torch.arange(start, end, device=q.device).expand(num_queries, -1)
        if end - start > k:
            scores, idx = refs._top_k_stable(scores, idx, k)
        scores = torch.cat([best_scores, scores], dim=1)
        idx = torch.cat([best_idx, idx], dim=1)
        best_scores, best_idx = (refs._top_k_stable(scores, idx, k) if scores.shape[1] > k
                                 else (scores, idx))
    if best_idx.shape[1] < k:  # every key block was in the future
        pad = k - best_idx.shape[1]
        best_scores = torch.cat([best_scores, best_scores.new_full((num_queries, pad),
                                                                   float("-inf"))], 1)
        best_idx = torch.cat([best_idx, best_idx.new_full((num_queries, pad), -1)], 1)
    best_idx = best_idx.masked_fill(torch.isneginf(best_scores), -1)
    return best_idx, best_scores


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                 query_positions: torch.Tensor, key_positions: torch.Tensor, topk: int,
                 scale: float, relu: bool, key_block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """`refs.indexer_topk` with DeepGEMM FP8 scores.

    q: [s, h_i, d_i], weights: [s, h_i], keys: [t, d_i], query_positions: [s], key_positions: [t]
    -> (indices [s, k] int64 into keys, ascending, -1 where fewer than k keys are visible;
    scores [s, k] float32), k = min(topk, t).
    """
    return running_topk(_score_fn(q, weights, scale, relu), q, keys, query_positions,
                        key_positions, topk, key_block)


# ---- FP8 GEMM: fp8_gemm_nt behind fp8_linear ---------------------------------------------------


def per_token_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [m, k] -> (x_fp8 [m, k] float8_e4m3fn, scales [m, ceil(k / 128)] fp32) with
    x ~ x_fp8 * scale per token and 128-column group (scale = amax / 448, amax >= 1e-4, as
    DeepGEMM's `per_token_cast_to_fp8`). Pure PyTorch (runs on CPU in tests)."""
    m, k = x.shape
    pad = -k % fp8.BLOCK
    padded = torch.nn.functional.pad(x.float(), (0, pad)).view(m, -1, fp8.BLOCK)
    scale = padded.abs().amax(dim=2).clamp(min=1e-4) / _FP8_MAX
    x_fp8 = (padded / scale[..., None]).to(torch.float8_e4m3fn).view(m, k + pad)[:, :k]
    return x_fp8.contiguous(), scale.contiguous()


def supports_fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                      row_parts: int) -> str | None:
    """None when `fp8_gemm_nt` can compute this `fp8_linear` call exactly as specified, else why
    not (module docstring)."""
    major = _sm_major(x)
    if major is None:
        return "tensors are not on a CUDA device"
    if major != 9:
        return (f"SM{major}x: fp8_gemm_nt casts fp32 block scales to UE8M0 there; only SM90 "
                "takes a checkpoint's scales unchanged")
    if x.dtype != torch.bfloat16:
        return f"activations in {x.dtype} (fp8_gemm_nt writes bf16: run the model in bf16)"
    n, k = weight.shape
    if k % fp8.BLOCK or n % 64:
        return f"weight [{n}, {k}] (needs k % 128 == 0 and n % 64 == 0)"
    if tuple(scale_inv.shape) != fp8.scale_shape(n, k):
        return f"{row_parts} row parts of {n // row_parts} rows (not one 128 x 128 scale grid)"
    return None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
               row_parts: int = 1) -> torch.Tensor:
    """`fp8.linear` by DeepGEMM's `fp8_gemm_nt` (activations quantised per 1 x 128 group).

    x: [..., k] bf16, weight: [n, k] float8_e4m3fn, scale_inv: [ceil(n / 128), ceil(k / 128)] fp32
    -> [..., n] bf16.
    """
    reason = supports_fp8_gemm(x, weight, scale_inv, row_parts)
    if reason is not None:
        if reason not in _WARNED:
            _WARNED.add(reason)
            logger.warning("deepgemm fp8_gemm: %s; using the reference GEMM.", reason)
        return fp8.linear(x, weight, scale_inv, row_parts)
    deep_gemm = packages.require("deep_gemm")
    if not hasattr(deep_gemm, "fp8_gemm_nt"):
        raise packages.MissingKernelPackage("`deep_gemm` has no fp8_gemm_nt (an old release)",
                                            "deep_gemm")
    n, k = weight.shape
    flat = x.reshape(-1, k)
    out = torch.empty(flat.shape[0], n, dtype=torch.bfloat16, device=x.device)
    if flat.shape[0]:
        x_fp8, x_scale = per_token_cast_to_fp8(flat)
        deep_gemm.fp8_gemm_nt((x_fp8, x_scale), (weight.contiguous(), scale_inv.contiguous()), out,
                              disable_ue8m0_cast=True)
    return out.reshape(*x.shape[:-1], n)
