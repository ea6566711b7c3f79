"""Expert-parallel names: a rank's local expert `mlp.experts.local_experts.<i>` under its global
index, and loading a full (all experts) state dict into this rank's shard."""

from __future__ import annotations

import torch


_LOCAL_EXPERT = "mlp.experts.local_experts."


def _expert_offset() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1
    return ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()


def global_name(name: str, num_experts: int) -> str:
    """Name of a local parameter in the single-process (EP = 1) model: local expert j on EP rank e
    is global expert e * (num_experts / EP) + j (Megatron's contiguous expert placement)."""
    if _LOCAL_EXPERT not in name:
        return name
    ep_rank, ep_size = _expert_offset()
    head, tail = name.split(_LOCAL_EXPERT)
    local, rest = tail.split(".", 1)
    return f"{head}{_LOCAL_EXPERT}{ep_rank * (num_experts // ep_size) + int(local)}.{rest}"


def load_full_state_dict(model: torch.nn.Module, full: dict[str, torch.Tensor],
                         num_experts: int) -> None:
    """Load a single-process state dict into an expert-parallel model (this rank's experts)."""
    own = model.state_dict()
    missing = [n for n in own if global_name(n, num_experts) not in full
               and not n.endswith("_extra_state")]
    if missing:
        raise KeyError(f"state dict lacks {len(missing)} entries, e.g. {missing[:3]}")
    wrong = [(n, tuple(full[global_name(n, num_experts)].shape), tuple(t.shape))
             for n, t in own.items() if not n.endswith("_extra_state")
             and full[global_name(n, num_experts)].shape != t.shape]
    if wrong:  # checked before anything is written: copy_ would broadcast silently
        raise ValueError(f"state dict shapes differ from the model for {len(wrong)} entries, "
                         f"e.g. {wrong[:3]} (saved, model).")
    with torch.no_grad():
        for name, tensor in own.items():
            if name.endswith("_extra_state"):
                continue
            tensor.copy_(full[global_name(name, num_experts)])
