"""One writer per save folder (checkpointing/save_lock.py) and no orphaned worker
(runtime/parent_watch.py)."""

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

import processes
from megatron_longstraw.checkpointing.save_lock import LOCK, SaveLock
from megatron_longstraw.runtime.errors import CheckpointError

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "glm52" / "tiny.yaml")


def _holder(folder: Path, **record) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK
    path.write_text(json.dumps({"host": socket.gethostname(), "since": time.time(), **record}))
    return path


def test_the_lock_records_its_holder_and_a_second_writer_is_refused_by_name(tmp_path):
    lock = SaveLock(tmp_path / "ckpt").acquire()
    record = json.loads((tmp_path / "ckpt" / LOCK).read_text())
    assert record["host"] == socket.gethostname() and record["pid"] == os.getpid()
    assert lock.message is None
    lock.release()
    assert not (tmp_path / "ckpt" / LOCK).exists()

    # Another live process on this host holds it (a `sleep` here stands for the other job).
    other = subprocess.Popen(["sleep", "60"])
    try:
        _holder(tmp_path / "ckpt", pid=other.pid, job="4242")
        with pytest.raises(CheckpointError, match=(
                rf"^--save {tmp_path / 'ckpt'} is in use by another run: process {other.pid} on "
                rf"{socket.gethostname()}, job 4242, since .* holds .*{LOCK}\. Two runs saving "
                r"into one folder overwrite each other's checkpoints")):
            SaveLock(tmp_path / "ckpt").acquire()
    finally:
        other.kill()
        other.wait()
    # Now that process is gone: its lock is stale, taken over with a message.
    lock = SaveLock(tmp_path / "ckpt").acquire()
    assert lock.message.startswith(f"took over the save lock {tmp_path / 'ckpt' / LOCK} of "
                                   f"process {other.pid} on {socket.gethostname()}")
    assert lock.message.endswith("that process no longer runs")
    assert json.loads((tmp_path / "ckpt" / LOCK).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_holder_on_another_host_is_stale_only_without_heartbeat(tmp_path):
    path = _holder(tmp_path / "ckpt", host="node-7", pid=123)
    with pytest.raises(CheckpointError, match="process 123 on node-7"):
        SaveLock(tmp_path / "ckpt", stale_s=60).acquire()
    os.utime(path, (time.time() - 120, time.time() - 120))   # its job died 2 minutes ago
    lock = SaveLock(tmp_path / "ckpt", stale_s=60).acquire()
    assert "no heartbeat for 120 s (over 60 s)" in lock.message
    lock.release()


def test_the_holder_heartbeats(tmp_path):
    lock = SaveLock(tmp_path, heartbeat_s=0.05).acquire()
    old = time.time() - 1000
    os.utime(tmp_path / LOCK, (old, old))
    time.sleep(0.5)
    assert (tmp_path / LOCK).stat().st_mtime > old + 900
    lock.release()


@pytest.mark.usefixtures("single_process")
def test_the_launcher_refuses_a_save_folder_in_use_and_gives_its_lock_back(tmp_path):
    from megatron_longstraw.training import train

    flags = ["--longstraw", "--longstraw-config", TINY, "--longstraw-synthetic-prompt-len", "32",
             "--longstraw-synthetic-response-len", "4", "--longstraw-group-size", "2",
             "--longstraw-out-dir", str(tmp_path), "--longstraw-run-name", "t",
             "--no-longstraw-live-bytes", "--train-iters", "1", "--save", str(tmp_path / "ckpt"),
             "--save-interval", "1"]
    other = subprocess.Popen(["sleep", "60"])
    try:
        _holder(tmp_path / "ckpt", pid=other.pid)
        with pytest.raises(CheckpointError, match=f"in use by another run: process {other.pid}"):
            train.main(flags)
    finally:
        other.kill()
        other.wait()
    train.main(flags)   # the holder is gone: taken over, trained, saved, given back
    assert (tmp_path / "ckpt" / "latest").exists() and not (tmp_path / "ckpt" / LOCK).exists()


ORPHAN = """
import os, sys, time
sys.path.insert(0, {root!r})
from megatron_longstraw.runtime.parent_watch import watch_parent
assert watch_parent(0.1) is not None
open({ready!r}, "w").write(str(os.getpid()))
time.sleep(60)
"""


def test_a_worker_whose_torchrun_died_stops(tmp_path):
    """torchrun (1 worker) is killed with SIGKILL: it cannot end its worker, which notices that
    its parent changed and exits with one line instead of running on."""
    script, ready = tmp_path / "worker.py", tmp_path / "ready"
    script.write_text(ORPHAN.format(root=str(ROOT), ready=str(ready)))
    with processes.Job(
            [processes.TORCHRUN, "--standalone", "--nproc-per-node", "1",
             "--log-dir", str(tmp_path / "logs"), "--redirects", "3", str(script)],
            env={"PATH": "/usr/bin:/bin", **{k: v for k, v in os.environ.items()
                                             if k in ("TORCHDYNAMO_DISABLE",)}}) as torchrun:
        torchrun.wait_for(lambda: ready.exists() and ready.read_text(), "the worker to start")
        worker = int(ready.read_text())
        os.kill(torchrun.pid, signal.SIGKILL)
        torchrun.proc.wait()
        deadline = time.time() + 10
        while _alive(worker):
            assert time.time() < deadline, "the orphaned worker runs on"
            time.sleep(0.1)
    logged = "".join(p.read_text() for p in (tmp_path / "logs").glob("*/attempt_0/0/stderr.log"))
    assert f"the launcher (torchrun, pid {torchrun.pid}) is gone; this worker stops" in logged


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_no_watch_outside_torchrun(monkeypatch):
    from megatron_longstraw.runtime.parent_watch import watch_parent

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert watch_parent() is None
