"""The public API: `megatron_longstraw.__all__`, imported lazily (PEP 562) from the wings.

`import megatron_longstraw.runtime.parent_watch` is the launcher's first statement
(examples/pretrain_gpt.py): it must start the watch before torch and Megatron load, so the package
root may not import them; each public name is imported from its module on first use instead."""

import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_longstraw

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "megatron", "numpy", "transformers")
"""What the launcher's first statement and a bare `import megatron_longstraw` leave unloaded."""

_LIGHT = f"""
import json, sys
import megatron_longstraw.runtime.parent_watch
import megatron_longstraw
names = (megatron_longstraw.__all__, dir(megatron_longstraw))
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})))
"""


def test_the_launchers_first_import_loads_neither_torch_nor_megatron():
    """In a fresh process: the parent watch, the package root, its `__all__` and `dir()`."""
    out = subprocess.run([sys.executable, "-c", _LIGHT], cwd=ROOT, capture_output=True,
                         text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == []


def test_every_public_name_is_the_object_its_module_defines():
    exports = megatron_longstraw._EXPORTS
    assert megatron_longstraw.__all__ == sorted(exports)
    assert set(megatron_longstraw.__all__) <= set(dir(megatron_longstraw))
    for name, module_name in exports.items():
        obj = getattr(megatron_longstraw, name)
        assert obj is getattr(importlib.import_module(module_name), name), name
        if inspect.isclass(obj) or inspect.isfunction(obj):   # defined there, not re-exported
            assert obj.__module__ == module_name, (name, obj.__module__)
    # What a library user needs: set-up, a family's model, settings, a group, the phases, a step.
    assert {"initialize", "use_dtype", "get_family", "GLM52Config", "build_glm52_model",
            "Qwen36Config", "build_qwen36_model", "DeepseekV3Config", "build_deepseekv3_model",
            "LongStrawConfig", "GRPOGroup", "capture_prompt", "generate", "iter_scores",
            "train_step"} <= set(exports)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'GRPOGroupp'"):
        megatron_longstraw.GRPOGroupp  # noqa: B018
    assert not hasattr(megatron_longstraw, "score_groups")
