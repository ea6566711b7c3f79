"""The frozen FP8 base of `--longstraw-fp8-base`: Megatron linears whose weight is held as FP8
blocks (megatron_longstraw/kernels/fp8.py: float8_e4m3fn values, one float32 scale per 128 x 128 block),
LoRA adapters on top (adapters.py wraps an `FP8Linear` as it wraps a Megatron linear).

`apply_fp8_base(model, patterns, sources)` swaps linears in place for `FP8Linear`s, before
`adapters.apply_lora` (which then wraps the targeted ones):

- from a checkpoint: `sources` (filled by `model_format.load_model(..., fp8_sources=...)`) names
  this rank's linears whose weight the model-format directory holds in FP8 (tools/convert_hf.py
  keeps them from a block-FP8 HF checkpoint); each keeps those bytes and scales unchanged (read
  from disk one weight at a time), the dequantised copy `load_model` wrote into the layer is
  dropped with it. Linears the checkpoint holds in bf16 stay as they are (as shipped);
- from a base without FP8 weights (bf16 / fp32 checkpoint, or the seeded initialisation): the
  family's FP8 linears (`Family.fp8_linears`, the set its FP8 checkpoints quantise) are quantised
  here (`fp8.quantize`, round trip checked once per weight against the e4m3 bound).

Every FP8 linear is frozen and stored in FP8 whether or not an adapter wraps it: excluding the
routed experts from the adapters (`--longstraw-lora-exclude '*.experts.*'`, the usual setup at
GLM-5.2's size) keeps them in FP8, where most of the bytes are.

`FP8Linear` keeps the Megatron call contract at TP = 1 (`[s, b, in]` in, `(output, bias)` out,
`skip_bias_add` and modelopt `Linear`'s return convention honoured); its `weight` reads the
dequantised weight in the model's dtype (GLM-5.2's absorbed MLA product reads
`linear_kv_up_proj.weight`). The FP8 buffers are not persistent: LoRA checkpoints hold the
adapters, and a resume rebuilds the base from where it came from (checkpoint.py). `.to(dtype)`
and `.half()` leave the FP8 bytes and scales alone (they move between devices only) and change
the dtype the layer computes in.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatron_longstraw.kernels import fp8, select


def megatron_linear_types() -> tuple[type, ...]:
    """The Megatron-Core linears an FP8 base (and a LoRA adapter) replaces."""
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    return ColumnParallelLinear, RowParallelLinear, Linear


class FP8Linear(nn.Module):
    """A frozen Megatron linear (TP = 1) whose weight is FP8 blocks: `weight_fp8` [out, in]
    float8_e4m3fn and `weight_scale_inv` (`fp8.scale_shape`) float32, both buffers."""

    def __init__(self, linear: nn.Module, name: str, weight: torch.Tensor,
                 scale_inv: torch.Tensor, row_parts: int = 1):
        super().__init__()
        from megatron.core.post_training.modelopt.layers import Linear

        tp_group = getattr(linear, "tp_group", None)
        if tp_group is not None and dist.is_initialized() and dist.get_world_size(tp_group) > 1:
            raise ValueError(f"{name}: an FP8 base layer has tensor-parallel size 1 only "
                             "(LongStraw runs TP = 1); set --tensor-model-parallel-size 1.")
        base = linear.weight
        fp8.check_pair(f"{name}.weight", weight, scale_inv, row_parts)
        if tuple(weight.shape) != tuple(base.shape):
            raise fp8.FP8Error(f"{name}.weight: FP8 weight of shape {list(weight.shape)}, the "
                               f"model's layer is {list(base.shape)}.")
        self.out_features, self.in_features = base.shape
        self.base_dtype = base.dtype
        self.row_parts = row_parts
        self.config = getattr(linear, "config", None)
        self.allreduce = getattr(base, "allreduce", True)
        """False for a routed expert under EP > 1 (as Megatron marks its weight)."""
        self.modelopt = isinstance(linear, Linear)
        self.return_bias = bool(getattr(linear, "_return_bias", False))
        self.skip_bias_add = bool(getattr(linear, "skip_bias_add", False))
        bias = getattr(linear, "bias", None)
        if bias is not None:
            bias.requires_grad_(False)
        self.register_parameter("bias", bias)
        self.register_buffer("weight_fp8", weight.to(base.device).contiguous(), persistent=False)
        self.register_buffer("weight_scale_inv",
                             scale_inv.to(base.device, torch.float32).contiguous(),
                             persistent=False)

    def _apply(self, fn, recurse=True):
        # The generic _apply would cast the float8 values and float32 scales with `.to(dtype)` /
        # `.half()`; move them between devices only, and take the new compute dtype from fn.
        held = {k: self._buffers.pop(k) for k in ("weight_fp8", "weight_scale_inv")}
        try:
            super()._apply(fn, recurse)
        finally:
            device = fn(torch.empty(0, device=held["weight_fp8"].device)).device
            self._buffers.update({k: v.to(device) for k, v in held.items()})
        self.base_dtype = fn(torch.empty(0, dtype=self.base_dtype)).dtype
        return self

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight [out, in] in the layer's dtype (a new tensor each time)."""
        return self.dequantized(self.base_dtype)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return fp8.dequantize(self.weight_fp8, self.weight_scale_inv, dtype, self.row_parts)

    def nbytes(self) -> int:
        """Bytes of the FP8 values and their scales."""
        return (self.weight_fp8.numel() * self.weight_fp8.element_size()
                + self.weight_scale_inv.numel() * self.weight_scale_inv.element_size())

    def forward(self, x: torch.Tensor, *args, **kwargs):
        """x: [s, b, in] -> (out [s, b, out], bias) as the replaced layer returns."""
        if args or kwargs:
            raise TypeError("an FP8 base layer takes only the input tensor")
        out = select.kernels().fp8_matmul(x, self.weight_fp8, self.weight_scale_inv,
                                          self.row_parts)
        if self.modelopt:   # modelopt Linear: bias always added (nn.Linear)
            out = out if self.bias is None else out + self.bias
            return out if self.return_bias else (out, None)
        if self.skip_bias_add:
            return out, self.bias
        return (out if self.bias is None else out + self.bias), None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"fp8 e4m3 128x128 blocks, row_parts={self.row_parts}, dtype={self.base_dtype}")


@dataclass
class FP8BaseSummary:
    """What `apply_fp8_base` did."""

    names: list[str]
    """The linears now held in FP8."""
    from_checkpoint: bool
    """True: the checkpoint's FP8 bytes kept; False: quantised here."""
    nbytes: int
    """Bytes of the FP8 values and scales."""

    def describe(self) -> str:
        how = "as the checkpoint ships them" if self.from_checkpoint else "quantised at load"
        return (f"FP8 base: {len(self.names)} linears in FP8 128x128 blocks ({how}), "
                f"{self.nbytes / 2 ** 20:.1f} MiB")


def matches(name: str, patterns: Iterable[str]) -> bool:
    last = name.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(last, p) or fnmatch.fnmatchcase(name, p) for p in patterns)


def fp8_modules(model: nn.Module) -> Iterator[tuple[str, FP8Linear]]:
    """(name, layer) of every FP8 base layer in `model` (inside LoRA wrappers: `<name>.base`)."""
    return ((n, m) for n, m in model.named_modules() if isinstance(m, FP8Linear))


def fp8_base_bytes(model: nn.Module) -> int:
    """Bytes of every FP8 base layer's values and scales."""
    return sum(m.nbytes() for _, m in fp8_modules(model))


def apply_fp8_base(model: nn.Module, patterns: tuple[str, ...],
                   sources: Mapping[str, fp8.CheckpointFP8] | None = None) -> FP8BaseSummary:
    """Swap linears of `model` in place for `FP8Linear`s (module docstring): those `sources` holds
    (local `<linear>.weight` -> the checkpoint's FP8 weight), or, when `sources` is empty, the
    linears matching `patterns` (the family's `fp8_linears`), quantised here. Call it before
    `adapters.apply_lora`; the model's other parameters are untouched."""
    # A linear already wrapped by adapters.apply_lora is a module with a `base` linear: lora.py
    # builds on this module, so it is recognised by that shape, not by its class.
    if any(isinstance(m, FP8Linear) or isinstance(getattr(m, "base", None), nn.Module)
           for m in model.modules()):
        raise ValueError("apply_fp8_base runs once, before adapters.apply_lora.")
    linear_types = megatron_linear_types()
    sources = dict(sources or {})
    if sources:
        chosen = [(n, m) for n, m in model.named_modules() if f"{n}.weight" in sources]
        stray = sorted(set(sources) - {f"{n}.weight" for n, _ in chosen})
        wrong = [n for n, m in chosen if not isinstance(m, linear_types)]
        if stray or wrong:
            raise fp8.FP8Error(f"FP8 weights that are not the weight of a Megatron linear layer: "
                               f"{(stray + wrong)[:5]}; only linear weights can stay in FP8 "
                               "(dequantise the others when converting).")
    else:
        if not patterns:
            raise ValueError("this model family declares no FP8 linears (Family.fp8_linears), and "
                             "the base has no FP8 weights: nothing to hold in FP8; drop "
                             "--longstraw-fp8-base.")
        chosen = [(n, m) for n, m in model.named_modules()
                  if n and isinstance(m, linear_types) and matches(n, patterns)]
        if not chosen:
            raise ValueError(f"no linear layer of this model matches the FP8 linears {patterns}.")
    total = 0
    for name, module in chosen:
        parts = fp8.row_parts(name)
        if sources:
            weight, scale_inv = sources[f"{name}.weight"].read()
        else:
            weight, scale_inv = fp8.quantize(module.weight, f"{name}.weight", parts)
        layer = FP8Linear(module, name, weight, scale_inv, parts)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer)
        module.weight = None   # the dequantised copy goes with the replaced layer
        total += layer.nbytes()
    return FP8BaseSummary([n for n, _ in chosen], bool(sources), total)


def expert_weight_names(model: nn.Module) -> set[str]:
    """`<linear>.weight` (the names of the model without adapters) of the FP8 base layers that
    are routed experts under EP > 1 (their weights live in buffers, not expert parameters)."""
    return {f"{n[:-len('.base')] if n.endswith('.base') else n}.weight"
            for n, m in fp8_modules(model) if not m.allreduce}
