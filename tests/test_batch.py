"""Batch semantics and held-out evaluation through the launcher: --global-batch-size B on DP2 gives
the update of B groups' gradients averaged by hand (fp64), and --longstraw-eval-data scores equal
log-probs of a plain full-sequence forward of the same weights."""

import math
import re
from pathlib import Path

import pytest
import torch

from megatron_longstraw.training import train
from megatron_longstraw.data.groups import read_groups, synthetic_group, write_groups
import processes

pytestmark = pytest.mark.usefixtures("single_process")

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "glm52" / "tiny.yaml")
LR, WEIGHT_DECAY = 1e-3, 0.1


def _flags(tmp_path: Path, *extra: str) -> list[str]:
    return ["--longstraw", "--longstraw-config", TINY, "--longstraw-group-size", "2",
            "--longstraw-dtype", "fp64", "--lr", str(LR), "--lr-decay-style", "constant",
            "--weight-decay", str(WEIGHT_DECAY), "--clip-grad", "0", "--seed", "5",
            "--longstraw-out-dir", str(tmp_path), "--longstraw-run-name", "t",
            "--no-longstraw-live-bytes", *extra]   # (the CPU meter's cost; nothing here reads it)


def _groups(vocab: int, n: int, with_old: bool = False) -> list:
    groups = [synthetic_group(vocab, 40 + 8 * g, 2, 5, seed=20 + g) for g in range(n)]
    if with_old:   # an engine's log-probs: any values <= 0 of the right lengths
        gen = torch.Generator().manual_seed(1)
        for group in groups:
            group.logps_old = [-torch.rand(len(r), generator=gen, dtype=torch.float64) * 3
                               for r in group.response_ids]
    return groups


def _build(flags):
    """The launcher's model (family, config, dtype from `flags`) and its LongStrawConfig."""
    from megatron_longstraw.runtime import precision
    from megatron_longstraw.models.registry import get_family

    args, given = train.parse(flags)
    family, model_cfg, ls, dtype = train.resolve(args, given)
    precision.use_dtype(dtype)
    return get_family(family).build(model_cfg, dtype, 1), ls


def _init(tmp_path: Path, flags) -> tuple[Path, dict]:
    """Perturbed initial weights in model format (so no test depends on a seeded init)."""
    from megatron_longstraw.checkpointing import model_format

    model, _ = _build(flags)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model_format.save_model(tmp_path / "init", model, family="glm52")
    return tmp_path / "init", {n: p.detach().clone() for n, p in model.named_parameters()}


def _torchrun(tmp_path: Path, flags: list[str]) -> str:
    out = processes.run(
        [str(ROOT / ".venv" / "bin" / "torchrun"), "--standalone", "--nproc-per-node", "2",
         str(ROOT / "examples" / "pretrain_gpt.py"), *flags],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "TORCHDYNAMO_DISABLE": "1", "PYTHONWARNINGS": "ignore",
             "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return out.stdout


def _by_hand(flags, init: Path, groups: list) -> dict:
    """Each group's finalized gradient on its own (loss scale 1), averaged by hand, then one
    torch.optim.AdamW step: the parameters after the update."""
    from megatron_longstraw.checkpointing import model_format
    from megatron_longstraw.distributed.finalize import finalize_longstraw_grads
    from megatron_longstraw.step.schedule import forward_backward_longstraw

    model, ls = _build(flags)
    model_format.load_model(init, model, family="glm52")
    params = dict(model.named_parameters())
    total = {}
    for group in groups:
        model.zero_grad(set_to_none=True)
        forward_backward_longstraw(model, group, ls)
        finalize_longstraw_grads(model)
        for n, p in params.items():
            if p.grad is not None:
                total[n] = total.get(n, 0) + p.grad
    for n, p in params.items():   # no gradient (the DSA indexer): no update, as in the optimizer
        p.grad = total[n] / len(groups) if n in total else None
    torch.optim.AdamW(params.values(), lr=LR, weight_decay=WEIGHT_DECAY).step()
    return model


def _saved_weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def test_global_batch_4_on_dp2_equals_four_groups_accumulated_by_hand(tmp_path):
    flags = _flags(tmp_path)
    init, before = _init(tmp_path, flags)
    model_cfg_vocab = 512
    groups = _groups(model_cfg_vocab, 4)
    data = write_groups(tmp_path / "data" / "g.jsonl", groups)
    held_out = _groups(model_cfg_vocab, 3, with_old=True)
    eval_data = write_groups(tmp_path / "eval" / "g.jsonl", held_out)
    ckpt = tmp_path / "ckpt"
    out = _torchrun(tmp_path, [
        *flags, "--pretrained-checkpoint", str(init), "--longstraw-data", str(data),
        "--no-longstraw-data-shuffle", "--global-batch-size", "4", "--train-iters", "1",
        "--save", str(ckpt), "--save-interval", "1", "--longstraw-eval-data", str(eval_data),
        "--eval-iters", "3"])
    got = _saved_weights(ckpt / "step_00000001")
    model = _by_hand(flags, init, list(read_groups(data)))
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    common = got.keys() & expected.keys()
    assert len(common) == len(expected)
    worst = max(float((got[n] - expected[n]).norm() / (expected[n] - before[n]).norm())
                for n in common if not torch.equal(expected[n], before[n]))
    assert all(torch.equal(got[n], before[n]) for n in common if torch.equal(expected[n], before[n]))
    print(f"DP2, global batch 4 vs by hand: max relative difference of the update {worst:.2e}")
    assert worst <= 1e-9
    # Held-out scoring on DP2: 3 groups rounded down to 2 (one per replica), reduced over DP.
    with torch.no_grad():
        scores = _expected_eval(model, held_out[:2])
    line, = [line for line in out.splitlines() if line.startswith("eval ")]
    printed = dict(re.findall(r"(logprob/token|perplexity|kl_to_old) ([-+]?[\d.e+-]+)", line))
    assert "groups 2 |" in line
    assert float(printed["logprob/token"]) == pytest.approx(scores["eval/logprob_token_mean"], abs=1e-6)
    assert float(printed["kl_to_old"]) == pytest.approx(scores["eval/kl_to_old"], rel=1e-3)
    # The comparison can tell batches apart: two of the four groups give another update.
    model = _by_hand(flags, init, list(read_groups(data))[:2])
    two = {n: p.detach() for n, p in model.named_parameters()}
    assert max(float((two[n] - expected[n]).norm() / (expected[n] - before[n]).norm())
               for n in common if not torch.equal(expected[n], before[n])) > 1e-3


def _expected_eval(model, groups) -> dict:
    """The held-out metrics (evaluate.py's definitions) from plain full-sequence forwards."""
    from helpers import full_sequence_logprobs

    logps = [full_sequence_logprobs(model, g.prompt_ids, r).double()
             for g in groups for r in g.response_ids]
    olds = [old for g in groups for old in g.logps_old]
    tokens = sum(lp.numel() for lp in logps)
    token_mean = float(sum(lp.sum() for lp in logps) / tokens)
    diffs = [old - lp for old, lp in zip(olds, logps)]
    return {"eval/groups": float(len(groups)), "eval/logprob_token_mean": token_mean,
            "eval/perplexity": math.exp(-token_mean),
            "eval/logprob_seq_mean": float(sum(lp.sum() for lp in logps) / len(logps)),
            "eval/kl_to_old": float(sum((d.exp() - 1 - d).sum() for d in diffs) / tokens),
            "eval/logprob_abs_diff_to_old": float(sum(d.abs().sum() for d in diffs) / tokens)}


def test_held_out_scores_equal_full_sequence_log_probs_at_the_interval(tmp_path, monkeypatch, capsys):
    from megatron_longstraw.step import evaluate as evaluate_module

    flags = _flags(tmp_path)
    held_out = _groups(512, 3, with_old=True)
    path = write_groups(tmp_path / "eval" / "g.jsonl", held_out)
    calls = []
    real = evaluate_module.evaluate

    def spy(model, dataset, cfg, count, *args):
        values = real(model, dataset, cfg, count, *args)
        with torch.no_grad():
            calls.append((values, _expected_eval(model, held_out[:count])))
        return values

    monkeypatch.setattr(evaluate_module, "evaluate", spy)
    train.main([*flags, "--longstraw-synthetic-prompt-len", "32",
                "--longstraw-synthetic-response-len", "4", "--train-iters", "3",
                "--longstraw-eval-data", str(path), "--eval-interval", "2", "--eval-iters", "2"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("eval ")]
    assert [line.split("|")[0].strip() for line in lines] == ["eval after step     1",
                                                              "eval after step     2"]
    assert len(calls) == 2
    for got, expected in calls:
        assert got.keys() == expected.keys()
        for key in expected:
            assert got[key] == pytest.approx(expected[key], rel=1e-10, abs=1e-12), key
    assert calls[0][0]["eval/logprob_token_mean"] != calls[1][0]["eval/logprob_token_mean"]
    assert re.search(r"groups 2 \| logprob/token [-+]\d\.\d{6} \| perplexity", lines[0])


@pytest.mark.parametrize("flags,message", [
    (["--global-batch-size", "0"], "groups per optimizer step"),
    (["--micro-batch-size", "2"], "a LongStraw micro-batch is one GRPO group"),
    (["--data-path", "x"], "--data-path: Megatron's pre-training data flags"),
    (["--eval-iters", "4"], "given without held-out data"),
])
def test_batch_and_data_flags_that_do_not_fit_are_refused(tmp_path, flags, message):
    from megatron_longstraw.runtime.errors import FlagError

    with pytest.raises(FlagError, match=re.escape(message)):
        train.main(_flags(tmp_path, *flags))


def test_a_global_batch_that_does_not_divide_over_the_replicas_is_refused():
    from megatron_longstraw.runtime.errors import FlagError

    args, _ = train.parse(["--longstraw", "--global-batch-size", "3"])
    assert train.global_batch_size(args, 1) == 3
    with pytest.raises(FlagError, match="must be a multiple of 2, e.g. 2"):
        train.global_batch_size(args, 2)
    args, _ = train.parse(["--longstraw"])
    assert train.global_batch_size(args, 2) == 2               # default: one group per replica
