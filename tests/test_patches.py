"""patches/: every upstreamable patch is explained, well formed, and applies to the pinned wheel.

Fast (no model, no process group): each check copies the patched files out of the installed
megatron-core wheel into a temporary tree, applies the patch there with `git apply` (or `patch`
when git is missing), and compiles the result. The wheel itself is never modified.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import py_compile
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PATCH_DIR = Path(__file__).resolve().parents[1] / "patches"
PATCHES = sorted(PATCH_DIR.glob("*.patch"))
PATCH_IDS = [p.name for p in PATCHES]
HEADER_FIELDS = ("Target", "Function", "Why", "Results unchanged")
HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass
class FileDiff:
    old_path: str               # as written after '--- ', e.g. a/megatron/core/utils.py
    new_path: str               # as written after '+++ '
    num_hunks: int = 0
    added: list[str] = field(default_factory=list)


@dataclass
class ParsedPatch:
    header: list[str]           # the comment lines before the first '--- '
    files: list[FileDiff]

    def header_field(self, name: str) -> str:
        """The text of header field `name` ('# Name: text', continuation lines indented)."""
        text, inside = [], False
        for line in self.header:
            body = line[1:].strip()
            if body.startswith(f"{name}:"):
                inside = True
                text.append(body[len(name) + 1:].strip())
            elif inside and line.startswith("#   "):
                text.append(body)
            else:
                inside = False
        return " ".join(text).strip()

    @property
    def targets(self) -> list[str]:
        """Package-relative target paths (the `a/` prefix removed)."""
        return [f.old_path[2:] for f in self.files]


def parse_patch(text: str) -> ParsedPatch:
    """Parse a `diff -u` patch with a comment header; raise ValueError on anything malformed
    (missing labels, hunk line counts that do not add up, stray lines)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("--- ")), None)
    if start is None:
        raise ValueError("no '--- a/...' line: not a unified diff")
    header = lines[:start]
    for line in header:
        if not line.startswith("#"):
            raise ValueError(f"header line is not a comment: {line!r}")
    files: list[FileDiff] = []
    i = start
    while i < len(lines):
        if not lines[i].startswith("--- ") or i + 1 >= len(lines) or \
                not lines[i + 1].startswith("+++ "):
            raise ValueError(f"line {i + 1}: expected a '--- ' / '+++ ' pair, got {lines[i]!r}")
        diff = FileDiff(lines[i][4:].split("\t")[0], lines[i + 1][4:].split("\t")[0])
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            match = HUNK_RE.match(lines[i])
            if match is None:
                raise ValueError(f"line {i + 1}: malformed hunk header {lines[i]!r}")
            old_left = int(match[2]) if match[2] is not None else 1
            new_left = int(match[4]) if match[4] is not None else 1
            i += 1
            while old_left > 0 or new_left > 0:
                if i >= len(lines):
                    raise ValueError("patch ends inside a hunk")
                tag, body = lines[i][:1], lines[i][1:]
                if tag == " ":
                    old_left, new_left = old_left - 1, new_left - 1
                elif tag == "-":
                    old_left -= 1
                elif tag == "+":
                    new_left -= 1
                    diff.added.append(body)
                elif tag != "\\":           # '\ No newline at end of file'
                    raise ValueError(f"line {i + 1}: not a hunk line: {lines[i]!r}")
                if old_left < 0 or new_left < 0:
                    raise ValueError(f"line {i + 1}: hunk longer than its header says")
                i += 1
            while i < len(lines) and lines[i].startswith("\\"):
                i += 1
            diff.num_hunks += 1
        if diff.num_hunks == 0:
            raise ValueError(f"{diff.old_path}: no hunks")
        files.append(diff)
    return ParsedPatch(header, files)


@functools.lru_cache(maxsize=1)
def wheel_files() -> frozenset[str]:
    """Paths (relative to site-packages) of every file the megatron-core wheel installed."""
    return frozenset(str(path) for path in importlib.metadata.files("megatron-core") or [])


def site_packages() -> Path:
    return Path(importlib.metadata.distribution("megatron-core").locate_file(""))


def core_version() -> str:
    return importlib.metadata.version("megatron-core")


def apply(patch: Path, root: Path, check_only: bool = False) -> subprocess.CompletedProcess:
    """Apply `patch` (-p1) to the tree at `root` with git apply, or patch when git is missing."""
    if shutil.which("git"):
        # Stop git from finding an enclosing repository: paths must be relative to `root`.
        env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(root.parent))
        cmd = ["git", "apply", "-p1"] + (["--check"] if check_only else []) + [str(patch)]
        return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    if shutil.which("patch"):
        cmd = ["patch", "-p1", "--batch", "--forward", "-d", str(root), "-i", str(patch)]
        return subprocess.run(cmd + (["--dry-run"] if check_only else []),
                              capture_output=True, text=True)
    pytest.skip("neither git nor patch is installed")


def copy_targets(targets: list[str], root: Path) -> None:
    for target in targets:
        (root / target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(site_packages() / target, root / target)


def parsed(patch: Path) -> ParsedPatch:
    return parse_patch(patch.read_text())


def test_patch_set_is_present():
    names = set(PATCH_IDS)
    expected = {
        "core-hybrid_block-final_norm.patch",
        "core-moe_utils-maybe_move_tensor_to_cpu.patch",
        "core-token_dispatcher-cuda_streams.patch",
        "core-random-cpu_rng_tracker.patch",
        "core-moe_utils-fp64_sigmoid_routing.patch",
        "core-current_device-cpu.patch",
        "core-finalize_model_grads-longstraw.patch",
        "megatron-lm-pretrain_gpt-longstraw.patch",
    }
    assert expected <= names, f"missing: {sorted(expected - names)}"


@pytest.mark.parametrize("patch", PATCHES, ids=PATCH_IDS)
def test_header_explains_the_patch(patch):
    info = parsed(patch)
    for name in HEADER_FIELDS:
        assert info.header_field(name), f"{patch.name}: header has no '# {name}: ...' line"


@pytest.mark.parametrize("patch", PATCHES, ids=PATCH_IDS)
def test_diff_labels_use_a_b_prefixes(patch):
    for diff in parsed(patch).files:
        assert diff.old_path.startswith("a/") and diff.new_path.startswith("b/"), diff
        assert diff.old_path[2:] == diff.new_path[2:], f"{patch.name}: renames are not expected"


@pytest.mark.parametrize("patch", PATCHES, ids=PATCH_IDS)
def test_header_targets_name_the_version(patch):
    """Core patches name the wheel version they were made against, and it is the installed one
    (a newer wheel needs the patches re-based); the Megatron-LM patch names its upstream commit."""
    info = parsed(patch)
    target = info.header_field("Target")
    if all(t in wheel_files() for t in info.targets):
        assert f"megatron-core {core_version()}" in target, (target, core_version())
        for path in info.targets:
            assert path in target, f"{patch.name}: Target does not list {path}"
    else:
        assert re.search(r"\b[0-9a-f]{40}\b", target), f"{patch.name}: no upstream commit id"


@pytest.mark.parametrize("patch", PATCHES, ids=PATCH_IDS)
def test_applies_to_the_installed_wheel_and_compiles(patch, tmp_path):
    info = parsed(patch)
    missing = [t for t in info.targets if t not in wheel_files()]
    if missing:
        pytest.skip(f"{', '.join(missing)} is not shipped in the megatron-core wheel "
                    "(a Megatron-LM repository file; its upstream base is not stored here)")
    copy_targets(info.targets, tmp_path)
    check = apply(patch, tmp_path, check_only=True)
    assert check.returncode == 0, f"{patch.name} does not apply:\n{check.stdout}{check.stderr}"
    done = apply(patch, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    for target in info.targets:
        patched = tmp_path / target
        assert patched.read_text() != (site_packages() / target).read_text(), target
        py_compile.compile(str(patched), cfile=str(tmp_path / "out.pyc"), doraise=True)


def test_core_patches_apply_together(tmp_path):
    """All core patches on one tree (two of them touch moe_utils.py), then every file compiles."""
    core = [p for p in PATCHES if all(t in wheel_files() for t in parsed(p).targets)]
    targets = sorted({t for p in core for t in parsed(p).targets})
    copy_targets(targets, tmp_path)
    for patch in core:
        done = apply(patch, tmp_path)
        assert done.returncode == 0, f"{patch.name}:\n{done.stdout}{done.stderr}"
    for target in targets:
        py_compile.compile(str(tmp_path / target), cfile=str(tmp_path / "out.pyc"), doraise=True)


def test_pretrain_gpt_patch_is_a_megatron_lm_diff():
    patch = PATCH_DIR / "megatron-lm-pretrain_gpt-longstraw.patch"
    info = parsed(patch)
    assert info.targets == ["pretrain_gpt.py"]
    assert "pretrain_gpt.py" not in wheel_files(), "now in the wheel: give it an apply test"
    added = "\n".join(line for diff in info.files for line in diff.added)
    assert "add_longstraw_args" in added and "megatron_longstraw.training.train import main" in added
    assert ".longstraw" in added, "the hand-off must be keyed on args.longstraw"


def test_parser_rejects_a_broken_diff():
    """The parser the checks above rely on fails on a hunk whose counts do not add up."""
    good = parsed(PATCHES[0]).header
    broken = "\n".join(good + ["--- a/x.py", "+++ b/x.py", "@@ -1,2 +1,2 @@", " a", "-b"]) + "\n"
    with pytest.raises(ValueError):
        parse_patch(broken)
    with pytest.raises(ValueError):
        parse_patch("# Target: x\nnot a diff\n")


def test_readme_lists_every_patch():
    readme = (PATCH_DIR / "README.md").read_text()
    for name in PATCH_IDS:
        assert name in readme, f"patches/README.md does not mention {name}"
