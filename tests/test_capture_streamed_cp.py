"""Streamed capture under context parallelism (capture.py, `context_parallel.StreamedCapture`), on
real processes over gloo: the same pages as the whole-shard capture, and device memory flat in
the prompt length.

Under CP each layer runs in three phases over a rank's token blocks: the key rows to its pages,
an exchange through host memory (attention: every rank's rows gathered in position order; GDN: the
recurrence per global token block over the rank's heads), then the blocks' queries and FFN/MoE.
The whole-shard capture (`capture="whole"`) is the reference: it all-gathers (GLM-5.2's DSA) or
rings (Qwen3.6's attention, DeepSeek-V3) the shard's keys on the device and runs GDN's exchange
over the whole shard."""

import pytest
import torch

import dist_workers
from distributed import run_ranks

pytestmark = pytest.mark.usefixtures("single_process")

BLOCKS = dict(key_block=32, query_block=16, token_block=48)


def _weights(tmp_path, family):
    from test_capture_streamed import _build

    _, model = _build(family, torch.float64)
    path = tmp_path / f"{family}.pt"
    torch.save({k: v.clone() for k, v in model.state_dict().items()
                if not k.endswith("_extra_state")}, path)
    return str(path)


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("length", [9, 17, 100, 577])
def test_shard_rows_and_capture_blocks(cp, length):
    """A rank's rows within a global range and capture's token blocks against its positions
    (`CPLayout.prompt_positions`): the local rows of [start, end) are exactly those whose position
    lies there; every rank runs as many token blocks (MoE is a collective), contiguous, covering
    its rows, none larger than the token block; one process: blocks of token_block rows."""
    from megatron_longstraw.models.context_parallel import capture_blocks
    from megatron_longstraw.distributed.cp_layout import CPLayout

    token_block = 12
    counts = set()
    for rank in range(cp):
        layout = CPLayout(None, cp, rank)
        positions = layout.prompt_positions(length)
        assert layout.shard_len(length) == positions.numel()
        for start in range(0, length, 5):
            lo, hi = layout.shard_rows_within(length, start, start + 7)
            inside = ((positions >= start) & (positions < start + 7)).nonzero()[:, 0]
            assert torch.equal(inside, torch.arange(lo, hi))
        blocks = capture_blocks(layout, length, token_block)
        assert blocks[0][0] == 0 and blocks[-1][1] == positions.numel()
        assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
        assert all(0 < end - start <= token_block for start, end in blocks)
        counts.add(len(blocks))
        if cp == 1:
            assert blocks == [(s, min(s + token_block, length))
                              for s in range(0, length, token_block)]
    assert len(counts) == 1


# Worked out by hand from the load-balanced order: chunk c of 2 * CP spans
# [round(L c / (2 CP)), round(L (c + 1) / (2 CP))), a half rounded to even (13 * 2 / 4 = 6.5 -> 6),
# and rank r holds chunks r and 2 CP - 1 - r.
SHARDS_BY_HAND = {
    (12, 2): [[(0, 3), (9, 12)], [(3, 6), (6, 9)]],                       # Megatron's equal chunks
    (12, 3): [[(0, 2), (10, 12)], [(2, 4), (8, 10)], [(4, 6), (6, 8)]],
    (13, 2): [[(0, 3), (10, 13)], [(3, 6), (6, 10)]],                     # bounds 0 3 6 10 13
    (13, 3): [[(0, 2), (11, 13)], [(2, 4), (9, 11)], [(4, 6), (6, 9)]],   # bounds 0 2 4 6 9 11 13
}


@pytest.mark.parametrize("length,cp", SHARDS_BY_HAND)
def test_shard_ranges_by_hand(length, cp):
    """`CPLayout.shard_ranges` equals the hand-worked ranges (the test above checks the other
    helpers against it), and `prompt_positions` lists their positions."""
    from megatron_longstraw.distributed.cp_layout import CPLayout

    for rank, expected in enumerate(SHARDS_BY_HAND[length, cp]):
        layout = CPLayout(None, cp, rank)
        assert layout.shard_ranges(length) == expected
        assert layout.prompt_positions(length).tolist() == [p for a, b in expected
                                                            for p in range(a, b)]


FAMILIES = ["glm52", "qwen36", "deepseekv3"]
EQUAL_LEN = 145                 # 72 rows per rank: 2 blocks of 36; GDN's first global block of
                                # 48 tokens held by both ranks
LENGTHS = (193, 769)            # P and 4P: 96 and 384 rows per rank, all in blocks of 48
POSITIONS_BYTES = 8             # per captured row: the positions table (int64)


@pytest.fixture(scope="module")
def cp2(tmp_path_factory):
    """Every family captured on 2 ranks (one process each), whole and streamed; and, on one
    process, the streamed capture of the same prompt (fp64)."""
    from test_capture_streamed import _build
    from megatron_longstraw.context.capture import capture_prompt
    from megatron_longstraw.config.settings import LongStrawConfig

    tmp = tmp_path_factory.mktemp("weights")
    cases = [(family, 2, 1, _weights(tmp, family), (EQUAL_LEN,) + LENGTHS) for family in FAMILIES]
    ranks = run_ranks(dist_workers.streamed_capture_worker, 2, cases=cases, blocks=BLOCKS)
    one_process = {}
    for family in FAMILIES:
        cfg, model = _build(family, torch.float64)
        ls = LongStrawConfig.of(group_size=2, page_tokens=64, **BLOCKS)
        pages = []
        for length in (EQUAL_LEN, LENGTHS[0]):
            ids = torch.randint(0, cfg.vocab_size, (length,),
                                generator=torch.Generator().manual_seed(length))
            pages.append(capture_prompt(model, ids, ls).pages)
        one_process[family] = cfg, pages
    return {family: ([out[i] for out in ranks], *one_process[family])
            for i, family in enumerate(FAMILIES)}


@pytest.mark.parametrize("family", FAMILIES)
def test_cp2_streamed_capture_equals_whole_shard_capture(cp2, family):
    """fp64, CP 2, P = 145 (2 token blocks of 36 per rank; GDN's first global block of 48 held
    by both ranks): every page, layer input and top-k selection
    of the streamed capture against the whole-shard capture. GLM-5.2 bitwise (both gather every
    key and score it in the same key blocks); Qwen3.6 and DeepSeek-V3 within 1e-13: the whole
    shard's ring merges each rank's keys by log-sum-exp in rank order, streamed capture reads them
    in position order (different summation order, nothing else). Each rank's key rows also equal
    one process's streamed capture at that rank's positions within 1e-13 (the same windows; the
    token blocks, so the GEMMs' batches, differ), and bitwise where the blocks align (P = 193:
    blocks of 48 at one process's boundaries)."""
    ranks, _, (one_process, aligned) = cp2[family]
    for out in ranks:
        whole, streamed = out["whole"], out["streamed"]
        assert whole["pages"].keys() == streamed["pages"].keys()
        for key, page in whole["pages"].items():
            if family == "glm52":
                assert torch.equal(page, streamed["pages"][key]), key
            else:
                torch.testing.assert_close(streamed["pages"][key], page, rtol=0, atol=1e-13)
        for x, y in zip(whole["layer_inputs"], streamed["layer_inputs"], strict=True):
            if family == "glm52":
                assert torch.equal(x, y)
            else:
                torch.testing.assert_close(y, x, rtol=0, atol=1e-13)
        assert whole["selections"].keys() == streamed["selections"].keys()
        for layer, selection in whole["selections"].items():
            assert torch.equal(selection, streamed["selections"][layer]), layer
        positions = streamed["positions"]
        for (layer, kind), page in streamed["pages"].items():
            if kind in one_process.kinds(layer) and page.shape[0] == positions.numel():
                torch.testing.assert_close(page, one_process.fetch(layer, kind)[positions],
                                           rtol=0, atol=1e-13)
        # P = 193: a rank's blocks are 48 rows at one process's block boundaries: bitwise.
        positions = out["aligned"]["positions"]
        for (layer, kind), page in out["aligned"]["pages"].items():
            if page.shape[0] == positions.numel():
                assert torch.equal(page, aligned.fetch(layer, kind)[positions]), (layer, kind)


@pytest.mark.parametrize("family", FAMILIES)
def test_cp2_streamed_capture_device_bytes_flat(cp2, family):
    """fp64, CP 2, P = 193 and 769 (96 and 384 captured rows per rank, token blocks of 48: the
    same per-block work at both): on every rank the streamed capture's device peak (live-bytes
    meter, host storage left out; exact on gloo: `memory.collective_frees_on_this_thread`) grows
    by the positions table (8 B per added row) within the stated per-block bytes: one token block
    of the residual stream (which block's transients make the peak may differ), one gathered
    window of the widest key row (48 rows), DSA: the selected latent rows of one query block (16
    queries x top-k). GDN's exchange of a global block needs no term of its own: its buffers are
    Megatron's all-to-all's, freed with the block. The whole-shard capture grows by far more (the
    meter tells them apart: over 100 B per added row). The planner at CP 2: its one prompt-sized device line
    (positions) grows by the same 8 B per row, and the host peak is the pages plus its capture
    host lines (residual stream, selection, every rank's rows of a layer, GDN's exchange buffer),
    exactly."""
    from megatron_longstraw import planner

    ranks, cfg, _ = cp2[family]
    streamed_pages = ranks[0]["streamed"]
    row_bytes = max(page.element_size() * page[0].numel()
                    for (layer, kind), page in streamed_pages["pages"].items()
                    if page.shape[0] == streamed_pages["positions"].numel())
    residual = streamed_pages["layer_inputs"][0]
    block_bytes = BLOCKS["token_block"] * residual[0].numel() * residual.element_size()
    slack = block_bytes + BLOCKS["token_block"] * row_bytes     # a block, a gathered window
    if family == "glm52":
        from helpers import tiny_glm_config

        slack += BLOCKS["query_block"] * tiny_glm_config().index_topk * row_bytes
    for rank, out in enumerate(ranks):
        streamed, whole = out["peaks"]["streamed"], out["peaks"]["whole"]
        added = streamed[1]["local_rows"] - streamed[0]["local_rows"]
        growth = streamed[1]["device"] - streamed[0]["device"]
        whole_growth = whole[1]["device"] - whole[0]["device"]
        print(f"{family} rank {rank}: streamed {streamed[0]['device']} -> {streamed[1]['device']} B "
              f"(growth {growth}, positions {POSITIONS_BYTES * added}, slack {slack}); whole "
              f"{whole[0]['device']} -> {whole[1]['device']} B")
        assert abs(growth - POSITIONS_BYTES * added) <= slack
        assert whole_growth > 100 * added
        planned = []
        for prompt_len, peak in zip(LENGTHS, streamed):
            spec = planner.PlanSpec(family=family, model=cfg, prompt_len=prompt_len, group_size=2,
                                    response_len=16, cp=2, weight_bytes=8, act_bytes=8,
                                    latent_bytes=8, index_key_bytes=8, page_tokens=64, **BLOCKS)
            plan = planner.plan(spec, search_max=False)
            capture_host = [i for i in plan.host_items if i.name.startswith("capture")]
            assert capture_host and all(i.measured for i in capture_host)
            assert plan.host_page_bytes_per_rank == peak["pages"]
            assert peak["host"] == peak["pages"] + sum(i.bytes for i in capture_host)
            tables = {sum(i.bytes for i in items if i.name.startswith("capture positions"))
                      for name, items in plan.phases.items() if name.startswith("capture")}
            assert len(tables) == 1            # every capture phase holds the same table
            planned.append(tables.pop())
        assert planned[1] - planned[0] == POSITIONS_BYTES * added


def test_cp2_phase_peaks_against_the_planner(tmp_path):
    """GLM-5.2 and Qwen3.6 on 2 CP ranks (fp64), one step at P = 193 and 769, the pages copied on
    every read as to a device: each rank's own peak in capture, scoring and replay against the
    planner's phase at CP 2 (the lines only CP has included: the exchange windows, the global
    position lookup, the gathered branch rows, the global top-k merge, the log-sum-exp merge;
    Qwen3.6: GDN's head-parallel exchange, planned with the delta rule the CPU runs): never above
    the plan and at least 80% of it (observed GLM-5.2 0.93, 0.99-0.997 and 0.89; Qwen3.6 0.993,
    0.971-0.975 and 0.887-0.924)."""
    from test_capture_streamed import _build
    from megatron_longstraw import planner

    families = ("glm52", "qwen36")
    cases = [(family, 2, 1, _weights(tmp_path, family), LENGTHS) for family in families]
    ranks = run_ranks(dist_workers.phase_peaks_worker, 2, cases=cases, blocks=BLOCKS)
    for case, family in enumerate(families):
        cfg, _ = _build(family, torch.float64)
        for i, prompt_len in enumerate(LENGTHS):
            spec = planner.PlanSpec(family=family, model=cfg, prompt_len=prompt_len,
                                    group_size=2, response_len=16, cp=2, weight_bytes=8,
                                    act_bytes=8, latent_bytes=8, index_key_bytes=8,
                                    page_tokens=16384, gdn_kernels="torch", **BLOCKS)
            plan = planner.plan(spec, search_max=False)
            planned = {"capture": max(planner.phase_bytes(items)
                                      for name, items in plan.phases.items()
                                      if name.startswith("capture")),
                       "scoring": planner.phase_bytes(plan.phases["scoring"]),
                       "replay": planner.phase_bytes(plan.phases["replay"])}
            for rank, out in enumerate(ranks):
                own = out[case][i]
                for phase, bytes_ in planned.items():
                    print(f"{family} CP 2 rank {rank} P={prompt_len}: {phase} own peak "
                          f"{own[phase]} B, planned {bytes_:.0f} B ({own[phase] / bytes_:.3f})")
                    assert 0.8 * bytes_ <= own[phase] <= bytes_, (family, rank, prompt_len, phase)
