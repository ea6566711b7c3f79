"""The exact prompt gradient (prompt_backward.py, --longstraw-prompt-grad exact): the update of
LongStraw equals plain autograd GRPO over the full [prompt; response] sequences, every parameter,
for the three families (fp64, CP 1). The reference is built without capture or replay
(models/reference.full_sequence_logprobs), so it checks the path, not the path against itself."""

import re

import pytest
import torch

from helpers import build_tiny_glm, build_tiny_qwen, full_sequence_logprobs
from megatron_longstraw.config.settings import LongStrawConfig
from megatron_longstraw.grpo.loss import grpo_loss
from megatron_longstraw.config.loss import GRPOLossConfig
from megatron_longstraw.step.schedule import forward_backward_longstraw
from megatron_longstraw.data.group import GRPOGroup

pytestmark = pytest.mark.usefixtures("single_process")

LENS = (1, 6, 17)


def _build(family):
    if family == "deepseekv3":
        from test_deepseekv3 import build_tiny_deepseekv3

        return build_tiny_deepseekv3(torch.float64)
    return (build_tiny_glm if family == "glm52" else build_tiny_qwen)(torch.float64)


def _group(vocab, prompt_len):
    gen = torch.Generator().manual_seed(11)
    return GRPOGroup(prompt_ids=torch.randint(0, vocab, (prompt_len,), generator=gen),
                     response_ids=[torch.randint(0, vocab, (n,), generator=gen) for n in LENS],
                     rewards=torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64))


def _full_autograd(model, group, aggregation="sequence_mean"):
    """d GRPO loss / d theta by autograd through full-sequence forwards (ratio 1: old = new); the
    constant normaliser is C = 64, `_longstraw`'s max_response_len (its default C)."""
    model.zero_grad(set_to_none=True)
    logps = [full_sequence_logprobs(model, group.prompt_ids, r) for r in group.response_ids]
    grpo_loss(logps, [lp.detach() for lp in logps], group.rewards,
              GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.28, aggregation=aggregation,
                             norm_constant=64)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _longstraw(model, group, mode, **kw):
    model.zero_grad(set_to_none=True)
    ls = LongStrawConfig.of(group_size=len(LENS), query_block=29, key_block=37, token_block=50,
                         max_response_len=64, clip_eps_high=0.28, prompt_grad=mode, **kw)
    forward_backward_longstraw(model, group, ls)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _worst(got, ref):
    assert got.keys() == ref.keys() and got
    return max(float((got[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-300)) for n in ref)


# GLM-5.2's prompt is 10x its top-k with IndexShare layers (their selection comes from capture);
# without layer checkpointing once (the page leaves are then read once per member, not twice).
# The loss aggregations (grpo/loss.py) on the cheapest case, its 17-token member in blocks of 8:
# token_mean's divisor is the whole group's token count, the same in every member's (and block's)
# share, so member-by-member replay is still the group loss's gradient.
@pytest.mark.parametrize("family,prompt_len,checkpoint_layers,aggregation,response_block", [
    ("glm52", 160, True, "sequence_mean", 8192), ("glm52", 160, False, "sequence_mean", 8192),
    ("qwen36", 64, True, "sequence_mean", 8192), ("deepseekv3", 64, True, "sequence_mean", 8192),
    ("glm52", 160, False, "token_mean", 8), ("glm52", 160, False, "constant", 8)])
def test_exact_mode_equals_full_sequence_autograd_for_every_parameter(
        family, prompt_len, checkpoint_layers, aggregation, response_block):
    cfg, model = _build(family)
    group = _group(cfg.vocab_size, prompt_len)
    reference = _full_autograd(model, group, aggregation)
    kw = dict(checkpoint_layers=checkpoint_layers, loss_aggregation=aggregation,
              response_block=response_block)
    exact = _longstraw(model, group, "exact", **kw)
    worst = _worst(exact, reference)
    detached = _worst(_longstraw(model, group, "detached", **kw), reference)
    print(f"{family} {aggregation}: exact vs full autograd {worst:.2e} (detached: {detached:.2e})")
    assert worst <= 1e-9
    assert detached > 1e-6          # the prompt's share is real: detached is measurably off


def test_exact_mode_with_lora_adapters_equals_full_sequence_autograd():
    """LoRA on GLM-5.2's attention and MLP linears (B perturbed from its zero init so both A and B
    get gradients; no dropout): the adapters' exact gradients equal full-sequence autograd."""
    from megatron_longstraw.adapters.lora import LoRAConfig, apply_lora
    from megatron_longstraw.models.glm52.family import LORA_TARGETS

    cfg, model = _build("glm52")
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=LORA_TARGETS))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    group = _group(cfg.vocab_size, 96)
    reference = _full_autograd(model, group)
    assert reference and all("lora" in n for n in reference)
    worst = _worst(_longstraw(model, group, "exact"), reference)
    print(f"glm52 LoRA: exact vs full autograd {worst:.2e}")
    assert worst <= 1e-9


@pytest.mark.parametrize("world,cases", [
    (2, [("glm52", 2, 2, 160), ("qwen36", 2, 1, 64), ("deepseekv3", 2, 2, 64)]),
    (4, [("glm52", 4, 4, 160), ("qwen36", 4, 1, 64)])])
def test_exact_mode_under_cp_and_ep_equals_full_sequence_autograd(tmp_path, world, cases):
    """Real gloo ranks, CP (x EP folded), the cases one after the other in the same processes:
    each rank's prompt backward over its shard (key rows gathered under autograd, GDN's heads
    exchange), finalized over the ranks, equals full-sequence autograd on one process for every
    parameter (each rank holds its own experts')."""
    import dist_workers
    from distributed import run_ranks

    references, jobs = [], []
    for family, cp, ep, prompt_len in cases:
        cfg, model = _build(family)
        path = tmp_path / f"{family}.pt"
        torch.save({k: v.clone() for k, v in model.state_dict().items()
                    if not k.endswith("_extra_state")}, path)
        references.append(_full_autograd(model, _group(cfg.vocab_size, prompt_len)))
        jobs.append((family, cp, ep, str(path), prompt_len))
    outs = run_ranks(dist_workers.exact_gradient_worker, world, cases=jobs, lens=LENS)
    for case, (family, cp, ep, _), reference in zip(range(len(cases)), cases, references):
        grads = [out[case] for out in outs]
        assert set().union(*grads) == set(reference)   # every parameter, experts on their owners
        worst = max(float((g[n] - reference[n]).norm() / reference[n].norm().clamp_min(1e-300))
                    for g in grads for n in g)
        print(f"{family} CP{cp}/EP{ep}: exact vs full autograd {worst:.2e}")
        assert worst <= 1e-9, (family, cp, ep, worst)


def test_an_unknown_prompt_gradient_mode_is_refused():
    with pytest.raises(ValueError, match=r"prompt_grad must be one of \['detached', 'exact'\]"):
        LongStrawConfig.of(prompt_grad="full")


def test_the_prompt_gradient_mode_is_read_as_the_enum_and_written_as_its_string():
    """YAML and flags give a string, the config holds `PromptGrad`, receipts write the string."""
    import json

    from megatron_longstraw.config.choices import PromptGrad

    assert LongStrawConfig().replay.prompt_grad is PromptGrad.DETACHED
    cfg = LongStrawConfig.of(prompt_grad="exact")
    assert cfg.replay.prompt_grad is PromptGrad.EXACT
    assert LongStrawConfig.of(prompt_grad=PromptGrad.EXACT).replay.prompt_grad is PromptGrad.EXACT
    assert json.dumps({"prompt_grad": cfg.replay.prompt_grad}) == '{"prompt_grad": "exact"}'
    assert f"{cfg.replay.prompt_grad}" == str(cfg.replay.prompt_grad) == "exact"


def test_launcher_flag_runs_the_prompt_backward_and_refuses_lora_dropout(tmp_path, capsys):
    from pathlib import Path

    from megatron_longstraw.training import train
    from megatron_longstraw.runtime.errors import ConfigError

    tiny = str(Path(__file__).resolve().parents[1] / "examples" / "glm52" / "tiny.yaml")
    flags = ["--longstraw", "--longstraw-config", tiny, "--longstraw-synthetic-prompt-len", "64",
             "--longstraw-synthetic-response-len", "4", "--longstraw-group-size", "2",
             "--longstraw-dtype", "fp32", "--lr", "1e-3", "--longstraw-out-dir", str(tmp_path),
             "--longstraw-run-name", "t", "--longstraw-prompt-grad", "exact"]
    receipt = train.main(flags)
    assert receipt["phase_seconds"]["prompt_backward"] > 0
    assert receipt["peak_live_bytes"]["prompt_backward"] > 0
    # Its time is in the step line (after replay's) and in the summary table.
    out = capsys.readouterr().out
    seconds = receipt["phase_seconds"]["prompt_backward"]
    assert re.search(rf"replay \d+\.\ds prompt-backward {seconds:.1f}s \| pages", out), out
    assert re.search(rf"\n  replay\+backward +\d+\.\d s\n  prompt backward +{seconds:.1f} s\n",
                     out), out
    with pytest.raises((ValueError, ConfigError), match="recomputes the prompt's forward"):
        train.main(flags + ["--longstraw-lora", "--longstraw-lora-dropout", "0.1"])
