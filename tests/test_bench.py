"""tools/bench.py end to end at one tiny point (fresh child processes, table, JSON, PNG), and the
sweep itself when LONGSTRAW_SLOW=1; tools/bench_prefill.py at one tiny point."""

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


# ---- the measured largest-P sweep: summary logic on synthetic results (no child processes) ------

MiB = 2 ** 20


def _bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_tool", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _point(method, p, rss_mib, capture=None, forward=None, pages=0):
    phases = {"capture": capture} if capture is not None else {}
    if forward is not None:
        phases = {"forward": forward}
    return {"method": method, "prompt_len": p, "group_size": 2, "peak_rss_bytes": rss_mib * MiB,
            "live_peak_bytes": rss_mib * MiB // 4, "page_bytes": pages, "step_seconds": 3.0,
            "phase_seconds": phases}


def test_sweep_conventional_stops_at_first_point_over_cap():
    bench = _bench_module()
    cap = 1000 * MiB
    rss = {4096: 700, 8192: 900, 16384: 1100, 32768: 1500}
    asked = []

    def run(p):
        asked.append(p)
        return _point("conventional", p, rss[p])

    out = bench.sweep_until_over([32768, 4096, 16384, 8192], run, cap)
    assert asked == [4096, 8192, 16384]                      # growing P, nothing after 16K
    assert bench.exceeds_cap(out[-1], cap) and not bench.exceeds_cap(out[-2], cap)
    # A watchdog kill counts as over the cap and stops the sweep too; exactly the cap fits.
    killed = {"method": "conventional", "prompt_len": 4096, "exceeded_cap": True,
              "killed_at_rss_bytes": 1001 * MiB, "error": "exceeded the cap"}
    assert bench.sweep_until_over([4096, 8192], lambda p: killed, cap) == [killed]
    assert bench.fits_cap(_point("longstraw", 4096, 1000), cap)
    assert not bench.fits_cap(killed, cap) and bench.exceeds_cap(killed, cap)


def test_summarise_sweep_largest_measured_p_and_capture_ratio():
    bench = _bench_module()
    cap = 1000 * MiB
    results = [
        _point("forward", 4096, 600, forward=2.0),
        _point("longstraw", 4096, 610, capture=2.08, pages=10),
        _point("conventional", 4096, 800),
        _point("longstraw", 8192, 620, capture=5.0, pages=20),
        {"method": "conventional", "prompt_len": 8192, "group_size": 2, "exceeded_cap": True,
         "killed_at_rss_bytes": 1010 * MiB, "error": "exceeded the cap"},
        _point("forward", 32768, 600, forward=10.0),
        _point("longstraw", 32768, 990, capture=11.0, pages=80),
        _point("longstraw", 65536, 1200, capture=40.0, pages=160),   # ran, but over the cap
    ]
    s = bench.summarise_sweep(results, cap, [4096, 8192, 32768, 65536], [4096, 32768])
    assert s["largest_measured_under_cap"] == {"longstraw": 32768, "conventional": 4096}
    assert s["first_over_cap"] == {"longstraw": 65536, "conventional": 8192}
    assert s["largest_measured_ratio"] == 8
    rows = {row["prompt_len"]: row for row in s["rows"]}
    assert rows[8192]["conventional"] == {"status": "exceeds cap", "rss_bytes": 1010 * MiB}
    assert rows[32768]["conventional"] == {"status": "not run"}
    assert rows[65536]["longstraw"]["status"] == "exceeds cap"
    assert rows[32768]["longstraw"]["peak_rss_bytes"] == 990 * MiB
    assert rows[32768]["longstraw"]["page_bytes"] == 80
    cvf = s["capture_vs_forward"]
    assert cvf["P=4096"]["ratio"] == 2.08 / 2.0 and cvf["P=4096"]["within_limit"]
    assert cvf["P=32768"]["ratio"] == 1.1 and not cvf["P=32768"]["within_limit"]
    table = bench.markdown_sweep(s, {"config": "examples/glm52/bench.yaml", "group_size": 2,
                                     "response_len": 32})
    assert "**exceeds cap** (killed at 1,010)" in table
    assert "not run (over the cap at P = 8,192)" in table
    assert "LongStraw 32,768, conventional GRPO 4,096 (x8)" in table
    assert "x1.040 (within x1.05)" in table and "x1.100 (NOT within x1.05)" in table
    assert "cpu_ratio" not in cvf["P=4096"]                 # no CPU seconds in these runs
    # With the children's CPU seconds the CPU-time ratio is given too, from the same two runs.
    results[0]["cpu_seconds"], results[1]["cpu_seconds"] = {"forward": 2.0}, {"capture": 2.2}
    s = bench.summarise_sweep(results, cap, [4096], [4096])
    assert s["capture_vs_forward"]["P=4096"]["cpu_ratio"] == 1.1
    assert not s["capture_vs_forward"]["P=4096"]["cpu_within_limit"]
    assert "CPU time: 2.20 s / 2.00 s = x1.100 (NOT within)" in bench.markdown_sweep(
        s, {"config": "c", "group_size": 2, "response_len": 32})
    # Without a forward run at a requested P the ratio is reported missing, not invented.
    s = bench.summarise_sweep(results[1:], cap, [4096], [4096])
    assert "error" in s["capture_vs_forward"]["P=4096"]


def test_bench_yaml_follows_glm52_width_ratios():
    import yaml

    bench, full = (yaml.safe_load((ROOT / "examples" / "glm52" / f"{n}.yaml").read_text())["model"]
                   for n in ("bench", "full"))
    latent = lambda m: m["hidden_size"] / (m["kv_lora_rank"] + m["qk_rope_head_dim"])
    assert abs(latent(bench) - latent(full)) < 0.05                   # 10.67
    for key in ("qk_nope_head_dim", "v_head_dim"):
        assert bench[key] / bench["qk_rope_head_dim"] == full[key] / full["qk_rope_head_dim"]
    assert bench["intermediate_size"] / bench["hidden_size"] == 2


def test_capture_vs_forward_pairs_repeats_by_index_and_takes_the_median(tmp_path):
    bench = _bench_module()
    cap = 1000 * MiB
    runs = []
    for k, (fw, cap_s) in enumerate([(2.0, 2.2), (2.0, 1.9), (2.0, 2.0)]):
        f, c = _point("forward", 4096, 600, forward=fw), _point("longstraw", 4096, 600, capture=cap_s)
        if k:
            f["repeat"] = c["repeat"] = k
        runs += [f, c]
    runs[-1]["peak_rss_bytes"] = 5000 * MiB       # a repeat never enters the capacity rows
    s = bench.summarise_sweep(runs, cap, [4096], [4096])
    v = s["capture_vs_forward"]["P=4096"]
    assert v["pairs"] == 3 and v["ratios"] == [1.1, 0.95, 1.0] and v["ratio"] == 1.0
    assert v["within_limit"] and s["largest_measured_under_cap"]["longstraw"] == 4096
    # --from-json: a second file's pairs become further repeats of the first file's sweep.
    sweep = {"settings": {"cap_bytes": cap, "points": [4096], "forward_points": [4096],
                          "config": "c", "group_size": 2, "response_len": 32},
             "results": runs[:2], "summary": {"wall_seconds": 60.0}}
    extra = {"settings": sweep["settings"], "results": runs[2:4]}
    (tmp_path / "a.json").write_text(json.dumps(sweep))
    (tmp_path / "b.json").write_text(json.dumps(extra))
    args = bench.parse_args(["--from-json", str(tmp_path / "a.json"),
                             "--timing-json", str(tmp_path / "b.json"), "--out-dir", str(tmp_path)])
    v = bench.render_sweep(args)["summary"]["capture_vs_forward"]["P=4096"]
    assert v["ratios"] == [1.1, 0.95] and v["ratio"] == (1.1 + 0.95) / 2
    assert "median of 2 pairs" in (tmp_path / "bench-sweep-merged.md").read_text()


def test_merged_sweeps_take_later_points_and_the_last_cap(tmp_path):
    bench = _bench_module()
    base = {"forward_points": [], "config": "c", "group_size": 2, "response_len": 32}
    killed = {"method": "conventional", "prompt_len": 8192, "group_size": 2, "exceeded_cap": True,
              "killed_at_rss_bytes": 1001 * MiB, "error": "exceeded the cap"}
    low = {"settings": {**base, "cap_bytes": 1000 * MiB, "points": [4096, 8192]},
           "results": [_point("longstraw", 4096, 900, capture=1.0), _point("conventional", 4096, 950), killed]}
    # Killed at 1001 MiB under a 1000 MiB cap: under a 2000 MiB cap that is not a measurement.
    assert bench.exceeds_cap(killed, 1000 * MiB) and not bench.exceeds_cap(killed, 2000 * MiB)
    assert not bench.fits_cap(killed, 2000 * MiB)
    high = {"settings": {**base, "cap_bytes": 2000 * MiB, "points": [8192, 16384]},
            "results": [_point("conventional", 8192, 1500),
                        {**killed, "prompt_len": 16384, "killed_at_rss_bytes": 2001 * MiB},
                        _point("longstraw", 16384, 1200, capture=3.0)]}
    (tmp_path / "low.json").write_text(json.dumps(low))
    (tmp_path / "high.json").write_text(json.dumps(high))
    args = bench.parse_args(["--from-json", f"{tmp_path / 'low.json'},{tmp_path / 'high.json'}",
                             "--out-dir", str(tmp_path)])
    s = bench.render_sweep(args)["summary"]
    assert s["cap_bytes"] == 2000 * MiB and s["points"] == [4096, 8192, 16384]
    assert s["largest_measured_under_cap"] == {"longstraw": 16384, "conventional": 8192}
    assert s["first_over_cap"]["conventional"] == 16384


# ---- the measured largest-R sweep: summary and table on synthetic results ------------------------


def _rpoint(method, R, rss_mib, role="capacity", replay=1.0, block=2048, **tags):
    return {"method": method, "prompt_len": 4096, "group_size": 2, "response_len": R,
            "response_block": None if method == "conventional" else block, "role": role,
            "peak_rss_bytes": rss_mib * MiB, "step_seconds": 3.0 + replay,
            "phase_seconds": {"capture": 1.0, "scoring": 2.0, "replay": replay}, **tags}


def _rkilled(method, R, rss_mib):
    return {"method": method, "prompt_len": 4096, "group_size": 2, "response_len": R,
            "role": "capacity", "exceeded_cap": True, "killed_at_rss_bytes": rss_mib * MiB,
            "error": "exceeded the cap"}


def test_summarise_response_sweep_largest_r_live_bytes_and_replay_ratio():
    bench = _bench_module()
    cap = 1000 * MiB
    live = lambda R, rep: {**_rpoint("longstraw", R, 1500, role="live"),
                           "live_phase_bytes": {"capture": 10 * MiB, "scoring": 20 * MiB,
                                                "replay": rep * MiB},
                           "live_host_peak_bytes": 7 * MiB}
    results = [
        _rpoint("longstraw", 2048, 800), live(2048, 30),
        _rpoint("longstraw", 4096, 850), live(4096, 31),
        _rpoint("longstraw", 8192, 990),                         # fitted; its meter run failed
        {"method": "longstraw", "response_len": 8192, "role": "live", "error": "exit 1: boom"},
        _rkilled("longstraw", 16384, 1001),
        _rpoint("conventional", 2048, 900),
        _rpoint("conventional", 4096, 1200),                      # ran to the end, over the cap
        # Timing pairs at R = 4096: whole branch (block 4096) and 4 blocks (block 1024).
        _rpoint("longstraw", 4096, 800, "timing", 2.0, 4096, variant="whole", repeat=0),
        _rpoint("longstraw", 4096, 800, "timing", 2.4, 1024, variant="blockwise", repeat=0),
        _rpoint("longstraw", 4096, 800, "timing", 2.0, 4096, variant="whole", repeat=1),
        _rpoint("longstraw", 4096, 800, "timing", 3.0, 1024, variant="blockwise", repeat=1),
        _rpoint("longstraw", 4096, 800, "timing", 2.0, 4096, variant="whole", repeat=2),
        _rpoint("longstraw", 4096, 800, "timing", 2.2, 1024, variant="blockwise", repeat=2),
        # With reuse_branch_pages (replay over scoring's pages): two pairs.
        _rpoint("longstraw", 4096, 800, "timing", 2.4, 1024, variant="reuse", repeat=0),
        _rpoint("longstraw", 4096, 800, "timing", 3.0, 1024, variant="reuse", repeat=1),
        # A blockwise run without its whole-branch pair is not a pair.
        _rpoint("longstraw", 8192, 800, "timing", 9.0, 2048, variant="blockwise", repeat=0),
    ]
    points = [2048, 4096, 8192, 16384, 32768]
    s = bench.summarise_response_sweep(results, cap, points, [4096, 8192])
    assert s["largest_measured_under_cap"] == {"longstraw": 8192, "conventional": 2048}
    assert s["first_over_cap"] == {"longstraw": 16384, "conventional": 4096}
    assert s["largest_measured_ratio"] == 4
    rows = {row["response_len"]: row for row in s["rows"]}
    # The capacity run's RSS (800 MiB), not the meter run's (1500 MiB); the meter run's live bytes.
    assert rows[2048]["longstraw"]["peak_rss_bytes"] == 800 * MiB
    assert rows[4096]["longstraw"]["live_phase_bytes"]["replay"] == 31 * MiB
    assert "live_phase_bytes" not in rows[8192]["longstraw"]
    assert rows[16384]["longstraw"] == {"status": "exceeds cap", "rss_bytes": 1001 * MiB}
    assert rows[4096]["conventional"] == {"status": "exceeds cap", "rss_bytes": 1200 * MiB}
    assert rows[8192]["conventional"] == {"status": "not run"}
    assert rows[32768]["longstraw"] == {"status": "not run"}
    t = s["replay_time"]["R=4096"]
    assert t["pairs"] == 3 and t["whole_block"] == 4096 and t["blockwise_block"] == 1024
    assert t["ratios"] == pytest.approx([1.2, 1.5, 1.1])
    assert t["ratio"] == pytest.approx(1.2) and t["within_goal"]        # median of the pairs
    assert t["blockwise_median"] == 2.4 and t["whole_median"] == 2.0
    assert t["reuse_ratios"] == pytest.approx([1.2, 1.5])
    assert t["reuse_ratio"] == pytest.approx(1.35) and not t["reuse_within_goal"]
    assert "error" in s["replay_time"]["R=8192"]
    table = bench.markdown_response_sweep(s, {"config": "examples/glm52/bench.yaml",
                                              "prompt_len": 4096, "group_size": 2,
                                              "response_block": 2048})
    assert "| 2,048 | 800 | 4.0 | 2.0 | 1.0 | 10.0 / 20.0 / 30.0 | 7.0 | 900 | 4.0 |" in table
    assert "| 8,192 | 990 | 4.0 | 2.0 | 1.0 | not measured |  | not run (over the cap at R = 4,096) |  |" in table
    assert "| 16,384 | **exceeds cap** (killed at 1,001) |" in table
    assert "| 32,768 | not run (over the cap at R = 16,384) |" in table
    assert "LongStraw 8,192, conventional 2,048 (x4); first over the cap: LongStraw R = 16,384, " \
        "conventional R = 4,096." in table
    assert s["limit_above_points"] == {"longstraw": False, "conventional": False}
    assert "4 blocks" in table and "x1.200 (pairs: 1.200, 1.500, 1.100) within x1.3" in table
    assert "- R=8192: blockwise or whole-branch run missing" in table
    # LongStraw fitting at every R tried: its limit is above the points, the ratio a lower bound.
    fitted = [r for r in results if r["response_len"] < 16384 or r["method"] != "longstraw"]
    fitted.append(_rpoint("longstraw", 16384, 995))
    s = bench.summarise_response_sweep(fitted, cap, [2048, 4096, 8192, 16384], [])
    assert s["limit_above_points"] == {"longstraw": True, "conventional": False}
    assert s["largest_measured_under_cap"]["longstraw"] == 16384
    assert ("LongStraw 16,384, conventional 2,048 (at least x8); first over the cap: LongStraw not "
            "reached (it fitted at every R run, up to 16,384") in bench.markdown_response_sweep(
        s, {"config": "c", "prompt_len": 4096, "group_size": 2, "response_block": 2048})
    # Over the goal: said so.
    slow = [r for r in results if r.get("variant") != "blockwise" or r["response_len"] != 4096]
    slow.append(_rpoint("longstraw", 4096, 800, "timing", 2.8, 1024, variant="blockwise", repeat=0))
    s = bench.summarise_response_sweep(slow, cap, points, [4096])
    assert s["replay_time"]["R=4096"]["ratio"] == pytest.approx(1.4)
    assert "NOT within x1.3" in bench.markdown_response_sweep(
        s, {"config": "c", "prompt_len": 4096, "group_size": 2, "response_block": 2048})


def test_response_sweep_end_to_end_tiny(tmp_path):
    """The sweep's wiring on the tiny GLM-5.2 at P = 64 (fresh children, flags, JSON, table): the
    blockwise runs really ran with the block asked for, the capacity runs without the meter."""
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1")
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--response-sweep", "--config",
         str(ROOT / "examples" / "glm52" / "tiny.yaml"), "--out-dir", str(tmp_path),
         "--response-sweep-prompt", "64", "--groups", "2", "--response-points", "16",
         "--response-block", "8", "--replay-timing-points", "16", "--timing-repeats", "1",
         "--cap-gib", "64"], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "bench-response.json").read_text())
    assert not any("error" in r for r in data["results"]), data["results"]
    roles = sorted((r["method"], r["role"], r.get("variant", "")) for r in data["results"])
    assert roles == [("conventional", "capacity", ""), ("longstraw", "capacity", ""),
                     ("longstraw", "live", ""), ("longstraw", "timing", "blockwise"),
                     ("longstraw", "timing", "reuse"), ("longstraw", "timing", "whole")]
    for r in data["results"]:
        assert r["response_lens"] == [r["response_len"]] * 2
        if r["role"] == "capacity":
            assert r["live_peak_bytes"] is None                       # no meter on the cap runs
        if r["role"] == "live":
            assert r["live_excludes_host"] and set(r["live_phase_bytes"]) == {
                "capture", "scoring", "replay"}
    timing = {r["variant"]: r for r in data["results"] if r["role"] == "timing"}
    assert timing["whole"]["response_block"] == 16 and timing["blockwise"]["response_block"] == 4
    # Same data and weights: whole-branch and 4 blocks score the same log-probs (fp32).
    diff = max(abs(a - b) for x, y in zip(timing["whole"]["logps"], timing["blockwise"]["logps"])
               for a, b in zip(x, y))
    assert diff <= 1e-5
    assert timing["reuse"]["response_block"] == 4
    diff = max(abs(a - b) for x, y in zip(timing["reuse"]["logps"], timing["blockwise"]["logps"])
               for a, b in zip(x, y))
    assert diff <= 1e-5
    s = data["summary"]
    assert s["largest_measured_under_cap"] == {"longstraw": 16, "conventional": 16}
    assert s["replay_time"]["R=16"]["pairs"] == 1
    table = (tmp_path / "bench-response.md").read_text()
    assert "Largest measured R under the cap: LongStraw 16, conventional 16" in table
    assert "Wall time" in table and "R=16: blockwise (response_block 4, 4 blocks)" in table


def test_merged_response_sweeps_extend_longstraw(tmp_path):
    bench = _bench_module()
    cap = 1000 * MiB
    base = {"timing_points": [4096], "config": "c", "prompt_len": 4096, "group_size": 2,
            "response_block": 2048, "cap_bytes": cap}
    first = {"settings": {**base, "points": [2048, 4096, 8192]}, "summary": {"wall_seconds": 600},
             "results": [_rpoint("longstraw", 2048, 800), _rpoint("longstraw", 4096, 810),
                         _rpoint("longstraw", 8192, 820), _rpoint("conventional", 2048, 900),
                         _rkilled("conventional", 4096, 1001),
                         _rpoint("longstraw", 4096, 800, "timing", 2.0, 4096, variant="whole"),
                         _rpoint("longstraw", 4096, 800, "timing", 2.2, 1024, variant="blockwise")]}
    # LongStraw alone at larger R (its limit was above the first file's points); a rerun of 8K.
    more = {"settings": {**base, "points": [8192, 16384], "timing_points": []},
            "summary": {"wall_seconds": 300},
            "results": [_rpoint("longstraw", 8192, 830), _rkilled("longstraw", 16384, 1002)]}
    (tmp_path / "a.json").write_text(json.dumps(first))
    (tmp_path / "b.json").write_text(json.dumps(more))
    args = bench.parse_args(["--response-sweep", "--from-json",
                             f"{tmp_path / 'a.json'},{tmp_path / 'b.json'}", "--out-dir", str(tmp_path)])
    s = bench.render_response_sweep(args)["summary"]
    assert s["points"] == [2048, 4096, 8192, 16384]
    assert s["largest_measured_under_cap"] == {"longstraw": 8192, "conventional": 2048}
    assert s["first_over_cap"] == {"longstraw": 16384, "conventional": 4096}
    rows = {row["response_len"]: row for row in s["rows"]}
    assert rows[8192]["longstraw"]["peak_rss_bytes"] == 830 * MiB          # the later file's run
    assert rows[16384]["conventional"] == {"status": "not run"}
    assert s["replay_time"]["R=4096"]["ratio"] == pytest.approx(1.1)
    table = (tmp_path / "bench-response-merged.md").read_text()
    assert "| 16,384 | **exceeds cap** (killed at 1,002) |" in table
    assert "wall time 10.0 min + 5.0 min" in table


def test_reuse_sweep_end_to_end_tiny(tmp_path):
    """`--reuse-sweep` on the tiny model: one launcher run of one capture per K, per-update time
    the mean of that run's update times, the ratio against K = 1, K = 1's capture share."""
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1")
    proc = subprocess.run([sys.executable, str(BENCH), "--reuse-sweep", "--out-dir", str(tmp_path),
                           "--config", str(ROOT / "examples" / "glm52" / "tiny.yaml"),
                           "--reuse-prompt", "96", "--reuse-points", "1,2", "--groups", "2",
                           "--response-len", "4"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "bench-reuse.json").read_text())
    rows = {r["updates"]: r for r in summary["rows"]}
    assert set(rows) == {1, 2} and rows[1]["vs_k1"] == 1.0
    for k, row in rows.items():
        history = json.loads((tmp_path / "reuse" / f"K{k}" / "receipt.json").read_text())["history"]
        assert row["update_s"] == [h["time/step_s"] for h in history]
        assert row["per_update_s"] == pytest.approx(sum(row["update_s"]) / k)
    assert rows[2]["vs_k1"] == pytest.approx(rows[2]["per_update_s"] / rows[1]["per_update_s"])
    assert 0 < summary["capture_share_k1"] < 1
    assert "| 2 | " in (tmp_path / "bench-reuse.md").read_text()


def test_summarise_reuse_by_hand():
    summarise_reuse = _bench_module().summarise_reuse

    def update(step, capture=0.0):
        return {"time/step_s": step, "time/capture_s": capture, "time/scoring_s": 1.0,
                "time/replay_s": 1.0}

    summary = summarise_reuse({1: [update(10.0, 8.5)], 4: [update(12.0, 8.5)] + [update(2.0)] * 3})
    rows = {r["updates"]: r for r in summary["rows"]}
    assert rows[4]["per_update_s"] == 4.5 and rows[4]["vs_k1"] == 0.45
    assert summary["capture_share_k1"] == 0.85
    with pytest.raises(ValueError, match="include 1 in --reuse-points"):
        summarise_reuse({4: [update(1.0)] * 4})
    with pytest.raises(ValueError, match="K = 4: the run logged 3 updates, not 4"):
        summarise_reuse({1: [update(1.0)], 4: [update(1.0)] * 3})


def test_bench_prefill_times_both_feeds_of_one_observation(tmp_path):
    """tools/bench_prefill.py at a tiny point: one observation fed one row per pass and as one
    block, the same trajectory both ways, the passes counted (1 + 40 + 1 against 3)."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_prefill.py"),
                           "--families", "qwen36", "--observation", "40", "--prompt", "32",
                           "--out-dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    row, = json.loads((tmp_path / "prefill.json").read_text())
    assert row["observation"] == 40 and row["members"] == 2
    assert (row["token_passes"], row["block_passes"]) == (42, 3)
    assert row["max_abs_dlogp"] <= 1e-5 and row["token_s"] > 0 and row["block_s"] > 0
    assert "| qwen36 | 32 | 40 | 2 |" in (tmp_path / "prefill.md").read_text()
