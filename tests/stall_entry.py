"""examples/pretrain_gpt.py with one rank held at a chosen point (tests/test_parent_watch.py).

STALL_PHASE=rendezvous: rank 1 stops before `init_process_group`, so rank 0 waits inside it
(the TCP store rendezvous); STALL_PHASE=collective: rank 1 stops as the first capture begins, so
rank 0 waits in that capture's first collective; anything else: nothing is held. Each rank
writes STALL_DIR/<point>-<rank> (its pid) on reaching the point. The held rank sleeps in Python;
the launcher's own code runs unchanged, its parent watch started by its first statement.
"""

import os
import runpy
import sys
import time
from pathlib import Path

PHASE, RANK = os.environ.get("STALL_PHASE", ""), os.environ["RANK"]


def mark(point: str) -> None:
    """The mark file `<point>-<rank>` holding this pid, made whole in one rename (the test polls
    for the name and reads the pid at once: a plain write_text showed it empty once)."""
    final = Path(os.environ["STALL_DIR"], f"{point}-{RANK}")
    partial = final.with_name(f".{final.name}.partial")
    partial.write_text(str(os.getpid()))
    partial.rename(final)


def hold() -> None:
    mark("held")
    while True:
        time.sleep(1)


def hold_at(module, name: str) -> None:
    """Replace `module.name` by a wrapper that marks the point, holds rank 1 there, and lets
    rank 0 go on into the real function (where it then waits for rank 1)."""
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        mark(PHASE)
        if RANK == "1":
            hold()
        return real(*args, **kwargs)

    setattr(module, name, wrapper)


if PHASE == "rendezvous":
    import torch.distributed as dist

    hold_at(dist, "init_process_group")
elif PHASE == "collective":
    from megatron_longstraw.context import capture

    hold_at(capture, "capture_prompt")

entry = Path(__file__).resolve().parents[1] / "examples" / "pretrain_gpt.py"
sys.argv[0] = str(entry)
runpy.run_path(str(entry), run_name="__main__")
