"""LoRA / QLoRA adapters on Megatron-Core linear layers (docs/design.md section 5, `adapters.py`).

`apply_lora(model, cfg, quantize_base)` swaps every targeted `ColumnParallelLinear`,
`RowParallelLinear` or modelopt `Linear` in place for a `LoRALinear` that keeps Megatron's call
contract (`[s, b, h]` in, `(output, bias)` out, `skip_bias_add` honoured) and adds
`scaling * B(A(dropout(x)))`, `scaling = alpha / rank`, with `A: [r, in]` (uniform, +-1/sqrt(in),
as `nn.Linear` / peft) and `B: [out, r] = 0`, so the wrapped model starts identical. The base weight
is frozen and, with `quantize_base`, stored in NF4 (block size 64, double quantisation: the fp32
absmax of each block is itself quantised to 8 bits in blocks of 256, as QLoRA). A base already held
in FP8 blocks (`fp8_base.FP8Linear`, `--longstraw-fp8-base`, applied before this) is wrapped the
same way: the adapters add to its output, `base_weight()` is its dequantised weight. Every other
base
parameter is frozen too: only `lora_A` / `lora_B` train. `wrapper.weight` is the effective weight
`W + scaling * B A` (the GLM-5.2 attention reads `linear_kv_up_proj.weight` for the absorbed MLA
product instead of calling the layer).

Library choices (bitsandbytes 0.50.2, peft 0.21.2, Megatron-Core 0.19.2, checked on CPU):
- NF4 comes from bitsandbytes' functional API through `nf4.py`: `quantize_4bit(w, blocksize=64,
  compress_statistics=True, quant_type="nf4")`, a dequantise over the flattened layout (bitsandbytes'
  native AVX-512 CPU kernel blocks per row and gets weights whose last dimension is not a multiple
  of 64 wrong; `nf4.py` says why and how), `matmul_4bit` on a GPU, and on CPU a matmul whose
  backward keeps only the packed weight (dequantising again) instead of a full-precision copy.
  Each quantised weight's round trip is checked against NF4's bound once (`nf4.NF4Error`).
  `bnb.nn.Linear4bit` works on the CPU as well, but it is an `nn.Linear` that returns one
  tensor, so it cannot stand in for a Megatron linear (no `(output, bias)` tuple, no
  `skip_bias_add`).
- peft is not used. Its Megatron path (`LoraConfig(megatron_config=..., megatron_core=...)` ->
  `tp_layer.LoraParallelLinear`) fails in 0.21.2 before any forward runs: `dispatch_megatron` raises
  `KeyError: 'fan_in_fan_out'`, and with that key supplied `update_layer` raises
  `KeyError: 'default'` (`lora_bias` is never set). Past that, its forward computes
  `lora_B(lora_A(x))` where one of the two is a Megatron parallel linear that returns a tuple,
  and it sets `params_dtype = float32` on the config it is given. Its QLoRA path only wraps
  `bnb.nn.Linear4bit` targets. Using it would take patches in three places. The wrapper here is
  about a hundred lines.

Parallelism: LongStraw runs TP = 1 (docs/design.md section 3). A wrapper refuses a base layer whose tensor-
parallel group is larger. Each adapter parameter copies its base weight's `allreduce` attribute, so
adapters of dense layers are replicated parameters that finalize.py sums over DP x CP, and adapters
of experts (allreduce=False under EP > 1) stay with their expert. `A` is seeded from the layer's
single-process name (`expert_names.global_name`), so every CP rank, and any EP layout, starts from the
same adapters.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fnmatch
import math
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatron_longstraw.adapters.fp8_base import FP8Linear, fp8_modules, megatron_linear_types
from megatron_longstraw.kernels import nf4
from megatron_longstraw.kernels.nf4 import nf4_nbytes  # noqa: F401 (part of this module's API)

DEFAULT_TARGETS = ("linear_qkv", "linear_proj", "in_proj", "out_proj", "linear_fc1", "linear_fc2")
"""Megatron-Core's own names of the attention (linear_qkv, linear_proj), Gated DeltaNet / Mamba
(in_proj, out_proj) and MLP (linear_fc1, linear_fc2) linears. The launcher passes the family's
targets (`Family.lora_targets`, models/<family>/family.py)."""


@dataclass
class LoRAConfig:
    """Which Megatron linears get adapters, and their shape."""

    rank: int = 64
    """r: inner dimension of B A."""
    alpha: float = 16.0
    """The update is scaled by alpha / rank (QLoRA paper: r = 64, alpha = 16)."""
    dropout: float = 0.0
    """Dropout on the adapter's input, in training mode and only while autograd records (the
    replay pass): the no-grad passes (prompt capture, pre-step scoring of logp_old) see the
    deterministic adapters, so the captured prompt state is not one random dropout sample shared
    by every member. `.weight` readers (GLM-5.2's absorbed MLA product) see no dropout."""
    targets: tuple[str, ...] = DEFAULT_TARGETS
    """Patterns (fnmatch) matched against a module's last name component or its full name."""
    exclude: tuple[str, ...] = ()
    """Patterns of modules to leave alone, e.g. "*.experts.*" for no expert adapters."""
    adapter_dtype: torch.dtype | None = None
    """dtype of A and B; None = float32 for 16-bit bases, else the base dtype."""
    seed: int = 0
    """A is drawn from a generator seeded by (seed, layer name): identical on every rank."""

    def __post_init__(self):
        self.targets, self.exclude = tuple(self.targets), tuple(self.exclude)
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be a positive integer, got {self.rank!r}.")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha!r}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}.")
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise ValueError(f"LoRA targets must be non-empty name patterns, got {self.targets!r}.")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def _linear_types() -> tuple[type, ...]:
    return (*megatron_linear_types(), FP8Linear)


class LoRALinear(nn.Module):
    """A Megatron linear (`base`, frozen; NF4 when quantised, or an FP8 base layer) plus a
    trainable low-rank update."""

    def __init__(self, base: nn.Module, cfg: LoRAConfig, name: str, quantize_base: bool):
        super().__init__()
        if isinstance(base, FP8Linear):
            if quantize_base:
                raise ValueError(f"{name} is an FP8 base layer; QLoRA (NF4) and the FP8 base "
                                 "exclude each other.")
            # shape, dtype and expert flag without dequantising the weight
            weight = torch.empty(base.out_features, base.in_features, dtype=base.base_dtype,
                                 device="meta")
            weight.allreduce = base.allreduce
            device = base.weight_fp8.device
        else:
            weight = base.weight
            device = None if weight is None else weight.device
        if weight is None or weight.dim() != 2:
            raise ValueError(f"{name}: LoRA needs a layer that owns a 2-D weight.")
        tp_group = getattr(base, "tp_group", None)
        if tp_group is not None and dist.is_initialized() and dist.get_world_size(tp_group) > 1:
            raise ValueError(f"{name}: LoRA wraps layers of tensor-parallel size 1 only "
                             "(LongStraw runs TP = 1); set --tensor-model-parallel-size 1.")
        self.base = base
        self.out_features, self.in_features = weight.shape
        self.scaling = cfg.scaling
        self.base_dtype = weight.dtype
        dtype = cfg.adapter_dtype or (torch.float32 if weight.element_size() < 4 else weight.dtype)
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + zlib.crc32(name.encode()))
        bound = 1.0 / math.sqrt(self.in_features)
        lora_a = torch.empty(cfg.rank, self.in_features, dtype=dtype).uniform_(-bound, bound,
                                                                               generator=gen)
        self.lora_A = nn.Parameter(lora_a.to(device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, cfg.rank, dtype=dtype,
                                               device=device))
        for param in (self.lora_A, self.lora_B):
            param.allreduce = getattr(weight, "allreduce", True)  # experts' adapters stay experts
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        base.requires_grad_(False)
        self.enabled, self.merged, self.quant_state = True, False, None
        if quantize_base:
            packed, self.quant_state = nf4.quantize(weight, name)   # round trip checked once
            # Not persistent: a QLoRA base is rebuilt from its checkpoint; save adapters only.
            self.register_buffer("nf4_weight", packed, persistent=False)
            base.weight = None

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.quant_state is not None:   # QuantState is no tensor: move it with the packed bytes
            self.quant_state.to(self.nf4_weight.device)
            self.base_dtype = fn(torch.empty(0, dtype=self.base_dtype)).dtype   # .half() etc.
        elif hasattr(self.base, "weight_fp8"):   # an FP8 base layer follows .half() etc. itself
            self.base_dtype = self.base.base_dtype
        return self

    def base_weight(self) -> torch.Tensor:
        """The frozen base weight [out, in] (dequantised when stored in NF4)."""
        if self.quant_state is None:
            return self.base.weight
        return nf4.dequantize(self.nf4_weight, self.quant_state).to(self.base_dtype)

    def delta_weight(self) -> torch.Tensor:
        """scaling * B A: [out, in]."""
        return self.scaling * (self.lora_B @ self.lora_A)

    @property
    def weight(self) -> torch.Tensor:
        """Effective weight for code that reads `.weight` instead of calling the layer."""
        weight = self.base_weight()
        if self.enabled and not self.merged:
            weight = weight + self.delta_weight().to(weight.dtype)
        return weight

    def _nf4_forward(self, x: torch.Tensor):
        """The base layer's forward (TP = 1) on the NF4 weight, same return convention."""
        from megatron.core.post_training.modelopt.layers import Linear

        out = nf4.matmul(x, self.nf4_weight, self.quant_state)
        bias = self.base.bias
        if isinstance(self.base, Linear):   # modelopt Linear: bias always added (nn.Linear)
            out = out if bias is None else out + bias
            return out if self.base._return_bias else (out, None)
        if self.base.skip_bias_add:
            return out, bias
        return (out if bias is None else out + bias), None

    def forward(self, x: torch.Tensor, *args, **kwargs):
        """x: [s, b, in] -> (out [s, b, out], bias) as the base layer returns."""
        if self.quant_state is None:
            result = self.base(x, *args, **kwargs)
        elif args or kwargs:
            raise TypeError("an NF4-quantised LoRA layer takes only the input tensor")
        else:
            result = self._nf4_forward(x)
        if not self.enabled or self.merged:
            return result
        out = result[0] if isinstance(result, tuple) else result
        inputs = x.to(self.lora_A.dtype)
        if torch.is_grad_enabled():   # replay only (LoRAConfig.dropout)
            inputs = self.dropout(inputs)
        update = (inputs @ self.lora_A.t()) @ self.lora_B.t()
        out = out + (self.scaling * update).to(out.dtype)
        return (out, *result[1:]) if isinstance(result, tuple) else out


@dataclass
class LoRASummary:
    """What `apply_lora` did."""

    wrapped: list[str]
    """Names of the wrapped linears."""
    num_trainable: int
    num_frozen: int
    quantized_bytes: int
    """Bytes of NF4 base weights and their statistics (0 without quantisation)."""


def _matches(name: str, patterns: Iterable[str]) -> bool:
    last = name.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(last, p) or fnmatch.fnmatchcase(name, p) for p in patterns)


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """(name, wrapper) for every adapter in `model`."""
    return ((n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear))


def linear_layer_names(model: nn.Module) -> list[str]:
    """The distinct last name components of `model`'s wrappable linears (for error messages)."""
    linear_types = _linear_types()
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                   if isinstance(m, linear_types + (LoRALinear,))})


def resolve_targets(model: nn.Module, cfg: LoRAConfig, strict: bool) -> LoRAConfig:
    """`cfg` with its targets checked against `model` (before `apply_lora`). `strict` (targets a
    user named): every pattern must select a linear layer outside `cfg.exclude`, else ValueError
    naming the patterns that select nothing and the model's linear layers. Not strict (a family's
    defaults): patterns that select nothing are dropped, e.g. GLM-5.2's q projections when
    q_lora_rank is None; ValueError when none is left."""
    linear_types = _linear_types()
    selected = {pattern: [n for n, m in model.named_modules()
                          if n and isinstance(m, linear_types) and _matches(n, (pattern,))
                          and not _matches(n, cfg.exclude)]
                for pattern in cfg.targets}
    empty = [pattern for pattern, names in selected.items() if not names]
    if empty and (strict or len(empty) == len(selected)):
        raise ValueError(f"LoRA targets {empty} match no linear layer of this model"
                         + (f" outside the excluded {list(cfg.exclude)}" if cfg.exclude else "")
                         + f"; its linear layers are named {linear_layer_names(model)} (patterns "
                         "match a module's last name component or its full name, fnmatch-style).")
    return dataclasses.replace(cfg, targets=tuple(p for p in cfg.targets if selected[p]))


def apply_lora(model: nn.Module, cfg: LoRAConfig, quantize_base: bool = False) -> LoRASummary:
    """Wrap every targeted Megatron linear of `model` in place; freeze every other parameter."""
    from megatron_longstraw.distributed.expert_names import global_name

    if any(True for _ in lora_modules(model)):
        raise ValueError("apply_lora was already applied to this model.")
    linear_types = _linear_types()
    chosen = [(n, m) for n, m in model.named_modules()
              if n and _matches(n, cfg.targets) and not _matches(n, cfg.exclude)]
    for name, module in chosen:
        if not isinstance(module, linear_types):
            raise TypeError(f"{name} matches the LoRA targets but is a {type(module).__name__}; "
                            "supported: ColumnParallelLinear, RowParallelLinear, modelopt Linear "
                            "(build the model with the local spec, or narrow the targets).")
    if not chosen:
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                          if isinstance(m, linear_types)})
        raise ValueError(f"No module matches the LoRA targets {cfg.targets}; this model's linear "
                         f"layers are named {linears}.")
    model.requires_grad_(False)
    for name, module in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        num_experts = getattr(module.config, "num_moe_experts", None) or 1
        wrapper = LoRALinear(module, cfg, global_name(name, num_experts), quantize_base)
        setattr(parent, child, wrapper)
    params = list(model.parameters())
    return LoRASummary(wrapped=[n for n, _ in chosen], num_trainable=trainable_parameters(model),
                       num_frozen=sum(p.numel() for p in params if not p.requires_grad),
                       quantized_bytes=quantized_base_bytes(model))


def _merged_check(model: nn.Module, what: str) -> None:
    if any(m.merged for _, m in lora_modules(model)):
        raise ValueError(f"{what} needs unmerged adapters: call unmerge_adapters(model) first.")


def merge_adapters(model: nn.Module) -> None:
    """Fold scaling * B A into each (unquantised) base weight; forward then skips the adapters."""
    for name, module in lora_modules(model):
        if module.quant_state is not None or isinstance(module.base, FP8Linear):
            kind = "an NF4" if module.quant_state is not None else "an FP8"
            raise ValueError(f"{name}: merging into {kind} base would requantise it (lossy); "
                             "export base_weight() + delta_weight() instead.")
        if not module.merged:
            with torch.no_grad():
                module.base.weight.add_(module.delta_weight().to(module.base.weight.dtype))
            module.merged = True


def unmerge_adapters(model: nn.Module) -> None:
    """Subtract the merged updates again (exact up to floating-point rounding)."""
    for _, module in lora_modules(model):
        if module.merged:
            with torch.no_grad():
                module.base.weight.sub_(module.delta_weight().to(module.base.weight.dtype))
            module.merged = False


@contextlib.contextmanager
def disable_adapters(model: nn.Module):
    """Run `model` as its frozen base: GRPO's reference policy ("logp_ref, adapters disabled")."""
    _merged_check(model, "disable_adapters")
    modules = [m for _, m in lora_modules(model)]
    previous = [m.enabled for m in modules]
    for module in modules:
        module.enabled = False
    try:
        yield model
    finally:
        for module, enabled in zip(modules, previous):
            module.enabled = enabled


def reference_view(model: nn.Module) -> nn.Module:
    """A module tree that shares every tensor with `model` (no copy) with all adapters off: the
    `ref_model` that schedule.forward_backward_longstraw captures and scores separately when
    kl_coef > 0, so the reference gets its own prompt state, as docs/design.md section 2 asks."""
    _merged_check(model, "reference_view")

    def twin(module: nn.Module) -> nn.Module:
        clone = copy.copy(module)
        clone._parameters, clone._buffers = dict(module._parameters), dict(module._buffers)
        clone._modules = {n: None if c is None else twin(c) for n, c in module._modules.items()}
        if isinstance(clone, LoRALinear):
            clone.enabled = False
        return clone

    return twin(model)


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters only: `<layer>.lora_A` / `<layer>.lora_B` -> detached copies (names as in
    `model.named_parameters()`; under EP > 1, expert adapters are this rank's local experts)."""
    return {f"{n}.{k}": getattr(m, k).detach().clone()
            for n, m in lora_modules(model) for k in ("lora_A", "lora_B")}


def load_adapter_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy saved adapters into `model` (same targets and rank); every key must match."""
    own = {f"{n}.{k}": getattr(m, k) for n, m in lora_modules(model) for k in ("lora_A", "lora_B")}
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise KeyError(f"adapter state does not fit the model: missing {missing[:3]} "
                       f"({len(missing)}), unexpected {unexpected[:3]} ({len(unexpected)})")
    for key, param in own.items():
        if state[key].shape != param.shape:
            raise ValueError(f"{key}: saved shape {tuple(state[key].shape)}, model "
                             f"{tuple(param.shape)} (different rank?)")
    with torch.no_grad():
        for key, param in own.items():
            param.copy_(state[key])


def merged_state_dict(model: nn.Module, device: torch.device | str | None = "cpu"
                      ) -> dict[str, torch.Tensor]:
    """`model`'s state dict as the model without adapters would have it (the names of the built
    model, every `<layer>.base.` folded away, no `lora_A` / `lora_B`), each wrapped layer's weight
    replaced by base + scaling * B A: the weights of the policy the adapters define, for export
    (model_format.save_model(..., merge_adapters=True)). The sum is computed in float32 (float64 for
    a float64 base) and cast once to the base dtype; with an NF4 base the base is its dequantised
    weight, the one the adapters were trained against. Merged tensors are moved to `device` one
    at a time (None: stay where they are); other entries are the model's own tensors. FP8 base
    layers (fp8_base.FP8Linear) give their dequantised weight (plus the adapters', when wrapped).
    The model is not modified."""
    wrappers = dict(lora_modules(model))
    _merged_check(model, "merged_state_dict")

    def owner(key: str) -> str | None:
        parts = key.split(".")
        for i in range(len(parts) - 1, 0, -1):
            if ".".join(parts[:i]) in wrappers:
                return ".".join(parts[:i])
        return None

    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        value = value.detach() if isinstance(value, torch.Tensor) else value   # _extra_state
        name = owner(key)
        if name is None:
            out[key] = value
            continue
        rest = key[len(name) + 1:]
        if rest in ("lora_A", "lora_B"):
            continue
        if not rest.startswith("base."):
            raise ValueError(f"{key}: unexpected state of a LoRA layer.")
        out[f"{name}.{rest[len('base.'):]}"] = value
    for name, module in fp8_modules(model):
        if not name.endswith(".base") or name[:-len(".base")] not in wrappers:
            with torch.no_grad():
                weight = module.weight
            out[f"{name}.weight"] = weight if device is None else weight.to(device)
    for name, module in wrappers.items():
        with torch.no_grad():
            wide = torch.float64 if module.base_dtype == torch.float64 else torch.float32
            base = (module.base.dequantized(wide) if isinstance(module.base, FP8Linear)
                    else module.base_weight())
            merged = (base.to(wide) + module.delta_weight().to(wide)).to(module.base_dtype)
        out[f"{name}.weight"] = merged if device is None else merged.to(device)
    return out


def trainable_parameters(model: nn.Module) -> int:
    """Number of parameters with requires_grad (after apply_lora: the adapters)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def quantized_base_bytes(model: nn.Module) -> int:
    """Bytes held by the NF4 base weights: packed codes, 8-bit absmax, fp32 second-level absmax and
    offset (the 16- and 256-entry code tables are constants, not counted)."""
    return sum(nf4_module_bytes(module) for _, module in lora_modules(model))


def nf4_module_bytes(module: LoRALinear) -> int:
    """`quantized_base_bytes` of one wrapper (0 when its base is not quantised)."""
    if module.quant_state is None:
        return 0
    return nf4.state_nbytes(module.nf4_weight, module.quant_state)


def lora_parameter_count(shapes: Iterable[tuple[int, int]], rank: int) -> int:
    """Trainable LoRA parameters for linears of (in_features, out_features): sum r * (in + out)
    (A: [r, in], B: [out, r])."""
    return sum(rank * (fan_in + fan_out) for fan_in, fan_out in shapes)
