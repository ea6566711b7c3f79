"""One writer per save folder: `<save>/longstraw.lock`, held by rank 0 of the run that writes it.

Two jobs saving into one `--save` folder overwrite each other's `latest` and steps (an orphaned
worker of a killed job next to its resubmission, two submissions of one script). The launcher
takes the lock before building the model and gives it back when it ends (`holding`); the file
records the holder

    {"host", "pid", "pid_start" (Linux: the process's start time, so a reused pid is not taken
     for the holder), "job" (SLURM_JOB_ID or torchrun's run id), "since" (epoch seconds)}

and its modification time is the holder's heartbeat (touched every `HEARTBEAT_S`). A second
run finds the file and

- refuses, naming the holder, while the holder lives: on the same host its pid runs (with the
  recorded start time); on another host its heartbeat is younger than `STALE_S`;
- takes the lock over, saying so, when the holder is gone (pid not running on this host, or no
  heartbeat for `STALE_S` from another host): a run killed with SIGKILL, or whose node died.

The lock is created atomically (written aside, then hard-linked into place: a link fails when
the name exists, also on NFS), so two runs racing for a free folder cannot both win.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path

from megatron_longstraw.runtime.errors import CheckpointError

LOCK = "longstraw.lock"
HEARTBEAT_S = 30.0
"""How often the holder touches the lock."""
STALE_S = 300.0
"""A lock held from another host without a heartbeat for this long belongs to a dead job."""


def _pid_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), None elsewhere / not running."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _running(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process: it runs
        pass
    now = _pid_start(pid)
    return start is None or now is None or now == start


def _holder_record() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _pid_start(os.getpid()),
            "job": os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID"),
            "since": time.time()}


def _describe(holder: dict) -> str:
    job = f", job {holder['job']}" if holder.get("job") else ""
    since = holder.get("since")
    when = (f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}"
            if isinstance(since, (int, float)) else "")
    return f"process {holder.get('pid')} on {holder.get('host')}{job}{when}"


class SaveLock:
    """The lock of one save folder, held by this process (`acquire`, `release`)."""

    def __init__(self, save_dir: str | os.PathLike, heartbeat_s: float = HEARTBEAT_S,
                 stale_s: float = STALE_S):
        self.save_dir = Path(save_dir)
        self.path = self.save_dir / LOCK
        self.heartbeat_s, self.stale_s = heartbeat_s, stale_s
        self.record = _holder_record()
        self.message: str | None = None
        """What acquiring did besides taking a free lock (a stale one taken over)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> "SaveLock":
        """Take the lock, or raise CheckpointError naming the live holder (module docstring)."""
        self.save_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(3):   # a lock released, or taken over by another, between our steps
            if self._create():
                self._start_heartbeat()
                return self
            holder = self._read()
            if holder is None:
                continue
            stale = self._stale_reason(holder)
            if stale is None:
                raise CheckpointError(
                    f"--save {self.save_dir} is in use by another run: {_describe(holder)} holds "
                    f"{self.path}. Two runs saving into one folder overwrite each other's "
                    "checkpoints: stop that run or pass another --save (if that run is gone, "
                    "delete the lock file).")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self.message = (f"took over the save lock {self.path} of {_describe(holder)}: "
                            f"{stale}")
        raise CheckpointError(f"--save {self.save_dir}: could not take {self.path} (another run "
                              "keeps taking it); pass another --save.")

    def _create(self) -> bool:
        aside = self.save_dir / f".{LOCK}.{self.record['host']}.{os.getpid()}"
        aside.write_text(json.dumps(self.record) + "\n")
        try:
            os.link(aside, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            aside.unlink()

    def _read(self) -> dict | None:
        """The holder's record; None when the lock went away meanwhile. A damaged record (a
        holder killed while writing it cannot be: it is linked complete) reads as unknown."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        try:
            holder = json.loads(text)
        except ValueError:
            holder = None
        return holder if isinstance(holder, dict) else {"host": "?", "pid": "?"}

    def _stale_reason(self, holder: dict) -> str | None:
        """Why the holder is gone, or None when it may still run."""
        if holder.get("host") == self.record["host"] and isinstance(holder.get("pid"), int):
            if holder["pid"] == os.getpid():
                return "this process (a run before in it ended without giving it back)"
            if not _running(holder["pid"], holder.get("pid_start")):
                return "that process no longer runs"
            return None
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return "it was given back"
        if age > self.stale_s:
            return f"no heartbeat for {age:.0f} s (over {self.stale_s:.0f} s)"
        return None

    def _start_heartbeat(self) -> None:
        def beat():
            while not self._stop.wait(self.heartbeat_s):
                with contextlib.suppress(OSError):
                    os.utime(self.path)

        self._thread = threading.Thread(target=beat, name="longstraw-save-lock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Give the lock back (only if it is still this process's)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        holder = self._read()
        if holder is not None and holder.get("pid") == os.getpid() \
                and holder.get("host") == self.record["host"]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


@contextlib.contextmanager
def holding(save_dir: str | os.PathLike | None, rank: int):
    """The launcher's lock on --save for the run (nothing without --save): rank 0 takes it, every
    rank raises when it is refused (collective). Yields what acquiring said (None: nothing to
    say)."""
    from megatron_longstraw.distributed.agreement import together

    if save_dir is None:
        yield None
        return
    lock = SaveLock(save_dir)
    together("save lock", lambda: lock.acquire() if rank == 0 else None)
    try:
        yield lock.message
    finally:
        if rank == 0:
            lock.release()
