"""The README's walkthrough, as written: every fenced bash block under its heading, in order, in one
bash process (`set -euo pipefail`) from the repository root, with the walkthrough's folder
`runs/walkthrough` moved to a temporary one. Then what each step promises: the tiny HF checkpoint
and its conversion, the training run stopped after step 2 with a checkpoint (exit 0), the resume
from it to step 4, the scores of both groups, and the export that transformers loads.

About a minute on 2 idle cores (six processes start: Megatron's and transformers' imports are most
of it)."""

import json
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Walkthrough"
FOLDER = "runs/walkthrough"


def walkthrough_blocks(readme: str) -> list[str]:
    """The ```bash blocks between the walkthrough heading and the next `## ` heading."""
    start = readme.index(HEADING)
    end = readme.find("\n## ", start + len(HEADING))
    section = readme[start:end if end >= 0 else len(readme)]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)


def test_the_readme_opens_with_the_two_commands_then_the_walkthrough():
    readme = (ROOT / "README.md").read_text()
    headings = re.findall(r"^## (.*)$", readme, flags=re.M)
    assert headings[0] == "The two commands" and headings[1].startswith("Walkthrough")
    first = re.search(r"```bash\n(.*?)```", readme, flags=re.S).group(1)
    assert [line.split()[:2] for line in first.strip().splitlines()] == [["make", "demo"],
                                                                         ["make", "test"]]
    blocks = walkthrough_blocks(readme)
    text = "\n".join(blocks)
    for step in ("tools/tiny_hf.py", "tools/convert_hf.py", "groups.jsonl", "examples/pretrain_gpt.py",
                 "tools/score.py", "--to-hf"):
        assert step in text, step
    assert "troubleshooting" in readme.lower() and "docs/evidence.md" in readme


def test_every_walkthrough_command_runs(tmp_path):
    blocks = walkthrough_blocks((ROOT / "README.md").read_text())
    work = tmp_path / "walkthrough"
    script = "set -euo pipefail\n" + "\n".join(b.replace(FOLDER, str(work)) for b in blocks)
    assert FOLDER not in script
    env = {"PATH": f"{ROOT / '.venv' / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path),
           "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1",
           "PYTHONWARNINGS": "ignore", "TMPDIR": os.environ.get("TMPDIR", "/tmp")}
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    # 1-2: the HF checkpoint and its conversion (the model config inside).
    assert (work / "hf" / "config.json").is_file()
    meta = json.loads((work / "model" / "longstraw.json").read_text())
    assert meta["family"] == "glm52" and meta["model"]["hidden_size"] == 64
    # 4: no YAML: the model config came from the converted folder; two steps, then the stop.
    assert f"model config from {work / 'model' / 'longstraw.json'}" in out.stdout
    assert "no checkpoint in --load" in out.stdout
    assert "(on-policy: the loss value is 0 by construction, its gradient is not)" in out.stdout
    assert "exiting after step 1: --exit-interval 2" in out.stdout
    # 5: the same command resumed at step 2 and ran steps 2 and 3 only.
    assert f"resumed from {work / 'ckpt' / 'step_00000002'} at step 2" in out.stdout
    for step in range(4):
        assert len(re.findall(rf"^step\s+{step} \| loss", out.stdout, flags=re.M)) == 1, step
    assert (work / "ckpt" / "latest").read_text().strip() == "step_00000004"
    receipt = json.loads((work / "train" / "receipt.json").read_text())
    assert receipt["context_parallel_size"] == 2 and receipt["expert_parallel_size"] == 2
    # 6: both groups scored, per token.
    lines = [json.loads(line) for line in (work / "scores.jsonl").read_text().splitlines()]
    assert [line["id"] for line in lines] == ["q1", "q2"]
    assert all(len(lp) == n for line in lines for lp, n in zip(line["logprobs"],
                                                              line["response_lens"]))
    # 7: exported and loaded by transformers.
    assert (work / "hf-trained" / "config.json").is_file()
    assert out.stdout.rstrip().endswith("GlmMoeDsaForCausalLM")
