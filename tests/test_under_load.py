"""tools/under_load.py: the command runs REPEAT times beside busy processes, each run reported,
exit 1 if any failed, and the busy processes gone afterwards whatever the outcome."""

import sys
from pathlib import Path

import processes

TOOL = str(Path(__file__).resolve().parents[1] / "tools" / "under_load.py")
BURNER = b"while True:"


def _run(*args: str) -> tuple[int, str, str, list[int]]:
    """(exit code, stdout, stderr, busy processes still alive once the tool exited), checked
    before the job's own cleanup would end them."""
    with processes.Job([sys.executable, TOOL, *args]) as job:
        code = job.wait()
        return code, job.stdout, job.stderr, _burners(job.mark)


def _burners(mark: str) -> list[int]:
    """Live processes of the job running the tool's busy loop."""
    out = []
    for pid in processes.marked_pids(mark):
        try:
            if BURNER in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
        except OSError:
            pass
    return [p for p in out if processes.alive(p)]


def test_runs_each_time_beside_busy_processes_and_ends_them(tmp_path):
    count = tmp_path / "runs"
    script = (f"import os, pathlib; p = pathlib.Path({str(count)!r}); "
              f"p.write_text(p.read_text() + 'x' if p.exists() else 'x'); "
              f"assert os.getloadavg() is not None")
    code, out, err, left = _run("--burners", "2", "--repeat", "3", "--", sys.executable, "-c",
                                script)
    assert code == 0, out + err
    assert count.read_text() == "xxx"
    assert [line.split(":")[1] for line in out.splitlines() if "exit 0" in line] == [
        " run 1/3", " run 2/3", " run 3/3"]
    assert "2 burners" in out and "3 of 3 runs passed" in out
    assert not left


def test_a_failing_run_fails_the_tool_and_the_burners_still_end():
    code, out, _, left = _run("--burners", "1", "--repeat", "2", "--", sys.executable, "-c",
                              "raise SystemExit(3)")
    assert code == 1 and "exit 3" in out and "0 of 2 runs passed" in out
    assert not left


def test_the_burners_run_while_the_command_does(tmp_path):
    """The command sees the busy processes (the control for the checks above)."""
    probe = ("import pathlib\n"
             "n = 0\n"
             "for p in pathlib.Path('/proc').glob('[0-9]*/cmdline'):\n"
             "    try:\n"
             "        n += b'while True:' in p.read_bytes()\n"
             "    except OSError:\n"
             "        pass\n"
             f"pathlib.Path({str(tmp_path / 'seen')!r}).write_text(str(n))\n")
    code, out, err, _ = _run("--burners", "2", "--", sys.executable, "-c", probe)
    assert code == 0, out + err
    assert int((tmp_path / "seen").read_text()) >= 2


def test_no_command_is_an_error():
    out = processes.run([sys.executable, TOOL, "--repeat", "2"])
    assert out.returncode == 2 and "give the command to run after --" in out.stderr
