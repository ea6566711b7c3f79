"""Environment worker processes (`WorkerEnvs`, env.py's module docstring): each member's
environment lives in a process of its own, so a call that hangs can be stopped (the process is
killed) and one that crashes the interpreter costs only its member.

    parent (generate, CP rank 0)                     worker (python -m this module)
    ------------------------------                   ------------------------------------------
    lease one worker per member (idle ones first)    imports only env.py (no torch), then the
                                                     environment's own module on "make"
    "make"  spec, meta, prompt ids -> stop ids       factory(meta, prompt_ids, tokenizer) and
                                                     check_environment; the env stays here
    "step"  turn ids -> a checked EnvStep            env.step, then plain_step: only plain
                                                     values come back
    "reset" at the end of the rollout                the env is dropped; the worker goes back
                                                     to the idle pool for the next rollout

The parent waits on the workers' pipes (`multiprocessing.connection.wait`), no threads: the calls
due at one decode step are sent together (at most `max_concurrency` in flight), and a call past
its deadline is answered by killing its worker (SIGKILL) and ending its member; a worker whose
pipe closes (os._exit, a segfault) ends its member with its exit code. A killed or dead worker is
never reused. The workers are plain subprocesses, not multiprocessing children: nothing of theirs
is joined at exit, `atexit` kills every worker still running, and a worker whose parent is gone
exits by itself (it polls its parent id once a second, and ends on its pipe's EOF), so a hung
tool never holds the launcher after its receipt. A worker ignores SIGINT: the parent decides.

The factory receives the prompt ids as a list of int (the worker does not import torch), and the
tokenizer pickled (sent once per worker). Making the environments may take longer than a call
(the worker starts, the environment's module is imported): it has `max(timeout_s, MAKE_S)`.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait

from megatron_longstraw.rollout.env import (
    EnvError,
    EnvLimits,
    EnvStep,
    load_env_factory,
    make_environment,
    plain_step,
    timeout_reason,
)

MAKE_S = 60.0
"""Seconds a worker may take to start and make its environment (python start, the
environment's module imported, the factory), at least."""
MAX_IDLE = 64
"""Idle workers kept for later rollouts; more are ended."""
_idle: list[_Worker] = []
_running: set[_Worker] = set()


class _Worker:
    """One worker process and its two pipes."""

    def __init__(self):
        child_read, parent_write = os.pipe()
        parent_read, child_write = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_longstraw.rollout.env_workers", str(child_read),
             str(child_write)], pass_fds=(child_read, child_write), stdin=subprocess.DEVNULL)
        os.close(child_read)
        os.close(child_write)
        self.inbox = Connection(parent_write, readable=False)
        self.reply = Connection(parent_read, writable=False)
        self.tokenizer_id: int | None = None
        self.ready = False
        _running.add(self)
        self.send(("path", list(sys.path)))   # the worker answers once it can import as we do

    def send(self, message) -> None:
        self.inbox.send(message)

    def ended(self) -> str:
        """How the process ended (it closed its pipe): its exit code or signal."""
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            return "its pipe closed; the process was stopped"
        self.close()
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    def kill(self) -> None:
        self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.close()

    def close(self) -> None:
        _running.discard(self)
        for conn in (self.inbox, self.reply):
            conn.close()


def _lease(count: int) -> list[_Worker]:
    leased = [_idle.pop() for _ in range(min(count, len(_idle)))]
    return leased + [_Worker() for _ in range(count - len(leased))]


def _release(worker: _Worker) -> None:
    try:
        worker.send(("reset",))
    except OSError:
        worker.kill()
        return
    if len(_idle) < MAX_IDLE:
        _idle.append(worker)
    else:
        worker.kill()


@atexit.register
def shutdown() -> None:
    """Kill every worker still running, idle ones included (at exit, and at the launcher's end:
    module docstring)."""
    for worker in list(_running):
        worker.kill()
    _idle.clear()


class WorkerEnvs:
    """The members' environments, each made by `spec`'s factory in a worker process of its own
    (module docstring); `start` makes them, `call` runs the due steps, `close` returns the
    workers."""

    def __init__(self, spec: str, meta, prompt_ids, tokenizer, count: int):
        self.spec, self.meta, self.tokenizer, self.count = spec, meta, tokenizer, count
        self.prompt_ids = [int(i) for i in prompt_ids]
        self.workers: list[_Worker | None] = []

    def __len__(self) -> int:
        return self.count

    def start(self, limits: EnvLimits) -> list[tuple[int, ...]]:
        """Make each member's environment in its worker -> each one's stop ids; ValueError when
        the factory fails (raises, returns no environment, one that would never be called,
        does not return in time): the run's error, not a member's."""
        self.workers = _lease(self.count)
        allowed_s = max(limits.timeout_s, MAKE_S)
        deadline = time.monotonic() + allowed_s
        fresh = [w for w in self.workers if not w.ready]
        self._check(fresh, _gather(fresh, deadline, allowed_s))   # new workers' "path" replies
        for worker in self.workers:
            worker.ready = True
            if self.tokenizer is not None and worker.tokenizer_id != id(self.tokenizer):
                worker.send(("tokenizer", self.tokenizer))
                worker.tokenizer_id = id(self.tokenizer)
            worker.send(("make", self.spec, self.meta, self.prompt_ids, limits.turn_tokens))
        replies = _gather(self.workers, deadline, allowed_s)
        self._check(self.workers, replies)
        return [tuple(value) for _, value in replies]

    def _check(self, workers: list[_Worker], replies: list) -> None:
        """Raise the first failure's message (the workers that failed are gone already)."""
        failed = [reply for reply in replies if isinstance(reply, str)]
        if failed:
            gone = {id(w) for w, reply in zip(workers, replies) if isinstance(reply, str)}
            self.workers = [None if id(w) in gone else w for w in self.workers]
            raise ValueError(failed[0])

    def call(self, due: list[tuple[int, list[int]]], limits: EnvLimits) -> list[EnvStep | str]:
        """`step(turn)` of each (member, turn) of `due` in the member's worker, at most
        `limits.max_concurrency` in flight -> per call the checked step or "env error: ..."."""
        outcomes: list[EnvStep | str] = [""] * len(due)
        queue = list(range(len(due)))
        in_flight: dict[Connection, tuple[int, int, float]] = {}
        while queue or in_flight:
            while queue and len(in_flight) < limits.max_concurrency:
                index = queue.pop(0)
                member, turn = due[index]
                worker = self.workers[member]
                if worker is None:
                    outcomes[index] = "env error: the member's worker process had ended"
                    continue
                try:
                    worker.send(("step", [int(i) for i in turn]))
                except OSError:
                    outcomes[index] = f"env error: the member's worker process had ended " \
                                      f"({worker.ended()})"
                    self.workers[member] = None
                    continue
                in_flight[worker.reply] = (index, member, time.monotonic() + limits.timeout_s)
            if not in_flight:
                break
            first_deadline = min(deadline for *_, deadline in in_flight.values())
            for conn in wait(list(in_flight), timeout=max(0.0, first_deadline - time.monotonic())):
                index, member, _ = in_flight.pop(conn)
                worker = self.workers[member]
                try:
                    kind, value = conn.recv()
                except (EOFError, OSError):
                    outcomes[index] = f"env error: env.step ended its worker process " \
                                      f"({worker.ended()})"
                    self.workers[member] = None
                    continue
                outcomes[index] = value if kind == "ok" else f"env error: {value}"
            now = time.monotonic()
            for conn, (index, member, deadline) in list(in_flight.items()):
                if now >= deadline:
                    del in_flight[conn]
                    self.workers[member].kill()
                    self.workers[member] = None
                    outcomes[index] = timeout_reason(limits, "its worker process was stopped")
        return outcomes

    def close(self) -> None:
        """Every live worker back to the idle pool (its environment dropped)."""
        for worker in self.workers:
            if worker is not None:
                _release(worker)
        self.workers = []


def _gather(workers: list[_Worker], deadline: float, allowed_s: float) -> list:
    """One reply of each worker by `deadline` -> ("ok", its value) or an error message (its
    "error" reply; a worker that died or missed the deadline: stopped, message)."""
    replies: list = [None] * len(workers)
    waiting = {worker.reply: index for index, worker in enumerate(workers)}
    while waiting:
        ready = wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        for conn in ready:
            index = waiting.pop(conn)
            try:
                kind, value = conn.recv()
            except (EOFError, OSError):
                replies[index] = (f"the environment worker process ended while making the "
                                  f"environment ({workers[index].ended()})")
                continue
            replies[index] = ("ok", value) if kind == "ok" else value
    for conn, index in waiting.items():
        workers[index].kill()
        replies[index] = ("the environment worker did not start and make its environment "
                          f"within {allowed_s:g} s (the factory hangs?)")
    return replies


def probe_factory(spec: str, meta, prompt_ids, tokenizer, limits: EnvLimits) -> tuple[int, ...]:
    """Make one environment up front, as a rollout would (the launcher, before the model loads)
    -> its stop ids; ValueError naming what is wrong."""
    envs = WorkerEnvs(spec, meta, prompt_ids, tokenizer, 1)
    try:
        return envs.start(limits)[0]
    finally:
        envs.close()


# ---- the worker ---------------------------------------------------------------------------------


def _serve(read_fd: int, write_fd: int) -> None:
    """The worker's loop (module docstring): one request at a time, until its pipe closes."""
    import signal
    import threading

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="longstraw-env-parent").start()
    inbox = Connection(read_fd, writable=False)
    outbox = Connection(write_fd, readable=False)
    env = tokenizer = None
    while True:
        try:
            message = inbox.recv()
        except EOFError:
            return
        except Exception as exc:     # a message that cannot be unpickled here (the tokenizer)
            outbox.send(("error", f"the environment worker could not read its request: "
                                  f"{type(exc).__name__}: {exc}"))
            continue
        kind = message[0]
        if kind == "path":
            sys.path[:] = message[1]
            outbox.send(("ok", None))
        elif kind == "tokenizer":
            tokenizer = message[1]
        elif kind == "reset":
            env = None
        elif kind == "make":
            spec, meta, prompt_ids, turn_tokens = message[1:]
            try:
                env, stop_ids = make_environment(load_env_factory(spec), spec, meta, prompt_ids,
                                                 tokenizer, turn_tokens)
                outbox.send(("ok", stop_ids))
            except BaseException as exc:
                env = None
                outbox.send(("error", str(exc) if isinstance(exc, ValueError) else
                             f"the environment factory {spec} raised {type(exc).__name__}: {exc}"))
        elif kind == "step":
            try:
                outbox.send(("ok", plain_step(env.step(message[1]))))
            except BaseException as exc:
                outbox.send(("error", str(exc) if isinstance(exc, EnvError) else
                             f"env.step raised {type(exc).__name__}: {exc}"))


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
