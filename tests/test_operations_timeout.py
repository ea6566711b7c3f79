"""--distributed-timeout-minutes bounds every collective of every process group (parallel.py
`apply_timeout`): a hung rank stops its peers within the configured time, not torch's 30-minute
default for groups created without a timeout."""

import os
import time
from pathlib import Path

import pytest

from distributed import run_ranks

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "glm52" / "tiny.yaml")
MINUTES = 0.02   # 1.2 s: the flag takes fractions of a minute (arguments.fractional_timeout)


def _hung_peer(rank: int, done: str) -> list[tuple[str, float, str]]:
    """Both ranks start the launcher's process groups (CP2/EP2); rank 1 then hangs (never enters
    a collective until rank 0 is done) while rank 0 runs an all-reduce on every group both ranks
    belong to: (group, seconds until it failed, error) per group."""
    import datetime

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_longstraw.training import train

    # A world group started elsewhere with torch's default timeout: the launcher resets it too.
    dist.init_process_group("gloo", init_method=os.environ["LONGSTRAW_TEST_INIT"], rank=rank,
                            world_size=2)
    launch = train.configure([
        "--longstraw", "--longstraw-config", TINY, "--context-parallel-size", "2",
        "--expert-model-parallel-size", "2", "--distributed-timeout-minutes", str(MINUTES)])
    train.start_process_groups(launch, None)
    groups = [dist.group.WORLD] + [g for g in ps._global_process_group_list if g is not None]
    expected = datetime.timedelta(seconds=MINUTES * 60)
    timeouts = {g._get_backend(torch.device("cpu")).options._timeout for g in groups}
    assert timeouts == {expected}, timeouts
    if rank == 1:
        deadline = time.monotonic() + 120
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.1)
        return []
    seen = []
    try:
        for group in groups:
            if dist.get_world_size(group) < 2:
                continue
            start = time.monotonic()
            try:
                dist.all_reduce(torch.ones(1), group=group)
                error = "completed"
            except RuntimeError as exc:
                error = str(exc).splitlines()[0]
            seen.append((group.group_desc, time.monotonic() - start, error))
    finally:
        Path(done).touch()
    return seen


def test_a_hung_rank_stops_every_collective_within_the_timeout(tmp_path):
    seen = run_ranks(_hung_peer, 2, timeout=240, done=str(tmp_path / "done"))[0]
    assert len(seen) >= 5, seen   # world, CP, EP, DP x CP, model-parallel, their gloo twins...
    for name, seconds, error in seen:
        assert "Timed out" in error or "timed out" in error.lower(), (name, error)
        # 1.2 s configured; the slack covers a loaded 2-core machine, far below 30 minutes.
        assert MINUTES * 60 * 0.9 <= seconds < MINUTES * 60 + 5, (name, seconds)


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_timeout_must_be_positive_minutes(value):
    from megatron_longstraw.runtime.errors import FlagError
    from megatron_longstraw.training import train

    with pytest.raises(FlagError, match="--distributed-timeout-minutes"):
        train.parse(["--longstraw", "--distributed-timeout-minutes", value])
