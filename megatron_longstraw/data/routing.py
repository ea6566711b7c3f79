"""The engine's routing fields of a group (`routed_experts`, `dsa_topk`; docs/design.md section 2):
their names, shapes and value checks, shared by the JSONL reader and routing replay
(step/routing_replay.py applies them to a model)."""

from __future__ import annotations

import torch

FIELDS = ("routed_experts", "dsa_topk")
WHAT = {"routed_experts": "MoE layer", "dsa_topk": "indexer layer"}
SHAPE = {"routed_experts": "[tokens][moe_layers][topk] integer expert ids",
         "dsa_topk": "[tokens][indexer_layers][k] integer key positions (-1: none)"}


def member_tensor(field: str, value, member: int, num_tokens: int) -> torch.Tensor:
    """One member's JSON value `[tokens][layers][k]` -> int32 [R, L, k]; ValueError with the
    member and token when it is not that shape or not integers."""
    if not isinstance(value, list):
        raise ValueError(f"item {member} must be a list {SHAPE[field]}, got "
                         f"{type(value).__name__}.")
    if len(value) != num_tokens:
        raise ValueError(f"item {member} has {len(value)} tokens but response {member} has "
                         f"{num_tokens}; give one entry per response token, in order (the query "
                         "that predicted token j is at position P - 1 + j: from an engine's "
                         "per-position array of [prompt; response], take rows P - 1 onwards).")
    try:
        t = torch.tensor(value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise ValueError(_malformed(field, value, member)) from None
    if t.dtype != torch.int64 or t.dim() != 3 or 0 in t.shape:
        raise ValueError(_malformed(field, value, member))
    if t.abs().max() >= 2**31:
        raise ValueError(f"item {member} holds {int(t.abs().max())}, beyond int32.")
    return t.to(torch.int32)


def _malformed(field: str, value, member: int) -> str:
    """Where a member's nested list stops being a rectangle of integers."""
    shape = None
    for token, layers in enumerate(value):
        ok = isinstance(layers, list) and layers and all(
            isinstance(ids, list) and ids and all(type(x) is int for x in ids) for ids in layers)
        here = (len(layers), len(layers[0])) if ok else None
        if ok and shape is None:
            shape = here
        if not ok or here != shape or any(len(ids) != shape[1] for ids in layers):
            return (f"item {member} token {token} is not a list of {WHAT[field]}s each holding "
                    f"the same number of integers (expected {SHAPE[field]}, the same layer count "
                    "and width for every token).")
    return f"item {member} must be {SHAPE[field]}."


def check_values(field: str, t: torch.Tensor, member: int, prompt_len: int | None) -> None:
    """Value checks that need no model: routed experts are distinct ids >= 0; DSA key positions
    are -1 or causal (0 <= p <= P - 1 + token; with `prompt_len` known) and distinct."""
    t = t.long()

    def where(idx) -> str:
        return f"item {member} token {int(idx[0])} {WHAT[field]} {int(idx[1])}"
    if field == "routed_experts":
        bad = (t < 0).nonzero()
        if bad.numel():
            raise ValueError(f"{where(bad[0])}: expert id {int(t[tuple(bad[0])])} is negative; "
                             "expert ids are 0 .. num_experts - 1.")
    else:
        limit = (torch.full((t.shape[0],), 2**62) if prompt_len is None
                 else prompt_len - 1 + torch.arange(t.shape[0]))
        bad = ((t < -1) | (t > limit[:, None, None])).nonzero()
        if bad.numel():
            token, value = int(bad[0][0]), int(t[tuple(bad[0])])
            raise ValueError(
                f"{where(bad[0])}: key position {value} is outside [0, {int(limit[token])}] "
                f"(-1 for none); token {token} is predicted by the query at position "
                f"P - 1 + {token} = {int(limit[token])}, which attends only to keys at or before "
                "it (key positions count [prompt; response] from 0).")
    ordered = t.sort(dim=-1).values
    dup = ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any(-1).nonzero()
    if dup.numel():
        row = ordered[tuple(dup[0])]
        value = int(row[1:][(row[1:] == row[:-1]) & (row[1:] >= 0)][0])
        what = "expert" if field == "routed_experts" else "key position"
        raise ValueError(f"{where(dup[0])} lists {what} {value} twice; each entry is a set.")
