"""FP8 block-quantised weights (megatron_longstraw/kernels/fp8.py) and the `fp8_gemm` kernel part: the
round trip within the e4m3 bound, the stacked grids of fused rows, the reference GEMM against the
dequantised weight (exact) and against the unquantised weight (within the quantisation bound),
its backward, the checks that name a misfit tensor, the kernel selector, and DeepGEMM's wrapper
(its pure-PyTorch parts here; the kernel itself on an SM90 GPU only).

Bounds. e4m3 keeps 3 mantissa bits: w / scale rounds to the nearest e4m3 value with an error of at
most 2^-4 of it where it is normal (>= 2^-6) and 2^-10 (half the subnormal spacing) below, so
|w - dq| <= max(2^-4 |w|, 2^-10 scale) (`fp8.round_trip_bound` adds float32 slack). A GEMM over
the dequantised weight then errs from the unquantised one by at most |x| @ bound^T per output.
"""

import math

import pytest
import torch

from megatron_longstraw.kernels import fp8
from megatron_longstraw.kernels import deepgemm, select
from megatron_longstraw.kernels.packages import MissingKernelPackage


def _weight(shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen, dtype=torch.float64)
    # blocks of very different magnitudes, and tiny values (subnormal range of their block)
    w = w * torch.logspace(-3, 1, shape[0], dtype=torch.float64)[:, None]
    w[0, :7] = 1e-7
    return w.to(dtype)


def _expanded_scale(scale_inv, out_features, in_features, parts=1):
    rows = fp8.scale_rows(out_features, parts)
    return scale_inv[rows].repeat_interleave(fp8.BLOCK, dim=1)[:, :in_features].double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape,parts", [((300, 260), 1), ((400, 150), 2), ((64, 32), 1)])
def test_round_trip_within_the_e4m3_bound(shape, parts, dtype):
    w = _weight(shape, dtype)
    q, s = fp8.quantize(w, "w", parts)            # check_round_trip ran inside
    assert q.dtype == fp8.FP8_DTYPE and s.dtype == torch.float32
    assert tuple(s.shape) == fp8.scale_shape(*shape, parts)
    dq = fp8.dequantize(q, s, torch.float64, parts)
    scale = _expanded_scale(s, *shape, parts)
    error = (dq - w.double()).abs()
    bound = torch.maximum(2 ** -4 * w.double().abs(), 2 ** -10 * scale)
    # float32 slack only: the division and product round once each (2^-24 relative)
    assert (error <= bound * (1 + 2 ** -20) + 2 ** -22 * (w.double().abs() + scale)).all()
    assert (error / w.double().abs().clamp_min(1e-30)).max() > 2 ** -6   # FP8, not a copy
    # scale = amax / 448 per block: the largest value of each block is exact (448 is e4m3)
    assert torch.equal(q.float().abs().amax(1).max(), torch.tensor(448.0))


def test_fused_rows_stack_the_parts_grids():
    """A gated linear_fc1 = [gate; up] of 150 rows each: its FP8 form is gate's and up's own
    quantisation stacked (what an HF checkpoint ships), not one grid over 300 rows."""
    gate, up = _weight((150, 150), seed=1), _weight((150, 150), seed=2)
    (qg, sg), (qu, su) = fp8.quantize(gate), fp8.quantize(up)
    q, s = fp8.quantize(torch.cat([gate, up]), parts=2)
    assert torch.equal(q.view(torch.uint8), torch.cat([qg, qu]).view(torch.uint8))
    assert torch.equal(s, torch.cat([sg, su]))
    assert tuple(s.shape) == (4, 2) != fp8.scale_shape(300, 150)        # 2 x ceil(150/128) rows
    assert torch.equal(fp8.dequantize(q, s, parts=2),
                       torch.cat([fp8.dequantize(qg, sg), fp8.dequantize(qu, su)]))
    assert fp8.row_parts("decoder.layers.1.mlp.linear_fc1.weight") == 2
    assert fp8.row_parts("decoder.layers.1.mlp.linear_fc2") == 1
    assert fp8.nbytes(300, 150, 2) == 300 * 150 + 4 * 4 * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_reference_gemm_is_the_dequantised_matmul(dtype):
    """Exact: the reference computes Megatron's product with the weight dequantised in x's
    precision, so a layer holding that dequantised weight gives the same bits."""
    q, s = fp8.quantize(_weight((300, 260)))
    x = torch.randn(3, 5, 260, generator=torch.Generator().manual_seed(3)).to(dtype)
    out = fp8.linear(x, q, s)
    assert out.dtype == dtype
    assert torch.equal(out, torch.matmul(x, fp8.dequantize(q, s, dtype).t()))
    if dtype == torch.float64:   # e4m3 x fp32 scale is exact in float64
        exact = q.double() * _expanded_scale(s, 300, 260)
        assert torch.equal(out, torch.matmul(x, exact.t()))


def test_reference_gemm_within_the_quantisation_bound():
    """fp64: |x W^T - x dq(W)^T| <= |x| (bound)^T elementwise (the dot products of fp64 rounding,
    ~1e-16 relative, are far below the bound's ~6e-2)."""
    w = _weight((300, 260), torch.float64)
    q, s = fp8.quantize(w)
    x = torch.randn(7, 260, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    bound = torch.maximum(2 ** -4 * w.abs(), 2 ** -10 * _expanded_scale(s, 300, 260))
    error = (fp8.linear(x, q, s) - x @ w.t()).abs()
    allowed = x.abs() @ bound.t()
    assert (error <= allowed * (1 + 1e-6) + 1e-12).all()
    assert (error / allowed).max() > 0.01            # the bound is not vacuous


def test_sliced_gemm_and_backward(monkeypatch):
    """With SLICE_VALUES small the weight is dequantised 128 rows at a time: the same outputs as
    one dequantise (each is the same dot product; BLAS may block it differently: fp64 rounding,
    1e-14 of the largest output) and the same dL/dx (summed over slices: the same)."""
    q, s = fp8.quantize(_weight((300, 260)))
    x = torch.randn(4, 260, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    whole = fp8.linear(x, q, s)
    grad = torch.randn(4, 300, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    whole_grad = fp8.grad_input(grad, q, s)
    monkeypatch.setattr(fp8, "SLICE_VALUES", 128 * 260)
    assert len(fp8._row_slices(300, 260)) == 3
    assert (fp8.linear(x, q, s) - whole).abs().max() <= 1e-14 * whole.abs().max()
    assert (fp8.grad_input(grad, q, s) - whole_grad).abs().max() <= 1e-14 * whole_grad.abs().max()
    assert torch.equal(whole_grad, grad @ fp8.dequantize(q, s, torch.float64))


def test_matmul_forward_and_backward_equal_the_dequantised_linear():
    q, s = fp8.quantize(_weight((200, 96)), parts=2)
    x = torch.randn(2, 3, 96, dtype=torch.float64, requires_grad=True)
    select.use("ref")
    out = select.kernels().fp8_matmul(x, q, s, 2)
    (grad_x,) = torch.autograd.grad(out.square().sum(), x)
    x2 = x.detach().requires_grad_()
    ref = torch.matmul(x2, fp8.dequantize(q, s, torch.float64, 2).t())
    (ref_grad,) = torch.autograd.grad(ref.square().sum(), x2)
    assert torch.equal(out, ref)
    assert (grad_x - ref_grad).abs().max() <= 1e-12


def test_errors_name_the_tensor_and_the_fix():
    q, s = fp8.quantize(_weight((300, 260)))
    with pytest.raises(fp8.FP8Error, match=r"w\.weight_scale_inv is torch\.float32 of shape "
                                           r"\[2, 3\], but w\.weight \[300, 260\] in 128 x 128 "
                                           r"blocks needs float32 \[3, 3\]"):
        fp8.check_pair("w.weight", q, s[:2])
    with pytest.raises(fp8.FP8Error, match=r"w\.weight is float8_e4m3fn but w\.weight_scale_inv "
                                           r"is missing"):
        fp8.check_pair("w.weight", q, None)
    with pytest.raises(fp8.FP8Error, match="must be 2-D float8_e4m3fn"):
        fp8.check_pair("w.weight", q.float(), s)
    bad = _weight((8, 8))
    bad[1, 1] = float("inf")
    with pytest.raises(fp8.FP8Error, match="non-finite"):
        fp8.quantize(bad, "layer.weight")
    broken = q.clone()
    broken.view(torch.uint8)[5, 5] ^= 0x40                # flip an exponent bit
    with pytest.raises(fp8.FP8Error, match=r"round trip of layer\.weight \(shape \[300, 260\]\) "
                                           r"is outside the e4m3 bound: element \[5, 5\]"):
        fp8.check_round_trip("layer.weight", _weight((300, 260)), broken, s)

    # A checkpoint's tensors (safetensors dtype codes and shapes).
    def pairs(tensors):
        codes = {torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
                 torch.float32: "F32", torch.bfloat16: "BF16"}
        return fp8.find_pairs(tensors, lambda n: codes[tensors[n].dtype],
                              lambda n: tuple(tensors[n].shape), "ckpt")

    good = {"a.weight": q, "a.weight_scale_inv": s, "b.weight": torch.zeros(2, 2)}
    assert pairs(good) == {"a.weight": "a.weight_scale_inv"}
    with pytest.raises(fp8.FP8Error, match=r"ckpt: a\.weight is float8_e4m3fn but "
                                           r"a\.weight_scale_inv is missing"):
        pairs({"a.weight": q})
    with pytest.raises(fp8.FP8Error, match=r"ckpt: a\.weight_scale_inv is F32 of shape \[3, 2\], "
                                           r"but a\.weight \[300, 260\] in 128 x 128 blocks needs "
                                           r"F32 \[3, 3\]"):
        pairs({"a.weight": q, "a.weight_scale_inv": s[:, :2]})
    with pytest.raises(fp8.FP8Error, match=r"b\.weight_scale_inv has no float8_e4m3fn weight"):
        pairs({**good, "b.weight_scale_inv": s})
    with pytest.raises(fp8.FP8Error, match=r"c\.weight is F8_E5M2"):
        pairs({**good, "c.weight": torch.zeros(2, 2, dtype=torch.float8_e5m2)})


def test_kernel_selector_has_the_fp8_gemm_part():
    select.reset()
    assert select.parse_spec("auto")["fp8_gemm"] == "auto"
    assert select.resolve("auto")[0]["fp8_gemm"] == "ref"     # auto never picks deepgemm here
    assert select.parse_spec("fp8_gemm=deepgemm")["fp8_gemm"] == "deepgemm"
    assert select.parse_spec("deepgemm")["fp8_gemm"] == "deepgemm"   # with the indexer
    with pytest.raises(ValueError, match="does not implement 'fp8_gemm'"):
        select.parse_spec("fp8_gemm=triton")
    assert select.use("ref").fp8_linear is fp8.linear
    if select.unusable_reason("deepgemm") is not None:          # this machine: no CUDA
        with pytest.raises(MissingKernelPackage, match="deepgemm"):
            select.resolve("auto,fp8_gemm=deepgemm")
    select.reset()


def test_deepgemm_wrapper_parts_on_cpu():
    """What runs without a GPU: the activation cast (DeepGEMM's per 1 x 128 recipe) within the
    e4m3 bound, and the wrapper's fallback to the reference where the kernel cannot run."""
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(7)) * 3
    x_fp8, sx = deepgemm.per_token_cast_to_fp8(x)
    assert x_fp8.shape == (5, 300) and sx.shape == (5, 3)
    scale = sx.repeat_interleave(128, dim=1)[:, :300]
    error = (x_fp8.float() * scale - x).abs()
    assert (error <= torch.maximum(2 ** -4 * x.abs(), 2 ** -10 * scale) * (1 + 2 ** -8)
            + 2 ** -20 * (x.abs() + scale)).all()
    q, s = fp8.quantize(_weight((256, 256)))
    assert deepgemm.supports_fp8_gemm(x, q, s, 1) == "tensors are not on a CUDA device"
    xb = torch.randn(4, 256).bfloat16()
    assert torch.equal(deepgemm.fp8_linear(xb, q, s), fp8.linear(xb, q, s))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9
                    or select.unusable_reason("deepgemm") is not None,
                    reason="DeepGEMM's fp8_gemm_nt needs an SM90 GPU with deep_gemm installed "
                           "(tools/device_check.py runs the same check when a GPU is lent)")
def test_deepgemm_fp8_gemm_on_sm90():
    """fp8_gemm_nt against the reference on the same FP8 activations: both compute
    x_fp8 * sx @ W^T; the kernel accumulates in fp32 and writes bf16 (2^-9 relative per
    element), so 1e-2 relative (Frobenius) covers it; a wrong scale layout errs by O(1)."""
    w = torch.randn(4096, 6144, device="cuda") * 0.02
    q, s = fp8.quantize(w)
    x = torch.randn(512, 6144, device="cuda").bfloat16()
    x_fp8, sx = deepgemm.per_token_cast_to_fp8(x)
    x_dq = (x_fp8.float() * sx.repeat_interleave(128, dim=1)).double()
    ref = fp8.linear(x_dq, q, s)
    out = deepgemm.fp8_linear(x, q, s).double()
    assert math.isfinite(float(out.norm()))
    assert float((out - ref).norm() / ref.norm()) <= 1e-2
