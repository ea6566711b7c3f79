"""A worker whose launcher died stops: no orphan writes on.

torchrun's agent starts the workers and ends them when it stops, but an agent killed with
SIGKILL (or whose node's job step was torn down) cannot: its workers are re-parented (to init or
a subreaper) and, without a check, keep training and saving into the folder a resubmitted job is
also using. `watch_parent` starts a daemon thread that compares `os.getppid()` with the parent
the worker started under, every `interval_s`; once it changed, the worker prints one line and
exits at once (`os._exit`: no further step or save; a save cut short leaves only a `.tmp-step_*`
folder, never read, and the previous checkpoint intact; checkpoint.py).

Polling rather than `prctl(PR_SET_PDEATHSIG)`: the kernel sends that signal when the *thread*
that forked the worker exits, which need not be the agent's end; and it is Linux-only.
"""

from __future__ import annotations

import os
import sys
import threading
import time

EXIT_ORPHANED = 1


def under_launcher() -> bool:
    """Started by torchrun (its workers carry TORCHELASTIC_RUN_ID)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def watch_parent(interval_s: float = 1.0) -> threading.Thread | None:
    """Start the watch (module docstring) when this process runs under torchrun; returns the
    thread, or None when there is no launcher to watch."""
    if not under_launcher():
        return None
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                rank = os.environ.get("RANK", "?")
                print(f"error: rank {rank}: the launcher (torchrun, pid {parent}) is gone; this "
                      "worker stops without writing anything more (the last complete checkpoint "
                      "is intact).", file=sys.stderr, flush=True)
                os._exit(EXIT_ORPHANED)

    thread = threading.Thread(target=watch, name="longstraw-parent-watch", daemon=True)
    thread.start()
    return thread
