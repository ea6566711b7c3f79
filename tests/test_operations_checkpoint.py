"""Damaged checkpoints and a full disk: one error naming the file, whether the previous
checkpoint is intact and what to do; no raw traceback (checkpoint.py)."""

import re
import resource
import signal
from pathlib import Path

import pytest

from megatron_longstraw.checkpointing import checkpoint
from megatron_longstraw.runtime.errors import CheckpointError, is_user_error
from megatron_longstraw.training import train

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "glm52" / "tiny.yaml")


def _flags(tmp_path: Path, *extra: str) -> list[str]:
    return ["--longstraw", "--longstraw-config", TINY, "--longstraw-synthetic-prompt-len", "32",
            "--longstraw-synthetic-response-len", "4", "--longstraw-group-size", "2",
            "--longstraw-out-dir", str(tmp_path), "--longstraw-run-name", "t",
            "--no-longstraw-live-bytes", "--save", str(tmp_path / "ckpt"), "--save-interval", "1",
            "--train-iters", "4", "--exit-interval", "2", *extra]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, single_process):
    """A save folder with the checkpoints of steps 1 and 2 of 4 (tiny GLM-5.2; --exit-interval 2
    stops there, and a resume stops at the next even step)."""
    tmp_path = tmp_path_factory.mktemp("ckpt")
    train.main(_flags(tmp_path))
    return tmp_path


def _copy(two_steps: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(two_steps / "ckpt", tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.mark.parametrize("damage,file,reason", [
    (lambda b: b[:7], "model.safetensors", r"Error while deserializing header: .*; 7 bytes"),
    (lambda b: b[:-100], "model.safetensors", "incomplete metadata, file not fully covered"),
    (lambda b: b"\x80\x04garbage" * 3, "rank_00000.pt", "not a readable torch.save file"),
    (lambda b: b[: len(b) // 2], "rank_00000.pt", ""),
])
def test_a_damaged_checkpoint_names_the_file_and_the_intact_previous_one(
        two_steps, tmp_path, damage, file, reason):
    ckpt = _copy(two_steps, tmp_path)
    target = ckpt / "step_00000002" / file
    target.write_bytes(damage(target.read_bytes()))
    with pytest.raises(CheckpointError) as info:
        train.main(_flags(tmp_path, "--load", str(ckpt)))
    message = str(info.value)
    assert is_user_error(info.value) and "\n" not in message and "weights_only" not in message
    assert message.startswith(f"{target} is damaged ("), message
    assert re.search(reason, message), message
    assert message.endswith(f"The previous checkpoint {ckpt / 'step_00000001'} is intact: resume "
                            f"from it by writing step_00000001 into {ckpt / 'latest'} (or move "
                            f"{ckpt / 'step_00000002'} away)."), message
    # Following the advice resumes.
    (ckpt / "latest").write_text("step_00000001\n")
    train.main(_flags(tmp_path, "--load", str(ckpt)))


def test_a_full_disk_mid_save_keeps_the_previous_checkpoint(two_steps, tmp_path):
    """The file-size limit stands for a full disk: writes past it fail (EFBIG; ENOSPC takes the
    same path: safetensors and torch.save report both as their own errors)."""
    ckpt = _copy(two_steps, tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    with pytest.raises(CheckpointError) as info:
        try:
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
            train.main(_flags(tmp_path, "--load", str(ckpt)))
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, handler)
    message = str(info.value)
    assert is_user_error(info.value) and "\n" not in message
    assert message.startswith(f"saving step 3 into {ckpt} failed writing "
                              f"{ckpt / '.tmp-step_00000003' / 'model.safetensors'}: "), message
    assert "File too large" in message and "MiB free there" in message
    assert (f"the previous checkpoint {ckpt / 'step_00000002'} is intact (`latest` still names "
            "it) and the unfinished save is removed. Free space (or pass another --save) and "
            f"resume with --load {ckpt}.") in message
    assert checkpoint.latest_checkpoint(ckpt) == ckpt / "step_00000002"
    assert not list(ckpt.glob(".tmp-*"))
