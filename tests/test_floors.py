"""The package's import floors, read from the source (AST, no imports run): the ground floor
(platform, precision, parallel, pages, the norms, kernels/) reaches no model family, schedule,
launcher or registry, even through imports inside functions; data.py does not reach the schedule;
no import cycle among module-level imports."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "megatron_longstraw"
GROUND = ("runtime.platform", "runtime.precision", "distributed.parallel", "state.pages",
          "runtime.norms", "kernels")
# Every model family is a folder of models/ with a family.py (the registry's records).
FAMILIES = tuple(f"models.{p.parent.name}" for p in PKG.glob("models/*/family.py"))
ABOVE = FAMILIES + ("training.schedule", "training.train", "context.capture", "training.replay",
                    "models.registry", "models.mixer", "models.context_parallel", "models.mla")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    name = name.removeprefix("megatron_longstraw").lstrip(".")
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(path: Path, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in tree.body if top_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in (_resolve(n) for n in found if n.startswith("megatron_longstraw")) if m}


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def _is(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_ground_floor_imports_nothing_above_it():
    assert {"models.glm52", "models.qwen36"} <= set(FAMILIES)
    graph = {m: _imports(p, top_level_only=False) - {m} for m, p in MODULES.items()}
    ground = [m for m in MODULES if _is(m, GROUND)]
    assert "runtime.platform" in ground and "kernels.refs" in ground
    upward = {m: sorted(d for d in _reach(graph, m) if _is(d, ABOVE)) for m in ground}
    assert not {m: u for m, u in upward.items() if u}
    assert "training.schedule" not in _reach(graph, "data.groups")


def test_no_module_level_import_cycle():
    graph = {m: _imports(p, top_level_only=True) - {m} for m, p in MODULES.items()}
    cycles = [m for m in MODULES if m in _reach(graph, m)]
    assert not cycles, cycles
