"""User errors, and how an entry point reports them.

A *user error* is something the person launching a run got wrong, not a bug: a flag, a YAML or
model-config value, a data line, an input file that is missing, a checkpoint that does not fit the
run. This module is the one place that says which exceptions those are (`is_user_error`):

    UserError               the base; every class below derives from it and from the built-in
                            type callers already catch (ValueError, FileNotFoundError, SystemExit)
      FlagError             the command line itself (argparse's errors, a missing --longstraw)
      ConfigError           a flag / YAML / model-config value, or flags that do not go together
      InputNotFound         an input file or directory that is not there
      CheckpointError       a checkpoint or model-format directory that does not fit the run, or
                            cannot be read
      data.DataError        a line of a JSONL data file (file, line, field)
      rewards.RewardError   a reward function that raised or returned no finite number (the
                            record and the member)
      NonFiniteError        a step whose loss or gradient is NaN / inf, with
                            --check-for-nan-in-loss-and-grad (Megatron's default): the step and
                            the group, the weights untouched, the last checkpoint intact

`configuration()` marks the validation phase of an entry point (parsing and resolving flags, YAML
and model configs, where every ValueError is about what the user gave): a plain ValueError raised
inside becomes a ConfigError with the same message.

`run_entry(main)` is what the launcher (examples/pretrain_gpt.py -> train.cli), tools/score.py and
tools/generate.py run: after `main` returns, the process groups are ended (`end_process_groups`);
a user error becomes one line on stderr, `error: <cause and where>`, and exit code 2, without
a traceback; any other exception keeps its traceback (it is a bug). Under torchrun the line also
goes to the worker's TORCHELASTIC_ERROR_FILE: torchrun's own failure report (its ChildFailedError
traceback, which a worker cannot silence) then names it as the root cause. Under torchrun every rank
usually raises the same error: rank 0 prints it and posts it in the launcher's rendezvous store;
another rank exits silently when rank 0 posted the same message and otherwise (its error is its
own) prints `error: rank N: <message>`. A rank that stops only because another rank failed
(`PeerFailure`) prints nothing of that rank's error (the failing rank reports it) and exits 1.

Imports nothing of this package (data.py, config.py and parallel.py raise these).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time

from megatron_longstraw.runtime import parent_watch

PEER_WAIT_S = 15.0
"""How long a rank other than 0 waits for rank 0 to post its error before deciding that its own
error is rank-local (and printing it); also how long a rank stopped by another rank's failure
lingers so that rank can print before the launcher ends the job."""
EXIT_USER_ERROR = 2
_PEER = "\0peer-failure"


class UserError(Exception):
    """An error in what the user gave (module docstring); `str(exc)` names the cause and where."""


class FlagError(UserError, SystemExit):
    """The command line: an unknown flag, a bad flag value argparse rejects, a required flag
    missing. A SystemExit, as argparse's own errors are."""


class ConfigError(UserError, ValueError):
    """A flag, YAML or model-config value out of range, or settings that do not go together."""


class InputNotFound(UserError, FileNotFoundError):
    """An input file or directory that does not exist."""


class CheckpointError(UserError, ValueError):
    """A checkpoint or model-format directory that does not fit this run (another model config,
    family, layout, adapters, base) or cannot be read."""


class NonFiniteError(UserError, FloatingPointError):
    """A non-finite loss or gradient stopped the run before the optimizer stepped (train.py)."""


class PeerFailure(RuntimeError):
    """This rank stopped because another rank failed first; that rank reports the cause."""


def is_user_error(exc: BaseException) -> bool:
    return isinstance(exc, UserError)


@contextlib.contextmanager
def configuration():
    """The validation phase of an entry point: a ValueError raised inside is about what the user
    gave, and is re-raised as a ConfigError (same message, the original chained)."""
    try:
        yield
    except UserError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def one_line(exc: BaseException) -> str:
    """The exception's message on one line."""
    text = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    return text or type(exc).__name__


def run_entry(main, *args, **kwargs):
    """`main(*args, **kwargs)`, with user errors reported as one line and exit code 2 (module
    docstring); other exceptions propagate with their traceback."""
    try:
        result = main(*args, **kwargs)
        end_process_groups()
        return result
    except PeerFailure:
        _post_rank0(_PEER)
        time.sleep(PEER_WAIT_S if _world() > 1 else 0.0)  # the launcher stops us once it printed
        sys.exit(1)
    except UserError as exc:
        report(exc)
        _error_file(exc)
        sys.exit(EXIT_USER_ERROR)
    except BaseException:
        if parent_watch.orphaned():   # the launcher's end surfaced as this error: say that
            parent_watch.exit_orphaned()
        raise


def end_process_groups() -> None:
    """After a run that succeeded on every rank: a barrier (no rank still in a collective), then
    torch.distributed's groups destroyed (the default group and every group Megatron created;
    Megatron's parallel state forgets them, so a later `parallel.initialize` in the same process
    starts afresh).
    A gloo group left for the interpreter's teardown to destroy can abort the worker after its
    work is done ("terminate called without an active exception", SIGABRT: torchrun then
    reports the run failed; pytorch/pytorch#190489). A no-op without torch.distributed."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    dist.barrier()
    megatron_state = sys.modules.get("megatron.core.parallel_state")
    if megatron_state is not None and megatron_state.model_parallel_is_initialized():
        megatron_state.destroy_model_parallel()
    dist.destroy_process_group()


def _error_file(exc: BaseException) -> None:
    """Under torchrun: the one line in this worker's TORCHELASTIC_ERROR_FILE, which torchrun's
    failure summary shows as the root cause's `traceback` (instead of a link to its docs)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        import json

        with contextlib.suppress(OSError):
            with open(path, "w") as f:
                json.dump({"message": f"error: {one_line(exc)}", "timestamp": int(time.time())}, f)


def report(exc: BaseException, stream=None, wait_s: float = PEER_WAIT_S) -> None:
    """Print `exc` as `error: <message>` once per job (module docstring)."""
    stream = stream or sys.stderr
    message = one_line(exc)
    rank, world = _rank(), _world()
    if world == 1 or rank == 0:
        print(f"error: {message}", file=stream, flush=True)
        _post_rank0(message)   # after printing: a rank that sees it may exit and end the job
        return
    if _rank0_message(wait_s) != message:
        print(f"error: rank {rank}: {message}", file=stream, flush=True)


# ---- the rendezvous store (torchrun's agent store, or the process group's) -----------------------


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _key() -> str:
    run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    return f"longstraw/error/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/rank0"


# The reporting below talks through a store, not a collective: it runs at the entry point, before
# any process group exists or after one broke (distributed/agreement.py holds the collectives and
# reuses `default_store`; runtime/ cannot import from there).


def default_store():
    """The default process group's store (every rank of the group shares it), or None without an
    initialised process group."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from torch.distributed import distributed_c10d

            return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: single process or not initialised
        return None
    return None


def _store(timeout_s: float):
    """A store every rank of the job shares, or None: torchrun's agent store (there before any
    process group starts and after), else the default process group's."""
    try:
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=max(timeout_s, 1.0))
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_PORT" in os.environ:
            return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                 is_master=False, timeout=timeout)
    except Exception:  # noqa: BLE001 - no store: every rank then speaks for itself
        return None
    return default_store()


def _post_rank0(message: str) -> None:
    if _world() == 1 or _rank() != 0:
        return
    store = _store(PEER_WAIT_S)
    if store is not None:
        with contextlib.suppress(Exception):
            store.set(_key(), message)


def _rank0_message(wait_s: float) -> str | None:
    """What rank 0 posted, waiting up to `wait_s`; None when it posted nothing (yet)."""
    store = _store(wait_s)
    if store is None:
        return None
    try:
        store.wait([_key()], datetime.timedelta(seconds=wait_s))
        return store.get(_key()).decode()
    except Exception:  # noqa: BLE001 - timed out: rank 0 did not fail the same way
        return None
