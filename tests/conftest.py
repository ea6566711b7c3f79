import os
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import pytest  # noqa: E402

import processes  # noqa: E402

# Every process this session starts carries the session's mark (tests/processes.py): the ones a
# Job starts get their own, the rest (multiprocessing ranks, tools run with the inherited
# environment) inherit this one.
os.environ[processes.MARK] = f"{processes.SESSION}-0"


@pytest.fixture(scope="session")
def single_process():
    """A one-process gloo group with Megatron's parallel state (CP = EP = 1)."""
    from megatron_longstraw.distributed import parallel

    parallel.initialize(context_parallel_size=1, expert_parallel_size=1)
    yield


HELPERS = (b"multiprocessing.forkserver", b"multiprocessing.resource_tracker")
"""The session's own helpers (multiprocessing's fork server and resource tracker, started once for
tests/distributed.py): they live until the session ends by design."""


def pytest_sessionfinish(session, exitstatus):
    """No process a test started outlives the suite: each one left is named and killed."""
    left = {}
    for pid in processes.marked_pids(processes.SESSION, prefix=True):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if pid != os.getpid() and processes.alive(pid) and not any(h in cmdline for h in HELPERS):
            left[pid] = cmdline.replace(b"\0", b" ").decode(errors="replace")[:160]
    processes.kill_marked(processes.SESSION, prefix=True)
    if left:
        print(f"\n{len(left)} process(es) outlived their tests and were killed:")
        for pid, cmdline in left.items():
            print(f"  {pid}: {cmdline}")
