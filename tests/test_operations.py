"""Megatron's operational flags through the launcher: the LR / weight-decay schedule
(lr_schedule.py, Megatron-Core's OptimizerParamScheduler), non-finite losses and gradients
(--check-for-nan-in-loss-and-grad), and signals / exit conditions (exit_conditions.py)."""

from pathlib import Path

import pytest
import torch

from megatron_longstraw.step import schedule
from megatron_longstraw.training import train
import processes

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "glm52" / "tiny.yaml")

SCHEDULE = ["--lr", "1e-2", "--min-lr", "1e-3", "--lr-decay-style", "cosine",
            "--lr-warmup-iters", "1", "--weight-decay-incr-style", "linear",
            "--start-weight-decay", "0.0", "--end-weight-decay", "0.1"]


def _flags(tmp_path: Path, *extra: str) -> list[str]:
    return ["--longstraw", "--longstraw-config", TINY, "--longstraw-synthetic-prompt-len", "32",
            "--longstraw-synthetic-response-len", "4", "--longstraw-group-size", "2",
            "--longstraw-dtype", "fp32", "--longstraw-out-dir", str(tmp_path),
            "--longstraw-run-name", "t", "--no-longstraw-live-bytes", *extra]


class Stop(Exception):
    pass


@pytest.fixture
def steps(monkeypatch):
    """(lr, weight decay) the optimizer holds at every train_step call; `stop_at[0]` = n raises
    Stop at the n-th call (a crash after the checkpoint of step n)."""
    seen, stop_at = [], [None]
    real = schedule.train_step

    def spy(model, optimizer, *args, **kwargs):
        if stop_at[0] is not None and len(seen) == stop_at[0]:
            raise Stop()
        group = optimizer.param_groups[0]
        seen.append((group["lr"], group["weight_decay"]))
        return real(model, optimizer, *args, **kwargs)

    monkeypatch.setattr(schedule, "train_step", spy)
    return seen, stop_at


def _flat(pairs):
    return [x for pair in pairs for x in pair]


def _reference(iters: int) -> list[tuple[float, float]]:
    """Megatron-Core's scheduler itself, built as training.py's get_optimizer_param_scheduler does
    for --train-iters `iters` with SCHEDULE's flags, stepped once per iteration."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
    sched = OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=1, lr_decay_steps=iters,
        lr_decay_style="cosine", start_wd=0.0, end_wd=0.1, wd_incr_steps=iters,
        wd_incr_style="linear")
    out = []
    for _ in range(iters):
        out.append((opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"]))
        sched.step(1)
    return out


@pytest.mark.usefixtures("single_process")
def test_lr_schedule_follows_megatron_and_survives_resume(tmp_path, steps):
    seen, stop_at = steps
    train.main(_flags(tmp_path, *SCHEDULE, "--train-iters", "5"))
    reference = _reference(5)
    assert _flat(seen) == pytest.approx(_flat(reference), rel=1e-12, abs=1e-15)
    assert len({lr for lr, _ in seen}) == 5   # warm-up, then cosine decay: every step differs

    # Stop after the checkpoint of step 2, resume: the sequence continues as if uninterrupted.
    seen.clear()
    ckpt = str(tmp_path / "ckpt")
    stop_at[0] = 2
    with pytest.raises(Stop):
        train.main(_flags(tmp_path, *SCHEDULE, "--train-iters", "5", "--save", ckpt,
                          "--save-interval", "1"))
    stop_at[0] = None
    train.main(_flags(tmp_path, *SCHEDULE, "--train-iters", "5", "--save", ckpt,
                      "--save-interval", "1", "--load", ckpt))
    assert _flat(seen) == pytest.approx(_flat(reference), rel=1e-12, abs=1e-15)

    # Another schedule on resume is refused unless a flag says which one wins.
    from megatron_longstraw.runtime.errors import CheckpointError

    changed = [f if f != "1e-3" else "2e-3" for f in SCHEDULE]
    with pytest.raises(CheckpointError, match="--override-opt_param-scheduler"):
        train.main(_flags(tmp_path, *changed, "--train-iters", "5", "--load", ckpt))


@pytest.mark.usefixtures("single_process")
def test_decoupled_lr_gives_embedding_and_output_their_own_schedule(tmp_path, monkeypatch):
    """--decoupled-lr / --decoupled-min-lr (Megatron's): the word embeddings and the output layer
    (Megatron's `is_embedding_or_output_parameter`) follow the same warm-up and cosine decay
    between their own bounds; every other parameter follows --lr / --min-lr."""
    groups = []
    real = schedule.train_step

    def spy(model, optimizer, *args, **kwargs):
        names = {id(p): n for n, p in model.named_parameters()}
        groups.append([(g["lr"], sorted(names[id(p)] for p in g["params"]))
                       for g in optimizer.param_groups])
        return real(model, optimizer, *args, **kwargs)

    monkeypatch.setattr(schedule, "train_step", spy)
    train.main(_flags(tmp_path, *SCHEDULE, "--train-iters", "3", "--decoupled-lr", "5e-2",
                      "--decoupled-min-lr", "5e-3"))
    body = _reference(3)
    io = [(lr * 5, wd) for lr, wd in body]   # the same shape between 5x the bounds (init 0)
    assert [g[0][0] for g in groups] == pytest.approx([lr for lr, _ in body], rel=1e-12)
    assert [g[1][0] for g in groups] == pytest.approx([lr for lr, _ in io], rel=1e-12)
    io_names = groups[0][1][1]
    assert io_names and all("embedding" in n or "output_layer" in n for n in io_names)
    assert not any("embedding" in n or "output_layer" in n for n in groups[0][0][1])


@pytest.mark.parametrize("flags,message", [
    (["--decoupled-min-lr", "1e-3"], "--decoupled-min-lr needs --decoupled-lr"),
    (["--decoupled-lr", "1e-2", "--longstraw-lora"], "neither is trained here"),
    (["--min-lr", "1", "--lr", "0.1"], "--min-lr 1 must lie in"),
    (["--lr-warmup-iters", "9", "--train-iters", "3"], "must be shorter than the decay"),
    (["--weight-decay-incr-style", "linear"], "needs both --start-weight-decay"),
])
def test_bad_schedules_are_refused_before_any_work(tmp_path, flags, message):
    from megatron_longstraw.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        train.main(_flags(tmp_path, *flags))


@pytest.fixture
def poisoned(monkeypatch):
    """Makes the GRPO loss of the `poison[0]`-th train_step call NaN (member 0's share, so its
    gradient is NaN too); records the trainable weights before and after every call."""
    from megatron_longstraw.grpo import loss as grpo

    calls, poison, weights = [0], [None], []
    real_step, real_loss = schedule.train_step, grpo.member_loss

    def snapshot(model):
        return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    def step_spy(model, *args, **kwargs):
        before = snapshot(model)
        try:
            return real_step(model, *args, **kwargs)
        finally:
            weights.append((before, snapshot(model)))
            calls[0] += 1

    def loss_spy(*args, **kwargs):
        loss, stats = real_loss(*args, **kwargs)
        if calls[0] == poison[0]:
            loss = loss * float("nan")
        return loss, stats

    monkeypatch.setattr(schedule, "train_step", step_spy)
    monkeypatch.setattr(schedule, "member_loss", loss_spy)
    return poison, weights


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.usefixtures("single_process")
def test_nan_loss_skip_mode_counts_and_keeps_the_weights(tmp_path, poisoned, capsys):
    poison, weights = poisoned
    poison[0] = 1
    receipt = train.main(_flags(tmp_path, "--lr", "1e-2", "--train-iters", "3",
                                "--no-check-for-nan-in-loss-and-grad"))
    assert len(weights) == 3
    assert not _same(*weights[0]) and not _same(*weights[2])   # the other steps update
    assert _same(*weights[1])                                  # the NaN step does not
    assert all(torch.isfinite(t).all() for t in weights[2][1].values())
    assert receipt["skipped_steps"] == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.rsplit("skipped_steps ", 1)[1] for line in lines] == ["0", "1", "1"]


@pytest.mark.usefixtures("single_process")
def test_nan_loss_stop_mode_names_step_and_group_and_keeps_the_checkpoint(tmp_path, poisoned):
    from megatron_longstraw.checkpointing import checkpoint
    from megatron_longstraw.runtime.errors import NonFiniteError, is_user_error

    poison, weights = poisoned
    poison[0] = 1
    ckpt = tmp_path / "ckpt"
    with pytest.raises(NonFiniteError) as info:
        train.main(_flags(tmp_path, "--lr", "1e-2", "--train-iters", "3", "--save", str(ckpt),
                          "--save-interval", "1"))
    message = str(info.value)
    assert is_user_error(info.value) and "\n" not in message
    assert message.startswith("step 1: the loss is nan for the synthetic group of step 1 "
                              "(data-parallel replica 0, prompt 32 tokens"), message
    assert f"the last checkpoint in {ckpt} is intact" in message
    assert "--no-check-for-nan-in-loss-and-grad" in message
    assert _same(*weights[1])
    # The last checkpoint is step 1's (before the NaN step), finite, equal to the weights then.
    assert checkpoint.latest_checkpoint(ckpt).name == "step_00000001"
    assert not list(ckpt.glob(".tmp-*"))
    from safetensors.torch import load_file

    saved = {}
    for file in checkpoint.latest_checkpoint(ckpt).glob("*.safetensors"):
        saved.update(load_file(str(file)))
    before = weights[1][0]
    common = saved.keys() & before.keys()   # (the file also holds persistent buffers)
    assert len(common) == len(before)
    assert all(torch.equal(saved[n], before[n]) for n in common)


def _torchrun(tmp_path: Path, name: str, *flags: str, signal_after_step: int | None = None):
    """examples/pretrain_gpt.py on 2 processes (CP2/EP2, tiny GLM-5.2, 6 steps): (exit code,
    rank 0's output). With `signal_after_step`, SIGTERM goes to both workers (as SLURM sends it)
    once rank 0 logged that step."""
    import os
    import signal

    logs = tmp_path / f"logs-{name}"
    job = processes.Job(
        [processes.TORCHRUN, "--standalone", "--nproc-per-node", "2",
         "--log-dir", str(logs), "--redirects", "3", str(ROOT / "examples" / "pretrain_gpt.py"),
         *_flags(tmp_path / name, "--context-parallel-size", "2",
                 "--expert-model-parallel-size", "2", "--train-iters", "4", "--lr", "1e-2",
                 "--exit-signal-handler", *flags)],
        merge_stderr=True, cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "TORCHDYNAMO_DISABLE": "1", "PYTHONWARNINGS": "ignore",
             "OMP_NUM_THREADS": "1"})

    def rank0() -> str:
        return "".join(p.read_text() for p in sorted(logs.glob("*/attempt_0/0/stdout.log")))

    with job:
        if signal_after_step is not None:
            job.wait_for(lambda: f"step {signal_after_step:5d} |" in rank0(),
                         f"rank 0 to log step {signal_after_step}",
                         watch_files=lambda: logs.glob("*/attempt_0/*/*.log"))
            workers = [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit()
                       and _ppid(d) == job.pid]
            assert len(workers) == 2, workers
            for pid in workers:
                os.kill(pid, signal.SIGTERM)
        code = job.wait()
        return code, rank0(), job.stdout


def _ppid(proc_dir: Path) -> int | None:
    try:
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update({f"{file.name}:{k}": v for k, v in load_file(str(file)).items()})
    return out


def test_sigterm_saves_exits_0_and_the_resume_matches_an_uninterrupted_run(tmp_path):
    from megatron_longstraw.checkpointing import checkpoint

    full, cut = tmp_path / "full", tmp_path / "cut"
    code, _, out = _torchrun(tmp_path, "full", "--save", str(full), "--save-interval", "4")
    assert code == 0, out[-3000:]
    code, log, out = _torchrun(tmp_path, "cut", "--save", str(cut), "--save-interval", "4",
                               signal_after_step=0)
    assert code == 0, out[-3000:]
    stopped = checkpoint.latest_checkpoint(cut)
    assert stopped is not None and 1 <= int(stopped.name.split("_")[1]) < 4, log
    assert f"SIGTERM received (--exit-signal-handler); checkpoint {stopped}" in log, log
    code, log, out = _torchrun(tmp_path, "resume", "--save", str(cut), "--save-interval", "4",
                               "--load", str(cut))
    assert code == 0, out[-3000:]
    assert f"resumed from {stopped} at step {int(stopped.name.split('_')[1])}" in log
    a, b = _weights(full / "step_00000004"), _weights(cut / "step_00000004")
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
