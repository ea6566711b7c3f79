"""Run a function on N real processes over gloo (one machine), collect each rank's result.

The function must be importable (module-level) and picklable results come back through a queue.
A rank that raises reports its traceback; a run that exceeds `timeout` is killed and fails the
test instead of hanging it.
"""

from __future__ import annotations

import io
import os
import queue
import tempfile
import sys
import time
import traceback

import torch
import torch.multiprocessing as mp

TESTS = os.path.dirname(os.path.abspath(__file__))

# Ranks start from a fork server that has imported torch, Megatron-Core and this package once
# (about 6 s of imports a process otherwise: minutes over the suite on two cores). The server
# imports only; no parallel state, thread pool or RNG is set up before a rank forks, so each rank
# starts as a spawned one would, and `_worker` sets its environment first.
PRELOAD = ["torch", "megatron.core.parallel_state", "megatron_longstraw.distributed.parallel",
           "megatron_longstraw.step.schedule", "megatron_longstraw.context.capture",
           "megatron_longstraw.models.glm52.model", "megatron_longstraw.models.qwen36.model",
           "dist_workers"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _init_file() -> str:
    fd, path = tempfile.mkstemp(prefix="longstraw-rdzv-")
    os.close(fd)
    os.unlink(path)  # the file store creates it
    return path


def _worker(rank, world_size, init_file, fn, kwargs, results):
    # File rendezvous: no port to race for with other runs (or with the parent's own group).
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LONGSTRAW_TEST_INIT=f"file://{init_file}", TORCHDYNAMO_DISABLE="1",
                      OMP_NUM_THREADS="1")
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")
    try:
        # Serialised to bytes: a queue would otherwise pass tensors as shared-memory handles,
        # which die with this process.
        buffer = io.BytesIO()
        torch.save(fn(rank, **kwargs), buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1)


def run_ranks(fn, world_size: int, timeout: float = 600.0, **kwargs) -> list:
    """fn(rank, **kwargs) on `world_size` processes; returns results ordered by rank."""
    ctx = _context()
    results = ctx.Queue()
    port = _init_file()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, kwargs, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    collected, deadline = {}, time.monotonic() + timeout
    try:
        while len(collected) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"distributed run exceeded {timeout:.0f} s; got ranks "
                                   f"{sorted(collected)}")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 5.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in collected]
                if dead and all(p.exitcode is not None for p in procs):
                    raise RuntimeError(f"ranks {dead} exited without a result")
                continue
            collected[rank] = (status, payload)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = {r: msg for r, (status, msg) in collected.items() if status == "error"}
    if errors:
        raise RuntimeError("\n".join(f"rank {r}: {m}" for r, m in sorted(errors.items())))
    return [torch.load(io.BytesIO(collected[r][1]), weights_only=False) for r in range(world_size)]


def run_ranks_expect_failure(fn, world_size: int, timeout: float, **kwargs):
    """Like run_ranks, for runs that must fail: returns (seconds, {rank: status or message})."""
    ctx = _context()
    results = ctx.Queue()
    port = _init_file()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, kwargs, results))
             for r in range(world_size)]
    start = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=max(1.0, timeout - (time.monotonic() - start)))
    elapsed = time.monotonic() - start
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    outcome = {}
    while True:
        try:
            rank, status, payload = results.get(timeout=1.0)
        except queue.Empty:
            break
        outcome[rank] = payload if status == "error" else "ok"
    for r in alive:
        outcome[r] = "hung"
    return elapsed, outcome
