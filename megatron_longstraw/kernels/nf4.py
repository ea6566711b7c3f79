"""NF4 storage of frozen base weights (QLoRA), correct on every bitsandbytes code path.

bitsandbytes' `quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")` forms
blocks of 64 over the *flattened* weight and packs two 4-bit codes per byte in that order; its
`QuantState` records `shape = w.shape`. Its dequantize has several kernels, and they do not all
agree on that layout (bitsandbytes 0.50.2, torch 2.14.1):

- CUDA, and the generic ("default") kernel, which runs where bitsandbytes registers no native
  CPU kernel: blocks over the flattened weight, the layout the quantiser wrote. Right.
- The native CPU kernel (`libbitsandbytes_cpu`, registered whenever that library loads) picks its
  code path by the CPU at run time. Without AVX-512 it forms the blocks over the flattened weight:
  right. With AVX-512 it forms them along each row of `shape` (m rows x n columns): when n is not
  a multiple of 64 the blocks do not line up with the quantiser's, and a `[96, 32]` weight comes
  back with a per-block error of 1.07 x its absmax (nearest-code rounding allows 0.152).
  `matmul_4bit` reaches the same kernel on CPU. `native_layout()` probes which one this machine
  has.

This module therefore dequantises the flattened weight as one row, `shape = [1, numel]`, where
every kernel forms the same blocks, and reshapes the result. The packed bytes and the `QuantState`
kept with a layer are bitsandbytes' own (`shape = [out, in]`), so the CUDA kernels and
`matmul_4bit` on a GPU see exactly what they always did. On CPU the layer's matmul is a small
autograd function over this dequantise (`matmul`), not `matmul_4bit`. `dequantize(...,
path="generic")`, or `LONGSTRAW_NF4_DEQUANTIZE=generic`, bypasses bitsandbytes' kernels with a
pure-PyTorch dequantise of the same layout (bitwise equal to bitsandbytes' generic kernel, tested).

`check_round_trip` (run once per weight by `quantize`) compares the round trip with NF4's bound and
raises `NF4Error` naming the weight, its shape, the bitsandbytes version and the code path: a base
weight is never used wrong silently.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.nn.functional as F

NF4_BLOCKSIZE = 64
NF4_NESTED_BLOCKSIZE = 256
"""bitsandbytes quantises the absmax statistics in blocks of 256 (fixed in `quantize_4bit`)."""
NF4_MAX_GAP = 1.0 - 0.6961928009986877
"""Widest gap between adjacent NF4 codes ([-1, -0.696]): nearest-code rounding errs by at most
half of it, times the block's absmax."""
PATHS = ("auto", "generic")
ENV_PATH = "LONGSTRAW_NF4_DEQUANTIZE"
_CHECK_CHUNK = 1 << 22
"""Values per slice of the round-trip check (bounds its temporary memory on large weights)."""


class NF4Error(RuntimeError):
    """An NF4 round trip outside its bound: the dequantised base weight would be wrong."""


def _functional():
    try:
        import bitsandbytes.functional as bnb_functional
    except ImportError as exc:
        raise ImportError("NF4 base weights (QLoRA) need bitsandbytes: pip install -e '.[qlora]' "
                          "(the tested version is pinned in constraints.txt)") from exc
    return bnb_functional


def bitsandbytes_version() -> str:
    try:
        import bitsandbytes
    except ImportError:
        return "not installed"
    return bitsandbytes.__version__


def _path(path: str | None) -> str:
    path = path or os.environ.get(ENV_PATH) or "auto"
    if path not in PATHS:
        raise ValueError(f"NF4 dequantize path {path!r} (from the argument or {ENV_PATH}): "
                         f"choose one of {PATHS}.")
    return path


def has_native_cpu_kernel() -> bool:
    """bitsandbytes registered its native CPU dequantize (its CPU library loaded); otherwise its
    generic kernel runs on CPU."""
    _functional()
    return torch._C._dispatch_has_kernel_for_dispatch_key("bitsandbytes::dequantize_4bit", "CPU")


def _native_dequantize(packed: torch.Tensor, state) -> torch.Tensor:
    """bitsandbytes' `dequantize_4bit` as its users call it: the kernel registered for the
    tensors' device, blocks formed as that kernel forms them for `state.shape`."""
    return _functional().dequantize_4bit(packed, state)


NATIVE_LAYOUTS = ("none", "flattened", "row-blocked", "wrong")
_LAYOUT_WORDS = {
    "none": "no native CPU kernel: its generic kernel",
    "flattened": "native CPU kernel, blocks over the flattened weight (its non-AVX-512 path)",
    "row-blocked": "native CPU kernel, blocks along each row of the weight's shape (its AVX-512 "
                   "path)",
    "wrong": "native CPU kernel, wrong for the flattened weight too",
}


def native_layout() -> str:
    """What bitsandbytes' CPU dequantize does with a weight's own 2-D shape, probed on a [96, 32]
    weight (rows of half a block): "none" (no native kernel: the generic one, flattened),
    "flattened" (the native kernel forms the quantiser's blocks), "row-blocked" (it forms them
    along each row; the flattened `[1, numel]` call `dequantize` makes is right), or "wrong"
    (even that call differs from the generic dequantise: `check_round_trip` refuses every weight).
    A few milliseconds; for messages, receipts and tests, never on the hot path."""
    if not has_native_cpu_kernel():
        return "none"
    weight = torch.randn(96, 32, generator=torch.Generator().manual_seed(0))
    packed, state = quantize(weight, check=False)
    expected = _dequantize_generic(packed, state)
    if torch.equal(_native_dequantize(packed, state), expected):
        return "flattened"
    flat = copy.copy(state)
    flat.shape = torch.Size([1, state.shape.numel()])
    if torch.equal(_native_dequantize(packed, flat).reshape(state.shape), expected):
        return "row-blocked"
    return "wrong"


def describe_path(device: torch.device | str, path: str | None = None) -> str:
    """The kernel `dequantize` runs for tensors on `device`, in words (for errors and receipts)."""
    if _path(path) == "generic":
        return "longstraw generic dequantize (pure PyTorch)"
    device = torch.device(device)
    if device.type != "cpu":
        return f"bitsandbytes {device.type} kernel"
    capability = torch.backends.cpu.get_cpu_capability()
    return (f"bitsandbytes {_LAYOUT_WORDS[native_layout()]}; called with the flattened layout "
            f"(torch CPU capability {capability})")


def quantize(weight: torch.Tensor, name: str = "weight", check: bool = True):
    """weight: [out, in], 16/32/64-bit float -> (packed: [ceil(numel / 2), 1] uint8, QuantState
    with shape [out, in], nested absmax). A float64 weight goes through float32, far finer than
    NF4's own error. With `check`, the round trip is compared with NF4's bound once
    (`check_round_trip`)."""
    source = weight.detach()
    if source.dtype == torch.float64:
        source = source.float()
    packed, state = _functional().quantize_4bit(source, blocksize=NF4_BLOCKSIZE,
                                                compress_statistics=True, quant_type="nf4")
    if check:
        check_round_trip(name, source, packed, state)
    return packed, state


def block_absmax(state) -> torch.Tensor:
    """The fp32 scale of every block of 64, as stored (nested: code2[absmax_8bit] * absmax2 +
    offset, the order bitsandbytes' `dequantize_blockwise` uses)."""
    if not state.nested:
        return state.absmax.float()
    nested = state.state2
    group = torch.arange(state.absmax.numel(), device=state.absmax.device) // nested.blocksize
    return nested.code[state.absmax.long()] * nested.absmax[group] + state.offset


def _dequantize_generic(packed: torch.Tensor, state) -> torch.Tensor:
    """Pure PyTorch: blocks of 64 over the flattened weight, high nibble first (bitsandbytes'
    generic kernel `_dequantize_4bit_compute`, same arithmetic in fp32)."""
    numel = state.shape.numel()
    codes = packed.reshape(-1).view(torch.uint8)
    nibbles = torch.stack((codes >> 4, codes & 0xF), dim=1).reshape(-1)[:numel]
    values = state.code.float()[nibbles.long()]
    scales = block_absmax(state).float()
    block = torch.arange(numel, device=values.device) // state.blocksize
    return (values * scales[block]).reshape(state.shape).to(state.dtype)


def dequantize(packed: torch.Tensor, state, path: str | None = None) -> torch.Tensor:
    """The weight [out, in] in `state.dtype`. path "auto" (default, or LONGSTRAW_NF4_DEQUANTIZE):
    bitsandbytes' kernel for the device, on CPU over the flattened layout (module docstring);
    "generic": pure PyTorch."""
    if _path(path) == "generic":
        return _dequantize_generic(packed, state)
    if packed.device.type != "cpu":
        return _native_dequantize(packed, state)
    flat = copy.copy(state)   # shallow: shares absmax, code and the nested state
    flat.shape = torch.Size([1, state.shape.numel()])
    return _native_dequantize(packed, flat).reshape(state.shape)


def check_round_trip(name: str, weight: torch.Tensor, packed: torch.Tensor, state,
                     path: str | None = None) -> None:
    """Raise NF4Error unless every block of 64 of `weight` (flattened) satisfies
    |w - dq| <= absmax * NF4_MAX_GAP / 2 + |absmax - stored absmax| (+ fp32 rounding), where absmax
    is the block's true max |w| and the stored absmax its double-quantised scale: nearest-code
    rounding of w / absmax, then the scale's own quantisation error times |code| <= 1. One
    dequantise per weight, compared in slices."""
    dq = dequantize(packed, state, path).reshape(-1)
    w = weight.detach().reshape(-1)
    stored = block_absmax(state).float()
    step = _CHECK_CHUNK - _CHECK_CHUNK % NF4_BLOCKSIZE
    for start in range(0, w.numel(), step):
        part = w[start:start + step].float()
        pad = -part.numel() % NF4_BLOCKSIZE
        blocks = F.pad(part, (0, pad)).view(-1, NF4_BLOCKSIZE)
        error = F.pad((dq[start:start + step].float() - part).abs(), (0, pad))
        error = error.view(-1, NF4_BLOCKSIZE).amax(1)
        absmax = blocks.abs().amax(1)
        scale = stored[start // NF4_BLOCKSIZE:start // NF4_BLOCKSIZE + len(absmax)]
        bound = (absmax * NF4_MAX_GAP / 2 + (absmax - scale).abs()) * (1 + 1e-5) + 1e-12
        bad = error > bound
        if bad.any():
            block = int(bad.nonzero()[0]) + start // NF4_BLOCKSIZE
            ratio = float((error / absmax.clamp_min(1e-30)).max())
            raise NF4Error(
                f"NF4 round trip of {name} (shape {list(weight.shape)}) is outside its bound: "
                f"block {block} comes back with max |w - dq| = {float(error[bad].max()):.4g}, "
                f"{ratio:.3f} x the block's absmax (nearest-code rounding allows "
                f"{NF4_MAX_GAP / 2:.3f}); bitsandbytes {bitsandbytes_version()}, path: "
                f"{describe_path(dq.device, path)}. Training on these base weights would be "
                f"silently wrong. Install the bitsandbytes version pinned in constraints.txt, or "
                f"set {ENV_PATH}=generic to dequantise in pure PyTorch.")


class _NF4Matmul(torch.autograd.Function):
    """x @ dequantize(W)^T with the backward dequantising again, so autograd keeps only the packed
    weight (a buffer the layer holds anyway, kept as a ctx attribute like `matmul_4bit` does,
    not as a saved tensor)."""

    @staticmethod
    def forward(ctx, x, packed, state):
        ctx.packed, ctx.state = packed, state
        return F.linear(x, dequantize(packed, state).to(x.dtype))

    @staticmethod
    def backward(ctx, grad_out):
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out.matmul(dequantize(ctx.packed, ctx.state).to(grad_out.dtype))
        return grad_x, None, None


def matmul(x: torch.Tensor, packed: torch.Tensor, state) -> torch.Tensor:
    """x: [..., in] -> [..., out] = x @ W^T, W the NF4 weight [out, in]. On a GPU with x in the
    weight's dtype: bitsandbytes' `matmul_4bit` (its kernels; unchanged). Elsewhere (CPU, or
    another dtype): the dequantise above."""
    if x.device.type != "cpu" and x.dtype == state.dtype and _path(None) == "auto":
        import bitsandbytes

        return bitsandbytes.matmul_4bit(x, packed.t(), quant_state=state)
    return _NF4Matmul.apply(x, packed, state)


def nf4_nbytes(numel: int) -> int:
    """NF4 bytes of one weight of `numel` values: 4 bits each, one 8-bit absmax per block of 64,
    one fp32 scale per 256 absmax values, one fp32 offset: 0.5 + 1/64 + 4/16384 bytes/value."""
    blocks = -(-numel // NF4_BLOCKSIZE)
    return -(-numel // 2) + blocks + 4 * -(-blocks // NF4_NESTED_BLOCKSIZE) + 4


def state_nbytes(packed: torch.Tensor, state) -> int:
    """Bytes held by one NF4 weight: packed codes, 8-bit absmax, fp32 second-level absmax and
    offset (the 16- and 256-entry code tables are constants, not counted)."""
    return (packed.numel() * packed.element_size()
            + state.absmax.numel() * state.absmax.element_size()
            + state.state2.absmax.numel() * state.state2.absmax.element_size()
            + state.offset.numel() * state.offset.element_size())
