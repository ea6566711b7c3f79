"""tools/demo_rl.py (`make demo-rl`): the start / end figures of the receipt, the learning
criterion on synthetic curves, and a two-step smoke run of the whole tool at a tiny size."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import demo_rl  # noqa: E402


def test_start_and_end_are_the_means_of_the_first_and_last_tenth():
    curve = [0.0] * 5 + [0.5] * 10 + [1.0] * 5   # 20 steps: 2 steps each end
    assert demo_rl.start_end(curve) == (0.0, 1.0)
    assert demo_rl.start_end([0.25, 0.5, 0.75]) == (0.25, 0.75)   # ceil: one step each end
    assert demo_rl.start_end([0.1] * 9 + [0.3] * 11) == pytest.approx((0.1, 0.3))
    with pytest.raises(ValueError, match="empty"):
        demo_rl.start_end([])
    run = demo_rl.summarise_run([{"step": i, "grpo/reward_mean": r, "time/capture_s": 1.0}
                                 for i, r in enumerate(curve)])
    assert (run["reward_start"], run["reward_end"], run["steps"]) == (0.0, 1.0, 20)
    assert run["curve"] == curve and run["step_s_mean"] == 1.0
    timed = demo_rl.summarise_run([{"grpo/reward_mean": 0.5, "time/step_s": s}
                                   for s in (4.0, 1.0, 1.5)])
    assert timed["elapsed_s"] == [4.0, 5.0, 6.5]    # the run's clock at each update's end


def _seed(seed, run_end, control_end):
    return {"seed": seed, "run": {"reward_start": 0.1, "reward_end": run_end},
            "control": {"reward_start": 0.1, "reward_end": control_end}}


def test_the_criterion_needs_every_run_to_learn_and_every_control_not_to():
    chance = 0.25
    good = [_seed(1, 0.8, 0.25), _seed(2, 0.5, 0.4), _seed(3, 0.9, 0.1)]
    check = demo_rl.criterion(good, chance, min_gain=0.25, max_control_gain=0.15)
    assert check["passed"] and check["failures"] == []
    assert (check["run_min"], check["control_max"]) == (0.5, 0.4)
    bad = [_seed(1, 0.8, 0.25), _seed(2, 0.49, 0.25), _seed(3, 0.9, 0.41)]
    check = demo_rl.criterion(bad, chance, min_gain=0.25, max_control_gain=0.15)
    assert not check["passed"]
    assert len(check["failures"]) == 2
    assert check["failures"][0].startswith("seed 2: run") and "seed 3: control" in \
        check["failures"][1]
    nan = demo_rl.criterion([_seed(1, float("nan"), 0.2)], chance, 0.25, 0.15)
    assert not nan["passed"]   # a NaN reward is no evidence of learning


def test_spread_and_the_table():
    assert demo_rl.spread([1.0, 2.0, 3.0]) == {"mean": 2.0, "std": 1.0, "min": 1.0, "max": 3.0}
    assert demo_rl.spread([0.5])["std"] == 0.0


def test_both_gradient_modes_are_offered_and_the_control_stays_detached():
    args = demo_rl.parse_args(["--prompt-grad", "exact"])
    task = {"path": "prompts.jsonl"}
    run = demo_rl.launcher_argv(args, task, 1, False, Path("out"))
    control = demo_rl.launcher_argv(args, task, 1, True, Path("out"))
    assert run[run.index("--longstraw-prompt-grad") + 1] == "exact"
    assert "--longstraw-prompt-grad" not in control and "zeros" in control
    assert "--longstraw-prompt-grad" not in demo_rl.launcher_argv(demo_rl.parse_args([]), task, 1,
                                                                  False, Path("out"))
    assert run[run.index("--decoupled-lr") + 1] == "0.005" and run[run.index("--lr") + 1] == "0.001"


def test_the_demo_s_defaults_are_the_sweep_s_chosen_recipe_on_its_suite():
    """`make demo-rl` runs tools/demo_rl.py's defaults: they must be the recipe the sweep chose
    (demo_rl_sweep.CHOSEN) at the suite's sizes, or the README's demo is not the swept recipe."""
    import demo_rl_sweep

    assert demo_rl_sweep.CHOSEN is not None
    swept = demo_rl.parse_args([*demo_rl_sweep.TASK_FLAGS,
                                *demo_rl_sweep.RECIPES[demo_rl_sweep.CHOSEN]])
    assert vars(demo_rl.parse_args([])) == vars(swept)


def test_the_tool_runs_end_to_end_at_a_tiny_size(tmp_path):
    """Two steps per run, 64-token prompts, one seed: the receipt's shape, the PNG, the exit
    status following the criterion (a 2-step run cannot pass it)."""
    receipt = demo_rl.main(["--out", str(tmp_path), "--seeds", "7", "--steps", "2",
                            "--batch", "1", "--group-size", "2", "--prompt-len", "64",
                            "--num-prompts", "3", "--majority-count", "4",
                            "--minority-max", "2"])
    saved = json.loads((tmp_path / "receipt.json").read_text())
    assert saved["seeds"][0]["seed"] == 7
    for kind in ("run", "control"):
        figures = saved["seeds"][0][kind]
        assert figures["steps"] == 2 and len(figures["curve"]) == 2
        assert figures["reward_start"] == figures["curve"][0]
        assert figures["reward_end"] == figures["curve"][1]
    assert saved["chance"]["marker"] == pytest.approx(1 / 4)
    assert saved["passed"] == receipt["passed"]
    assert (tmp_path / "reward_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "seed7-control" / "receipt.json").exists()


def test_the_suite_s_tasks_reach_the_launcher_with_their_reward(tmp_path):
    """--task picks the prompts' generator and the reward; --dynamic-sampling and
    --loss-aggregation pass through; the 64-token model's prompts hold the cue and 4 markers."""
    args = demo_rl.parse_args(["--task", "first", "--config",
                               "examples/demo_rl/qwen36_demo_v64.yaml", "--num-markers", "4",
                               "--prompt-len", "64", "--count", "4", "--num-prompts", "8",
                               "--dynamic-sampling", "2", "--loss-aggregation", "token_mean"])
    task = demo_rl.make_task(args, tmp_path)
    assert (task["task"], task["reward"], task["markers"]) == (
        "first", "longstraw:marker_first", [60, 61, 62, 63])
    rows = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and [r["meta"]["answer"] for r in rows[:4]] != [60] * 4
    argv = demo_rl.launcher_argv(args, task, 1, False, tmp_path)
    assert argv[argv.index("--longstraw-reward") + 1] == "longstraw:marker_first"
    assert argv[argv.index("--longstraw-dynamic-sampling-rounds") + 1] == "2"
    assert argv[argv.index("--longstraw-loss-aggregation") + 1] == "token_mean"
    # with dynamic sampling the curve is the generated members' mean, not the trained groups'
    run = demo_rl.summarise_run([{"grpo/reward_mean": 0.5, "sampling/generated_reward_mean": 0.1}])
    assert run["curve"] == [0.1]


def test_the_sweep_table_comes_from_the_records():
    import demo_rl_sweep

    def record(recipe, task, seed, kind, end):
        return {"recipe": recipe, "task": task, "seed": seed, "kind": kind, "chance": 0.25,
                "reward_start": 0.0, "reward_end": end, "steps": 40, "curve": []}

    records = [record("A", "copy", 1, "run", 0.9), record("A", "copy", 1, "control", 0.3),
               record("A", "copy", 2, "run", 0.4), record("B", "copy", 1, "run", 0.2)]
    text = demo_rl_sweep.tables(records, chosen="A")
    assert "| A | copy | 0.000 | 0.900 | 40 |" in text and "| B | copy |" in text
    assert "| copy | 1 | 0.000 | 0.900 | 0.000 | 0.300 | run learns; control at chance |" in text
    assert "| copy | 2 | 0.000 | 0.400 | - | - | run FAILS; not run yet: control |" in text
    assert "No recipe chosen yet" in demo_rl_sweep.tables(records, chosen=None)
    # a recipe besides the chosen one gets its own task x seed table once it ran more than
    # screening (here a control); one that ran seed 1 only does not
    assert "## Recipe B" not in text
    text = demo_rl_sweep.tables(records + [record("B", "copy", 1, "control", 0.5)], chosen="A")
    assert "## Recipe B" in text and "| copy | 1 | 0.000 | 0.200 | 0.000 | 0.500 | run FAILS; " \
                                      "control FAILS |" in text
