"""Which kernel backend runs each part of the model (`--longstraw-kernels`, `RunSettings.kernels`).

`ref` (pure PyTorch, `kernels/refs.py`) is complete and the only path on CPU. GPU backends, one
module each, take over the parts they implement:

    part             called as                                     backends (auto tries in order)
    sparse_mla       sparse_mla_attention without autograd          flashmla, triton, ref
                     (capture, scoring)
    sparse_mla_grad  sparse_mla_attention under autograd (replay)   triton, ref
    indexer          indexer_topk                                   deepgemm, ref
    attention        blockwise_attention (dense causal GQA/MQA,     ref
                     log-sum-exp out, differentiable)
    moe              MoE dispatch: moe_config_overrides()           deepep, ref
    dense            layer specs: dense_spec_provider()             te, ref
    optimizer        optimizer_class()                              apex, ref
    fp8_gemm         fp8_linear: the FP8 base's GEMM (fp8_matmul)   ref (deepgemm: explicit only)

A spec is comma-separated items: one default (`auto`, `ref`, or a backend name, which takes the parts
it implements and leaves the rest on ref) and `part=name` overrides, e.g. `auto`, `triton`,
`auto,indexer=ref`, `sparse_mla=triton,indexer=ref` (unnamed parts: ref). `auto` takes, per part,
the first backend that is importable and usable here (CUDA present, supported GPU) and logs its
choice; an explicit backend that cannot run fails at once with the package name and how to install
it. `apply_rope` and `merge_partial_attention` always run the reference. `attention` has only the
reference today (blockwise over keys, recomputing backward); a fused GPU backend that returns the
log-sum-exp and takes its gradient (FlashAttention-style) plugs in as one more row here.

The selection is process-wide and made once at set-up (`use`: the launcher, before building the
model); the step and the scoring loop `adopt` their config's spec, which selects only when it is
not the active one (a library caller who never called `use`).

`fp8_gemm` (the frozen FP8 base of `--longstraw-fp8-base`, megatron_longstraw/kernels/fp8.py): its
reference is `fp8.linear` (beside the format it computes; kernels/refs.py holds the others).
`deepgemm` (DeepGEMM's `fp8_gemm_nt`, kernels/deepgemm.py) quantises the activations to FP8 per
1 x 128 group, which changes the numbers, so `auto` never picks it: name it (`fp8_gemm=deepgemm`,
or the `deepgemm` default, which also takes the indexer).
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from megatron_longstraw.kernels import fp8
from megatron_longstraw.kernels import packages, refs
from megatron_longstraw.kernels.packages import MissingKernelPackage

logger = logging.getLogger(__name__)

PARTS = ("sparse_mla", "sparse_mla_grad", "indexer", "attention", "moe", "dense", "optimizer",
         "fp8_gemm")


@dataclass(frozen=True)
class Backend:
    name: str
    parts: tuple[str, ...]
    """Parts this backend implements."""
    package: str | None = None
    """Key in `packages.PACKAGES` (None: nothing to import)."""
    needs_cuda: bool = True
    sm_majors: tuple[int, ...] = ()
    """GPU architectures (compute capability majors) it runs on; () = any."""
    module: str | None = None
    """Wrapper module under megatron_longstraw.kernels."""
    check: str | None = None
    """Function of that module returning None or why the installed package cannot run (beyond
    importing it)."""


BACKENDS: dict[str, Backend] = {
    "ref": Backend("ref", PARTS, needs_cuda=False),
    "flashmla": Backend("flashmla", ("sparse_mla",), "flash_mla", sm_majors=(9, 10),
                        module="flashmla"),
    "triton": Backend("triton", ("sparse_mla", "sparse_mla_grad"), "triton",
                      module="triton_sparse_mla"),
    "deepgemm": Backend("deepgemm", ("indexer", "fp8_gemm"), "deep_gemm", sm_majors=(9, 10),
                        module="deepgemm"),
    "deepep": Backend("deepep", ("moe",), "deep_ep", module="deepep"),
    "te": Backend("te", ("dense",), "transformer_engine", module="te"),
    "apex": Backend("apex", ("optimizer",), "apex", module="nvidia_apex",
                    check="cuda_extension_problem"),
}

AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "sparse_mla": ("flashmla", "triton", "ref"),
    "sparse_mla_grad": ("triton", "ref"),
    "indexer": ("deepgemm", "ref"),
    "attention": ("ref",),
    "moe": ("deepep", "ref"),
    "dense": ("te", "ref"),
    "optimizer": ("apex", "ref"),
    "fp8_gemm": ("ref",),   # deepgemm quantises activations: explicit only (module docstring)
}


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _triton_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_UNUSABLE: dict[tuple[str, bool], str | None] = {}


def unusable_reason(name: str, for_auto: bool = False) -> str | None:
    """None when backend `name` can run in this process, else why not (cached). `triton` without
    CUDA runs in Triton's CPU interpreter when TRITON_INTERPRET=1 (tests), but `auto` never picks
    the interpreter."""
    key = (name, for_auto)
    if key not in _UNUSABLE:
        _UNUSABLE[key] = _probe(BACKENDS[name], for_auto)
    return _UNUSABLE[key]


def _probe(backend: Backend, for_auto: bool) -> str | None:
    if backend.package is None:
        return None
    if not packages.is_installed(backend.package):
        return f"`{packages.PACKAGES[backend.package].import_name}` is not installed"
    cuda = _cuda_available()
    interpreted = backend.name == "triton" and _triton_interpreter() and not for_auto
    if backend.needs_cuda and not cuda and not interpreted:
        return "no CUDA device" + (" (TRITON_INTERPRET=1 runs it on the CPU, for tests)"
                                   if backend.name == "triton" and not for_auto else "")
    try:
        packages.require(backend.package)
    except MissingKernelPackage as exc:
        return exc.reason
    if backend.check is not None:
        problem = _wrapper(backend.name, backend.check)()
        if problem is not None:
            return problem
    if backend.sm_majors and cuda:
        major, minor = torch.cuda.get_device_capability()
        if major not in backend.sm_majors:
            return f"GPU SM{major}{minor} is not supported"
    return None


def available() -> list[str]:
    """Names of the backends that can be selected explicitly in this process."""
    return sorted(name for name in BACKENDS if unusable_reason(name) is None)


def describe() -> dict[str, str | None]:
    """Every backend -> None (usable here) or the reason it is not."""
    return {name: unusable_reason(name) for name in BACKENDS}


# ---- specs -------------------------------------------------------------------------------------


def parse_spec(spec: str) -> dict[str, str]:
    """Spec string -> requested name per part (`auto`, `ref` or a backend). Raises ValueError for
    unknown parts or names, a backend that does not implement the part, or duplicates."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"Empty kernel spec {spec!r}; use auto, ref, a backend name "
                         f"({', '.join(sorted(BACKENDS))}) or part=name items.")
    names = ("auto",) + tuple(BACKENDS)
    default, overrides = None, {}
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            raise ValueError(f"Kernel spec {spec!r} has an empty item.")
        if "=" in item:
            part, name = (x.strip() for x in item.split("=", 1))
            if part not in PARTS:
                raise ValueError(f"Unknown kernel part {part!r} in {spec!r}; parts: {', '.join(PARTS)}.")
            if name not in names:
                raise ValueError(f"Unknown kernel backend {name!r} for {part} in {spec!r}; "
                                 f"backends: {', '.join(names)}.")
            if name != "auto" and part not in BACKENDS[name].parts:
                raise ValueError(f"Kernel backend {name!r} does not implement {part!r} (it "
                                 f"implements {', '.join(BACKENDS[name].parts)}); for {part} use one "
                                 f"of {', '.join(AUTO_ORDER[part])} or auto.")
            if part in overrides:
                raise ValueError(f"Kernel part {part!r} given twice in {spec!r}.")
            overrides[part] = name
        else:
            if item not in names:
                raise ValueError(f"Unknown kernel backend {item!r} in {spec!r}; use auto, or one of "
                                 f"{', '.join(BACKENDS)} (or part=name items; parts: "
                                 f"{', '.join(PARTS)}).")
            if default is not None:
                raise ValueError(f"Kernel spec {spec!r} names two defaults ({default}, {item}).")
            default = item
    default = default or "ref"
    requested = {}
    for part in PARTS:
        if part in overrides:
            requested[part] = overrides[part]
        elif default in ("auto", "ref") or part in BACKENDS[default].parts:
            requested[part] = default
        else:
            requested[part] = "ref"
    return requested


def resolve(spec: str) -> tuple[dict[str, str], list[str]]:
    """Spec -> (backend per part, notes on auto's choices). Raises ValueError for a malformed spec and
    MissingKernelPackage when an explicitly named backend cannot run here (all of them listed)."""
    requested = parse_spec(spec)
    chosen, notes, failures = {}, [], {}
    for part, name in requested.items():
        if name == "auto":
            skipped = []
            for candidate in AUTO_ORDER[part]:
                reason = unusable_reason(candidate, for_auto=True)
                if reason is None:
                    chosen[part] = candidate
                    break
                skipped.append(f"{candidate}: {reason}")
            notes.append(f"{part}={chosen[part]}" + (f" ({'; '.join(skipped)})" if skipped else ""))
        else:
            reason = unusable_reason(name)
            if reason is not None:
                failures.setdefault(name, reason)
            chosen[part] = name
    if failures:
        lines = "\n".join(f"  {name}: {reason}. Needs {packages.install_hint(BACKENDS[name].package)}"
                          for name, reason in failures.items())
        raise MissingKernelPackage(f"--longstraw-kernels {spec!r} names backends that cannot run "
                                   f"here:\n{lines}")
    return chosen, notes


class KernelChoices(tuple):
    """The names argparse shows for `--longstraw-kernels`; membership also accepts any well-formed
    per-part spec (`sparse_mla=triton,indexer=ref`), so `choices=` keeps rejecting typos."""

    def __contains__(self, value) -> bool:
        if tuple.__contains__(self, value):
            return True
        try:
            parse_spec(value)
        except ValueError:
            return False
        return True


# ---- the active set ----------------------------------------------------------------------------


def _wrapper(name: str, attr: str) -> Callable:
    backend = BACKENDS[name]
    if backend.module is None:
        return getattr(refs, attr)
    return getattr(importlib.import_module(f"megatron_longstraw.kernels.{backend.module}"), attr)


@dataclass(frozen=True)
class KernelSet:
    """The functions the model calls (same names and signatures as `refs`), per the active choice."""

    choices: dict[str, str]
    indexer_topk: Callable
    _sparse_mla: Callable = field(repr=False)
    _sparse_mla_grad: Callable = field(repr=False)
    blockwise_attention: Callable = refs.blockwise_attention
    apply_rope: Callable = refs.apply_rope
    merge_partial_attention: Callable = refs.merge_partial_attention
    fp8_linear: Callable = fp8.linear

    def sparse_mla_attention(self, query: torch.Tensor, latents: torch.Tensor, indices: torch.Tensor,
                             scale: float, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`refs.sparse_mla_attention`'s contract. Calls that autograd records (replay) go to the
        `sparse_mla_grad` backend, the others (capture, scoring) to `sparse_mla`."""
        if torch.is_grad_enabled() and (query.requires_grad or latents.requires_grad):
            return self._sparse_mla_grad(query, latents, indices, scale, v_dim)
        return self._sparse_mla(query, latents, indices, scale, v_dim)

    def fp8_matmul(self, x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                   row_parts: int = 1) -> torch.Tensor:
        """x: [..., in] -> [..., out] = x @ W^T through `fp8_linear` (the active `fp8_gemm`
        kernel), differentiable in x (`fp8.FP8Matmul`)."""
        return fp8.FP8Matmul.apply(x, weight, scale_inv, row_parts, self.fp8_linear)


def _build(choices: dict[str, str]) -> KernelSet:
    return KernelSet(
        choices=dict(choices),
        indexer_topk=_wrapper(choices["indexer"], "indexer_topk"),
        blockwise_attention=_wrapper(choices["attention"], "blockwise_attention"),
        _sparse_mla=_wrapper(choices["sparse_mla"], "sparse_mla_attention"),
        _sparse_mla_grad=_wrapper(choices["sparse_mla_grad"], "sparse_mla_attention"),
        fp8_linear=(fp8.linear if choices["fp8_gemm"] == "ref"
                    else _wrapper(choices["fp8_gemm"], "fp8_linear")),
    )


_REF = KernelSet(choices={part: "ref" for part in PARTS}, indexer_topk=refs.indexer_topk,
                 blockwise_attention=refs.blockwise_attention,
                 _sparse_mla=refs.sparse_mla_attention, _sparse_mla_grad=refs.sparse_mla_attention)
_ACTIVE: list[KernelSet] = [_REF]
_ACTIVE_SPEC: list[str | None] = [None]   # the spec `use` last made active (None: the default ref)
_RESOLVED: dict[str, KernelSet] = {}
_LOGGED: set[tuple] = set()


def use(spec: str) -> KernelSet:
    """Select the kernels for `spec` (see the module docstring) and make them active: the
    process's set-up choice (the launcher's `start_process_groups`, the tools, tests). Resolutions
    are cached; each distinct choice is logged once. An explicit backend that cannot run raises
    here and leaves the active selection as it was."""
    if spec not in _RESOLVED:
        choices, notes = resolve(spec)
        _RESOLVED[spec] = _build(choices)
        key = tuple(sorted(choices.items()))
        if key not in _LOGGED:
            _LOGGED.add(key)
            if notes:
                logger.info("longstraw kernels %r: auto selected %s", spec, "; ".join(notes))
            else:
                logger.info("longstraw kernels %r: %s", spec,
                            ", ".join(f"{part}={name}" for part, name in choices.items()))
    _ACTIVE[0] = _RESOLVED[spec]
    _ACTIVE_SPEC[0] = spec
    return _ACTIVE[0]


def adopt(spec: str) -> KernelSet:
    """The active kernels, after `use(spec)` only if `spec` is not already the active selection.

    Who chooses, and when: the kernels are a process-wide choice made once at set-up, before the
    model is built (the launcher: training/train.py `start_process_groups` calls `use`). The step
    and the scoring loop (`forward_backward_longstraw`, `train_step` through it, `iter_scores`)
    only adopt their config's `kernels`: nothing to do when set-up selected that spec, and the
    selection itself for a library caller who never called `use` (or whose `cfg.run.kernels` changed
    since), so the kernels running are always the config's, as when the step called `use`."""
    if _ACTIVE_SPEC[0] != spec:
        return use(spec)
    return _ACTIVE[0]


def reset() -> None:
    """Forget cached probes and resolutions and go back to ref (tests; after installing a package)."""
    _UNUSABLE.clear()
    _RESOLVED.clear()
    _LOGGED.clear()
    _ACTIVE[0] = _REF
    _ACTIVE_SPEC[0] = None


def kernels() -> KernelSet:
    """The active kernels (`apply_rope`, `indexer_topk`, `sparse_mla_attention`,
    `blockwise_attention`, `merge_partial_attention`, `fp8_linear`)."""
    return _ACTIVE[0]


def choices() -> dict[str, str]:
    """Backend per part of the active selection."""
    return dict(_ACTIVE[0].choices)


# ---- model-level parts (used when building the model and the optimizer) -------------------------


def moe_config_overrides(expert_parallel_size: int, tensor_parallel_size: int = 1) -> dict:
    """TransformerConfig overrides for the active `moe` choice ({} for ref: Megatron's all-to-all)."""
    if choices()["moe"] == "ref":
        return {}
    return _wrapper("deepep", "transformer_config_overrides")(expert_parallel_size,
                                                              tensor_parallel_size)


def dense_spec_provider():
    """Backend spec provider for `glm52_stack_spec(backend=...)` (None for ref: the local backend)."""
    if choices()["dense"] == "ref":
        return None
    return _wrapper("te", "spec_provider")()


def optimizer_class() -> type:
    """apex FusedAdam (AdamW mode) for the `apex` choice, else torch.optim.AdamW."""
    if choices()["optimizer"] == "ref":
        return torch.optim.AdamW
    return _wrapper("apex", "optimizer_class")()
