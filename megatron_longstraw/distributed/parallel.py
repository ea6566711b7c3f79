"""Process groups for LongStraw: TP = PP = 1, context parallel (CP) and expert parallel (EP) folded
on the same ranks (docs/design.md section 3): `initialize`, the layouts supported, the sizes in use
and the groups gradients are summed over. The layout of a sequence over CP is `cp_layout.py`, the
collectives `collectives.py`, expert names `expert_names.py`, agreement `agreement.py`."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from megatron_longstraw.runtime import platform
from megatron_longstraw.runtime.errors import ConfigError


DEFAULT_TIMEOUT_S = 600.0
"""Megatron's default --distributed-timeout-minutes (10)."""


def initialize(context_parallel_size: int = 1, expert_parallel_size: int = 1, seed: int = 1234,
               timeout_s: float = DEFAULT_TIMEOUT_S, init_method: str | None = None) -> None:
    """Start torch.distributed (env:// rendezvous as torchrun sets it up, `init_method` when given,
    or a one-process group when no launcher set one up) and Megatron's model-parallel state with CP
    and EP folded on the same ranks. `timeout_s` (the launcher's --distributed-timeout-minutes x
    60) bounds every collective of every process group: a rank whose peer died or hangs fails
    within it instead of waiting (`apply_timeout`)."""
    from megatron.core import parallel_state as ps

    platform.apply()
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if platform.has_cuda():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        kwargs = {}
        if init_method is not None:
            kwargs = dict(init_method=init_method, rank=int(os.environ["RANK"]),
                          world_size=int(os.environ["WORLD_SIZE"]))
        elif "RANK" not in os.environ:
            # One process, no launcher: an in-process store, no port and no environment
            # variables, so a child process this one starts cannot inherit a rendezvous that is
            # not its own (a port already in use: EADDRINUSE).
            kwargs = dict(store=dist.HashStore(), rank=0, world_size=1)
        dist.init_process_group(platform.dist_backend(), timeout=timeout, **kwargs)
    world = dist.get_world_size()
    if world % context_parallel_size or world % expert_parallel_size:
        raise ConfigError(f"world size {world} must be divisible by the context-parallel size "
                          f"(--context-parallel-size {context_parallel_size}) and the "
                          f"expert-parallel size (--expert-model-parallel-size "
                          f"{expert_parallel_size}).")
    if ps.model_parallel_is_initialized():
        _destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_parallel_size,
        distributed_timeout_minutes=timeout_s / 60.0,
    )
    apply_timeout(timeout)
    platform.manual_seed(seed)


def _destroy_model_parallel() -> None:
    """Megatron's `destroy_model_parallel` forgets its groups without ending them, and each gloo
    group keeps two threads per peer: a process that initialises again and again (the tests,
    tools that build several layouts) collected thousands of threads. Its groups are destroyed
    here too (`destroy_process_group(group)` is local: no collective), the default group kept."""
    from megatron.core import parallel_state as ps
    from torch.distributed import distributed_c10d as c10d

    groups = {g for g in (ps._global_process_group_list or []) if g is not None
              and g is not dist.group.WORLD}
    ps.destroy_model_parallel()          # (it ends a few itself: those are skipped)
    for group in groups:
        if group in c10d._world.pg_map:
            dist.destroy_process_group(group)


def apply_timeout(timeout: datetime.timedelta) -> list:
    """Set `timeout` on the default group and every group Megatron created (this rank's).
    Megatron passes its `distributed_timeout_minutes` to most groups but not all (megatron-core
    0.19.2 creates EXPERT_DATA_PARALLEL_GROUP_GLOO without it), and torch gives a group created
    without a timeout its backend's default (30 minutes for gloo), not the default group's.
    `torch.distributed.set_timeout` is local (no collective, unlike Megatron's
    update_pg_timeout, which starts with a barrier). Returns the groups set."""
    from megatron.core import parallel_state as ps
    from torch.distributed import distributed_c10d as c10d

    groups = [dist.group.WORLD] + [g for g in (ps._global_process_group_list or [])
                                   if g is not None and not c10d._rank_not_in_group(g)]
    for group in groups:
        dist.set_timeout(timeout, group)
    return groups


SUPPORTED_LAYOUT = (
    "LongStraw runs tensor- and pipeline-parallel size 1: it splits a long prompt with context "
    "parallelism (--context-parallel-size), shards experts with expert parallelism folded on the "
    "same ranks (--expert-model-parallel-size dividing the world size, at most the family's "
    "expert limit), and gives the remaining ranks to data parallelism (world size / CP replicas)")


def check_model_parallel_sizes(tensor_parallel_size: int | None = 1,
                               pipeline_parallel_size: int | None = 1,
                               expert_tensor_parallel_size: int | None = None) -> None:
    """Refuse, before any process group starts, the Megatron parallel sizes LongStraw does not
    run (`initialize` builds TP = PP = 1; extra ranks would silently become data-parallel)."""
    for flag, size in (("--tensor-model-parallel-size", tensor_parallel_size),
                       ("--pipeline-model-parallel-size", pipeline_parallel_size),
                       ("--expert-tensor-parallel-size", expert_tensor_parallel_size)):
        if size is not None and size > 1:
            raise ConfigError(f"{flag} {size} is not supported. {SUPPORTED_LAYOUT}. Set {flag} 1 "
                              "and give those ranks to --context-parallel-size.")


def current_sizes() -> dict:
    """The parallel sizes of the initialised Megatron state, as TransformerConfig fields (layers
    read them from the config: e.g. expert parameters are marked for expert-DP reduction only when
    `expert_model_parallel_size` > 1)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return {}
    return {"context_parallel_size": ps.get_context_parallel_world_size(),
            "expert_model_parallel_size": ps.get_expert_model_parallel_world_size()}


def gradient_groups():
    """(DP x CP group, expert-DP group, expert-model-parallel group) of the initialised Megatron
    state, or (None, None, None) without a process group: the groups a gradient is summed over
    (non-expert, expert) and the one whose ranks hold distinct experts (for norms and counts)."""
    from megatron.core import parallel_state as ps

    if not (dist.is_initialized() and ps.model_parallel_is_initialized()):
        return None, None, None
    return (ps.get_data_parallel_group(with_context_parallel=True),
            ps.get_expert_data_parallel_group(),
            ps.get_expert_model_parallel_group())


