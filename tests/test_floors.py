"""The package's wings and their import order, read from the source (AST, no imports run).

The package is a few folders (wings) whose order is the import order (`WINGS`, the same list as
the package docstring and docs/design.md): a module imports only from its own wing or a wing
before it, counting every import (module level, inside functions, under `if TYPE_CHECKING`).
There is no import cycle, no module outside a wing, and no tool imports another tool.

The package root (`megatron_longstraw/__init__.py`, the module "" here) is the floor above every
wing: it is the public API, whose names it imports lazily from any wing (PEP 562: its `_EXPORTS`
map of name -> module, which is strings, so the graph reads the map as the root's imports). A wing
never imports a public name from the root (`from megatron_longstraw import train_step` in a wing
points up, and closes a cycle through the map); `from megatron_longstraw import planner` imports
the wing `planner`, not the root. The repository keeps no tracked file over 1 MB that the tests do
not read."""

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "megatron_longstraw"
WINGS = ("config", "runtime", "kernels", "distributed", "data", "state", "models", "adapters",
         "context", "rollout", "grpo", "step", "checkpointing", "training", "planner")


def package_modules(pkg: Path) -> dict[str, Path]:
    """Dotted name (relative to the package) -> file, for every module of `pkg`."""
    out = {}
    for path in pkg.rglob("*.py"):
        parts = list(path.relative_to(pkg).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imported_modules(path: Path, module: str, modules: dict[str, Path], pkg_name: str) -> set[str]:
    """The package modules `path` imports anywhere in its body (relative imports resolved)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                here = here[:len(here) - (node.level - 1)] if node.level > 1 else here
                base = ".".join([pkg_name, *here, *([base] if base else [])])
            if base != pkg_name:   # `from megatron_longstraw import x`: x says which module
                found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    resolved = set()
    for name in found:
        if name != pkg_name and not name.startswith(pkg_name + "."):
            continue
        name = name.removeprefix(pkg_name).lstrip(".")
        while name and name not in modules:   # a name defined in a module -> that module;
            name = name.rpartition(".")[0]     # a public name of the root (or the bare root) -> ""
        resolved.add(name)
    return resolved - {module}


def lazy_exports(init: Path, pkg_name: str) -> set[str]:
    """The modules (relative to the package) the root's `_EXPORTS` map imports on first use."""
    for node in ast.parse(init.read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == "_EXPORTS":
            return {v.value.removeprefix(pkg_name + ".") for v in node.value.values}
    return set()


def import_graph(pkg: Path) -> dict[str, set[str]]:
    """Module -> the package modules it imports; the root ("") also imports its lazy exports."""
    modules = package_modules(pkg)
    graph = {m: imported_modules(p, m, modules, pkg.name) for m, p in modules.items()}
    graph[""] |= lazy_exports(pkg / "__init__.py", pkg.name)
    return graph


def upward_imports(graph: dict[str, set[str]], wings=WINGS) -> list[str]:
    """'a -> b' for every import of a module in a later wing (or outside every wing; the root,
    shown as `megatron_longstraw`, is above them all)."""
    def floor(module: str) -> int:
        top = module.split(".")[0]
        return wings.index(top) if top in wings else len(wings)

    return sorted(f"{m or PKG.name} -> {d or PKG.name}" for m, deps in graph.items()
                  for d in deps if floor(d) > floor(m))


def cycles(graph: dict[str, set[str]]) -> list[str]:
    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for dep in graph.get(todo.pop(), set()) - seen:
                seen.add(dep)
                todo.append(dep)
        return seen

    return sorted(m for m in graph if m in reach(m))


def test_every_module_is_in_a_wing_with_a_docstring():
    modules = package_modules(PKG)
    outside = sorted(m for m in modules if m and m.split(".")[0] not in WINGS)
    assert not outside, f"modules outside the wings {WINGS}: {outside}"
    for wing in WINGS:
        init = PKG / wing / "__init__.py"
        assert init.is_file(), f"wing {wing} has no __init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "Imports:" in doc, f"{init}: its docstring says what lives there and what it imports"


def test_wing_order_is_the_documented_one():
    """The package docstring and docs/design.md list the wings in the order this test enforces."""
    doc = ast.get_docstring(ast.parse((PKG / "__init__.py").read_text()))
    listed = re.findall(r"^\s*([a-z_]+)/", doc, re.M)
    assert tuple(listed) == WINGS, listed
    design = (ROOT / "docs" / "design.md").read_text()
    in_design = re.findall(r"^\| `([a-z_]+)/` \|", design, re.M)
    assert tuple(in_design) == WINGS, in_design


def test_no_import_points_up_a_wing():
    graph = import_graph(PKG)
    assert {"runtime.platform", "models.glm52.attention", "step.schedule"} <= set(graph)
    assert {"step.schedule", "models.registry"} <= graph[""]   # the public API's map
    assert all(d.split(".")[0] in WINGS for d in graph[""]), graph[""]
    assert not upward_imports(graph)


def test_no_import_cycle():
    assert not cycles(import_graph(PKG))


def test_the_checks_see_imports_inside_functions(tmp_path):
    """A planted upward import inside a function, and a cycle closed through one, are found."""
    pkg = tmp_path / "megatron_longstraw"
    for wing in ("runtime", "training"):
        (pkg / wing).mkdir(parents=True)
        (pkg / wing / "__init__.py").write_text('"""x. Imports: nothing."""\n')
    (pkg / "__init__.py").write_text("")
    (pkg / "training" / "loop.py").write_text("from megatron_longstraw.runtime import meter\n")
    (pkg / "runtime" / "meter.py").write_text(
        "def f():\n    from megatron_longstraw.training.loop import g\n    return g\n")
    (pkg / "runtime" / "rel.py").write_text(
        "def f():\n    from ..training import loop\n    return loop\n")
    graph = import_graph(pkg)
    assert upward_imports(graph) == ["runtime.meter -> training.loop", "runtime.rel -> training",
                                     "runtime.rel -> training.loop"]
    assert cycles(graph) == ["runtime.meter", "training.loop"]


def test_the_checks_see_the_public_api(tmp_path):
    """The root's lazy map counts as its imports; a wing importing a public name from the root
    points up (and closes a cycle through the map); importing a wing through the root does not."""
    pkg = tmp_path / "megatron_longstraw"
    for wing in ("runtime", "training"):
        (pkg / wing).mkdir(parents=True)
        (pkg / wing / "__init__.py").write_text('"""x. Imports: nothing."""\n')
    (pkg / "__init__.py").write_text(
        '_EXPORTS: dict[str, str] = {"step": "megatron_longstraw.training.loop"}\n')
    (pkg / "training" / "loop.py").write_text("from megatron_longstraw import runtime\n")
    (pkg / "runtime" / "meter.py").write_text(
        "def f():\n    from megatron_longstraw import step\n    return step\n")
    graph = import_graph(pkg)
    assert graph[""] == {"training.loop"} and graph["training.loop"] == {"runtime"}
    assert upward_imports(graph) == ["runtime.meter -> megatron_longstraw"]
    (pkg / "training" / "loop.py").write_text("import megatron_longstraw\n")
    graph = import_graph(pkg)
    assert upward_imports(graph) == ["runtime.meter -> megatron_longstraw",
                                     "training.loop -> megatron_longstraw"]
    assert cycles(graph) == ["", "training.loop"]


def _tool_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_no_tool_imports_another_tool():
    """A tool (tools/*.py) imports the package, never another tool; a folder of sections under
    tools/ (device_checks/) belongs to the one tool that imports it."""
    scripts = {p.stem: p for p in (ROOT / "tools").glob("*.py")}
    sections = {p.name for p in (ROOT / "tools").iterdir() if (p / "__init__.py").is_file()}
    imports = {name: _tool_imports(path) for name, path in scripts.items()}
    crossing = {name: sorted(found & (set(scripts) - {name})) for name, found in imports.items()}
    assert not {k: v for k, v in crossing.items() if v}
    for folder in sections:
        owners = sorted(name for name, found in imports.items() if folder in found)
        assert len(owners) <= 1, f"tools/{folder}/ is imported by several tools: {owners}"


# ---- the repository's files ----------------------------------------------------------------------

MAX_TRACKED_BYTES = 1_000_000
LARGE_FILES_THE_TESTS_READ: dict[str, str] = {}
"""Tracked files allowed over `MAX_TRACKED_BYTES`: path -> the test that reads it and why it must be
that large. None today: the test data (examples/data/, tokenizers included) and the largest docs
(docs/demo_rl_sweep.json) are under 100 kB."""


def test_no_large_tracked_file():
    """A tracked file over 1 MB is debris (a wheel, a log, a checkpoint) unless a test reads it:
    then it is listed above with the reason."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True,
                           text=True).stdout.split("\0")
    sizes = {name: (ROOT / name).stat().st_size for name in names
             if name and (ROOT / name).is_file()}   # a deletion not yet staged: gone, not large
    assert len(sizes) > 100, "git ls-files listed almost nothing"
    large = {name: size for name, size in sizes.items()
             if size > MAX_TRACKED_BYTES and name not in LARGE_FILES_THE_TESTS_READ}
    assert not large, f"tracked files over {MAX_TRACKED_BYTES} bytes: {large}"
