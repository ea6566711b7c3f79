"""Blockwise branches bound device memory by a block, not by the response (issue #30): the
live-bytes meter (`memory.LiveBytesMeter`, host storage left out: the branch's pages, their
cotangent buffers and the kept selections are host memory, as on a GPU) sees the same scoring
and replay peaks at R and 4R, three families, detached and exact, one process and CP 2.

What may grow with R, and is asserted as the bound (per added response token):
- tables: the earlier rows' positions (kept, and their concatenation for the block's pass) and
  the log-probs (per block, the member's, the step's), `TABLE_BYTES`;
- one layer's rows of the earlier blocks as the attention reads them (their page window, as the
  device holds one layer's window of the prompt's pages) and, GLM-5.2's scoring, their index
  keys and positions for the top-k (the index-key window of the prompt's test,
  tests/test_replay_memory.py). Measured (fp64, R = 16 -> 64, blocks of 8): replay grows by
  32-48 B a token (the tables), scoring by 28-48 B, GLM-5.2's by 205-361 B (its index-key
  window); with blocks of 16 (R = 32 -> 128) GLM-5.2's replay grew by 406 B a token, within
  one layer's rows (456 B), not traced further.
A whole-branch run (one block) grows by its activations: the last test shows the meter catching
that under the same bound."""

import pytest
import torch

from helpers import build_tiny_glm, build_tiny_qwen
from megatron_longstraw.config.settings import LongStrawConfig
from megatron_longstraw.data.group import GRPOGroup
from megatron_longstraw.runtime.memory import LiveBytesMeter
from megatron_longstraw.step.schedule import forward_backward_longstraw

LENGTHS = (16, 64)           # 2 and 8 blocks of 8
BLOCKS = dict(key_block=32, query_block=8, token_block=32, response_block=8)
TABLE_BYTES = 64             # per response token, fp64 (see the module docstring)
FAMILIES = ("glm52", "qwen36", "deepseekv3")


def _build(family):
    if family == "deepseekv3":
        from test_deepseekv3 import build_tiny_deepseekv3

        return build_tiny_deepseekv3(torch.float64)
    return (build_tiny_glm if family == "glm52" else build_tiny_qwen)(torch.float64)


def _window_bytes(family, cfg) -> int:
    """Bytes per token of one layer's earlier rows as scoring reads them (fp64), and GLM-5.2's
    index key and position."""
    if family == "qwen36":
        return 2 * cfg.num_key_value_heads * cfg.head_dim * 8
    rows = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 8
    return rows + (cfg.index_head_dim * 8 + 8 if family == "glm52" else 0)


def _peaks(model, cfg, response_len, **overrides):
    gen = torch.Generator().manual_seed(response_len)
    group = GRPOGroup(prompt_ids=torch.randint(0, cfg.vocab_size, (32,), generator=gen),
                      response_ids=[torch.randint(0, cfg.vocab_size, (response_len,),
                                                  generator=gen) for _ in range(2)],
                      rewards=torch.tensor([1.0, 0.0], dtype=torch.float64))
    ls = LongStrawConfig.of(group_size=2, max_response_len=response_len,
                         **{**BLOCKS, **overrides})
    with LiveBytesMeter("cpu", exclude_host=True) as meter:
        forward_backward_longstraw(model, group, ls)
    return meter.own_peaks


def _check(family, cfg, at_r, at_4r, label):
    added = LENGTHS[1] - LENGTHS[0]
    bound = (TABLE_BYTES + _window_bytes(family, cfg)) * added
    bounds = {"scoring": bound, "replay": bound}
    for phase, bound in bounds.items():
        growth = at_4r[phase] - at_r[phase]
        print(f"{label}: {phase} own peak {at_r[phase]} B at R={LENGTHS[0]}, {at_4r[phase]} B "
              f"at R={LENGTHS[1]} (growth {growth} B, bound {bound} B)")
        assert at_r[phase] > 0
        assert growth <= bound, (label, phase, growth, bound)


@pytest.mark.usefixtures("single_process")
@pytest.mark.parametrize("family", FAMILIES)
def test_blockwise_peaks_flat_from_r_to_4r(family):
    cfg, model = _build(family)
    _peaks(model, cfg, LENGTHS[0], prompt_grad="exact")                     # warm-up
    for mode in ("detached", "exact"):
        at_r, at_4r = (_peaks(model, cfg, n, prompt_grad=mode) for n in LENGTHS)
        _check(family, cfg, at_r, at_4r, f"{family} {mode}")


def test_blockwise_peaks_flat_from_r_to_4r_under_cp(tmp_path):
    """Real gloo ranks, CP 2 (x EP 2 for the MoE families): every rank's scoring and replay
    peaks, detached and exact."""
    import dist_workers
    from distributed import run_ranks

    cases = [("glm52", 2, 2), ("qwen36", 2, 1), ("deepseekv3", 2, 2)]
    jobs = []
    for family, cp, ep in cases:
        _, model = _build(family)
        path = tmp_path / f"{family}.pt"
        torch.save({k: v.clone() for k, v in model.state_dict().items()
                    if not k.endswith("_extra_state")}, path)
        jobs.append((family, cp, ep, str(path)))
    settings = [dict(prompt_grad="detached"), dict(prompt_grad="exact")]
    outs = run_ranks(dist_workers.response_peaks_worker, 2, cases=jobs, settings=settings,
                     lengths=LENGTHS, blocks=BLOCKS)
    for case, (family, cp, _) in enumerate(cases):
        cfg, _ = _build(family)
        for rank, out in enumerate(outs):
            for setting, (at_r, at_4r) in zip(settings, out[case]):
                _check(family, cfg, at_r, at_4r,
                       f"{family} CP{cp} rank {rank} {setting['prompt_grad']}")


@pytest.mark.usefixtures("single_process")
def test_the_meter_catches_a_whole_branch_growing_with_r():
    """The same bound on a whole-branch run (one block of R rows): its activations grow with R
    and break it, so the flat peaks above are the blocks' doing."""
    cfg, model = _build("deepseekv3")
    whole = dict(response_block=4096)
    _peaks(model, cfg, LENGTHS[0], **whole)
    at_r, at_4r = (_peaks(model, cfg, n, **whole) for n in LENGTHS)
    with pytest.raises(AssertionError):
        _check("deepseekv3", cfg, at_r, at_4r, "deepseekv3 whole branch")
