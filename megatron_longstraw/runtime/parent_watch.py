"""A worker whose launcher died stops: no orphan writes on.

torchrun's agent starts the workers and ends them when it stops, but an agent killed with
SIGKILL (or whose node's job step was torn down) cannot: its workers are re-parented (to init or
a subreaper) and, without a check, keep training and saving into the folder a resubmitted job is
also using. `watch_parent` starts a daemon thread that compares `os.getppid()` with the parent
the worker started under, every `interval_s`; once it changed, the worker prints one line and
exits at once (`os._exit`: no further step or save; a save cut short leaves only a `.tmp-step_*`
folder, never read, and the previous checkpoint intact; checkpoint.py).

The watch must start before the worker's heavy imports: it learns the launcher as the parent
the worker has when it starts, and a launcher killed while the worker still imports torch and
Megatron (seconds; a minute on a loaded machine) would leave a worker whose parent is already
init, watching init forever. `examples/pretrain_gpt.py` therefore starts it in its first
statement, before anything else is imported; this module imports only the standard library, and
`training/train.py` `main` calls it again (a second call returns the running watch). What is
left is the interpreter's own start before that statement (about 0.05 s).

The thread needs the GIL once a second. Waits in gloo collectives, the TCP store rendezvous and
`time.sleep` release it (tests/test_parent_watch.py kills torchrun while the workers import, wait
in rendezvous, wait in a collective and run a step). A worker may also learn of the launcher's
end first as an error: the rendezvous store lived in torchrun, or the peer it waits on in a
collective already stopped. The entry point's handler (`errors.run_entry`) then checks
`orphaned()` and ends with the same line instead of that error's traceback. Polling rather than
`prctl(PR_SET_PDEATHSIG)`: the kernel sends that signal when the *thread* that forked the worker
exits, which need not be the agent's end; and it is Linux-only.
"""

from __future__ import annotations

import os
import sys
import threading
import time

EXIT_ORPHANED = 1
_watch: threading.Thread | None = None
_parent: int | None = None


def under_launcher() -> bool:
    """Started by torchrun (its workers carry TORCHELASTIC_RUN_ID)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def orphaned() -> bool:
    """The watch runs and this worker's launcher is gone (its parent is no longer the one the
    watch started under)."""
    return _parent is not None and os.getppid() != _parent


def exit_orphaned() -> None:
    """Print the one line and exit at once (`os._exit`: no step, save or cleanup runs on)."""
    rank = os.environ.get("RANK", "?")
    print(f"error: rank {rank}: the launcher (torchrun, pid {_parent}) is gone; this worker "
          "stops without writing anything more (the last complete checkpoint is intact).",
          file=sys.stderr, flush=True)
    os._exit(EXIT_ORPHANED)


def watch_parent(interval_s: float = 1.0) -> threading.Thread | None:
    """Start the watch (module docstring) when this process runs under torchrun; returns the
    thread, or None when there is no launcher to watch. Once started, later calls return the
    same thread: the launcher stays the parent the first call saw."""
    global _watch, _parent
    if not under_launcher():
        return None
    if _watch is not None and _watch.is_alive():
        return _watch
    _parent = os.getppid()

    def watch():
        while True:
            time.sleep(interval_s)
            if orphaned():
                exit_orphaned()

    _watch = threading.Thread(target=watch, name="longstraw-parent-watch", daemon=True)
    _watch.start()
    return _watch
