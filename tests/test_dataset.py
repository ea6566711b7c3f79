"""dataset.py: the lazily read JSONL dataset, the seeded per-epoch order and the split of a global
batch over data-parallel replicas; memory flat in the number of groups; through the launcher, a
resume continues at the next group."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_longstraw.step import schedule
from megatron_longstraw.training import train
from megatron_longstraw.data.groups import DataError, read_groups, synthetic_jsonl, write_groups
from megatron_longstraw.data.dataset import GroupDataset, GroupSampler, epoch_order
from megatron_longstraw.data.group import GRPOGroup

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "glm52" / "tiny.yaml")


def _tiny_groups(n: int, prompt_len: int = 5) -> list[GRPOGroup]:
    return [GRPOGroup(prompt_ids=torch.arange(prompt_len) + g, response_ids=[torch.tensor([g]), torch.tensor([1, 2])],
                      rewards=torch.tensor([1.0, 0.0], dtype=torch.float64)) for g in range(n)]


# ---- the sampler ----------------------------------------------------------------------------------

def test_sampler_splits_a_global_batch_over_replicas_in_file_order():
    """Without shuffling, global sample g is group g % N; a step of B = 4 on DP2 gives replica r
    the samples consumed + r and consumed + 2 + r (written out by hand below)."""
    rank0 = GroupSampler(10, global_batch_size=4, dp_rank=0, dp_size=2, seed=0, shuffle=False)
    rank1 = GroupSampler(10, global_batch_size=4, dp_rank=1, dp_size=2, seed=0, shuffle=False)
    assert rank0.micro_batches == 2
    assert (rank0.step_indices(0), rank1.step_indices(0)) == ([0, 2], [1, 3])
    assert (rank0.step_indices(4), rank1.step_indices(4)) == ([4, 6], [5, 7])
    assert (rank0.step_indices(8), rank1.step_indices(8)) == ([8, 0], [9, 1])   # into epoch 1
    synthetic = GroupSampler(None, global_batch_size=2, dp_rank=1, dp_size=2, seed=0)
    assert synthetic.step_indices(6) == [7]                     # a global index, no epochs


def test_sampler_visits_every_group_once_per_epoch_in_a_seeded_order():
    n, batch, dp = 7, 3, 1
    sampler = GroupSampler(n, batch, 0, dp, seed=1234)
    seen = [i for consumed in range(0, 3 * n, batch) for i in sampler.step_indices(consumed)]
    epochs = [seen[e * n:(e + 1) * n] for e in range(3)]
    assert all(sorted(epoch) == list(range(n)) for epoch in epochs)
    assert epochs[0] != epochs[1] and epochs[0] != list(range(n))    # reshuffled every epoch
    assert epochs == [epoch_order(n, 1234, e).tolist() for e in range(3)]
    again = GroupSampler(n, batch, 0, dp, seed=1234)
    assert again.step_indices(9) == sampler.step_indices(9)         # the same order on every rank
    assert epoch_order(n, 1235, 0).tolist() != epochs[0]


def test_replicas_together_read_each_group_of_an_epoch_once():
    n, batch, dp = 12, 4, 2
    samplers = [GroupSampler(n, batch, r, dp, seed=7) for r in range(dp)]
    read = [i for consumed in range(0, n, batch) for s in samplers for i in s.step_indices(consumed)]
    assert sorted(read) == list(range(n))


def test_a_global_batch_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="not a multiple of the data-parallel size 2"):
        GroupSampler(10, global_batch_size=3, dp_rank=0, dp_size=2, seed=0)


# ---- the dataset ----------------------------------------------------------------------------------

def test_dataset_reads_what_read_groups_reads_one_group_at_a_time(tmp_path):
    path = write_groups(tmp_path / "g.jsonl", _tiny_groups(5, prompt_len=9), prompt_file_min_len=9)
    with path.open("a") as f:
        f.write("\n   \n")                                      # blank lines are not groups
    dataset = GroupDataset(path, vocab_size=64)
    eager = list(read_groups(path, vocab_size=64))
    assert len(dataset) == 5
    for index in (3, 0, 4):
        assert torch.equal(dataset[index].prompt_ids, eager[index].prompt_ids)
        assert all(torch.equal(a, b) for a, b in zip(dataset[index].response_ids, eager[index].response_ids))
        assert dataset[index].source == f"{path} line {index + 1}"
    assert dataset.offsets.nbytes == 5 * 8                     # what it keeps per group


def test_dataset_checks_every_line_up_front_and_prompt_ids_when_read(tmp_path):
    path = write_groups(tmp_path / "g.jsonl", _tiny_groups(3), prompt_file_min_len=1)
    lines = path.read_text().splitlines()
    (tmp_path / "cut.jsonl").write_text("\n".join([lines[0], lines[1][:-7]]) + "\n")
    with pytest.raises(DataError, match=r"cut.jsonl line 2"):
        GroupDataset(tmp_path / "cut.jsonl")

    def check(record):   # the launcher's: group size and response lengths against the flags
        if record.line == 3:
            raise DataError(path, record.line, record.response_field, "is too long")

    with pytest.raises(DataError, match=r"line 3: field 'response_ids' is too long"):
        GroupDataset(path, check=check)
    # A prompt file's ids are read when its group is: an id past the vocabulary is found then.
    np.save(tmp_path / "g.prompts" / "2.npy", np.array([1, 99], dtype=np.int32))
    dataset = GroupDataset(path, vocab_size=64)
    dataset[0]
    with pytest.raises(DataError, match=r"g.jsonl line 2: field 'prompt_file'.*99"):
        dataset[1]
    with pytest.raises(DataError, match="holds no groups"):
        (tmp_path / "blank.jsonl").write_text("\n\n")
        GroupDataset(tmp_path / "blank.jsonl")


_RSS_SCRIPT = r"""
import json, sys
from megatron_longstraw.data.groups import read_groups
from megatron_longstraw.data.dataset import GroupDataset
from megatron_longstraw.runtime.memory import current_rss_bytes
path, mode = sys.argv[1], sys.argv[2]
base = current_rss_bytes()            # after the imports: their own transients do not count
peak, total = 0, 0
if mode == "lazy":
    dataset = GroupDataset(path, vocab_size=256)
    for index in range(len(dataset)):   # every group read once, as the steps of one epoch do
        group = dataset[index]
        total += int(group.prompt_ids.numel())
        peak = max(peak, current_rss_bytes() - base)
else:                                    # the previous reader: every group in a list
    groups = []
    for group in read_groups(path, vocab_size=256):
        groups.append(group)
        total += int(group.prompt_ids.numel())
        peak = max(peak, current_rss_bytes() - base)
print(json.dumps({"tokens": total, "peak_rss": peak}))
"""


def _peak_rss(path: Path, mode: str) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(path), mode], env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_peak_rss_reading_long_prompt_files_is_flat_in_the_number_of_groups(tmp_path):
    """200 groups of 64K-token prompt files (.npy): reading all of them lazily peaks within 8 MiB
    of reading 20 (one prompt is 0.5 MiB as int64). Peak RSS is sampled after every group read,
    above the RSS after the imports. The eager list reader, measured the same way, grows by about
    180 x 0.5 MiB: the test would fail on it."""
    prompt_len = 65536
    small = synthetic_jsonl(tmp_path / "small" / "g.jsonl", 20, 256, prompt_len, 2, 4)
    large = synthetic_jsonl(tmp_path / "large" / "g.jsonl", 200, 256, prompt_len, 2, 4)
    lazy = {n: _peak_rss(p, "lazy") for n, p in ((20, small), (200, large))}
    eager = {n: _peak_rss(p, "eager") for n, p in ((20, small), (200, large))}
    assert lazy[200]["tokens"] == 200 * prompt_len and lazy[20]["tokens"] == 20 * prompt_len
    mib = 1 << 20
    growth = {mode: (runs[200]["peak_rss"] - runs[20]["peak_rss"]) / mib
              for mode, runs in (("lazy", lazy), ("eager", eager))}
    print(f"peak RSS growth from 20 to 200 groups: lazy {growth['lazy']:.1f} MiB, "
          f"eager list {growth['eager']:.1f} MiB")
    assert growth["lazy"] <= 8
    assert growth["eager"] >= 60                              # 180 prompts x 0.5 MiB held


# ---- through the launcher -------------------------------------------------------------------------

def _flags(tmp_path: Path, data: Path, *extra: str) -> list[str]:
    return ["--longstraw", "--longstraw-config", TINY, "--longstraw-data", str(data),
            "--longstraw-group-size", "2", "--longstraw-dtype", "fp32", "--lr", "1e-3",
            "--longstraw-out-dir", str(tmp_path), "--longstraw-run-name", "t", *extra]


class Stop(Exception):
    pass


@pytest.fixture
def step_groups(monkeypatch):
    """The `source` of every group each train_step call receives; `stop_at[0]` = n raises Stop at
    the n-th call (a crash after the checkpoint of step n)."""
    seen, stop_at = [], [None]
    real = schedule.train_step

    def spy(model, optimizer, groups, *args, **kwargs):
        if stop_at[0] is not None and len(seen) == stop_at[0]:
            raise Stop()
        seen.append([g.source.rsplit(" ", 1)[1] for g in groups])
        return real(model, optimizer, groups, *args, **kwargs)

    monkeypatch.setattr(schedule, "train_step", spy)
    return seen, stop_at


@pytest.mark.usefixtures("single_process")
def test_resume_continues_at_the_next_group(tmp_path, step_groups):
    seen, stop_at = step_groups
    data = synthetic_jsonl(tmp_path / "d" / "g.jsonl", 5, 512, 24, 2, 3)
    args = ("--global-batch-size", "2", "--train-iters", "4", "--seed", "3")
    receipt = train.main(_flags(tmp_path, data, *args))
    full = [list(s) for s in seen]
    order = [str(i + 1) for e in range(2) for i in epoch_order(5, 3, e).tolist()]
    assert [line for step in full for line in step] == order[:8]   # epoch 0, then epoch 1's order
    assert receipt["global_batch_size"] == 2

    seen.clear()
    ckpt = str(tmp_path / "ckpt")
    stop_at[0] = 3                                 # crash in step 3, after the checkpoint of steps 0-2
    with pytest.raises(Stop):
        train.main(_flags(tmp_path, data, *args, "--save", ckpt, "--save-interval", "1"))
    stop_at[0] = None
    seen.clear()
    train.main(_flags(tmp_path, data, *args, "--save", ckpt, "--save-interval", "1", "--load", ckpt))
    assert seen == full[3:]

    # A resume with another global batch size continues from the groups consumed, not the steps.
    seen.clear()
    train.main(_flags(tmp_path, data, "--global-batch-size", "1", "--train-iters", "6",
                      "--seed", "3", "--load", ckpt, "--override-opt_param-scheduler"))
    assert [line for step in seen for line in step] == order[8:10]
