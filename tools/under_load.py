"""Run a command (the test suite, or some of its tests) with every core kept busy by other work,
several times in a row: how CI and shared machines run it, on purpose.

    python tools/under_load.py --repeat 5 -- .venv/bin/python -m pytest -q tests/test_parent_watch.py
    make test-under-load                     # the multi-process tests, 5 times, both cores busy

`--burners N` (default: one per core) processes spin in pure Python at the same priority as the
command, for as long as it runs; each run's exit code, wall time and load average are printed, and
the tool exits 1 if any run failed. The burners are ended however the tool ends (their own process
group, killed in a `finally`). Use it before a change to the multi-process tests lands
(docs/usage.md, "Testing under load").
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

BURN = "while True:\n    pass\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--burners", type=int, default=os.cpu_count() or 1,
                        help="busy processes beside the command (default: one per core)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of the command, in a row")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    if args.burners < 0 or args.repeat < 1:
        parser.error("--burners must be >= 0 and --repeat >= 1")

    burners = [subprocess.Popen([sys.executable, "-c", BURN], start_new_session=True)
               for _ in range(args.burners)]
    failed = 0
    try:
        time.sleep(1.0)   # the burners are running before the command starts
        for run in range(1, args.repeat + 1):
            start = time.monotonic()
            code = subprocess.call(command)
            wall = time.monotonic() - start
            load = " ".join(f"{x:.1f}" for x in os.getloadavg())
            print(f"under_load: run {run}/{args.repeat}: exit {code}, {wall:.0f} s, "
                  f"{args.burners} burners, load average {load}", flush=True)
            failed += code != 0
    finally:
        for proc in burners:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print(f"under_load: {args.repeat - failed} of {args.repeat} runs passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
