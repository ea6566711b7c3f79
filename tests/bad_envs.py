"""Environments that go wrong, for tests/test_env_robust.py: made by `make` inside the
environment worker processes (rollout/env_workers.py), so this module imports nothing heavy
(no torch: a worker starts in a fraction of a second). `meta["kind"]` says how the tool call goes
wrong; "fine" answers [1, 2]; "sleep" sleeps `meta["seconds"]` and answers."""

import math
import os
import signal
import time

from megatron_longstraw.rollout.env import EnvStep

OBSERVATIONS = {"none": None, "nested": [[1, 2], [3]], "floats": [3.7, 4.2], "oov": [10 ** 6],
                "negative": [-1, 2], "bools": [True, False], "text": "the answer"}
REWARDS = {"nan_reward": math.nan, "inf_reward": math.inf, "string_reward": "1.0"}


class BadEnv:
    def __init__(self, kind, seconds=1.0, stop_ids=()):
        self.kind, self.seconds, self.stop_ids = kind, seconds, tuple(stop_ids)

    def step(self, turn_ids):
        kind = self.kind
        if kind == "raises":
            raise RuntimeError("tool crashed")
        if kind == "hangs":
            time.sleep(3600)
        if kind == "exits":
            os._exit(3)
        if kind == "segfault":
            os.kill(os.getpid(), signal.SIGSEGV)
        if kind == "returns_none":
            return None
        if kind == "sleep":
            time.sleep(self.seconds)
        if kind in OBSERVATIONS:
            return EnvStep(observation=OBSERVATIONS[kind])
        if kind in REWARDS:
            return EnvStep(observation=[1], reward=REWARDS[kind])
        return EnvStep(observation=[1, 2])


def make(meta, prompt_ids, tokenizer):
    kind = meta.get("kind", "fine")
    if kind == "factory_raises":
        raise RuntimeError("no tool server")
    if kind == "factory_none":
        return None
    return BadEnv(kind, meta.get("seconds", 1.0), meta.get("stop_ids", ()))


def in_process_hang(meta, prompt_ids, tokenizer):
    """An environment object whose every call hangs (for an in-process `generate`)."""
    return BadEnv("hangs")
