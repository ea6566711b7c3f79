"""Environments in the online loop (`--longstraw-env module:factory`, docs/design.md section 2):
multi-turn agent rollouts over one captured prompt.

    factory(meta, prompt_ids, tokenizer) -> env        one environment per member (the record's
                                                        `meta`, the prompt's ids, the tokenizer or
                                                        None)
    env.stop_ids                                        ids that end a tool call (a turn)
    env.step(turn_ids) -> EnvStep                       the policy's tokens of the turn -> the
                                                        observation (ids, or text tokenised with
                                                        the tokenizer), optionally a final reward
                                                        and done

Generation (decode.generate with `envs`) samples a member's tokens until one of the env's stop ids
(or `EnvLimits.turn_tokens` tokens of the turn, when set), calls `step`, and prefills the
observation's ids into the member's branch state in blocks of up to `EnvLimits.prefill_block`
rows per decode pass (beside the other members' sampled rows), from the captured prompt and the
member's own earlier rows: the prompt and earlier turns are never run again. The
observation's tokens are context, not policy output: their loss mask is 0. A member ends at the
policy's own stop ids (`--longstraw-stop-ids`), when the env says done, at `max_turns` env calls,
or at `max_new_tokens` tokens in all (observations included; an observation that does not fit is
cut and the member ends).

Where the environments run (the runners: `call(due, limits)` -> per call a checked `EnvStep` or
an "env error: ..." string):

    env_workers.WorkerEnvs   the launcher's and tools/generate.py's (`--longstraw-env`): each
                             member's environment is made by the factory inside a worker process
                             of its own and lives there for the member's whole trajectory; a call
                             past `timeout_s` kills the worker (it is replaced for later
                             rollouts), a worker that dies ends only its member
    LocalEnvs                environment objects given to `generate` directly (tests, Python
                             use): called in this process on daemon threads; a call past its
                             timeout is abandoned, not stopped (Python threads cannot be), but it
                             never blocks the process's exit

Either way the calls of the members whose turns close at the same decode step run concurrently,
at most `max_concurrency` at a time. Every return is checked (`plain_step`, `observation_ids`):
observation ids must be integers (Python or numpy; not bools, floats, nested lists or None) in
[0, vocab); text needs the run's tokenizer; a reward must be None or a finite real number.
Anything else, a raise, a timeout or a dead worker ends that member with a named reason
(`Generation.end_reason`, "env error: ..."); its trajectory so far is kept and the job goes on.
An environment that would never be called (no `stop_ids` while `turn_tokens` is 0) and a
factory that raises or returns no environment are the run's errors (`check_environment`):
the launcher makes one environment up front, before the model loads (`probe_factory`).
"""

from __future__ import annotations

import importlib
import math
import numbers
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from megatron_longstraw.runtime.errors import ConfigError


@dataclass
class EnvStep:
    """What an environment returns for one tool call."""

    observation: Sequence[int] | str = ()
    """Token ids (or text, tokenised with the run's tokenizer) appended to the trajectory as
    context: prefilled into the member's state, loss mask 0."""
    reward: float | None = None
    """The member's final reward (used when `done`; otherwise ignored)."""
    done: bool = False
    """The trajectory ends here (the observation is not appended)."""


class Environment(Protocol):
    stop_ids: Sequence[int]

    def step(self, turn_ids: list[int]) -> EnvStep: ...


@dataclass(frozen=True)
class EnvLimits:
    """Bounds on one member's rollout with an environment."""

    max_turns: int = 8
    """Environment calls per member; the member ends after the last one's observation."""
    turn_tokens: int = 0
    """A turn also ends after this many policy tokens (0: only at the env's stop ids)."""
    timeout_s: float = 30.0
    """Seconds one `step` call may take."""
    max_concurrency: int = 16
    """Environment calls in flight at once (the members whose turns close at one decode step)."""
    prefill_block: int = 2048
    """Observation tokens a member feeds in one decode pass (1: one per step, token by token)."""

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"env max_turns={self.max_turns}: allow at least one environment "
                             "call (--longstraw-env-max-turns).")
        if self.turn_tokens < 0:
            raise ValueError(f"env turn_tokens={self.turn_tokens}: use 0 (turns end at the env's "
                             "stop ids only) or a positive count (--longstraw-env-turn-tokens).")
        if not self.timeout_s > 0:
            raise ValueError(f"env timeout_s={self.timeout_s}: use a positive number of seconds "
                             "(--longstraw-env-timeout).")
        if self.max_concurrency < 1:
            raise ValueError(f"env max_concurrency={self.max_concurrency}: allow at least one "
                             "call at a time (--longstraw-env-max-concurrency).")
        if self.prefill_block < 1:
            raise ValueError(f"env prefill_block={self.prefill_block}: feed at least one "
                             "observation token per pass (--longstraw-env-prefill-block).")


class EnvError(Exception):
    """An environment call failed (raised, timed out, returned something bad): ends the member."""


class EnvSetupError(ConfigError):
    """The environments cannot serve the run (the factory raised or returned no environment, or
    one that would never be called): the run's error, raised by `generate` on every CP rank (a
    user error: one line, exit 2, at the entry points)."""


def load_env_factory(spec: str) -> Callable:
    """'package.module:factory' -> the factory (module docstring), with an error naming what is
    missing."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--longstraw-env {spec!r}: give 'module:factory', e.g. "
                         "'megatron_longstraw.rollout.example_env:lookup'.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--longstraw-env {spec!r}: cannot import {module_name!r} ({exc}); is it "
                         "on PYTHONPATH?") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--longstraw-env {spec!r}: {module_name} has no callable {attr!r}.")
    return factory


def make_environment(factory: Callable, spec: str, meta, prompt_ids, tokenizer,
                     turn_tokens: int) -> tuple[object, tuple[int, ...]]:
    """factory(meta, prompt_ids, tokenizer) -> (the environment, its stop ids), checked
    (`check_environment`); ValueError naming the factory when it raises or returns no
    environment."""
    try:
        env = factory(meta, prompt_ids, tokenizer)
    except Exception as exc:
        raise ValueError(f"the environment factory {spec} raised {type(exc).__name__}: "
                         f"{exc}") from exc
    return env, check_environment(env, spec, turn_tokens)


def check_environment(env, spec: str, turn_tokens: int) -> tuple[int, ...]:
    """The environment's stop ids, after checking that it is one (a `step` method, `stop_ids`
    of integer ids) and that it would be called: no stop ids needs `turn_tokens` > 0."""
    if env is None or not callable(getattr(env, "step", None)):
        raise ValueError(f"the environment factory {spec} returned "
                         f"{'None' if env is None else type(env).__name__}, not an environment "
                         "(an object with `stop_ids` and `step(turn_ids)`).")
    try:
        stop_ids = tuple(getattr(env, "stop_ids", None) or ())
    except TypeError:
        raise ValueError(f"the environment of {spec} has stop_ids {env.stop_ids!r}: give a "
                         "sequence of token ids.") from None
    if any(not _is_id(i) for i in stop_ids):
        raise ValueError(f"the environment of {spec} has stop_ids {list(stop_ids)!r}: give "
                         "integer token ids.")
    if not stop_ids and not turn_tokens:
        raise ValueError(f"the environment of {spec} has no stop_ids and "
                         "--longstraw-env-turn-tokens is 0: it would never be called. Set "
                         "--longstraw-env-turn-tokens N (a turn ends after N policy tokens) or "
                         "give the environment stop_ids.")
    return tuple(int(i) for i in stop_ids)


def _is_id(value) -> bool:
    """A Python or numpy integer, not a bool (numpy registers its integers as Integral)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _shown(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def plain_step(result) -> EnvStep:
    """`env.step`'s return -> an EnvStep of plain values (observation: a list of int or a str;
    reward: a float or None; done: a bool), or EnvError naming what is wrong (module
    docstring). Needs neither the vocabulary nor the tokenizer (`observation_ids` does), so a
    worker process checks here before sending a return back."""
    if not isinstance(result, EnvStep):
        raise EnvError(f"env.step returned {type(result).__name__}, expected "
                       "megatron_longstraw.rollout.env.EnvStep")
    observation = result.observation
    if observation is None:
        raise EnvError("observation is None: return token ids, text, or () for none")
    if not isinstance(observation, str):
        if hasattr(observation, "tolist") and not isinstance(observation, list):
            observation = observation.tolist()     # a numpy array or a torch tensor
        if not isinstance(observation, (list, tuple, range)):
            raise EnvError(f"observation of type {type(observation).__name__}: return token "
                           "ids (a list of int) or text")
        nested = [i for i in observation if isinstance(i, (list, tuple, dict, set))]
        if nested:
            raise EnvError(f"observation {_shown(observation)} holds nested lists: return a "
                           "flat list of token ids")
        bad = [i for i in observation if not _is_id(i)]
        if bad:
            raise EnvError(f"observation {_shown(observation)} holds non-integer ids "
                           f"({type(bad[0]).__name__} {_shown(bad[0], 20)})")
        observation = [int(i) for i in observation]
    reward = result.reward
    if reward is not None:
        if hasattr(reward, "item") and not isinstance(reward, numbers.Real):
            reward = reward.item() if getattr(reward, "ndim", 1) == 0 else reward
        if not isinstance(reward, numbers.Real) or isinstance(reward, bool):
            raise EnvError(f"reward {_shown(reward, 30)} of type {type(reward).__name__}: "
                           "return a finite number or None")
        if not math.isfinite(float(reward)):
            raise EnvError(f"reward {float(reward)!r} is not finite: return a finite number or "
                           "None")
        reward = float(reward)
    if not isinstance(result.done, (bool, numbers.Integral)):
        raise EnvError(f"done {_shown(result.done, 30)} of type {type(result.done).__name__}: "
                       "return True or False")
    return EnvStep(observation=observation, reward=reward, done=bool(result.done))


def observation_ids(step: EnvStep, vocab_size: int, tokenizer=None) -> list[int]:
    """A checked step's observation as ids in [0, vocab_size) (text tokenised with `tokenizer`),
    or EnvError."""
    observation = step.observation
    if isinstance(observation, str):
        if tokenizer is None:
            raise EnvError("env.step returned text but the run has no tokenizer "
                           "(--longstraw-tokenizer): return token ids instead")
        ids = [int(i) for i in tokenizer.encode(observation)]
    else:
        ids = list(observation)
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise EnvError(f"env.step returned ids outside the vocabulary [0, {vocab_size}): "
                       f"{bad[:5]}")
    return ids


def timeout_reason(limits: EnvLimits, what: str) -> str:
    return (f"env error: env.step did not return within {limits.timeout_s:g} s "
            f"(--longstraw-env-timeout); {what}")


class LocalEnvs:
    """Environment objects given to `generate` (module docstring): called in this process, on
    daemon threads, at most `limits.max_concurrency` at a time."""

    def __init__(self, envs: Sequence):
        self.envs = list(envs)

    def __len__(self) -> int:
        return len(self.envs)

    def start(self, limits: EnvLimits) -> list[tuple[int, ...]]:
        """Each member's stop ids (ValueError: an object that is no environment, or one that
        would never be called)."""
        return [check_environment(env, "generate(envs=...)", limits.turn_tokens)
                for env in self.envs]

    def call(self, due: list[tuple[int, list[int]]], limits: EnvLimits) -> list[EnvStep | str]:
        """`env.step(turn)` for each (member, turn) of `due`, concurrently -> per call the
        checked step or "env error: ..."."""
        outcomes: list[EnvStep | str] = [""] * len(due)

        def run(index: int, member: int, turn: list[int]) -> None:
            try:
                outcomes[index] = plain_step(self.envs[member].step(list(turn)))
            except EnvError as exc:
                outcomes[index] = f"env error: {exc}"
            except BaseException as exc:   # the environment's own failure: its member ends
                outcomes[index] = f"env error: env.step raised {type(exc).__name__}: {exc}"

        for first in range(0, len(due), limits.max_concurrency):
            threads = []
            for index in range(first, min(first + limits.max_concurrency, len(due))):
                thread = threading.Thread(target=run, args=(index, *due[index]), daemon=True,
                                          name=f"longstraw-env-{due[index][0]}")
                thread.start()
                threads.append((index, thread))
            deadline = time.monotonic() + limits.timeout_s
            for index, thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
                if thread.is_alive():
                    outcomes[index] = timeout_reason(
                        limits, "an environment object given to generate runs in this process "
                        "and was abandoned, not stopped")
        return list(outcomes)   # a copy: an abandoned thread may still write into `outcomes`

    def close(self) -> None:
        pass


class BlindEnvs:
    """A runner (`LocalEnvs`, `env_workers.WorkerEnvs`) whose observations are withheld: every
    call runs and its reward and `done` count, but its observation is empty, so the policy is
    told nothing by its tools (`--longstraw-control blind`, the control of an agent task). The
    withheld observations are not checked against the vocabulary (nothing of them is fed)."""

    def __init__(self, runner):
        self.runner = runner

    def __len__(self) -> int:
        return len(self.runner)

    def start(self, limits: EnvLimits) -> list[tuple[int, ...]]:
        return self.runner.start(limits)

    def call(self, due: list[tuple[int, list[int]]], limits: EnvLimits) -> list[EnvStep | str]:
        return [outcome if isinstance(outcome, str) else
                EnvStep(observation=(), reward=outcome.reward, done=outcome.done)
                for outcome in self.runner.call(due, limits)]

    def close(self) -> None:
        self.runner.close()
