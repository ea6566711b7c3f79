"""FP8 block-quantised weights (DeepSeek-V3 / GLM-5.2 FP8 checkpoints): the format, the pure-PyTorch
reference GEMM, and the round-trip check of a weight quantised here.

The format, as those checkpoints ship it: a linear's `weight` [out, in] in float8 e4m3
(`torch.float8_e4m3fn`, finite range +-448) and `weight_scale_inv` [ceil(out / 128),
ceil(in / 128)] float32, one scale per 128 x 128 block; the real value of element (r, c) is

    weight[r, c] * weight_scale_inv[r // 128, c // 128]

(the last row and column blocks are partial when out or in is not a multiple of 128). Megatron's
gated `linear_fc1` holds HF's `gate_proj` and `up_proj` stacked along rows; a checkpoint quantises
each on its own, so its scale is the two grids stacked ([2 ceil(out / 256), ceil(in / 128)] rather
than one grid over the stacked rows; the same whenever out / 2 is a multiple of 128, as at every
GLM-5.2 width). `row_parts(name)` says how many such parts a linear holds (`FUSED_ROW_PARTS`);
`scale_rows` maps each weight row to its scale row.

Quantising here (`quantize`, a bf16 / fp32 base for `--longstraw-fp8-base`, and tests) uses the
checkpoints' recipe: per block, scale = amax / 448, weight = round-to-nearest-even(w / scale) in
e4m3 (an all-zero block gets scale 1). e4m3 has 3 mantissa bits, so the rounding errs by at most
2^-4 |w| where w / scale is a normal e4m3 value (>= 2^-6) and by half the subnormal spacing, 2^-10
x scale, below: |w - dequantised w| <= max(2^-4 |w|, 2^-10 scale), plus float32 rounding.
`check_round_trip` (run once per weight by `quantize`) compares every element with that bound and
raises `FP8Error` naming the weight: a base weight is never used wrong silently.

The reference GEMM `linear(x, weight, scale_inv)` is `x @ W^T` with W dequantised in x's precision
(float32 arithmetic for 16- and 32-bit x, float64 for float64 x: e4m3 x float32 is exact in
float64) a slice of output rows at a time (at most `SLICE_VALUES` dequantised values alive), with
Megatron's own product (`torch.matmul(x, W.t())`, `LinearWithFrozenWeight`): a layer whose weight
fits one slice gives exactly the numbers of the same layer holding the dequantised weight. It does
not quantise the activations. `matmul` is the autograd op the FP8 base layers call: the forward
runs the selected `fp8_gemm` kernel (kernels/select.py: this reference, or DeepGEMM's
`fp8_gemm_nt` on SM90, which quantises the activations per 1 x 128 group), the backward computes
dL/dx with the same sliced dequantise; the weight is frozen (no weight gradient) and is kept as a
ctx attribute, not a saved tensor (it is a buffer the layer holds anyway).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from megatron_longstraw.runtime.errors import CheckpointError

FP8_DTYPE = torch.float8_e4m3fn
SAFETENSORS_DTYPE = "F8_E4M3"
BLOCK = 128
"""Rows and columns of one scale block."""
E4M3_MAX = 448.0
E4M3_REL = 2.0 ** -4
"""Half a unit in the last place of a 3-mantissa-bit value, relative to it."""
E4M3_SUBNORMAL_HALF = 2.0 ** -10
"""Half the e4m3 subnormal spacing (2^-9), absolute, below the smallest normal 2^-6."""
SCALE_SUFFIX = "_scale_inv"
"""`<linear>.weight` -> `<linear>.weight_scale_inv`, in HF checkpoints and in the model format."""
FUSED_ROW_PARTS = {"linear_fc1": 2}
"""Megatron linears that hold several HF weights stacked along rows, each quantised in its own
128-row blocks by an FP8 checkpoint: a gated MLP's `linear_fc1` = [gate_proj; up_proj] (equal
halves; every family here uses gated MLPs)."""
SLICE_VALUES = 1 << 22
"""Dequantised values alive at a time in `linear`, its backward and `check_round_trip` (16 MiB in
float32): a slice of output rows (a multiple of 128 rows), the whole weight when it is smaller."""
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK]}
"""The `quantization_config` of a block-FP8 HF checkpoint (transformers' fine-grained FP8)."""


class FP8Error(CheckpointError):
    """An FP8 weight that does not fit the format (dtype, missing or misshapen scale), or a round
    trip outside the e4m3 bound; the message names the tensor and what to do."""


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def row_parts(name: str) -> int:
    """Row parts of the linear `name` (module name or `<module>.weight`): 2 for a gated
    `linear_fc1`, else 1 (`FUSED_ROW_PARTS`)."""
    module = name[:-len(".weight")] if name.endswith(".weight") else name
    return FUSED_ROW_PARTS.get(module.rsplit(".", 1)[-1], 1)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def scale_shape(out_features: int, in_features: int, parts: int = 1) -> tuple[int, int]:
    """Shape of the scales of an [out, in] weight stacked from `parts` equal row parts."""
    return parts * _ceil(out_features // parts, BLOCK), _ceil(in_features, BLOCK)


def scale_rows(out_features: int, parts: int = 1, device=None) -> torch.Tensor:
    """[out] int64: the scale row of each weight row (part p's rows use its own grid)."""
    rows = torch.arange(out_features, device=device)
    part_rows = out_features // parts
    part, within = rows // part_rows, rows % part_rows
    return part * _ceil(part_rows, BLOCK) + within // BLOCK


def check_pair(name: str, weight: torch.Tensor, scale_inv: torch.Tensor | None,
               parts: int = 1) -> None:
    """Raise FP8Error unless `weight` is a 2-D float8_e4m3fn tensor and `scale_inv` its float32
    scales of shape `scale_shape` (`name`: the weight's name)."""
    if weight.dtype != FP8_DTYPE or weight.dim() != 2:
        raise FP8Error(f"{name}: an FP8 base weight must be 2-D float8_e4m3fn, got "
                       f"{weight.dtype} of shape {list(weight.shape)}.")
    out_features, in_features = weight.shape
    expected = scale_shape(out_features, in_features, parts)
    if scale_inv is None:
        raise FP8Error(f"{name} is float8_e4m3fn but {scale_name(name)} is missing: an FP8 weight "
                       f"needs its per-block scales (float32 {list(expected)}, one per 128 x 128 "
                       "block); the checkpoint is incomplete: copy or convert it again.")
    if scale_inv.dtype != torch.float32 or tuple(scale_inv.shape) != expected:
        layout = (f"{parts} row parts of {out_features // parts} rows, each in 128 x 128 blocks"
                  if parts > 1 else "128 x 128 blocks")
        raise FP8Error(f"{scale_name(name)} is {scale_inv.dtype} of shape {list(scale_inv.shape)}, "
                       f"but {name} [{out_features}, {in_features}] in {layout} needs float32 "
                       f"{list(expected)}; the checkpoint uses another block size or is damaged "
                       "(only 128 x 128 blocks are read).")


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
               parts: int = 1, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """weight: [out, in] float8_e4m3fn, scale_inv: `scale_shape` float32 -> the real values of
    rows [start, stop) (all rows without `rows`) in `dtype`: weight * scale computed in float32
    (float64 for a float64 `dtype`), then cast once."""
    out_features, in_features = weight.shape
    start, stop = rows if rows is not None else (0, out_features)
    wide = _wide(dtype)
    scale = scale_inv[scale_rows(out_features, parts, scale_inv.device)[start:stop]].to(wide)
    scale = scale.repeat_interleave(BLOCK, dim=1)[:, :in_features]
    return (weight[start:stop].to(wide) * scale).to(dtype)


def _row_slices(out_features: int, in_features: int):
    """[start, stop) of the output-row slices `linear` works on (multiples of 128 rows)."""
    step = max(BLOCK, SLICE_VALUES // max(in_features, 1) // BLOCK * BLOCK)
    return [(start, min(start + step, out_features)) for start in range(0, out_features, step)]


def quantize(weight: torch.Tensor, name: str = "weight", parts: int = 1,
             check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """weight: [out, in], 16/32/64-bit float -> (weight [out, in] float8_e4m3fn, scale_inv
    `scale_shape` float32), the checkpoints' recipe (module docstring), each of `parts` equal row
    parts in its own blocks. With `check`, the round trip is compared with the e4m3 bound once."""
    if weight.dim() != 2 or weight.shape[0] % parts:
        raise ValueError(f"{name}: expected a 2-D weight whose rows split into {parts} parts, got "
                         f"{list(weight.shape)}.")
    source = weight.detach()
    if not torch.isfinite(source).all():
        raise FP8Error(f"{name} has non-finite values; it cannot be quantised to FP8.")
    out_features, in_features = source.shape
    part_rows = out_features // parts
    values, scales = [], []
    for part in source.split(part_rows, dim=0):
        padded = torch.zeros(_ceil(part_rows, BLOCK) * BLOCK, _ceil(in_features, BLOCK) * BLOCK,
                             dtype=torch.float32, device=source.device)
        padded[:part_rows, :in_features] = part.float()
        blocks = padded.view(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // BLOCK, BLOCK)
        amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        coded = (blocks / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
        values.append(coded.view_as(padded)[:part_rows, :in_features])
        scales.append(scale.view(blocks.shape[0], blocks.shape[2]))
    quantised, scale_inv = torch.cat(values).contiguous(), torch.cat(scales).contiguous()
    if check:
        check_round_trip(name, source, quantised, scale_inv, parts)
    return quantised, scale_inv


def round_trip_bound(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |w - dequantised w| (`scale`: each element's block scale, expanded):
    e4m3 rounding max(2^-4 |w|, 2^-10 scale), widened for the float32 division and product."""
    w = weight.abs().float()
    return torch.maximum(E4M3_REL * w, E4M3_SUBNORMAL_HALF * scale) * (1 + 2 ** -8) \
        + 2 ** -20 * (w + scale)


def check_round_trip(name: str, weight: torch.Tensor, quantised: torch.Tensor,
                     scale_inv: torch.Tensor, parts: int = 1) -> None:
    """Raise FP8Error unless every element of `weight` is within `round_trip_bound` of its
    dequantised value. One dequantise per weight, a slice of rows at a time."""
    out_features, in_features = weight.shape
    rows = scale_rows(out_features, parts, scale_inv.device)
    for start, stop in _row_slices(out_features, in_features):
        part = weight[start:stop].float()
        dq = dequantize(quantised, scale_inv, torch.float32, parts, (start, stop))
        scale = scale_inv[rows[start:stop]].repeat_interleave(BLOCK, dim=1)[:, :in_features]
        error = (dq - part).abs()
        bad = error > round_trip_bound(part, scale)
        if bad.any():
            r, c = (int(i) for i in bad.nonzero()[0])
            raise FP8Error(
                f"FP8 round trip of {name} (shape {list(weight.shape)}) is outside the e4m3 bound: "
                f"element [{start + r}, {c}] = {float(part[r, c]):.6g} comes back as "
                f"{float(dq[r, c]):.6g} (block scale {float(scale[r, c]):.4g}; allowed "
                f"max(2^-4 |w|, 2^-10 scale)). Training on this base would be silently wrong; "
                "check the weight's values (and torch's float8_e4m3fn conversion).")


def linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
           row_parts: int = 1) -> torch.Tensor:
    """Reference FP8 GEMM. x: [..., in] -> [..., out] = x @ W^T in x's dtype, W = the dequantised
    weight ([out, in] float8_e4m3fn with `scale_shape` float32 scales), one slice of output rows
    at a time (module docstring: exact against the dequantised layer)."""
    out_features, in_features = weight.shape
    slices = _row_slices(out_features, in_features)
    if len(slices) == 1:
        return torch.matmul(x, dequantize(weight, scale_inv, x.dtype, row_parts).t())
    out = x.new_empty(*x.shape[:-1], out_features)
    for start, stop in slices:
        out[..., start:stop] = torch.matmul(
            x, dequantize(weight, scale_inv, x.dtype, row_parts, (start, stop)).t())
    return out


def grad_input(grad_out: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
               row_parts: int = 1) -> torch.Tensor:
    """dL/dx of `linear`: grad_out [..., out] @ W -> [..., in], summed over the row slices (as
    Megatron's LinearWithFrozenWeight: flattened to 2-D first)."""
    out_features, in_features = weight.shape
    flat = grad_out.reshape(-1, out_features)
    total = None
    for start, stop in _row_slices(out_features, in_features):
        w = dequantize(weight, scale_inv, grad_out.dtype, row_parts, (start, stop))
        part = flat[:, start:stop].matmul(w)
        total = part if total is None else total.add_(part)
    return total.reshape(*grad_out.shape[:-1], in_features)


class FP8Matmul(torch.autograd.Function):
    """x @ W^T by the given kernel (`apply(x, weight, scale_inv, row_parts, kernel)`; the selected
    one: `select.kernels().fp8_matmul`); dL/dx by `grad_input` (W frozen: no weight gradient)."""

    @staticmethod
    def forward(ctx, x, weight, scale_inv, row_parts, kernel):
        ctx.weight, ctx.scale_inv, ctx.row_parts = weight, scale_inv, row_parts
        return kernel(x, weight, scale_inv, row_parts)

    @staticmethod
    def backward(ctx, grad_out):
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_input(grad_out, ctx.weight, ctx.scale_inv, ctx.row_parts)
        return grad_x, None, None, None, None


def nbytes(out_features: int, in_features: int, parts: int = 1) -> int:
    """Bytes of one FP8 weight: one byte per value plus a float32 scale per 128 x 128 block (per
    row part)."""
    rows, cols = scale_shape(out_features, in_features, parts)
    return out_features * in_features + 4 * rows * cols


# ---- per-token rows (DeepGEMM's indexer keys; FP8 index-key pages) -----------------------------

ROW_AMAX_MIN = 1e-4
"""Smallest amax a per-token row is scaled by (DeepGEMM's `per_token_cast_to_fp8` clamp): an
all-zero row gets the scale 1e-4 / 448 and zero values."""


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., d] float -> (values [..., d] float8_e4m3fn, scales [...] float32) with x ~ values *
    scales[..., None]: one scale per row of the last dim, amax / 448 (amax >= 1e-4), x / scale
    rounded to the nearest e4m3 in float32. DeepGEMM's per-token cast, the layout `fp8_mqa_logits`
    reads for the indexer keys (kernels/deepgemm.py) and FP8 index-key pages store (pages.py). The
    rounding errs by at most max(2^-4 |x|, 2^-10 scale) per value, as `quantize`'s."""
    scale = x.abs().float().amax(dim=-1).clamp(min=ROW_AMAX_MIN) / E4M3_MAX
    return (x.float() / scale[..., None]).to(FP8_DTYPE), scale


def dequantize_rows(values: torch.Tensor, scales: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`quantize_rows`' inverse: values [..., d] float8_e4m3fn, scales [...] float32 -> [..., d] in
    `dtype`, the product computed in float32 (float64 for a float64 `dtype`: exact), cast once."""
    wide = _wide(dtype)
    return (values.to(wide) * scales.to(wide)[..., None]).to(dtype)


# ---- checkpoints: which tensors are FP8 ----------------------------------------------------------


def find_pairs(names, dtype_name, shape, where: str,
               parts: Callable[[str], int] = lambda name: 1) -> dict[str, str]:
    """{FP8 weight name: its scale name} of a checkpoint's tensors, checked: every float8 e4m3
    tensor has a float32 `<name>_scale_inv` of shape `scale_shape(*its shape, parts(name))` (an HF
    checkpoint: one part each; the model format: `row_parts`), every scale belongs to an FP8
    tensor, no other 8-bit float. `dtype_name(n)` is the safetensors dtype code, `shape(n)` the
    shape; `where` names the checkpoint in errors."""
    names = list(names)
    present = set(names)
    pairs = {}
    for name in names:
        code = dtype_name(name)
        if name.endswith(SCALE_SUFFIX):
            weight = name[:-len(SCALE_SUFFIX)]
            if weight not in present or dtype_name(weight) != SAFETENSORS_DTYPE:
                raise FP8Error(f"{where}: {name} has no float8_e4m3fn weight {weight} beside it; "
                               "the checkpoint is incomplete or not block-FP8.")
            continue
        if code.startswith("F8") and code != SAFETENSORS_DTYPE:
            raise FP8Error(f"{where}: {name} is {code}; only e4m3 (F8_E4M3) weights with 128 x 128 "
                           "block scales are read: dequantise this checkpoint to bf16 first.")
        if code == SAFETENSORS_DTYPE:
            scale = scale_name(name)
            out_shape = tuple(shape(name))
            expected = scale_shape(*out_shape, parts(name)) if len(out_shape) == 2 else None
            if scale not in present:
                raise FP8Error(f"{where}: {name} is float8_e4m3fn but {scale} is missing: an FP8 "
                               "weight needs its per-block scales (float32 [ceil(out / 128), "
                               "ceil(in / 128)]); the checkpoint is incomplete: download or copy "
                               "it again.")
            if expected is None or dtype_name(scale) != "F32" or tuple(shape(scale)) != expected:
                layout = (f"{parts(name)} row parts, each in 128 x 128 blocks," if parts(name) > 1
                          else "128 x 128 blocks")
                raise FP8Error(f"{where}: {scale} is {dtype_name(scale)} of shape "
                               f"{list(shape(scale))}, but {name} {list(out_shape)} in {layout} "
                               f"needs F32 {list(expected) if expected else '(a 2-D weight)'}; "
                               "the checkpoint uses another block size or is damaged.")
            pairs[name] = scale
    return pairs


@dataclass(frozen=True)
class CheckpointFP8:
    """One FP8 weight of a checkpoint, read when needed (`tensors`: a lazy name -> tensor view)."""

    tensors: Mapping
    weight_name: str
    scale_name: str

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight [out, in] float8_e4m3fn, scale_inv float32), as stored."""
        return self.tensors[self.weight_name], self.tensors[self.scale_name]


class Dequantized(Mapping):
    """A read-only view of `tensors` (name -> tensor, lazy) in which each FP8 weight of `pairs`
    reads as its dequantised value in `dtypes[name]` (its row parts by `row_parts(name)`) and the
    scales are hidden: what a model holding plain weights loads."""

    def __init__(self, tensors: Mapping, pairs: Mapping[str, str],
                 dtypes: Mapping[str, torch.dtype]):
        self._tensors, self._pairs, self._dtypes = tensors, dict(pairs), dict(dtypes)
        self._scales = set(self._pairs.values())

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._scales:
            raise KeyError(name)
        value = self._tensors[name]
        if name not in self._pairs:
            return value
        return dequantize(value, self._tensors[self._pairs[name]],
                          self._dtypes.get(name, torch.float32), row_parts(name))

    def __contains__(self, name) -> bool:
        return name in self._tensors and name not in self._scales

    def __iter__(self):
        return (n for n in self._tensors if n not in self._scales)

    def __len__(self) -> int:
        return len(self._tensors) - len(self._scales)
