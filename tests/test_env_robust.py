"""Environments that go wrong (issue 43, rollout/env.py, rollout/env_workers.py): each bad
behaviour of a tool ends only its member, with a named reason, and the other member's trajectory
is the one it has without the bad member beside it; settings under which an environment could
never be called, and factories that fail, are refused (up front through the launcher, exit 2,
before the model loads); calls due at one decode step run concurrently; a hung tool never holds
the process at exit. The environments run in worker processes made from tests/bad_envs.py."""

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from test_decode import _build, _cfg as _ls
from test_env import _agent_flags, _agent_prompts
from megatron_longstraw.config.sampling import SamplingParams
from megatron_longstraw.context.capture import capture_prompt
from megatron_longstraw.rollout import env_workers
from megatron_longstraw.rollout.decode import generate
from megatron_longstraw.rollout.env import EnvLimits, EnvSetupError
from megatron_longstraw.rollout.env_workers import WorkerEnvs

pytestmark = pytest.mark.usefixtures("single_process")
SPEC = "bad_envs:make"
LIMITS = EnvLimits(max_turns=3, turn_tokens=2, timeout_s=0.5)
PARAMS = SamplingParams(max_new_tokens=12, seed=3)
BOUND_S = 20.0
"""A generate with one bad member returns within this (its hung call is killed at 0.5 s)."""


@pytest.fixture(scope="module")
def tiny():
    cfg, model = _build("glm52")
    prompt = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(2))
    ls = _ls(2)
    captured = capture_prompt(model, prompt, ls)
    # the good member alone: member 0 of a one-member run (generate seeds member m's sampler
    # from (seed, m), so member 0 of the two-member runs below draws the same samples)
    reference = generate(model, captured, 1, PARAMS, ls, envs=_Members(prompt, "fine"),
                         env_limits=LIMITS)[0]
    assert reference.end_reason == "max turns" and len(reference.turns) == 3
    yield cfg, model, prompt, ls, captured, reference
    env_workers.shutdown()


class _Members:
    """One WorkerEnvs per member, so members get different environments (a runner for
    `generate(envs=...)`: start, call, close)."""

    def __init__(self, prompt, *kinds, **meta):
        self.runners = [WorkerEnvs(SPEC, {"kind": k, **meta}, prompt, None, 1) for k in kinds]

    def __len__(self):
        return len(self.runners)

    def start(self, limits):
        return [runner.start(limits)[0] for runner in self.runners]

    def call(self, due, limits):
        return [self.runners[member].call([(0, turn)], limits)[0] for member, turn in due]

    def close(self):
        for runner in self.runners:
            runner.close()


VOCAB = "[0, 512)"
BAD = {
    "raises": "env.step raised RuntimeError: tool crashed",
    "hangs": "env.step did not return within 0.5 s (--longstraw-env-timeout); its worker process "
             "was stopped",
    "exits": "env.step ended its worker process (exit code 3)",
    "segfault": "env.step ended its worker process (killed by signal 11)",
    "returns_none": "env.step returned NoneType, expected megatron_longstraw.rollout.env.EnvStep",
    "none": "observation is None: return token ids, text, or () for none",
    "nested": "observation [[1, 2], [3]] holds nested lists: return a flat list of token ids",
    "floats": "observation [3.7, 4.2] holds non-integer ids (float 3.7)",
    "bools": "observation [True, False] holds non-integer ids (bool True)",
    "oov": "env.step returned ids outside the vocabulary {vocab}: [1000000]",
    "negative": "env.step returned ids outside the vocabulary {vocab}: [-1]",
    "text": "env.step returned text but the run has no tokenizer (--longstraw-tokenizer): return "
            "token ids instead",
    "nan_reward": "reward nan is not finite: return a finite number or None",
    "inf_reward": "reward inf is not finite: return a finite number or None",
    "string_reward": "reward '1.0' of type str: return a finite number or None",
}


@pytest.mark.parametrize("kind", list(BAD))
def test_a_bad_environment_ends_only_its_member_with_a_named_reason(tiny, kind):
    cfg, model, prompt, ls, captured, reference = tiny
    start = time.perf_counter()
    good, bad = generate(model, captured, 2, PARAMS, ls, envs=_Members(prompt, "fine", kind),
                         env_limits=LIMITS)
    seconds = time.perf_counter() - start
    expected = "env error: " + BAD[kind].format(vocab=f"[0, {cfg.vocab_size})")
    print(f"{kind}: {bad.end_reason!r} in {seconds:.2f} s")
    assert bad.end_reason == expected
    assert bad.token_ids.numel() == 2 and bad.loss_mask.tolist() == [True, True]
    assert bad.turns == [] and bad.env_reward is None
    # the good member's trajectory is the one it has alone (fp64 rows batched with another
    # member's: the same tokens and masks, log-probs to round-off)
    assert torch.equal(good.token_ids, reference.token_ids)
    assert torch.equal(good.loss_mask, reference.loss_mask) and good.turns == reference.turns
    assert float((good.logprobs - reference.logprobs).abs().max()) <= 1e-12
    assert good.end_reason == "max turns" and seconds < BOUND_S


@pytest.mark.parametrize("kind,limits,message", [
    ("fine", EnvLimits(turn_tokens=0), "has no stop_ids and --longstraw-env-turn-tokens is 0: it "
     "would never be called. Set --longstraw-env-turn-tokens N"),
    ("factory_none", LIMITS, "the environment factory bad_envs:make returned None, not an "
     "environment"),
    ("factory_raises", LIMITS, "the environment factory bad_envs:make raised RuntimeError: no "
     "tool server"),
])
def test_an_environment_that_cannot_serve_is_refused_before_any_token(tiny, kind, limits,
                                                                      message):
    cfg, model, prompt, ls, captured, _ = tiny
    with pytest.raises(EnvSetupError, match=message):
        generate(model, captured, 2, PARAMS, ls, envs=_Members(prompt, "fine", kind),
                 env_limits=limits)
    # stop ids and no turn budget: accepted
    generate(model, captured, 1, SamplingParams(max_new_tokens=2), ls,
             envs=_Members(prompt, "fine", stop_ids=[5]), env_limits=EnvLimits(turn_tokens=0))


def test_calls_due_at_one_step_run_concurrently(tiny):
    """G = 16 members whose turns all end at the same decode step, a tool that sleeps 1 s per
    call: the turn's calls take about 1 s in all, not 16."""
    cfg, model, prompt, ls, captured, _ = tiny
    turns = []

    class Timed(WorkerEnvs):
        def call(self, due, limits):
            start = time.perf_counter()
            out = super().call(due, limits)
            turns.append((len(due), time.perf_counter() - start))
            return out

    outs = generate(model, captured, 16, SamplingParams(max_new_tokens=4, seed=1), ls,
                    envs=Timed(SPEC, {"kind": "sleep", "seconds": 1.0}, prompt, None, 16),
                    env_limits=EnvLimits(max_turns=1, turn_tokens=2, timeout_s=30))
    assert all(o.end_reason == "max turns" and len(o.turns) == 1 for o in outs)
    ((calls, seconds),) = turns
    print(f"G=16, 1 s per call: the turn's 16 calls took {seconds:.2f} s")
    assert calls == 16 and seconds < 6.0


def test_a_hung_tool_never_holds_the_process_at_exit(tmp_path):
    """A script whose tools hang (worker processes killed at the timeout; an in-process object's
    call abandoned on a daemon thread) and which leaves idle workers: it exits at once, and no
    worker outlives it."""
    root = Path(__file__).resolve().parents[1]
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import bad_envs
        from megatron_longstraw.rollout import env_workers
        from megatron_longstraw.rollout.env import EnvLimits, LocalEnvs
        limits = EnvLimits(turn_tokens=1, timeout_s=0.5)
        hung = env_workers.WorkerEnvs("bad_envs:make", {{"kind": "hangs"}}, [1], None, 2)
        hung.start(limits)
        print(hung.call([(0, [1]), (1, [1])], limits))
        hung.close()
        idle = env_workers.WorkerEnvs("bad_envs:make", {{}}, [1], None, 2)
        idle.start(limits)
        idle.close()                            # back to the pool: alive at exit
        print("pids", *[w.proc.pid for w in env_workers._idle])
        local = LocalEnvs([bad_envs.in_process_hang(None, None, None)])
        print(local.call([(0, [1])], limits))
    """)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True,
                         text=True, timeout=60)
    seconds = time.perf_counter() - start
    print(f"hung tools: the script exited in {seconds:.2f} s")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("did not return within 0.5 s") == 3, out.stdout
    pids = [int(p) for p in out.stdout.split("pids", 1)[1].split("\n")[0].split()]
    assert len(pids) == 2 and seconds < 15.0
    time.sleep(0.2)
    assert not [p for p in pids if Path(f"/proc/{p}").exists()
                and "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]]


def test_a_wrong_module_path_is_one_line_and_exit_2_before_the_model_loads(tmp_path, capsys,
                                                                            monkeypatch):
    from megatron_longstraw.training import train

    monkeypatch.setattr(train, "setup_model", _no_model)
    flags = _agent_flags(tmp_path, "wrong", _agent_prompts(tmp_path))
    flags[flags.index("--longstraw-env") + 1] = "no_such_module_xyz:make"
    start = time.perf_counter()
    with pytest.raises(SystemExit) as caught:
        train.cli(flags)
    err = capsys.readouterr().err.strip()
    assert caught.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: --longstraw-env 'no_such_module_xyz:make': cannot import")
    assert time.perf_counter() - start < BOUND_S


@pytest.mark.parametrize("kind,message", [
    ("factory_none", "returned None, not an environment"),
    ("factory_raises", "raised RuntimeError: no tool server"),
    ("fine", "it would never be called. Set --longstraw-env-turn-tokens N"),
])
def test_the_launcher_makes_one_environment_before_the_model_loads(tmp_path, monkeypatch, kind,
                                                                   message):
    from megatron_longstraw.runtime.errors import ConfigError
    from megatron_longstraw.training import train

    monkeypatch.setattr(train, "setup_model", _no_model)
    flags = _agent_flags(tmp_path, kind, _agent_prompts(tmp_path, {"kind": kind}))
    flags[flags.index("--longstraw-env") + 1] = SPEC
    if kind == "fine":   # no stop ids, and no turn budget
        flags[flags.index("--longstraw-env-turn-tokens") + 1] = "0"
    with pytest.raises(ConfigError, match=r"agent\.jsonl line 1 \(id 'agent-0'\): .*" + message):
        train.main(flags)


def test_a_hung_tool_through_the_launcher_ends_its_members_and_the_step_line_says_so(
        tmp_path, capsys):
    """Through the launcher: every call hangs past --longstraw-env-timeout 0.5; each member ends
    with the timeout, the step line counts the members by end, the run trains on and leaves no
    worker process or non-daemon thread behind."""
    from megatron_longstraw.training import train

    flags = _agent_flags(tmp_path, "hung", _agent_prompts(tmp_path, {"kind": "hangs"}),
                         "--longstraw-reward", "longstraw:exact_match",
                         "--longstraw-env-timeout", "0.5", "--train-iters", "1")
    flags[flags.index("--longstraw-env") + 1] = SPEC
    start = time.perf_counter()
    receipt = train.main(flags)
    seconds = time.perf_counter() - start
    (h,) = receipt["history"]
    assert h["env/errors"] == 2.0 and h["env/ends_timeout"] == 2.0 and h["env/ends_done"] == 0
    for member in h["env_trajectories"][0]:
        assert member["end"].startswith("env error: env.step did not return within 0.5 s")
    assert "| ends: done 0, env error 0, timeout 2, budget 0, stop 0" in capsys.readouterr().out
    assert not env_workers._running
    assert [t for t in threading.enumerate() if not t.daemon] == [threading.main_thread()]
    print(f"hung tool through the launcher: run of one step in {seconds:.1f} s")


def _no_model(*args, **kwargs):
    raise AssertionError("the model was loaded before the environment was checked")
