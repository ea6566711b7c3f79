"""tools/bench.py end to end at one tiny point (fresh child processes, table, JSON, PNG), and the
sweep itself when LONGSTRAW_SLOW=1."""

import json
import os
import struct
import subprocess
import sys

import pytest

from helpers import ROOT

BENCH = ROOT / "tools" / "bench.py"


def _run(tmp_path, *extra, timeout=600):
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1")
    proc = subprocess.run([sys.executable, str(BENCH), "--out-dir", str(tmp_path), *extra],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads((tmp_path / "bench.json").read_text()), proc.stdout


def test_bench_one_point_both_methods(tmp_path):
    data, stdout = _run(tmp_path, "--points", "128", "--groups", "2", "--response-len", "4",
                        "--jobs", "2")
    results = {r["method"]: r for r in data["results"]}
    assert set(results) == {"longstraw", "longstraw-exact", "conventional", "forward"}
    assert not any("error" in r for r in results.values()), results
    ls, conv = results["longstraw"], results["conventional"]
    # Pages of the tiny GLM-5.2 in fp32: 127 captured rows x (8 x 40 + 4 x 16) values x 4 bytes.
    assert ls["page_bytes"] == 127 * (8 * 40 + 4 * 16) * 4
    assert conv["page_bytes"] == 0
    # Same weights and data: the replayed log-probs equal the full-sequence forward's (fp32
    # rounding at most; 1e-5 as in test_glm52_step).
    fidelity = data["summary"]["fidelity"]["P=128 G=2"]
    assert fidelity["same_weights"] and fidelity["max_abs_logp_diff"] <= 1e-5
    assert [len(x) for x in ls["logps"]] == ls["response_lens"] == conv["response_lens"]
    # Autograd holds the response branch in LongStraw and the whole [prompt; response] otherwise.
    assert 0 < ls["saved_peak_bytes"] < conv["saved_peak_bytes"]
    for r in (ls, conv):
        assert r["peak_rss_bytes"] >= r["base_rss_bytes"] > 0 and r["step_seconds"] > 0
    # The child environment the sweep promises.
    assert data["settings"]["child_env"]["MALLOC_MMAP_THRESHOLD_"] == "1048576"
    # The exact prompt gradient against the detached one: its phases, its extra phase.
    exact = results["longstraw-exact"]
    assert exact["logps"] == ls["logps"] and exact["page_bytes"] == ls["page_bytes"]
    assert set(exact["live_phase_bytes"]) == {"capture", "scoring", "replay", "prompt_backward"}
    assert set(ls["live_phase_bytes"]) == {"capture", "scoring", "replay"}
    versus = data["summary"]["exact_vs_detached"]["P=128 G=2"]
    assert versus["step_time_ratio"] > 0 and versus["live_peak_ratio"] > 0
    table = (tmp_path / "bench.md").read_text()
    assert "Exact vs detached prompt gradient" in table
    assert "| longstraw | 128 | 2 |" in table and "| conventional | 128 | 2 |" in table
    assert "Conventional recompute:" in table and table.strip() in stdout
    # Capture against a no-grad forward of the prompt alone, both timed.
    versus = data["summary"]["capture_vs_forward"]["P=128"]
    assert versus["capture_seconds"] > 0 and versus["forward_seconds"] > 0
    assert versus["ratio"] == versus["capture_seconds"] / versus["forward_seconds"]
    assert results["forward"]["page_bytes"] == 0
    assert "against one no-grad forward of the prompt" in table
    png = (tmp_path / "bench_memory.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    width, height = struct.unpack(">II", png[16:24])
    assert width > 100 and height > 100


@pytest.mark.skipif(os.environ.get("LONGSTRAW_SLOW") != "1", reason="slow: set LONGSTRAW_SLOW=1")
def test_bench_quick_sweep(tmp_path):
    data, _ = _run(tmp_path, "--quick", timeout=1800)
    summary = data["summary"]
    assert not any("error" in r for r in data["results"])
    # LongStraw's live autograd memory does not depend on G (one member's graph at a time).
    for key, growth in summary["memory_g_growth"].items():
        if key.startswith("longstraw"):
            assert growth["saved_ratio"] == pytest.approx(1.0, rel=0.2)
    assert summary["largest_prompt_ratio_G2"] > 1
