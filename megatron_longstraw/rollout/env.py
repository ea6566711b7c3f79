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
observation's ids into the member's branch state one decode row at a time, from the captured
prompt and the member's own earlier rows: the prompt and earlier turns are never run again. The
observation's tokens are context, not policy output: their loss mask is 0. A member ends at the
policy's own stop ids (`--longstraw-stop-ids`), when the env says done, at `max_turns` env calls,
or at `max_new_tokens` tokens in all (observations included; an observation that does not fit is
cut and the member ends).

An environment that raises, runs past `timeout_s`, or returns ids outside the vocabulary ends
that member (its trajectory so far is kept, `Generation.end_reason` says why); the job goes on.
A call past its timeout is abandoned, not killed (Python threads cannot be): an environment that
may hang should bound its own work.
"""

from __future__ import annotations

import concurrent.futures
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


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


class EnvError(Exception):
    """An environment call failed (raised, timed out, returned bad ids): ends the member."""


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


_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="longstraw-env")


def call_step(env: Environment, turn_ids: list[int], limits: EnvLimits, vocab_size: int,
              tokenizer=None) -> tuple[list[int], EnvStep]:
    """One `env.step(turn_ids)` within `limits.timeout_s` -> (observation ids, the step). Raises
    EnvError naming what went wrong."""
    future = _POOL.submit(env.step, list(turn_ids))
    try:
        result = future.result(timeout=limits.timeout_s)
    except concurrent.futures.TimeoutError:
        raise EnvError(f"env.step did not return within {limits.timeout_s:g} s "
                       "(--longstraw-env-timeout)") from None
    except Exception as exc:   # the environment's own failure: reported, the job goes on
        raise EnvError(f"env.step raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(result, EnvStep):
        raise EnvError(f"env.step returned {type(result).__name__}, expected "
                       "megatron_longstraw.rollout.env.EnvStep")
    observation = result.observation
    if isinstance(observation, str):
        if tokenizer is None:
            raise EnvError("env.step returned text but the run has no tokenizer "
                           "(--longstraw-tokenizer): return token ids instead")
        ids = list(tokenizer.encode(observation))
    else:
        ids = [int(i) for i in observation]
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise EnvError(f"env.step returned ids outside the vocabulary [0, {vocab_size}): "
                       f"{bad[:5]}")
    return ids, result
