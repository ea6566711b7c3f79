"""--load must name something to start from: a missing or empty folder is an error naming the
folder (Megatron would start from random weights there, silently), except the first run of a
fine-tuning job (--pretrained-checkpoint, --load = --save); the shipped SLURM scripts pass --load
only when their checkpoint folder holds a checkpoint."""

import argparse
import re
import subprocess
from pathlib import Path

import pytest

from megatron_longstraw.runtime.errors import CheckpointError
from megatron_longstraw.training import train
from megatron_longstraw.training.model_setup import starting_points

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "glm52" / "tiny.yaml")


def _flags(tmp_path: Path, *extra: str) -> list[str]:
    return ["--longstraw", "--longstraw-config", TINY, "--longstraw-synthetic-prompt-len", "32",
            "--longstraw-synthetic-response-len", "4", "--longstraw-group-size", "2",
            "--longstraw-out-dir", str(tmp_path), "--longstraw-run-name", "t", *extra]


def test_load_of_a_missing_or_empty_folder_is_refused_before_any_work(tmp_path):
    missing = tmp_path / "chekpoints"   # a typo
    with pytest.raises(CheckpointError, match=rf"^--load {re.escape(str(missing))} does not exist: "
                                              r"nothing to resume .*on a first run drop --load"):
        train.main(_flags(tmp_path, "--load", str(missing)))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match=r"empty: nothing to resume"):
        train.main(_flags(tmp_path, "--load", str(empty)))
    (empty / ".tmp-step_00000001").mkdir()   # an interrupted first save
    with pytest.raises(CheckpointError, match=r"holds no complete checkpoint \(found "
                                              r"\.tmp-step_00000001\)"):
        train.main(_flags(tmp_path, "--load", str(empty)))


def _args(**kwargs) -> argparse.Namespace:
    values = dict(load=None, save=None, pretrained_checkpoint=None,
                  exit_on_missing_checkpoint=False)
    return argparse.Namespace(**{**values, **kwargs})


def test_first_run_of_a_fine_tuning_job_starts_from_the_pretrained_weights(tmp_path):
    """Megatron's convention: --pretrained-checkpoint INIT --load RUN --save RUN starts from INIT
    while RUN holds no checkpoint; only where --load is the run's own --save folder."""
    init = tmp_path / "init"
    init.mkdir()
    (init / "longstraw.json").write_text("{}")
    run = str(tmp_path / "run")
    assert starting_points(_args(pretrained_checkpoint=str(init), load=run, save=run)) == \
        (str(init), None)
    with pytest.raises(CheckpointError, match="does not exist"):   # --load elsewhere: a typo?
        starting_points(_args(pretrained_checkpoint=str(init), load=run, save=run + "2"))
    with pytest.raises(CheckpointError, match="does not exist"):   # Megatron's flag: no fallback
        starting_points(_args(pretrained_checkpoint=str(init), load=run, save=run,
                              exit_on_missing_checkpoint=True))


@pytest.mark.parametrize("script", sorted(p.relative_to(ROOT).as_posix()
                                          for p in (ROOT / "examples").glob("*/*.slurm")))
def test_slurm_scripts_pass_load_only_when_a_checkpoint_is_there(tmp_path, script):
    """The script's block that chooses --load, run by bash on an empty folder and on one that
    holds a checkpoint."""
    text = (ROOT / script).read_text()
    assert 'mkdir -p "$CHECKPOINT_DIR"' not in text
    block = text[text.index("LOAD=()"):text.index("\nfi\n") + 4]
    ckpt = tmp_path / "ckpt"

    def chosen() -> list[str]:
        show = 'for a in "${LOAD[@]}"; do echo "$a"; done'
        out = subprocess.run(["bash", "-c", f"set -eu\n{block}\n{show}"],
                             env={"CHECKPOINT_DIR": str(ckpt), "BASE_DIR": "/base",
                                  "LOAD_DIR": "", "PATH": "/usr/bin:/bin"},
                             capture_output=True, text=True, check=True)
        return out.stdout.splitlines()[1:]   # after the script's own line

    assert chosen() == []   # first run: the script says so and passes no --load
    ckpt.mkdir()
    assert chosen() == []
    (ckpt / "latest").write_text("step_00000010\n")
    assert chosen() == ["--load", str(ckpt)]
