"""Preemption under torchrun with a long step and the shipped SLURM script's settings: SIGTERM to
torchrun (as srun forwards it, or as SLURM signals the job step) is forwarded to the workers;
with --exit-signal-handler they finish the running step, save and return normally within
torchrun's --shutdown-timeout; torchrun itself then exits 1 (torch elastic re-raises the signal),
which the script's last block turns into the job's 0 because this job saved the stop."""

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import processes
from megatron_longstraw.checkpointing import checkpoint

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "glm52" / "tiny.yaml")
SCRIPT = ROOT / "examples" / "glm52" / "glm52_32xH20.slurm"


def _script_settings() -> tuple[int, str]:
    """(torchrun's --shutdown-timeout, the script's block after srun) of the shipped script."""
    text = SCRIPT.read_text()
    shutdown = int(re.search(r"--shutdown-timeout (\d+)", text).group(1))
    lead = int(re.search(r"#SBATCH --signal=TERM@(\d+)", text).group(1))
    assert shutdown == lead   # both sized to a step plus a save
    assert re.search(r"^    --exit-signal-handler \\$", text, re.M)
    return shutdown, text[text.index("STEP=$!\n"):]


def _run(tmp_path: Path, name: str, shutdown: int):
    """examples/pretrain_gpt.py under torchrun (2 processes, CP2/EP2, tiny GLM-5.2 at a prompt of
    4096 tokens: steps of seconds), SIGTERM to torchrun as soon as step 0 is logged, i.e.
    at the start of step 1. -> (torchrun's exit code, its output, rank 0's log, save folder)."""
    logs, ckpt = tmp_path / f"logs-{name}", tmp_path / f"ckpt-{name}"
    job = processes.Job(
        [processes.TORCHRUN, "--standalone", "--nproc-per-node", "2",
         "--shutdown-timeout", str(shutdown), "--log-dir", str(logs), "--redirects", "3",
         str(ROOT / "examples" / "pretrain_gpt.py"), "--longstraw", "--longstraw-config", TINY,
         "--context-parallel-size", "2", "--expert-model-parallel-size", "2",
         "--train-iters", "4", "--longstraw-synthetic-prompt-len", "4096",
         "--longstraw-synthetic-response-len", "4", "--longstraw-group-size", "2",
         "--longstraw-out-dir", str(tmp_path / name), "--longstraw-run-name", "t",
         "--no-longstraw-live-bytes", "--exit-signal-handler", "--save", str(ckpt),
         "--save-interval", "4"],
        merge_stderr=True, cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "TORCHDYNAMO_DISABLE": "1", "PYTHONWARNINGS": "ignore",
             "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})

    def rank0() -> str:
        return "".join(p.read_text() for p in sorted(logs.glob("*/attempt_0/0/stdout.log")))

    with job:
        job.wait_for(lambda: re.search(r"^step +0 \|", rank0(), re.M), "rank 0 to log step 0",
                     watch_files=lambda: logs.glob("*/attempt_0/*/*.log"))
        os.kill(job.pid, signal.SIGTERM)
        code = job.wait()
        return code, job.stdout, rank0(), ckpt


def test_sigterm_to_torchrun_mid_step_saves_and_the_job_exits_0(tmp_path):
    shutdown, tail = _script_settings()
    code, out, log, ckpt = _run(tmp_path, "script", shutdown)
    stopped = checkpoint.latest_checkpoint(ckpt)
    assert stopped == ckpt / "step_00000002", (log[-2000:], out[-3000:])   # step 1 finished
    assert (f"exiting after step 1: SIGTERM received (--exit-signal-handler); checkpoint "
            f"{stopped}") in log
    meta = json.loads((stopped / "meta.json").read_text())
    assert meta["stopped"] == "SIGTERM received (--exit-signal-handler)"
    assert (tmp_path / "script" / "t" / "receipt.json").exists()   # main returned: exit 0
    assert "forcefully exiting" not in out                          # nobody was SIGKILLed
    assert code == 1 and "SignalException" in out                   # torchrun's own exit
    # The script's block after srun: torchrun's 1 becomes the job's 0 (this job saved the stop);
    # a failure without such a save keeps its code.
    def job_exit(before: str) -> int:
        return subprocess.run(["bash", "-c", f"set -euo pipefail\nCHECKPOINT_DIR={ckpt}\n"
                                             f"BEFORE={before}\n(exit {code}) &\n{tail}"],
                              capture_output=True, text=True).returncode

    assert job_exit("") == 0
    assert job_exit(stopped.name) == code


def test_without_the_shutdown_timeout_torchrun_kills_the_step_and_nothing_is_saved(tmp_path):
    """The control: torchrun's grace shorter than the step (its default is 30 s; 1 s here, for a
    step of seconds) SIGKILLs the workers mid-step."""
    code, out, log, ckpt = _run(tmp_path, "short", 1)
    assert re.search(r"Unable to shutdown process \d+ via 15, forcefully exiting via 9", out), \
        out[-3000:]
    assert checkpoint.latest_checkpoint(ckpt) is None and "exiting after step" not in log
    assert code != 0
