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
    Path(os.environ["STALL_DIR"], f"{point}-{RANK}").write_text(str(os.getpid()))


def hold() -> None:
    mark("held")
    while True:
        time.sleep(1)


if PHASE == "rendezvous":
    import torch.distributed as dist

    real_init = dist.init_process_group

    def init_process_group(*args, **kwargs):
        mark("rendezvous")
        if RANK == "1":
            hold()
        return real_init(*args, **kwargs)

    dist.init_process_group = init_process_group
elif PHASE == "collective":
    from megatron_longstraw.context import capture

    real_capture = capture.capture_prompt

    def capture_prompt(*args, **kwargs):
        mark("collective")
        if RANK == "1":
            hold()
        return real_capture(*args, **kwargs)

    capture.capture_prompt = capture_prompt

entry = Path(__file__).resolve().parents[1] / "examples" / "pretrain_gpt.py"
sys.argv[0] = str(entry)
runpy.run_path(str(entry), run_name="__main__")
