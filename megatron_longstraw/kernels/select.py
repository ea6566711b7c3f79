"""Which kernel backend the model calls. `ref` (pure PyTorch, `kernels/refs.py`) is the complete path
and the only one on CPU; GPU backends register here with the same function names and signatures."""

from __future__ import annotations

import logging
from types import ModuleType

from megatron_longstraw.kernels import refs

logger = logging.getLogger(__name__)

_BACKENDS: dict[str, ModuleType] = {"ref": refs}
_ACTIVE: list[str] = ["ref"]
_LOGGED: list[str] = []


def available() -> list[str]:
    """Names of the backends that can be selected in this process."""
    return sorted(_BACKENDS)


def use(name: str) -> None:
    """Select a backend by name (`auto` picks the fastest available and logs its choice)."""
    if name == "auto":
        name = "ref"
        if _ACTIVE[0] != name or not _LOGGED:
            logger.info("longstraw kernels: auto selected %r", name)
            _LOGGED.append(name)
    if name not in _BACKENDS:
        raise ValueError(f"Unknown kernel backend {name!r}; available here: {available()}.")
    _ACTIVE[0] = name


def kernels() -> ModuleType:
    """The active backend module (`apply_rope`, `indexer_topk`, `sparse_mla_attention`, ...)."""
    return _BACKENDS[_ACTIVE[0]]
