"""The README's Python examples, as written: every ```python block of README.md and of the family
READMEs (examples/*/README.md) runs in its own Python process from the repository root, on CPU
with the tiny configs, imports only the public API (`from megatron_longstraw import ...`) and
prints a finite loss and a positive, finite gradient norm. Every ```python block is meant to run
(a fragment that is not belongs in a ```text block).

About 10 s of CPU per block (Megatron's import is most of it)."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
READMES = [ROOT / "README.md", *sorted((ROOT / "examples").glob("*/README.md"))]


def python_blocks() -> dict[str, str]:
    """'README path#n' (n from 1 in each file) -> the code of its n-th ```python block."""
    blocks = {}
    for readme in READMES:
        found = re.findall(r"```python\n(.*?)```", readme.read_text(), flags=re.S)
        for n, code in enumerate(found, start=1):
            blocks[f"{readme.relative_to(ROOT)}#{n}"] = code
    return blocks


BLOCKS = python_blocks()


def test_the_readmes_have_their_examples_on_the_public_api():
    assert {"README.md#1", "examples/qwen36/README.md#1"} <= set(BLOCKS), sorted(BLOCKS)
    for name, code in BLOCKS.items():
        assert "from megatron_longstraw import" in code, name
        assert not re.search(r"\bmegatron_longstraw\.", code), f"{name}: a deep import"


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_the_example_runs_as_written(name, tmp_path):
    env = {"PATH": f"{ROOT / '.venv' / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path),
           "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1",
           "PYTHONWARNINGS": "ignore", "TMPDIR": os.environ.get("TMPDIR", "/tmp")}
    out = subprocess.run([sys.executable, "-c", BLOCKS[name]], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    found = re.search(r"loss (\S+)\s+grad norm (\S+)", out.stdout)
    assert found, out.stdout
    loss, norm = float(found.group(1)), float(found.group(2))
    # On-policy (the step scores then replays under the same weights): every ratio is 1 and the
    # advantages sum to 0, so the loss is 0 up to rounding; its gradient is not.
    assert abs(loss) < 1e-3 and math.isfinite(norm) and norm > 0, out.stdout
    responses = re.search(r"responses \[([\d, ]+)\]", out.stdout)
    if responses:   # sampled from a capture: group_size (4) members of 1 to 8 tokens
        lengths = [int(n) for n in responses.group(1).split(",")]
        assert len(lengths) == 4 and all(1 <= n <= 8 for n in lengths), out.stdout
