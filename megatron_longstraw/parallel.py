"""Process groups for LongStraw: TP = PP = 1, context parallel (CP) and expert parallel (EP) folded
on the same ranks (DESIGN section 3), and the collectives the schedule needs."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from megatron_longstraw import platform


def initialize(context_parallel_size: int = 1, expert_parallel_size: int = 1, seed: int = 1234,
               timeout_s: float = 600.0) -> None:
    """Start torch.distributed (env:// rendezvous, or a one-process group when no launcher set
    one up) and Megatron's model-parallel state with CP and EP folded on the same ranks."""
    from megatron.core import parallel_state as ps

    platform.apply()
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        if platform.has_cuda():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(platform.dist_backend(),
                                timeout=datetime.timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    if world % context_parallel_size or world % expert_parallel_size:
        raise ValueError(f"world size {world} must be divisible by the context-parallel size "
                         f"({context_parallel_size}) and the expert-parallel size "
                         f"({expert_parallel_size}).")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_parallel_size,
    )
    platform.manual_seed(seed)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
