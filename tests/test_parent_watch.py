"""torchrun killed with SIGKILL (it cannot end its workers: they run in sessions of their own) while
its workers import, wait in the rendezvous, wait in a collective, or run a step: every worker of
the real launcher (examples/pretrain_gpt.py, tiny GLM-5.2, CP2/EP2) stops within seconds and
writes nothing more (runtime/parent_watch.py). tests/stall_entry.py holds rank 1 at the point,
so rank 0 waits on it there."""

import os
import signal
import time
from pathlib import Path

import pytest

import processes

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "glm52" / "tiny.yaml")
GONE_WITHIN_S = 30.0
"""The watch polls once a second; the rest is the scheduler reaching a thread on a loaded
machine (measured: 1-2 s idle)."""


def _workers(job: processes.Job) -> list[int]:
    """The job's processes that run the launcher script (not torchrun itself)."""
    out = []
    for pid in job.pids():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if pid != job.pid and any(part.endswith((b"stall_entry.py", b"pretrain_gpt.py"))
                                  for part in cmdline):
            out.append(pid)
    return out


def _maps_torch(pid: int) -> bool:
    try:
        return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _launch(tmp_path: Path, phase: str) -> tuple[processes.Job, Path, Path, Path]:
    marks, logs, ckpt = tmp_path / "marks", tmp_path / "logs", tmp_path / "ckpt"
    marks.mkdir()
    job = processes.Job(
        [processes.TORCHRUN, "--standalone", "--nproc-per-node", "2", "--log-dir", str(logs),
         "--redirects", "3", str(ROOT / "tests" / "stall_entry.py"), "--longstraw",
         "--longstraw-config", TINY, "--context-parallel-size", "2",
         "--expert-model-parallel-size", "2", "--train-iters", "50",
         # Steps of seconds where the kill lands in one; the other phases never reach a step.
         "--longstraw-synthetic-prompt-len", "4096" if phase == "step" else "256",
         "--longstraw-synthetic-response-len", "4",
         "--longstraw-group-size", "2", "--longstraw-out-dir", str(tmp_path / "runs"),
         "--longstraw-run-name", "t", "--no-longstraw-live-bytes", "--save", str(ckpt),
         "--save-interval", "2"],
        merge_stderr=True, cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "TORCHDYNAMO_DISABLE": "1", "PYTHONWARNINGS": "ignore",
             "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "STALL_PHASE": phase,
             "STALL_DIR": str(marks)})
    return job, marks, logs, ckpt


def _still(pid: int, seconds: float) -> bool:
    """The process's main thread (where the launcher's Python and, with OMP_NUM_THREADS=1, its
    compute run) used at most 2% of a core over `seconds`: it waits (on a peer), it does not
    compute. The whole process is not still: Megatron's gloo groups run about 70
    `gloo_tcp_loop` threads that wake on their own (together 3-4% of a core, measured), and
    CPU time is counted in whole ticks."""
    before = processes.cpu_ticks(pid, thread=pid)
    time.sleep(seconds)
    after = processes.cpu_ticks(pid, thread=pid)
    return None not in (before, after) and (after - before) / processes.TICK <= 0.02 * seconds


@pytest.mark.parametrize("phase", ["import", "rendezvous", "collective", "step"])
def test_workers_stop_when_torchrun_is_killed(tmp_path, phase):
    began = time.monotonic()
    job, marks, logs, ckpt = _launch(tmp_path, phase)

    def rank0() -> str:
        return "".join(p.read_text() for p in sorted(logs.glob("*/attempt_0/0/*.log")))

    with job:
        if phase == "import":
            # Both workers exist and are loading torch; none has set up its process group.
            job.wait_for(lambda: len(_workers(job)) == 2 and all(map(_maps_torch, _workers(job))),
                         "both workers to be importing torch")
            assert "step" not in rank0()
        elif phase in ("rendezvous", "collective"):
            job.wait_for(lambda: {m.name for m in marks.iterdir()} >= {
                f"{phase}-0", f"{phase}-1", "held-1"}, f"both ranks at the {phase}",
                watch_files=lambda: logs.glob("*/attempt_0/*/*.log"))
            waiting = int((marks / f"{phase}-0").read_text())
            print(f"{phase}: both ranks there after {time.monotonic() - began:.1f} s")
            # Rank 0 is inside the rendezvous / collective, waiting for rank 1: no CPU used.
            job.wait_for(lambda: _still(waiting, 2.0), f"rank 0 to wait in the {phase}")
        else:
            job.wait_for(lambda: "step     0 |" in rank0(), "rank 0 to log step 0",
                         watch_files=lambda: logs.glob("*/attempt_0/*/*.log"))
        print(f"{phase}: ready to kill after {time.monotonic() - began:.1f} s")
        workers = _workers(job)
        assert len(workers) == 2, workers
        os.kill(job.pid, signal.SIGKILL)
        start = time.monotonic()
        while any(map(processes.alive, workers)) and time.monotonic() - start < GONE_WITHIN_S:
            time.sleep(0.05)
        gone_s = time.monotonic() - start
        survivors = [p for p in workers if processes.alive(p)]
    print(f"{phase}: workers gone {gone_s:.2f} s after torchrun's SIGKILL")
    assert not survivors, f"{phase}: workers {survivors} still alive after {GONE_WITHIN_S} s"
    # Each worker says why it stopped, in one line (the watch's, or the entry point's when the
    # launcher's end reached it first as an error: the store gone, the peer gone).
    for rank in (0, 1):
        log = "".join(p.read_text() for p in logs.glob(f"*/attempt_0/{rank}/stderr.log"))
        assert f"error: rank {rank}: the launcher (torchrun, pid {job.pid}) is gone" in log, \
            log[-2000:]
        assert "Traceback" not in log, log[-3000:]
    # Nothing written after the kill: no checkpoint (the first is due after step 1), no receipt.
    assert not list(ckpt.glob("step_*")) and not (ckpt / "latest").exists(), list(ckpt.iterdir())
    assert not list((tmp_path / "runs").glob("**/receipt.json"))
