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


@pytest.mark.parametrize("query", ["key", "any"])
def test_the_tool_task_s_answer_is_held_by_the_tool_only(tmp_path, query):
    """--task tool: the prompt holds one marker (the key) and never the table; the lookup env
    built from a row's meta answers the key with the row's answer and (query key) every other
    marker with a different value, (query any) every id with the answer; answers balanced; the
    launcher gets the environment, two one-token turns, and the blind control."""
    from megatron_longstraw.rollout.example_env import lookup

    args = demo_rl.parse_args(["--task", "tool", "--tool-query", query, "--prompt-len", "64",
                               "--count", "4", "--num-prompts", "8"])
    task = demo_rl.make_task(args, tmp_path)
    markers = task["markers"]
    assert task["reward"].startswith("the environment") and task["best_blind"] == 0.25
    rows = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert sorted(r["meta"]["answer"] for r in rows) == sorted(markers * 2)
    for row in rows:
        meta, prompt = row["meta"], row["prompt_ids"]
        assert [m for m in markers if m in prompt] == [meta["key"]]
        env = lookup({**meta, "answer_turn": 99}, prompt)     # every call a tool call
        assert env.step([meta["key"]]).observation == [meta["key"], meta["answer"]]
        for other in (m for m in markers if m != meta["key"]):
            value = env.step([other]).observation[1]
            assert (value == meta["answer"]) == (query == "any")
        assert env.step([0]).observation[1] == (meta["answer"] if query == "any" else 0)
    # the second call is the answer turn
    env = lookup(rows[0]["meta"], rows[0]["prompt_ids"])
    env.step([rows[0]["meta"]["key"]])
    assert env.step([rows[0]["meta"]["answer"]]).reward == 1.0
    run = demo_rl.launcher_argv(args, task, 1, False, tmp_path)
    control = demo_rl.launcher_argv(args, task, 1, True, tmp_path)
    assert "--longstraw-reward" not in run and "--longstraw-control" not in run
    assert run[run.index("--longstraw-env") + 1] == demo_rl.TOOL_ENV
    assert [run[run.index(f) + 1] for f in ("--longstraw-env-turn-tokens",
                                            "--longstraw-env-max-turns",
                                            "--longstraw-max-new-tokens")] == ["1", "2", "4"]
    assert control[control.index("--longstraw-control") + 1] == "blind"


def test_the_tool_task_runs_through_the_launcher_with_its_blind_control(tmp_path):
    """Two steps of `--task tool` end to end: every member makes its call and its answer (two
    turns, the tool's two ids fed in the run, none in the blind control)."""
    demo_rl.main(["--task", "tool", "--out", str(tmp_path), "--seeds", "3", "--steps", "2",
                  "--batch", "1", "--group-size", "2", "--prompt-len", "64", "--count", "4",
                  "--num-prompts", "4", "--dynamic-sampling", "0"])
    for kind, fed in (("run", 2.0), ("control", 0.0)):
        history = json.loads((tmp_path / f"seed3-{kind}" / "receipt.json").read_text())["history"]
        assert len(history) == 2
        for h in history:
            assert h["env/turns_mean"] == 2.0 and h["env/ends_done"] == 2.0
            assert h["env/observation_tokens_mean"] == fed


def test_the_text_plot_puts_each_mean_curve_in_its_row():
    """Two seeds whose runs average to 0 for 10 steps then 1, controls at 0.5: the first columns
    show both in row 0.5 / 0.0, the last the run at 1.0 and the control at 0.5; equal means
    share a cell as '*'."""
    seeds = [{"seed": s, "run": {"curve": [0.0] * 10 + [1.0] * 10},
              "control": {"curve": [0.5] * 20}} for s in (1, 2)]
    receipt = {"settings": {"steps": 10}, "chance": {"marker": 0.25}, "seeds": seeds}
    lines = demo_rl.text_plot(receipt, width=20, height=4).splitlines()
    rows = {line[:4]: line[6:] for line in lines[:5]}
    assert rows["1.00"] == " " * 10 + "R" * 10
    assert rows["0.50"] == "c" * 20 and rows["0.00"] == "R" * 10 + " " * 10
    assert set(rows["0.25"]) == {"."}
    seeds[0]["run"]["curve"] = seeds[1]["run"]["curve"] = [0.5] * 20
    assert demo_rl.text_plot(receipt, width=20, height=4).splitlines()[2][6:] == "*" * 20


def test_make_demo_agent_runs_the_tool_task_with_its_blind_control():
    """The Makefile's demo-agent recipe parses as tools/demo_rl.py arguments: the tool task (the
    tool answers whatever is asked), its runs and controls, 60 steps (docs/benchmarks.md)."""
    import shlex

    lines = (ROOT / "Makefile").read_text().splitlines()
    recipe = lines[lines.index("demo-agent: $(VENV)/.installed") + 1].split()
    assert recipe[:2] == ["$(PY)", "tools/demo_rl.py"]
    args = demo_rl.parse_args(shlex.split(" ".join(recipe[2:])))
    assert (args.task, args.tool_query, args.steps, args.control) == ("tool", "any", 60, True)
