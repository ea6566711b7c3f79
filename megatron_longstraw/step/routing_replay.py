"""Routing replay: the engine's MoE routing (`routed_experts`) and DSA selections (`dsa_topk`) of
the response tokens, used by pre-step scoring and by replay (docs/design.md section 2).

A token routed to other experts, or attending over other keys, in the trainer than in the engine
that sampled it is a train/inference mismatch that no importance weight fixes cheaply. When a
group carries the engine's decisions, every branch pass of the policy (scoring: `logp_old`; replay
and its checkpoint recompute: the gradient) routes and selects exactly as the engine did.

Formats (per member, per response token; `examples/data/README.md`):

    routed_experts  [R_i][num_moe_layers][moe_topk]        int expert ids in [0, num_experts)
    dsa_topk        [R_i][num_full_indexer_layers][k]      int global key positions, -1 = none

Position convention. Response token j (0-based) is predicted by the query at global position
P - 1 + j: branch row j (the last prompt token for j = 0, else y_{j-1}; replay.make_branch). The
engine's entry for token j is the routing / selection of that query, the forward that produced
token j's logits. An engine that reports one row per input position of `[prompt; response]`
(SGLang's `routed_experts`: P + R - 1 rows) gives these as rows P - 1 onwards. MoE layers count
the decoder layers with a router, in order (GLM-5.2: from `first_k_dense_replace`); full indexer
layers the decoder layers that compute their own top-k (IndexShare layers reuse their source's).
Key positions index `[prompt; response]` from 0; a query at position q may select 0 .. q.

Mechanisms.
- DSA: the selections go to scoring as `AttentionPass.selections` with `reuse_selections=True`
  (every full indexer layer attends with them, IndexShare layers with their source's); scoring
  returns them and replay reuses them, as it reuses computed ones (indexer replay).
- MoE: Megatron-Core's own router replay (`megatron.core.transformer.moe.router_replay.
  RouterReplay`, megatron-core 0.19.2): `replay_routing` gives each `TopKRouter` a `RouterReplay`
  in `REPLAY_FORWARD` with this rank's rows of the member for the duration of one branch pass
  (replay: forward, backward and the checkpoint recompute inside it), then restores the router.
  Megatron's own routing then gathers the router's scores at the given experts (weights
  normalised and scaled as usual; float64 models in float64: precision.enable_fp64_routing).
  Without supplied routing nothing is installed: routing is Megatron's, bitwise unchanged. The
  instances are driven per model and kept off Megatron's global instance list, which would span
  every model of the process (the policy and its KL reference).
The prompt capture routes and selects by itself; the KL reference (another policy) too.
Under CP each rank routes its own branch rows (`Branch.rows`); the padded rows past R take
experts 0 .. k-1 and attend to their own key only (the loss skips them; attention is causal).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from megatron_longstraw.data.routing import FIELDS, SHAPE, WHAT, check_values
from megatron_longstraw.models.common import decoder_groups, is_mixer

# ---- the model's layers --------------------------------------------------------------------------


def moe_routers(model) -> list[tuple[int, torch.nn.Module]]:
    """(decoder layer index, Megatron TopKRouter) of every MoE layer, in order."""
    return [(idx, layer.mlp.router) for idx, group in enumerate(decoder_groups(model))
            for layer in group if hasattr(getattr(layer, "mlp", None), "router")]


def indexer_layers(model) -> list[int]:
    """Decoder layer indices that compute their own DSA top-k (full indexer layers), in order."""
    out = []
    for idx, group in enumerate(decoder_groups(model)):
        cores = [getattr(layer.self_attention, "core_attention", None)
                 for layer in group if is_mixer(layer)]
        if any(getattr(core, "indexer", None) is not None for core in cores):
            out.append(idx)
    return out


def _index_topk(model) -> int:
    return int(getattr(model.config, "dsa_indexer_topk", 0) or 0)


# ---- checks (data.py: per line; schedule.validate_inputs: against the model) ---------------------


def validate_group(model, group) -> None:
    """The group's `routed_experts` / `dsa_topk` against the model (ValueError naming the field,
    response and token): layer counts, widths, id ranges, causality."""
    prompt_len = int(group.prompt_ids.numel())
    for field in FIELDS:
        values = getattr(group, field, None)
        if values is None:
            continue
        if len(values) != len(group.response_ids):
            raise ValueError(f"'{field}' has {len(values)} entries for {len(group.response_ids)} "
                             "responses; give one per response.")
        expected_layers, width_ok, width_text, limit = _model_limits(model, field)
        for i, (t, response) in enumerate(zip(values, group.response_ids)):
            t = torch.as_tensor(t)
            prefix = f"'{field}' response {i}"
            if t.dim() != 3 or t.shape[0] != response.numel():
                raise ValueError(f"{prefix}: shape {tuple(t.shape)}, expected "
                                 f"[{response.numel()}, {len(expected_layers)}, k] "
                                 f"({SHAPE[field]}).")
            if t.dtype.is_floating_point or t.dtype == torch.bool:
                raise ValueError(f"{prefix}: {t.dtype} values; give integers.")
            if t.shape[1] != len(expected_layers):
                raise ValueError(
                    f"{prefix}: {t.shape[1]} {WHAT[field]}s per token, but the model has "
                    f"{len(expected_layers)} (decoder layers {expected_layers}); give one entry "
                    f"per {WHAT[field]}, in order (drop other layers' entries).")
            if not width_ok(t.shape[2]):
                raise ValueError(f"{prefix}: {t.shape[2]} entries per layer; {width_text}.")
            try:
                check_values(field, t, i, prompt_len)
            except ValueError as exc:
                raise ValueError(f"'{field}' {str(exc).replace('item ', 'response ', 1)}") from None
            if limit is not None and int(t.max()) >= limit:
                bad = (t >= limit).nonzero()[0]
                raise ValueError(f"{prefix} token {int(bad[0])} MoE layer {int(bad[1])}: expert "
                                 f"id {int(t[tuple(bad)])} is not below the model's {limit} "
                                 "experts; was the routing recorded with this model?")


def _model_limits(model, field):
    """(layer indices, width check, its text, expert-id bound or None) for `field`."""
    if field == "routed_experts":
        routers = moe_routers(model)
        if not routers:
            raise ValueError("'routed_experts' given, but the model has no MoE layers; drop the "
                             "field.")
        topk = routers[0][1].topk
        return ([idx for idx, _ in routers], lambda k: k == topk,
                f"the model routes each token to {topk} experts (moe_router_topk)",
                int(model.config.num_moe_experts))
    layers = indexer_layers(model)
    if not layers:
        raise ValueError("'dsa_topk' given, but the model has no DSA indexer layers; drop the "
                         "field.")
    topk = _index_topk(model)
    return (layers, lambda k: 1 <= k <= topk,
            f"the model's DSA top-k is {topk} (pad with -1, never wider)", None)


# ---- use -----------------------------------------------------------------------------------------


def engine_selections(model, dsa_topk: torch.Tensor | None, prefix_len: int,
                      padded_length: int) -> dict[int, torch.Tensor] | None:
    """One member's [R, L, k] engine selections -> {full indexer decoder layer: [padded, k]} int32
    global key positions, what `AttentionPass.selections` holds for a branch pass (the whole
    padded branch: under CP every rank selects for every row). Padding rows select their own key
    (always causal; the loss skips them)."""
    if dsa_topk is None:
        return None
    dsa_topk = torch.as_tensor(dsa_topk).to(torch.int32)
    length, _, width = dsa_topk.shape
    pad = torch.full((padded_length - length, width), -1, dtype=torch.int32)
    pad[:, 0] = torch.arange(prefix_len + length, prefix_len + padded_length, dtype=torch.int32)
    return {layer: torch.cat([dsa_topk[:, n], pad])
            for n, layer in enumerate(indexer_layers(model))}


@contextlib.contextmanager
def replay_routing(model, routed_experts: torch.Tensor | None, rows: slice,
                   length: int) -> Iterator[None]:
    """Within the block, every MoE router of `model` routes this rank's branch rows `rows` (of
    the padded branch; `length` = R) to the experts `routed_experts` [R, L, k] gives (Megatron's
    RouterReplay, REPLAY_FORWARD); nothing changes when it is None."""
    if routed_experts is None:
        yield
        return
    from megatron.core.transformer.moe.router_replay import (
        RouterReplay,
        RouterReplayAction,
    )

    routed = torch.as_tensor(routed_experts).long()
    width = routed.shape[2]
    padded = torch.arange(width).expand(max(rows.stop - length, 0), width)  # padding rows
    installed = []
    try:
        for n, (_, router) in enumerate(moe_routers(model)):
            target = torch.cat([routed[:, n], padded])[rows]
            replay = RouterReplay()
            RouterReplay.global_router_replay_instances.remove(replay)  # driven per model here
            replay.set_target_indices(target)
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            installed.append((router, router.router_replay))
            router.router_replay = replay
        yield
    finally:
        for router, previous in installed:
            router.router_replay.clear_indices()
            router.router_replay = previous


def member_inputs(model, group, i: int, prefix_len: int, layout, response_block: int):
    """(engine selections or None, routed experts or None) of member i, as score_member and
    replay_member take them: the selections are this rank's rows of the (blockwise) branch
    (`CPLayout.own_branch_rows`), as scoring returns its own."""
    dsa = group.dsa_topk[i] if getattr(group, "dsa_topk", None) is not None else None
    routed = (group.routed_experts[i] if getattr(group, "routed_experts", None) is not None
              else None)
    selections = None
    if dsa is not None:
        length = int(group.response_ids[i].numel())
        _, _, padded = layout.branch_rows(length)
        rows = layout.own_branch_rows(length, response_block)
        selections = {layer: sel[rows] for layer, sel in
                      engine_selections(model, dsa, prefix_len, padded).items()}
    return selections, routed
