"""When a run stops before --train-iters: Megatron's exit flags, checked after every step.

    --exit-signal-handler       SIGTERM / SIGUSR1 (SLURM's preemption and time-limit warnings;
                                also --exit-signal when it names another one) are caught: the
                                current step finishes
    --exit-duration-in-mins N   the run has been going for N minutes (since the launcher started)
    --exit-interval N           the step just finished is a multiple of N (counted from step 0,
                                as Megatron's iteration)

On any of them the launcher saves a checkpoint (when --save is set, whatever --save-interval says)
and returns normally: exit code 0, and a resume (--load) continues from the next step with the
next learning rate. The ranks agree on the decision (one small MAX all-reduce per step), so a
signal delivered to one process stops every process after the same step.

Under torchrun the signal usually reaches torchrun (srun forwards it to its task; SLURM's
preemption signals every process of the step): torchrun forwards it to the workers and SIGKILLs
them after its --shutdown-timeout (default 30 s), so that timeout must cover the rest of a step
plus the save; torchrun then exits 1 whatever the workers did (the SLURM scripts read the saved
checkpoint's meta.json "stopped" to end the job with 0).
"""

from __future__ import annotations

import signal
import time


class ExitConditions:
    """Installs the signal handlers (with --exit-signal-handler) until `close()`; `check` after
    each step says why to stop, or None. Collective: every rank calls `check` once per step."""

    def __init__(self, args, start: float | None = None):
        self.interval = args.exit_interval
        self.duration_s = (args.exit_duration_in_mins * 60.0
                           if args.exit_duration_in_mins is not None else None)
        self.start = time.perf_counter() if start is None else start
        self.received: list[int] = []
        self._previous: dict[int, object] = {}
        if args.exit_signal_handler:
            wanted = {signal.SIGTERM, signal.SIGUSR1, signal.Signals(int(args.exit_signal))}
            for sig in sorted(wanted):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received.append(signum)

    def check(self, steps_done: int) -> str | None:
        """After `steps_done` steps (the last one finished): the reason to stop, agreed on by every
        rank, or None."""
        from megatron_longstraw.distributed.agreement import any_rank

        elapsed = time.perf_counter() - self.start
        local = [bool(self.received),
                 self.duration_s is not None and elapsed > self.duration_s,
                 bool(self.interval) and steps_done % self.interval == 0]
        by_signal, by_time, by_interval = any_rank(local)
        if by_signal:
            names = sorted({signal.Signals(s).name for s in self.received}) or ["a signal"]
            return f"{'/'.join(names)} received (--exit-signal-handler)"
        if by_time:
            return (f"--exit-duration-in-mins {self.duration_s / 60:g} reached "
                    f"({elapsed / 60:.1f} min)")
        if by_interval:
            return f"--exit-interval {self.interval}"
        return None

    def close(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def __enter__(self) -> "ExitConditions":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
