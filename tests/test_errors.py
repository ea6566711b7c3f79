"""User errors (megatron_longstraw/runtime/errors.py) through the launcher: one line naming the cause and
where, exit code 2, no traceback, printed once (by rank 0) under torchrun; other exceptions keep
their traceback; informational logging comes from rank 0 only (metrics.configure_logging)."""

import io
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_longstraw.runtime import errors
from megatron_longstraw.training import train
from megatron_longstraw.training.metrics import configure_logging
import processes

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "glm52" / "tiny.yaml")
GOOD = {"prompt_ids": list(range(1, 40)), "response_ids": [[5, 6, 7], [8, 9]], "rewards": [0, 1]}
KERNEL_LINE = "longstraw kernels 'auto'"


def _jsonl(path: Path, *lines) -> Path:
    path.write_text("".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines))
    return path


def _torchrun(tmp_path: Path, name: str, *flags: str) -> tuple[list[str], list[str], list[str]]:
    """examples/pretrain_gpt.py on 2 processes (CP2/EP2, tiny GLM-5.2); returns (the ranks' exit
    codes as torchrun reports them, rank 0's and rank 1's output lines). torchrun itself exits 1
    with its own ChildFailedError traceback whenever a worker fails; the workers' output is kept
    apart from it (--redirects, one log folder per rank)."""
    logs = tmp_path / f"logs-{name}"
    out = processes.run(
        [str(ROOT / ".venv" / "bin" / "torchrun"), "--standalone", "--nproc-per-node", "2",
         "--log-dir", str(logs), "--redirects", "3", str(ROOT / "examples" / "pretrain_gpt.py"),
         "--longstraw", "--longstraw-config", TINY, "--context-parallel-size", "2",
         "--expert-model-parallel-size", "2", "--train-iters", "1", "--longstraw-group-size", "2",
         "--longstraw-out-dir", str(tmp_path / "runs"), *flags], cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "TORCHDYNAMO_DISABLE": "1", "PYTHONWARNINGS": "ignore",
             "OMP_NUM_THREADS": "1"})
    ranks = []
    for rank in (0, 1):
        text = "".join(p.read_text() for p in sorted(logs.glob(f"*/attempt_0/{rank}/std*.log")))
        ranks.append(text.splitlines())
    launcher = out.stdout + out.stderr
    assert out.returncode != 0, launcher[-2000:]
    # The first rank to exit ends the job: the other one exits 2 too or is stopped (SIGTERM).
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", launcher)
    assert "2" in codes and set(codes) <= {"2", "-15"}, launcher[-2000:]
    return codes, ranks[0], ranks[1]


def _bad_inputs(tmp_path: Path) -> list[tuple[str, list[str], str]]:
    """(name, flags, the exact error line) of four bad inputs."""
    trunc = tmp_path / "trunc.jsonl"
    trunc.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD)[:47])   # cut mid-line, at EOF
    missing = _jsonl(tmp_path / "missing.jsonl", GOOD,
                     {**{k: GOOD[k] for k in ("response_ids", "rewards")},
                      "prompt_file": "prompts/absent.npy"})
    long = _jsonl(tmp_path / "long.jsonl", GOOD, GOOD, {**GOOD, "response_ids": [[1], [2] * 9]})
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text(Path(TINY).read_text().replace("  hidden_size: 64", "  hidden_size: [64"))
    return [
        ("truncated", ["--longstraw-data", str(trunc)],
         f"error: {trunc} line 2: not valid JSON (Expecting value at column 48) (the line "
         "ends early: was the file cut off?); each line must be one JSON object describing a "
         "group."),
        ("prompt-file", ["--longstraw-data", str(missing)],
         f"error: {missing} line 2: field 'prompt_file' cannot read "
         f"'{tmp_path / 'prompts' / 'absent.npy'}' (FileNotFoundError: [Errno 2] No such file or "
         f"directory: '{tmp_path / 'prompts' / 'absent.npy'}'); paths are relative to the JSONL "
         "file's folder."),
        ("too-long", ["--longstraw-data", str(long), "--longstraw-max-response-len", "8"],
         f"error: {long} line 3: field 'response_ids' item 1 has 9 tokens, more than "
         "--longstraw-max-response-len 8 (YAML longstraw.max_response_len); raise the limit or "
         "drop the member."),
        ("yaml", ["--longstraw-config", str(bad_yaml), "--longstraw-synthetic-prompt-len", "64"],
         f"error: --longstraw-config {bad_yaml} line 7 column 20: not valid YAML (expected ',' or "
         "']', but got ':'; while parsing a flow sequence from line 6 column 16)."),
    ]


def test_bad_inputs_under_torchrun_give_one_line_exit_2_no_traceback(tmp_path):
    for name, flags, expected in _bad_inputs(tmp_path):
        _, rank0, rank1 = _torchrun(tmp_path, name, *flags)
        errors_0 = [line for line in rank0 if line.startswith("error")]
        assert errors_0 == [expected], (name, rank0)
        assert not [line for line in rank1 if line.startswith("error")], (name, rank1)
        assert not any("Traceback" in line for line in rank0 + rank1), (name, rank0, rank1)


@pytest.mark.usefixtures("single_process")
def test_checkpoint_that_does_not_fit_under_torchrun(tmp_path):
    """After the process groups started (model built, kernels selected): a model-format directory
    of another model config is refused once, by rank 0; the kernel selection is logged once."""
    from helpers import build_tiny_glm

    from megatron_longstraw.checkpointing import model_format

    _, model = build_tiny_glm(torch.float32, hidden_size=96)
    model_format.save_model(tmp_path / "init", model, family="glm52")
    _, rank0, rank1 = _torchrun(tmp_path, "ckpt", "--load", str(tmp_path / "init"),
                                "--longstraw-synthetic-prompt-len", "64")
    errors_0 = [line for line in rank0 if line.startswith("error")]
    assert len(errors_0) == 1 and errors_0[0].startswith(
        f"error: {tmp_path / 'init' / 'longstraw.json'} holds a different model than the one "
        "built: hidden_size (saved 96, model 64)"), rank0
    assert not [line for line in rank1 if line.startswith("error")], rank1
    assert not any("Traceback" in line for line in rank0 + rank1)
    assert sum(KERNEL_LINE in line for line in rank0) == 1, rank0
    assert not any(KERNEL_LINE in line for line in rank1), rank1


# ---- in-process: the classification and the one-line report --------------------------------------


def _cli(argv, capsys) -> tuple[int, list[str]]:
    with pytest.raises(SystemExit) as info:
        train.cli(argv)
    lines = capsys.readouterr().err.splitlines()
    # Only our lines: importing Megatron the first time warns about CUDA and Triton.
    return info.value.code, [line for line in lines if line.startswith("error")]


@pytest.mark.parametrize("flags,expected", [
    (["--longstraw-kernels", "flashy"], "error: argument --longstraw-kernels: invalid choice: "
                                        "'flashy'"),
    (["--no-such-flag"], "error: unrecognized arguments: --no-such-flag"),
    (["--longstraw-group-size", "1"], "error: longstraw group_size must be an integer >= 2, got 1 "
                                      "(--longstraw-group-size, YAML longstraw.group_size)."),
    (["--tensor-model-parallel-size", "2"], "error: --tensor-model-parallel-size 2 is not "
                                            "supported. LongStraw runs tensor- and pipeline-"
                                            "parallel size 1"),
    (["--longstraw-data", "/nowhere/g.jsonl"], "error: /nowhere/g.jsonl: no such file; pass the "
                                               "path of a JSONL file"),
])
def test_user_errors_are_one_line_with_exit_code_2(flags, expected, capsys):
    code, lines = _cli(["--longstraw", "--longstraw-config", TINY, *flags], capsys)
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith(expected), lines


def test_a_group_size_that_differs_from_the_data_names_line_and_flag(tmp_path, capsys):
    path = _jsonl(tmp_path / "g.jsonl", GOOD, {**GOOD, "response_ids": [[1], [2], [3]],
                                                "rewards": [0, 1, 2]})
    code, lines = _cli(["--longstraw", "--longstraw-config", TINY, "--longstraw-group-size", "2",
                        "--longstraw-data", str(path)], capsys)
    assert code == 2 and lines == [
        f"error: {path} line 2: field 'response_ids' has 3 responses but the group size is 2 "
        "(--longstraw-group-size, YAML longstraw.group_size); give every member of the group or "
        "change the group size."]


def test_bugs_keep_their_traceback(monkeypatch):
    def broken(*args):
        raise ValueError("an internal invariant broke")

    monkeypatch.setattr(train, "read_data", broken)
    with pytest.raises(ValueError, match="internal invariant") as info:
        train.cli(["--longstraw", "--longstraw-config", TINY])
    assert not errors.is_user_error(info.value)


def test_user_error_types():
    from megatron_longstraw.data.groups import DataError

    for exc in (DataError("f.jsonl", 3, "rewards", "x"), errors.ConfigError("x"),
                errors.InputNotFound("x"), errors.CheckpointError("x"), errors.FlagError("x")):
        assert errors.is_user_error(exc)
    assert isinstance(errors.FlagError("x"), SystemExit)      # argparse's contract
    assert isinstance(errors.InputNotFound("x"), FileNotFoundError)
    for exc in (ValueError("x"), KeyError("x"), RuntimeError("x"), errors.PeerFailure("x")):
        assert not errors.is_user_error(exc)
    with pytest.raises(errors.ConfigError, match="^bad$"):
        with errors.configuration():
            raise ValueError("bad")
    with pytest.raises(KeyError):
        with errors.configuration():
            raise KeyError("not a configuration error")


def test_other_ranks_print_only_their_own_errors(monkeypatch):
    """Rank 1 stays silent when rank 0 posted the same message, prints it with its rank
    otherwise (rank-local), without waiting when rank 0 posted something else."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    posted = {}
    monkeypatch.setattr(errors, "_rank0_message", lambda wait_s: posted.get("rank0"))
    for rank0, expected in (("same", ""), ("other", "error: rank 1: same\n"),
                            (None, "error: rank 1: same\n")):
        posted["rank0"] = rank0
        stream = io.StringIO()
        errors.report(errors.ConfigError("same"), stream=stream)
        assert stream.getvalue() == expected, rank0


# ---- logging -------------------------------------------------------------------------------------


@pytest.fixture
def root_logger():
    root = logging.getLogger()
    saved = root.level, root.handlers[:], [h.formatter for h in root.handlers]
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root.handlers = [handler]
    yield stream
    root.setLevel(saved[0])
    root.handlers = saved[1]
    for h, f in zip(saved[1], saved[2]):
        h.setFormatter(f)


@pytest.mark.parametrize("rank", [0, 1])
def test_kernel_selection_is_logged_by_rank_0_only(rank, root_logger):
    from megatron_longstraw.kernels import select

    configure_logging(rank=rank, world_size=2)
    select.reset()
    select.use("ref")
    logging.getLogger("megatron_longstraw.test").warning("something odd")
    lines = root_logger.getvalue().splitlines()
    kernel_lines = [line for line in lines if "longstraw kernels 'ref'" in line]
    assert len(kernel_lines) == (1 if rank == 0 else 0), lines
    assert f"[rank {rank}] WARNING:megatron_longstraw.test:something odd" in lines
    select.reset()



def test_run_entry_ends_the_process_groups_after_a_run_that_succeeded(tmp_path):
    """A gloo group left for the interpreter's teardown can abort a worker whose run succeeded
    (SIGABRT, torchrun reports a failure): run_entry returns main's value and ends every group
    once `main` returned, and leaves them alone when `main` raised. (In a process of its own: it
    ends the groups of the process it runs in.)"""
    script = tmp_path / "entry.py"
    script.write_text(
        "import sys, torch.distributed as dist\n"
        "from megatron_longstraw.runtime import errors\n"
        "def main(fail):\n"
        "    dist.init_process_group('gloo', init_method=f'file://{sys.argv[1]}', rank=0,\n"
        "                            world_size=1)\n"
        "    side = dist.new_group([0])\n"
        "    dist.all_reduce(__import__('torch').ones(2), group=side)\n"
        "    if fail:\n"
        "        raise KeyError('a bug')\n"
        "    return 7\n"
        "try:\n"
        "    print('returned', errors.run_entry(main, sys.argv[2] == 'fail'))\n"
        "except KeyError:\n"
        "    print('raised')\n"
        "print('initialized', dist.is_initialized())\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for mode, expected in (("ok", "returned 7\ninitialized False"),
                           ("fail", "raised\ninitialized True")):
        out = subprocess.run([sys.executable, str(script), str(tmp_path / f"store-{mode}"), mode],
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip() == expected, (mode, out.stdout, out.stderr[-2000:])
