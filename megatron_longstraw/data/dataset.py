"""The groups each optimizer step consumes: a lazily read, indexed JSONL dataset, the seeded
per-epoch order, and the split of a global batch over data-parallel replicas.

    dataset = GroupDataset(path, vocab_size=..., check=...)   # one checking pass: offsets only
    sampler = GroupSampler(len(dataset), global_batch_size=4, dp_rank=r, dp_size=2, seed=1234)
    for index in sampler.step_indices(consumed_groups):      # this replica's share of one step
        group = dataset[index]                                # read from disk now, then dropped

The position in the data is one number, `consumed_groups` (Megatron's `consumed_train_samples`
with a GRPO group as the sample): the groups of every step before, summed over replicas. It is
saved in the checkpoint, so a resume continues at the next group even when --global-batch-size
changed. The sample with global index g belongs to epoch g // N and is the
(g % N)-th group of that epoch's order: a permutation drawn from (seed, epoch) (or the file's
order with --no-longstraw-data-shuffle). A step's B = --global-batch-size groups are
g = consumed + k * DP + r for replica r and micro-batch k (Megatron's MegatronPretrainingSampler
split with one group per micro-batch), so every replica gets B / DP of them.

Memory: the dataset holds one byte offset per group (8 bytes); a group's prompt is read when the
step needs it and dropped after (tests/test_dataset.py measures peak RSS flat in the number of
groups). Synthetic data (no --longstraw-data) uses the same global index: group g is
`data.synthetic_group(seed=seed + g)`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from megatron_longstraw.data.group import GRPOGroup
from megatron_longstraw.data.groups import (
    DataError,
    GroupRecord,
    _as_tokenizer,
    nonblank_lines,
    parse_line,
    read_line,
)


class GroupDataset:
    """The groups of a JSONL file (examples/data/README.md), read one at a time by index.

    Construction reads the file once and checks every line (JSON, fields, responses, rewards;
    prompt files by header and size, not their ids) and `check(record)` (e.g. the group size):
    a bad line is a DataError naming file, line and field before any training. It keeps only the
    byte offset and line number of each group. `dataset[i]` reads and fully checks line i again
    (the prompt file's ids included: a bad id is a DataError then)."""

    def __init__(self, path: str | os.PathLike, tokenizer=None, vocab_size: int | None = None,
                 check: Callable[[GroupRecord], None] | None = None,
                 require_rewards: bool = True, prompt_only: bool = False):
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(self.path, None, None, "no such file; pass the path of a JSONL file "
                                                   "with one GRPO group per line.")
        self.tokenizer = _as_tokenizer(tokenizer)
        self.vocab_size, self.require_rewards, self.check = vocab_size, require_rewards, check
        self.prompt_only = prompt_only   # prompt lines (the online loop; data.parse_line)
        offsets, line_numbers = [], []
        for line_no, offset, raw in nonblank_lines(self.path):
            record = parse_line(self.path, line_no, raw, self.tokenizer, vocab_size,
                                require_rewards, load_prompt_file=False, prompt_only=prompt_only)
            if check is not None:
                check(record)
            offsets.append(offset)
            line_numbers.append(line_no)
        if not offsets:
            raise DataError(self.path, None, None, "holds no groups (every line is blank); give "
                                                   "one JSON object per line.")
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.line_numbers = np.asarray(line_numbers, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.offsets)

    def record(self, index: int) -> GroupRecord:
        line_no = int(self.line_numbers[index])
        raw = read_line(self.path, int(self.offsets[index]))
        record = parse_line(self.path, line_no, raw, self.tokenizer, self.vocab_size,
                            self.require_rewards, prompt_only=self.prompt_only)
        if self.check is not None:
            self.check(record)
        record.group.source = f"{self.path} line {line_no}"   # named by a non-finite step's error
        return record

    def __getitem__(self, index: int) -> GRPOGroup:
        return self.record(index).group


def epoch_order(num_groups: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The order of the dataset's groups in `epoch`: a permutation drawn from (seed, epoch), the
    same on every rank, or 0..N-1 without shuffling."""
    if not shuffle:
        return np.arange(num_groups, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(num_groups).astype(np.int64)


class GroupSampler:
    """Which dataset index (or synthetic global index, `num_groups=None`) each micro-batch of a
    step reads on this data-parallel replica (module docstring)."""

    def __init__(self, num_groups: int | None, global_batch_size: int, dp_rank: int,
                 dp_size: int, seed: int, shuffle: bool = True):
        if global_batch_size % dp_size:
            raise ValueError(f"global batch {global_batch_size} is not a multiple of the "
                             f"data-parallel size {dp_size}.")
        self.num_groups, self.global_batch_size = num_groups, global_batch_size
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self._epoch, self._order = None, None

    @property
    def micro_batches(self) -> int:
        """Groups per replica per step (each its own micro-batch)."""
        return self.global_batch_size // self.dp_size

    def global_indices(self, consumed_groups: int) -> list[int]:
        """This replica's global sample indices of the step that starts at `consumed_groups`."""
        return [consumed_groups + k * self.dp_size + self.dp_rank
                for k in range(self.micro_batches)]

    def index(self, global_index: int) -> int:
        """The dataset index of the sample with this global index."""
        if self.num_groups is None:
            return global_index
        epoch, position = divmod(global_index, self.num_groups)
        if epoch != self._epoch:   # one epoch's order at a time: 8 bytes per group
            self._epoch, self._order = epoch, epoch_order(self.num_groups, self.seed, epoch,
                                                          self.shuffle)
        return int(self._order[position])

    def step_indices(self, consumed_groups: int) -> list[int]:
        """Dataset indices of this replica's groups for the step that starts at
        `consumed_groups`, in micro-batch order."""
        return [self.index(g) for g in self.global_indices(consumed_groups)]
