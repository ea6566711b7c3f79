"""The optional GPU packages behind the kernel backends: where each comes from, how to install it,
which GPUs it runs on, and one check that the installed version has the API we call.

None of them is installed by `pip install megatron_longstraw`. The registry's `flash-mla`, `deep-ep`
and `deep-gemm` are early-2025 snapshots without the APIs used here (sparse MLA prefill,
`fp8_mqa_logits`), and the PyPI project named `apex` is unrelated to NVIDIA apex: install every one of
these from source (README, "GPU backends").
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class Package:
    import_name: str
    """Top-level Python module (`flash_mla`)."""
    project: str
    """Human name (`FlashMLA`)."""
    install: str
    """Shell commands that install it from source."""
    gpus: str
    """GPUs the kernels we use run on."""
    api: str
    """Dotted attribute under the module that must exist (the function we call); its absence means
    a wrong or outdated package."""


PACKAGES: dict[str, Package] = {
    "flash_mla": Package(
        "flash_mla", "FlashMLA",
        "git clone --recursive https://github.com/deepseek-ai/FlashMLA && cd FlashMLA && "
        "pip install -v --no-build-isolation .",
        "SM90 (Hopper) or SM100 (Blackwell); CUDA >= 12.8",
        "flash_mla_sparse_fwd"),
    "deep_gemm": Package(
        "deep_gemm", "DeepGEMM",
        "git clone --recursive https://github.com/deepseek-ai/DeepGEMM && cd DeepGEMM && ./install.sh",
        "SM90 (Hopper) or SM100 (Blackwell); CUDA >= 12.9 recommended",
        "fp8_mqa_logits"),
    "deep_ep": Package(
        "deep_ep", "DeepEP",
        "git clone https://github.com/deepseek-ai/DeepEP && cd DeepEP && "
        "NVSHMEM_DIR=/path/to/nvshmem python setup.py install",
        "SM90 (Hopper) with NVLink inside a node; RDMA (InfiniBand/RoCE) across nodes",
        "Buffer"),
    "transformer_engine": Package(
        "transformer_engine", "TransformerEngine",
        "pip install --no-build-isolation "
        "'git+https://github.com/NVIDIA/TransformerEngine.git@stable#egg=transformer_engine[pytorch]'",
        "SM80+ (Ampere and newer); FP8 on SM89/SM90/SM100",
        "pytorch"),
    "apex": Package(
        "apex", "NVIDIA apex",
        "git clone https://github.com/NVIDIA/apex && cd apex && "
        "APEX_CPP_EXT=1 APEX_CUDA_EXT=1 pip install -v --no-build-isolation .  "
        "(never the PyPI package named `apex`, an unrelated project)",
        "any CUDA GPU",
        "optimizers.FusedAdam"),
    "triton": Package(
        "triton", "Triton",
        "pip install triton (PyTorch's CUDA wheels ship a matching version)",
        "SM80+ CUDA GPUs (CPU only in TRITON_INTERPRET=1 mode, for tests)",
        "jit"),
}


class MissingKernelPackage(RuntimeError):
    """A kernel backend cannot run here (package missing, outdated or unusable). `reason` is the short
    cause; the message adds the package and how to install it."""

    def __init__(self, reason: str, import_name: str | None = None):
        self.reason = reason
        self.import_name = import_name
        super().__init__(f"{reason}. Needed: {install_hint(import_name)}" if import_name else reason)


def install_hint(import_name: str) -> str:
    pkg = PACKAGES[import_name]
    return f"{pkg.project} (`{pkg.import_name}`; runs on {pkg.gpus}). Install from source: {pkg.install}"


def is_installed(import_name: str) -> bool:
    """Whether the top-level module can be found (without importing it)."""
    return importlib.util.find_spec(PACKAGES[import_name].import_name) is not None


def require(import_name: str):
    """Import `import_name` and check it has the API we call; raise `MissingKernelPackage` naming
    the package and how to install it otherwise. Returns the module."""
    pkg = PACKAGES[import_name]
    if not is_installed(import_name):
        raise MissingKernelPackage(f"`{pkg.import_name}` is not installed", import_name)
    try:
        module = importlib.import_module(pkg.import_name)
    except Exception as exc:  # noqa: BLE001 - ImportError, or a CUDA extension failing to load
        raise MissingKernelPackage(f"`{pkg.import_name}` fails to import ({type(exc).__name__}: "
                                   f"{exc})", import_name) from exc
    target = module
    for part in pkg.api.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            try:  # submodules (`apex.optimizers`, `transformer_engine.pytorch`) load on import
                target = importlib.import_module(f"{target.__name__}.{part}")
            except Exception as exc:  # noqa: BLE001
                raise MissingKernelPackage(
                    f"`{pkg.import_name}` is installed but has no `{pkg.api}` (a registry snapshot, "
                    f"or an unrelated package of the same name)", import_name) from exc
    return module
