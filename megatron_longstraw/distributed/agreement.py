"""Cross-rank agreement: the one module that makes the ranks of a run agree on something, or fail
together when one of them cannot go on.

    is_distributed()        more than one rank (a process group of one, or none, agrees with
                            itself: every function below then works on its own values)
    any_rank(flags)         each flag, true where it is true on any rank of the world (one MAX
                            all-reduce): a decision every rank takes the same way (skip the
                            optimizer step, stop the run, refuse to save)
    check_same(value, what) every rank of the world holds the same value, else the same ValueError
                            on all of them
    check_agreement(local_error, fingerprint, layout)
                            the ranks of a CP group, before any work: one rank's invalid input
                            becomes the same ValueError on every rank, and so do two ranks given
                            different GRPO groups
    agree(error, what), together(what, fn, *args)
                            a failure at a point every rank reaches (a checkpoint's prepare /
                            write / publish, a load): every rank raises, the failing one its own
                            error, the others a PeerFailure naming the rank and its error
    fail_together()         a failure inside a step, where the other ranks may be waiting in a
                            collective the failing rank never reaches: the first error goes into
                            the rendezvous store, and a rank whose collective then breaks
                            re-raises it as a PeerFailure instead of a bare connection error

Not here: runtime/errors.py reports a user error once per job (`run_entry`: rank 0 prints, the
others stay silent when rank 0 posted the same message). It talks through the launcher's
rendezvous store only, no collective, because it runs at the entry point, before any process
group exists or after one broke; and runtime/ sits below distributed/, so it cannot import from
here. `fail_together` uses its store lookup (`errors.default_store`).

Imports: runtime (errors), distributed.parallel (CPLayout, for annotations).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_longstraw.runtime.errors import PeerFailure, default_store

if TYPE_CHECKING:
    from megatron_longstraw.distributed.cp_layout import CPLayout


def is_distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def any_rank(flags: list[bool]) -> list[bool]:
    """Each of `flags`, true where it is true on any rank of the world (one MAX all-reduce; the
    flags themselves without a process group). Every rank calls it with the same number of
    flags."""
    if not is_distributed():
        return [bool(f) for f in flags]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    values = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [bool(v) for v in values.tolist()]


def check_same(value, what: str) -> None:
    """Raise `ranks disagree on <what>: [each rank's value]` on every rank when the ranks of the
    world do not all hold the same `value` (a picklable, hashable value). Collective."""
    if not is_distributed():
        return
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    if len(set(values)) > 1:
        raise ValueError(f"ranks disagree on {what}: {values}.")


def check_agreement(local_error: str | None, fingerprint: dict, layout: CPLayout) -> None:
    """Raise the same error on every rank of the CP group, before any work, when one rank's input
    is invalid or the ranks were not given the same GRPO group."""
    if layout.size == 1:
        if local_error:
            raise ValueError(local_error)
        return
    gathered = [None] * layout.size
    dist.all_gather_object(gathered, (local_error, fingerprint), group=layout.group)
    ranks = dist.get_process_group_ranks(layout.group)
    for rank, (error, _) in zip(ranks, gathered):
        if error:
            raise ValueError(f"rank {rank}: {error}")
    first = gathered[0][1]
    for rank, (_, other) in zip(ranks, gathered):
        if other != first:
            diff = {k: (first[k], other[k]) for k in first if first[k] != other.get(k)}
            raise ValueError(
                "The ranks of a context-parallel group must all be given the same GRPO group; "
                f"rank {ranks[0]} and rank {rank} differ in "
                + ", ".join(f"{k} ({a} vs {b})" for k, (a, b) in diff.items()) + ".")


def agree(error: BaseException | None, what: str) -> None:
    """Raise on every rank when any rank failed `what`: the failing rank raises its own error, the
    others say which rank failed and why (no rank is left waiting in a later collective)."""
    if not is_distributed():
        if error is not None:
            raise error
        return
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    for rank, message in enumerate(messages):
        if message:
            raise PeerFailure(f"{what} failed on rank {rank}: {message}")


def together(what: str, fn, *args) -> Any:
    """`fn(*args)` on every rank, then `agree` on whether it failed anywhere; its result."""
    try:
        result, error = fn(*args), None
    except Exception as exc:  # noqa: BLE001 - re-raised by agree on this rank
        result, error = None, exc
    agree(error, what)
    return result


_ERROR_KEY = "longstraw/first_error"


class fail_together:
    """Context manager around a distributed step: the first rank to fail records its error in the
    rendezvous store; a rank whose collective then breaks (peer gone) re-raises with that first
    error, so every rank goes down with the cause rather than a bare connection error. The process
    group's timeout bounds the wait."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or not is_distributed():
            return False
        store = default_store()
        if store is None:
            return False
        message = f"rank {dist.get_rank()}: {exc_type.__name__}: {exc}"
        try:
            if store.check([_ERROR_KEY]):
                first = store.get(_ERROR_KEY).decode()
                if not first.startswith(f"rank {dist.get_rank()}:"):
                    raise PeerFailure(f"LongStraw step aborted because {first}") from exc
            else:
                store.set(_ERROR_KEY, message)
        except RuntimeError as chained:
            if chained.__cause__ is exc:
                raise
        return False
