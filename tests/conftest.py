import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def single_process():
    """A one-process gloo group with Megatron's parallel state (CP = EP = 1)."""
    from megatron_longstraw.distributed import parallel

    parallel.initialize(context_parallel_size=1, expert_parallel_size=1)
    yield
