"""A built-in example environment (`--longstraw-env megatron_longstraw.rollout.example_env:lookup`):
a lookup tool over the prompt, so a member answers by calling it.

The prompt holds facts as token pairs: a key id, then its value id (the first occurrence of a key
counts). The record's `meta` says what to find and how turns end:

    {"answer": 7, "answer_turn": 3, "tool_end_id": 38, "unknown_id": 0, "table": [[5, 7], ...]}

- turns 1 .. answer_turn - 1 are tool calls: the last token of the policy's turn is the key; the
  observation is [key, value] (the value that follows the key's first occurrence in the prompt),
  or [key, unknown_id] when the key is not in the prompt; with "table" ([key, value] pairs),
  the tool answers from that table instead, which only it holds (the prompt need not say it);
- turn `answer_turn` is the answer: the reward is 1.0 when `answer` is among the turn's tokens,
  else 0.0, and the trajectory ends (`done`).

A turn ends at `tool_end_id` (omit it to end turns by `--longstraw-env-turn-tokens` only). Every
field is optional but `answer` (without it the reward function decides, and the env never ends
the trajectory itself). Token ids only: it runs on any vocabulary, the tiny demo models' too.
"""

from __future__ import annotations

from megatron_longstraw.rollout.env import EnvStep

_FIELDS = {"answer", "answer_turn", "tool_end_id", "unknown_id", "table"}


class LookupEnv:
    def __init__(self, prompt_ids, answer: int | None = None, answer_turn: int = 3,
                 tool_end_id: int | None = None, unknown_id: int = 0, table=None):
        if answer_turn < 1:
            raise ValueError(f"lookup env: answer_turn={answer_turn}; use 1 or more (1: the "
                             "first turn is the answer).")
        self.values: dict[int, int] = {}
        if table is not None:
            try:
                self.values = {int(key): int(value) for key, value in table}
            except (TypeError, ValueError) as exc:
                raise ValueError(f"lookup env: table must be [key, value] pairs of token ids "
                                 f"({exc}).") from None
        else:
            ids = [int(i) for i in prompt_ids]
            for key, value in zip(ids[:-1], ids[1:]):
                self.values.setdefault(key, value)
        self.answer, self.answer_turn = answer, answer_turn
        self.stop_ids = () if tool_end_id is None else (int(tool_end_id),)
        self.unknown_id, self.calls = int(unknown_id), 0

    def step(self, turn_ids: list[int]) -> EnvStep:
        self.calls += 1
        if self.answer is not None and self.calls >= self.answer_turn:
            return EnvStep(reward=float(int(self.answer) in turn_ids), done=True)
        key = turn_ids[-1]
        return EnvStep(observation=[key, self.values.get(key, self.unknown_id)])


def lookup(meta, prompt_ids, tokenizer=None) -> LookupEnv:
    """The factory `--longstraw-env` calls once per member (module docstring)."""
    meta = meta if isinstance(meta, dict) else {}      # other fields: the reward function's
    return LookupEnv(prompt_ids, **{k: meta[k] for k in _FIELDS if k in meta})
