"""Commands a test starts (torchrun and its workers, tools), always ended as a whole tree, and
waited on with bounds that a loaded machine does not break.

Every process of a job carries one environment variable, `LONGSTRAW_TEST_JOB=<session>-<n>`,
set when the job starts and inherited by everything under it: torchrun's workers are in sessions
of their own (torch starts them with `start_new_session=True`) and an orphan is re-parented, so
neither the process group nor the parent chain finds them all; the variable does
(`/proc/<pid>/environ`). A job's `kill()` (on leaving its `with`, however the test ended) and the
session's last hook (conftest.py) SIGKILL every process that carries it.

Waits are bounded by progress, not by the clock alone. On two cores beside other work a step can
take ten times as long as on an idle machine, but the job still uses CPU and writes output; a hung
job (every process waiting on another) does neither. `wait_for` fails when the job has used
`cpu_budget_s` CPU seconds (its processes' user + system time, summed over every process seen)
without the awaited condition, or when it made no progress (no CPU time, no output, no process
started or ended) for `stall_s` wall seconds, or past `wall_s`, a last bound far above either.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

MARK = "LONGSTRAW_TEST_JOB"
SESSION = uuid.uuid4().hex[:12]
ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = str(ROOT / ".venv" / "bin" / "torchrun")
TICK = os.sysconf("SC_CLK_TCK")
_count = 0

CPU_BUDGET_S = 1800.0
"""CPU seconds a job may use before the awaited condition holds (the longest of these jobs uses
about 200 on an idle machine)."""
STALL_S = 300.0
"""Wall seconds without any progress that count as a hang (under a load of 25 on two cores a
worker still gets several CPU seconds a minute)."""
WALL_S = 5400.0
"""The last bound: CI's whole budget."""


def marked_pids(value: str, prefix: bool = False) -> list[int]:
    """Processes whose environment holds MARK=value (or a value starting with it)."""
    needle = f"{MARK}={value}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        for item in env.split(b"\0"):
            if item == needle or (prefix and item.startswith(needle)):
                found.append(int(entry.name))
                break
    return found


def cpu_ticks(pid: int, thread: int | None = None) -> int | None:
    """User + system clock ticks of a live process, or of one of its threads (`thread`: its
    id; the main thread's is the pid). None once it is gone or a zombie."""
    stat = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    try:
        fields = Path(stat).read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":
        return None
    return int(fields[11]) + int(fields[12])


def alive(pid: int) -> bool:
    return cpu_ticks(pid) is not None


def kill_marked(value: str, prefix: bool = False, wait_s: float = 30.0) -> list[int]:
    """SIGKILL every process carrying the mark and wait until they are gone; returns their pids."""
    killed = []
    deadline = time.monotonic() + wait_s
    while True:
        pids = [p for p in marked_pids(value, prefix) if p != os.getpid() and alive(p)]
        if not pids or time.monotonic() > deadline:
            return killed
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed += [p for p in pids if p not in killed]
        time.sleep(0.05)


class JobFailed(AssertionError):
    pass


class Job:
    """One command and everything it starts. Use as a context manager:

        with Job([TORCHRUN, ...], env=env) as job:
            job.wait_for(lambda: "step 0" in log(), "rank 0 logs step 0")
            ...
        # every process of the job is gone here

    `stdout` / `stderr` are read from files (no pipe to fill; readable until the `with` ends);
    `merge_stderr` sends stderr to stdout."""

    def __init__(self, argv: list[str], env: dict | None = None, cwd: Path | str = ROOT,
                 merge_stderr: bool = False):
        global _count
        _count += 1
        self.mark = f"{SESSION}-{_count}"
        env = dict(os.environ if env is None else env)
        env[MARK] = self.mark
        self._dir = tempfile.TemporaryDirectory(prefix="longstraw-job-")
        self._out = Path(self._dir.name) / "stdout"
        self._err = None if merge_stderr else Path(self._dir.name) / "stderr"
        self.argv = argv
        # Append mode: the child writes at the end whatever offset a reader's handle has.
        with open(self._out, "ab") as out, open(self._err or os.devnull, "ab") as err:
            self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                         stdout=out,
                                         stderr=subprocess.STDOUT if merge_stderr else err,
                                         start_new_session=True)
        self.pid = self.proc.pid
        self._ticks: dict[int, int] = {}
        self._seen_size = 0

    # -- output -------------------------------------------------------------------------------
    @staticmethod
    def _read(path: Path | None) -> str:
        return path.read_bytes().decode(errors="replace") if path is not None else ""

    @property
    def stdout(self) -> str:
        return self._read(self._out)

    @property
    def stderr(self) -> str:
        return self._read(self._err)

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def tail(self, chars: int = 4000) -> str:
        return f"$ {' '.join(map(str, self.argv))}\n" + (self.stdout + self.stderr)[-chars:]

    # -- progress -----------------------------------------------------------------------------
    def pids(self) -> list[int]:
        """Live processes of the job (torchrun, its workers, their children, orphans too)."""
        return [p for p in marked_pids(self.mark) if alive(p)]

    def cpu_seconds(self) -> float:
        """CPU seconds used by every process of the job seen so far (a process's last reading
        is kept after it ends)."""
        for pid in self.pids():
            ticks = cpu_ticks(pid)
            if ticks is not None:
                self._ticks[pid] = max(ticks, self._ticks.get(pid, 0))
        return sum(self._ticks.values()) / TICK

    def _progress(self, watch_files) -> tuple:
        extra = watch_files() if callable(watch_files) else watch_files
        files = [self._out, self._err, *map(Path, extra)]
        sizes = tuple(f.stat().st_size if f is not None and f.exists() else -1 for f in files)
        return (round(self.cpu_seconds(), 2), sizes, tuple(sorted(self._ticks)))

    def wait_for(self, condition, what: str, cpu_budget_s: float = CPU_BUDGET_S,
                 stall_s: float = STALL_S, wall_s: float = WALL_S, poll_s: float = 0.05,
                 watch_files=(), exit_ok: bool = False) -> float:
        """Until `condition()` holds; returns the wall seconds waited. Fails (and ends the job)
        when the command exits first (unless `exit_ok`), on the CPU budget, on a stall or past
        `wall_s` (module docstring). `watch_files` (paths, or a function returning them: e.g.
        the workers' logs, which appear later) count as output."""
        start = time.monotonic()
        last_change, last = start, None
        next_probe = start
        while True:
            if condition():
                return time.monotonic() - start
            now = time.monotonic()
            if self.proc.poll() is not None and not exit_ok:
                if condition():
                    return now - start
                self.kill()
                raise JobFailed(f"waiting for {what}: the command exited with "
                                f"{self.proc.returncode} first\n{self.tail()}")
            if now >= next_probe:            # /proc scans twice a second, not every poll
                next_probe = now + 0.5
                state = self._progress(watch_files)
                if state != last:
                    last, last_change = state, now
                reason = None
                if state[0] > cpu_budget_s:
                    reason = f"the job used {state[0]:.0f} CPU s (budget {cpu_budget_s:.0f})"
                elif now - last_change > stall_s:
                    reason = f"no progress (CPU time, output, processes) for {stall_s:.0f} s"
                elif now - start > wall_s:
                    reason = f"{wall_s:.0f} s passed"
                if reason:
                    self.kill()
                    raise JobFailed(f"waiting for {what}: {reason}\n{self.tail()}")
            time.sleep(poll_s)

    def wait(self, **bounds) -> int:
        """Until the command exits; its exit code (its processes may outlive it: see kill)."""
        self.wait_for(lambda: self.proc.poll() is not None, "the command to exit",
                      exit_ok=True, **bounds)
        return self.proc.returncode

    # -- the end ------------------------------------------------------------------------------
    def kill(self) -> list[int]:
        """SIGKILL every process of the job, whichever session or parent it has now; returns
        the pids that were still alive."""
        killed = kill_marked(self.mark)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        return killed

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
        self._dir.cleanup()


def run(argv: list[str], env: dict | None = None, cwd: Path | str = ROOT, **bounds):
    """subprocess.run's shape (returncode, stdout, stderr as text) for a job waited on by
    progress (module docstring); everything it started is gone when this returns."""
    with Job(argv, env=env, cwd=cwd) as job:
        job.wait(**bounds)
        return subprocess.CompletedProcess(argv, job.returncode, job.stdout, job.stderr)
