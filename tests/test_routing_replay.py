"""Routing replay (megatron_longstraw/step/routing_replay.py): the engine's DSA selections (`dsa_topk`)
and MoE routing (`routed_experts`) are what scoring and replay use, for the tiny GLM-5.2 (fp64),
on one process and on CP2/EP2 ranks; bad fields fail with the line, field, member and token; the
JSONL round trip keeps them."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os

import pytest
import torch

from distributed import run_ranks
from helpers import build_tiny_glm
from megatron_longstraw.step import replay, routing_replay
from megatron_longstraw.config.settings import LongStrawConfig
from megatron_longstraw.data.groups import DataError, parse_line, read_groups, write_groups
from megatron_longstraw.step.schedule import forward_backward_longstraw, validate_inputs
from megatron_longstraw.data.group import GRPOGroup

pytestmark = pytest.mark.usefixtures("single_process")

PROMPT_LEN = 120          # DSA top-k 16: the selection is sparse over the prompt
LENS = (5, 8)             # under CP2 the first member's branch is padded (5 -> 6 rows)


def _cfg() -> LongStrawConfig:
    return LongStrawConfig.of(group_size=len(LENS), query_block=29, key_block=37, token_block=50,
                           max_response_len=64)


def _group(vocab: int, **fields) -> GRPOGroup:
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, vocab, (PROMPT_LEN,), generator=gen)
    responses = [torch.randint(0, vocab, (n,), generator=gen) for n in LENS]
    return GRPOGroup(prompt_ids=prompt, response_ids=responses,
                     rewards=torch.tensor([1.0, 0.0], dtype=torch.float64), **fields)


@pytest.fixture(scope="module")
def tiny():
    cfg, model = build_tiny_glm(torch.float64)
    return cfg, model


@contextlib.contextmanager
def recorded_routing(model):
    """Every router call of a branch pass: (mode, MoE layer n, experts [rows, k] ascending). The
    pass is the layer call's `attention_mask` (models/common.run_layer), seen by a pre-hook on
    every layer and read by the router hooks inside it."""
    calls = []
    current = [None]

    def see_pass(module, args, kwargs):
        current[0] = kwargs.get("attention_mask")

    def hook(n):
        def record(module, args, output):
            state = current[0]
            if state is not None and state.mode in ("score", "replay"):
                routing_map = output[1]                                   # [rows, experts] bool
                experts = routing_map.nonzero()[:, 1].view(routing_map.shape[0], -1)
                calls.append((state.mode, n, experts))
        return record

    handles = [layer.register_forward_pre_hook(see_pass, with_kwargs=True)
               for layer in model.decoder.layers]
    handles += [router.register_forward_hook(hook(n))
                for n, (_, router) in enumerate(routing_replay.moe_routers(model))]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _run(model, group):
    """forward_backward_longstraw from zero gradients -> (result, gradients, router calls)."""
    model.zero_grad(set_to_none=True)
    with recorded_routing(model) as calls:
        result = forward_backward_longstraw(model, group, _cfg())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return result, grads, calls


def _natural(model, group):
    """The run without supplied routing, and what it routed / selected, in the JSONL's layout."""
    result, grads, calls = _run(model, group)
    num_moe = len(routing_replay.moe_routers(model))
    score_calls = [experts for mode, _, experts in calls if mode == "score"]
    routed = [torch.stack(score_calls[i * num_moe:(i + 1) * num_moe], 1).to(torch.int32)
              for i in range(len(LENS))]
    layers = routing_replay.indexer_layers(model)
    dsa = [torch.stack([sel[layer] for layer in layers], 1) if layers else None
           for sel in result.selections]
    return result, grads, routed, dsa


def _random_selections(vocab_group, width: int, num_layers: int, seed: int) -> list[torch.Tensor]:
    """Valid engine selections unlike the computed ones: per token and layer, `width` - 3 distinct
    random causal key positions (query of token j at P - 1 + j), then three -1."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for response in vocab_group.response_ids:
        rows = []
        for j in range(response.numel()):
            visible = PROMPT_LEN + j                           # keys 0 .. P - 1 + j
            layers = [torch.randperm(visible, generator=gen)[:width - 3] for _ in range(num_layers)]
            rows.append(torch.stack(layers))
        sel = torch.stack(rows)
        out.append(torch.cat([sel, sel.new_full(sel.shape[:2] + (3,), -1)], 2).to(torch.int32))
    return out


def test_supplied_routing_equal_to_computed_changes_nothing(tiny):
    cfg, model = tiny
    group = _group(cfg.vocab_size)
    natural, natural_grads, routed, dsa = _natural(model, group)
    assert routed[0].shape == (LENS[0], 5, cfg.num_experts_per_tok)
    assert dsa[1].shape == (LENS[1], cfg.num_full_indexer_layers(), cfg.index_topk)
    result, grads, _ = _run(model, _group(cfg.vocab_size, dsa_topk=dsa, routed_experts=routed))
    # Bitwise: the same selections and experts reach the same operations.
    for got, exp in zip(result.logps_old + result.logps, natural.logps_old + natural.logps):
        assert torch.equal(got, exp)
    assert grads.keys() == natural_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, natural_grads[name]), name


def test_supplied_selections_are_what_scoring_and_replay_attend_with(tiny, monkeypatch):
    cfg, model = tiny
    group = _group(cfg.vocab_size)
    natural, _, _, _ = _natural(model, group)
    layers = routing_replay.indexer_layers(model)
    supplied = _random_selections(group, cfg.index_topk, len(layers), seed=5)

    passes = []
    make_pass = replay._pass

    def recording_pass(*args, **kwargs):
        state = dataclasses.replace(make_pass(*args, **kwargs), used_selections={})
        passes.append(state)
        return state

    monkeypatch.setattr(replay, "_pass", recording_pass)
    result, _, _ = _run(model, _group(cfg.vocab_size, dsa_topk=supplied))
    assert [p.mode for p in passes] == ["score", "score", "replay", "replay"]
    for state, member in zip(passes, [0, 1, 0, 1]):
        for layer in range(cfg.num_hidden_layers):
            # Every layer attends with the engine's selection of its source layer (IndexShare).
            expected = supplied[member][:, layers.index(cfg.topk_source_layer(layer))]
            assert torch.equal(state.used_selections[layer], expected.long()), (state.mode, layer)
    # Other keys, other log-probs; scoring and replay agree with each other (same selections).
    change = max(float((a - b).abs().max()) for a, b in zip(result.logps_old, natural.logps_old))
    assert change > 1e-4
    for old, new in zip(result.logps_old, result.logps):
        assert float((old - new).abs().max()) <= 1e-12


def _random_experts(cfg, routed, seed):
    """Distinct random experts per token and MoE layer, shaped like the natural `routed`."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(r.shape[:2] + (cfg.n_routed_experts,), generator=gen)
            .argsort(-1)[..., :cfg.num_experts_per_tok].to(torch.int32) for r in routed]


def test_supplied_experts_are_what_scoring_and_replay_route_to(tiny):
    cfg, model = tiny
    group = _group(cfg.vocab_size)
    natural, _, routed, _ = _natural(model, group)
    supplied = _random_experts(cfg, routed, seed=7)
    assert not any(torch.equal(s.sort(-1).values, r) for s, r in zip(supplied, routed))
    result, _, calls = _run(model, _group(cfg.vocab_size, routed_experts=supplied))
    num_moe = len(routing_replay.moe_routers(model))
    modes = [mode for mode, _, _ in calls]
    # Scoring: one call per member and MoE layer; replay: the forward and the checkpoint
    # recompute in backward, both with the engine's experts.
    assert modes.count("score") == len(LENS) * num_moe
    assert modes.count("replay") == 2 * len(LENS) * num_moe
    member_of = {"score": [i for i in range(len(LENS)) for _ in range(num_moe)],
                 "replay": [i for i in range(len(LENS)) for _ in range(2 * num_moe)]}
    seen = {"score": 0, "replay": 0}
    for mode, n, experts in calls:
        member = member_of[mode][seen[mode]]
        seen[mode] += 1
        assert torch.equal(experts, supplied[member][:, n].long().sort(-1).values), (mode, n)
    change = max(float((a - b).abs().max()) for a, b in zip(result.logps_old, natural.logps_old))
    assert change > 1e-4
    for old, new in zip(result.logps_old, result.logps):
        assert float((old - new).abs().max()) <= 1e-12


def _line(**fields) -> bytes:
    row = {"prompt_ids": list(range(10, 16)), "response_ids": [[1, 2, 3], [4, 5]],
           "rewards": [1.0, 0.0], **fields}
    return (json.dumps(row) + "\n").encode()


def _experts(lens=(3, 2), layers=2, k=2):
    return [[[[(t + l + s) % 8 for s in range(k)] for l in range(layers)] for t in range(n)]
            for n in lens]


@pytest.mark.parametrize("field,value,needle", [
    ("routed_experts", _experts()[:1], "has 1 entries but 'response_ids' has 2"),
    ("routed_experts", _experts(lens=(2, 2)), "item 0 has 2 tokens but response 0 has 3"),
    ("routed_experts", [_experts()[0][:2] + [[[1, 2]]], _experts()[1]], "item 0 token 2 is not"),
    ("routed_experts", [_experts()[0], [[[1.0, 2], [1, 2]], [[1, 2], [1, 2]]]], "item 1 token 0"),
    ("routed_experts", [[[[0, 1], [2, -3]]] * 3, _experts()[1]],
     "item 0 token 0 MoE layer 1: expert id -3 is negative"),
    ("routed_experts", [_experts()[0], [[[0, 1], [2, 2]]] * 2],
     "item 1 token 0 MoE layer 1 lists expert 2 twice"),
    ("routed_experts", [_experts()[0], _experts(layers=3)[1]], "item 1 has 3 layers"),
    # Prompt of 6 tokens: response token 1 is predicted by the query at position 6.
    ("dsa_topk", [[[[0, -1]], [[6, 7]], [[0, 1]]], [[[0, 1]], [[2, 3]]]],
     "item 0 token 1 indexer layer 0: key position 7 is outside [0, 6]"),
    ("dsa_topk", [[[[0, -2]]] * 3, [[[0, 1]]] * 2], "key position -2 is outside [0, 5]"),
    ("dsa_topk", [[[[0, 1]]] * 3, [[[4, 4]]] * 2], "lists key position 4 twice"),
])
def test_bad_fields_name_line_field_member_and_token(tmp_path, field, value, needle):
    with pytest.raises(DataError) as err:
        parse_line(tmp_path / "g.jsonl", 4, _line(**{field: value}))
    message = str(err.value)
    assert message.startswith(f"{tmp_path / 'g.jsonl'} line 4: field '{field}' "), message
    assert needle in message, message


def test_fields_checked_against_the_model(tiny):
    cfg, model = tiny
    group = _group(cfg.vocab_size)
    _, _, routed, dsa = _natural(model, group)
    ls = _cfg()

    def error(**fields) -> str:
        with pytest.raises(ValueError) as err:
            validate_inputs(model, _group(cfg.vocab_size, **fields), ls)
        return str(err.value)

    per_decoder_layer = [torch.cat([r[:, :3], r], 1) for r in routed]   # dense layers too
    assert "8 MoE layers per token, but the model has 5 (decoder layers [3, 4, 5, 6, 7])" in \
        error(routed_experts=per_decoder_layer)
    too_many = [r.clone() for r in routed]
    too_many[1][2, 4, 1] = cfg.n_routed_experts
    assert ("'routed_experts' response 1 token 2 MoE layer 4: expert id 8 is not below the "
            "model's 8 experts") in error(routed_experts=too_many)
    assert "routes each token to 2 experts" in error(routed_experts=[r[..., :1] for r in routed])
    wide = [torch.cat([d, d.new_full(d.shape[:2] + (1,), -1)], 2) for d in dsa]
    assert "the model's DSA top-k is 16" in error(dsa_topk=wide)
    late = [d.clone() for d in dsa]
    late[0][0, 0, 0] = PROMPT_LEN          # token 0's query is at P - 1
    assert f"'dsa_topk' response 0 token 0 indexer layer 0: key position {PROMPT_LEN} is outside" \
        in error(dsa_topk=late)
    assert "has 4 (decoder layers [0, 1, 2, 6])" in error(dsa_topk=[d[:, :2] for d in dsa])


def test_jsonl_round_trip(tmp_path):
    gen = torch.Generator().manual_seed(0)
    routed = [torch.randint(0, 8, (n, 5, 2), generator=gen, dtype=torch.int32) for n in LENS]
    routed = [torch.stack([r[..., 0], (r[..., 0] + 1) % 8], -1) for r in routed]   # distinct
    dsa = _random_selections(_group(512), 16, 4, seed=1)
    group = _group(512, routed_experts=routed, dsa_topk=dsa)
    path = write_groups(tmp_path / "g.jsonl", [group, _group(512)])
    first, second = list(read_groups(path))
    for field, sent in (("routed_experts", routed), ("dsa_topk", dsa)):
        back = getattr(first, field)
        assert all(b.dtype == torch.int32 and torch.equal(b, s) for b, s in zip(back, sent))
        assert getattr(second, field) is None
    assert json.loads(path.read_text().splitlines()[0])["dsa_topk"][1][7][3][-1] == -1


# ---- CP2 / EP2: each rank routes its own branch rows; selections cover the padded branch ---------


def routing_replay_worker(rank, state_path, group):
    from megatron_longstraw.distributed import parallel, expert_names
    from megatron_longstraw.distributed.finalize import finalize_longstraw_grads

    parallel.initialize(context_parallel_size=2, expert_parallel_size=2,
                        init_method=os.environ["LONGSTRAW_TEST_INIT"])
    cfg, model = build_tiny_glm(torch.float64)
    expert_names.load_full_state_dict(model, torch.load(state_path), cfg.n_routed_experts)
    result = forward_backward_longstraw(model, group, _cfg())
    finalize_longstraw_grads(model)
    grads = {expert_names.global_name(n, cfg.n_routed_experts): p.grad.clone()
             for n, p in model.named_parameters() if p.grad is not None}
    return {"logps": result.logps, "logps_old": result.logps_old, "grads": grads}


def test_context_parallel_ranks_replay_their_own_rows(tiny, tmp_path):
    cfg, model = tiny
    group = _group(cfg.vocab_size)
    natural, _, routed, _ = _natural(model, group)
    experts = _random_experts(cfg, routed, seed=11)
    dsa = _random_selections(group, cfg.index_topk, cfg.num_full_indexer_layers(), seed=12)
    supplied = _group(cfg.vocab_size, routed_experts=experts, dsa_topk=dsa)
    reference, ref_grads, _ = _run(model, supplied)
    assert max(float((a - b).abs().max())
               for a, b in zip(reference.logps, natural.logps)) > 1e-4
    path = tmp_path / "tiny_glm.pt"
    torch.save({k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")},
               path)
    outs = run_ranks(routing_replay_worker, 2, state_path=str(path), group=supplied)
    # fp64: the layouts differ from one process only in summation order.
    for out in outs:
        for got, exp in zip(out["logps_old"] + out["logps"], reference.logps_old + reference.logps):
            assert float((got - exp).abs().max()) <= 1e-9
        for name, grad in out["grads"].items():
            ref = ref_grads[name]
            assert float((grad - ref).norm() / ref.norm().clamp_min(1e-300)) <= 1e-9, name


def test_deepseekv3_routes_with_supplied_experts_and_has_no_dsa():
    """The third family: group-limited MoE routing replays the same way; it has no DSA."""
    from test_deepseekv3 import build_tiny_deepseekv3

    cfg, model = build_tiny_deepseekv3()
    assert cfg.n_group > 1 and cfg.topk_group < cfg.n_group      # group-limited routing
    group = _group(cfg.vocab_size)
    natural, natural_grads, routed, _ = _natural(model, group)
    result, grads, _ = _run(model, _group(cfg.vocab_size, routed_experts=routed))
    # Not bitwise: the routing weights' normalising sum over the top-k adds in the supplied
    # order (ascending ids here), not Megatron's (by score); fp64 rounding only.
    assert max(float((a - b).abs().max()) for a, b in zip(result.logps, natural.logps)) <= 1e-12
    assert max(float((g - natural_grads[n]).norm() / natural_grads[n].norm())
               for n, g in grads.items()) <= 1e-12
    # Experts outside the natural groups: replay routes there anyway (the engine's decision).
    other = [((r + 1) % cfg.n_routed_experts).to(torch.int32) for r in routed]
    result, _, calls = _run(model, _group(cfg.vocab_size, routed_experts=other))
    num_moe = len(routing_replay.moe_routers(model))
    first_member = [(mode, n, e) for mode, n, e in calls if mode == "score"][:num_moe]
    assert all(torch.equal(e, other[0][:, n].long().sort(-1).values) for _, n, e in first_member)
    assert max(float((a - b).abs().max()) for a, b in zip(result.logps, natural.logps)) > 1e-4
    dsa = [torch.zeros(n, 1, 1, dtype=torch.int32) for n in LENS]
    with pytest.raises(ValueError, match="no DSA indexer layers; drop the field"):
        validate_inputs(model, _group(cfg.vocab_size, dsa_topk=dsa), _cfg())
