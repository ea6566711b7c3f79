"""Multi-turn generation with an environment (rollout/env.py, decode.generate with `envs`): the
observations are prefilled into each member's branch state from the captured prompt, so the
log-probs of the whole trajectory equal one plain forward over [prompt; every turn] (fp64,
<= 1e-9, three families; across a DSA selection window and a GDN chunk boundary), and
observations fed in blocks of rows per pass give the token-by-token feed's trajectory (fp64,
<= 1e-12; CP2 and CP2/EP2 ranks against one process <= 1e-9); observation tokens carry loss
mask 0; an environment that raises, hangs, returns bad ids, or exceeds the turn
budget ends its member with a record, and the others go on."""

import time

import pytest
import torch

from helpers import LongObservations, full_sequence_logprobs
from test_decode import _build, _cfg as _ls
from megatron_longstraw.config.sampling import SamplingParams
from megatron_longstraw.context.capture import capture_prompt
from megatron_longstraw.rollout.decode import generate
from megatron_longstraw.rollout.env import EnvLimits, EnvStep, load_env_factory
from megatron_longstraw.rollout.example_env import LookupEnv, lookup

pytestmark = pytest.mark.usefixtures("single_process")


# GLM-5.2: P = 40 with top-k 16, so every query selects among many keys and the trajectory's
# own rows join the selection; Qwen3.6: P = 50, the trajectory crosses GDN's 64-token chunk.
@pytest.mark.parametrize("family,prompt_len", [("glm52", 40), ("qwen36", 50),
                                               ("deepseekv3", 30)])
def test_prefilled_observations_equal_a_full_forward_over_every_turn(family, prompt_len):
    cfg, model = _build(family)
    prompt = torch.randint(0, cfg.vocab_size, (prompt_len,),
                           generator=torch.Generator().manual_seed(4))
    ls = _ls(2)
    captured = capture_prompt(model, prompt, ls)
    envs = [LookupEnv(prompt) for _ in range(2)]          # no answer: turns end by length
    outs = generate(model, captured, 2, SamplingParams(max_new_tokens=28, seed=7), ls,
                    envs=envs, env_limits=EnvLimits(max_turns=5, turn_tokens=3))
    worst = 0.0
    for out, env in zip(outs, envs):
        assert len(out.turns) >= 2 and env.calls == len(out.turns)
        assert out.token_ids.numel() == out.loss_mask.numel() == out.logprobs.numel()
        # each call's observation [key, value] follows its three policy tokens, masked out
        mask = out.loss_mask.tolist()
        assert mask[:5] == [True, True, True, False, False] and sum(not m for m in mask) >= 4
        ids = out.token_ids.tolist()
        assert ids[3] == ids[2] and ids[4] == env.values.get(ids[2], 0)
        with torch.no_grad():
            ref = full_sequence_logprobs(model, prompt, out.token_ids)
        worst = max(worst, float((ref.double() - out.logprobs).abs().max()))
    print(f"{family} P={prompt_len}: trajectory of {outs[0].token_ids.numel()} tokens, "
          f"{len(outs[0].turns)} turns, decode vs full forward max |d logp| {worst:.1e}")
    assert worst <= 1e-9


# Observations of 70 and 41 ids, in blocks of 32 (and whole, and 1: the token-by-token path):
# GLM-5.2's blocks cross key windows (23) and query blocks (7) and select among the member's own
# rows (top-k 16); Qwen3.6's GDN runs the chunked rule over a block and a trajectory crosses its
# 64-token chunk. The two members' segments differ in length within one pass.
@pytest.mark.parametrize("family,prompt_len", [("glm52", 40), ("qwen36", 50),
                                               ("deepseekv3", 30)])
def test_block_prefill_equals_the_token_by_token_path(family, prompt_len, monkeypatch):
    # a block's attention tiles of 5 query and 5 key rows (dense_attention.DECODE_BLOCK_TILE,
    # 512, is larger than these tests' query blocks and key windows: it would not bind)
    from megatron_longstraw.models import dense_attention

    monkeypatch.setattr(dense_attention, "DECODE_BLOCK_TILE", 5)
    cfg, model = _build(family)
    prompt = torch.randint(0, cfg.vocab_size, (prompt_len,),
                           generator=torch.Generator().manual_seed(4))
    ls = _ls(2)
    captured = capture_prompt(model, prompt, ls)
    runs = {}
    for block in (1, 32, 2048):
        envs = [LongObservations(70 - 29 * m, cfg.vocab_size, salt=m) for m in range(2)]
        runs[block] = generate(model, captured, 2, SamplingParams(max_new_tokens=160, seed=7), ls,
                               envs=envs, env_limits=EnvLimits(max_turns=3, turn_tokens=3,
                                                               prefill_block=block))
    worst = 0.0
    for block in (32, 2048):
        for by_token, by_block in zip(runs[1], runs[block]):
            assert torch.equal(by_block.token_ids, by_token.token_ids)
            assert torch.equal(by_block.loss_mask, by_token.loss_mask)
            assert by_block.turns == by_token.turns and by_block.end_reason == by_token.end_reason
            worst = max(worst, float((by_block.logprobs - by_token.logprobs).abs().max()),
                        float((by_block.sample_logprobs - by_token.sample_logprobs).abs().max()))
    first = runs[1][0]
    assert len(first.turns) == 3 and int((~first.loss_mask).sum()) == 140
    with torch.no_grad():
        ref = full_sequence_logprobs(model, prompt, runs[2048][0].token_ids)
    print(f"{family}: {first.token_ids.numel()} tokens, blocks of 32 and 2048 vs one row per "
          f"step max |d logp| {worst:.1e}; vs a full forward "
          f"{float((ref.double() - runs[2048][0].logprobs).abs().max()):.1e}")
    assert worst <= 1e-12
    assert float((ref.double() - runs[2048][0].logprobs).abs().max()) <= 1e-9


class _Env:
    """Test environments: `kind` says how the call goes wrong."""

    def __init__(self, kind):
        self.kind, self.stop_ids = kind, ()

    def step(self, turn_ids):
        if self.kind == "raises":
            raise RuntimeError("tool crashed")
        if self.kind == "hangs":
            time.sleep(5)
        if self.kind == "oov":
            return EnvStep(observation=[10 ** 6])
        if self.kind == "text":
            return EnvStep(observation="the answer")
        return EnvStep(observation=[1, 2])


def test_a_failing_environment_ends_its_member_with_a_record_not_the_job():
    cfg, model = _build("glm52")
    prompt = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(2))
    ls = _ls(5)
    captured = capture_prompt(model, prompt, ls)
    kinds = ["raises", "hangs", "oov", "text", "fine"]
    outs = generate(model, captured, 5, SamplingParams(max_new_tokens=20, seed=1), ls,
                    envs=[_Env(k) for k in kinds],
                    env_limits=EnvLimits(max_turns=3, turn_tokens=2, timeout_s=0.5))
    reasons = {k: o.end_reason for k, o in zip(kinds, outs)}
    assert "env error: env.step raised RuntimeError: tool crashed" == reasons["raises"]
    assert "did not return within 0.5 s" in reasons["hangs"]
    assert "outside the vocabulary" in reasons["oov"] and "1000000" in reasons["oov"]
    assert "returned text but the run has no tokenizer" in reasons["text"]
    # the failing members keep the turn they sampled; the fine one runs its turn budget
    assert all(outs[i].token_ids.numel() == 2 for i in range(4))
    fine = outs[4]
    assert fine.end_reason == "max turns" and len(fine.turns) == 3
    assert fine.loss_mask.tolist() == [True, True, False, False] * 2 + [True, True]


def test_the_lookup_env_answers_from_the_prompt_and_rewards_the_answer_turn():
    env = lookup({"answer": 9, "answer_turn": 3, "tool_end_id": 38, "unknown_id": 0},
                 [5, 9, 7, 4, 5, 8])
    assert env.stop_ids == (38,)
    assert env.step([1, 5]).observation == [5, 9]        # first occurrence of key 5
    assert env.step([3]).observation == [3, 0]           # not in the prompt
    last = env.step([2, 9, 38])
    assert last.done and last.reward == 1.0
    other = lookup({"answer": 9}, [5, 9])
    other.step([5]), other.step([5])
    assert other.step([4]).reward == 0.0
    assert load_env_factory("megatron_longstraw.rollout.example_env:lookup") is lookup
    for spec, words in [("nomodule", "give 'module:factory'"),
                        ("no_such_module_xyz:f", "cannot import"),
                        ("megatron_longstraw.rollout.example_env:missing", "no callable")]:
        with pytest.raises(ValueError, match=words):
            load_env_factory(spec)
    with pytest.raises(ValueError, match="max_turns=0"):
        EnvLimits(max_turns=0)


def test_the_lookup_env_answers_from_a_table_only_it_holds():
    env = lookup({"answer": 7, "answer_turn": 2, "table": [[5, 7], [6, 3]]}, [5, 9, 5, 9])
    assert env.step([5]).observation == [5, 7]           # the table's, not the prompt's 9
    assert env.step([7]).reward == 1.0
    assert lookup({"table": [[6, 3]]}, [5, 9]).step([5]).observation == [5, 0]
    with pytest.raises(ValueError, match=r"table must be \[key, value\] pairs"):
        lookup({"table": [[5]]}, [5, 9])


def test_the_blind_control_calls_the_tools_but_feeds_nothing_of_them():
    """`--longstraw-control blind` (env.BlindEnvs): every call runs and its reward counts, no
    observation enters the trajectory; without an environment the control is refused."""
    from megatron_longstraw.config.settings import LongStrawConfig
    from megatron_longstraw.rollout.env import BlindEnvs, LocalEnvs

    cfg, model = _build("glm52")
    prompt = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(2))
    ls = _ls(2)
    captured = capture_prompt(model, prompt, ls)
    tools = [LookupEnv(prompt, answer=-1, answer_turn=3) for _ in range(2)]
    outs = generate(model, captured, 2, SamplingParams(max_new_tokens=12, seed=3), ls,
                    envs=BlindEnvs(LocalEnvs(tools)),
                    env_limits=EnvLimits(max_turns=3, turn_tokens=2))
    for out, env in zip(outs, tools):
        assert env.calls == 3 and out.end_reason == "env done" and out.env_reward == 0.0
        assert out.token_ids.numel() == 6 and bool(out.loss_mask.all())
        assert [t["observation_tokens"] for t in out.turns] == [0, 0, 0]
    with pytest.raises(ValueError, match="needs --longstraw-env"):
        LongStrawConfig.of(rollout="online", control="blind")


def _agent_prompts(tmp_path, meta_extra=None):
    """Prompt lines for the lookup env: facts as (key, value) id pairs; the answer is a value."""
    import json

    gen = torch.Generator().manual_seed(8)
    path = tmp_path / "agent.jsonl"
    with path.open("w") as f:
        for line in range(2):
            ids = torch.randint(10, 500, (40,), generator=gen).tolist()
            meta = {"answer": ids[7], "answer_turn": 3, **(meta_extra or {})}
            f.write(json.dumps({"id": f"agent-{line}", "prompt_ids": ids, "meta": meta}) + "\n")
    return str(path)


def _agent_flags(tmp_path, name, data, *extra):
    from pathlib import Path

    tiny = str(Path(__file__).resolve().parents[1] / "examples" / "qwen36" / "tiny.yaml")
    return ["--longstraw", "--longstraw-family", "qwen36", "--longstraw-config", tiny,
            "--longstraw-data", data, "--longstraw-rollout", "online",
            "--longstraw-env", "megatron_longstraw.rollout.example_env:lookup",
            "--longstraw-env-turn-tokens", "3", "--longstraw-env-max-turns", "4",
            "--longstraw-group-size", "2", "--longstraw-max-new-tokens", "16",
            "--longstraw-dtype", "fp64", "--lr", "1e-2", "--seed", "5", "--train-iters", "2",
            "--longstraw-out-dir", str(tmp_path), "--longstraw-run-name", name,
            "--no-longstraw-live-bytes", *extra]


def test_an_online_run_with_the_example_environment_trains_on_masked_trajectories(tmp_path):
    """Through the launcher: every member makes two lookup calls and answers on its third turn
    (the env's reward); the history holds each member's turns, tokens and reward."""
    from megatron_longstraw.training import train

    receipt = train.main(_agent_flags(tmp_path, "agent", _agent_prompts(tmp_path)))
    for h in receipt["history"]:
        assert h["env/turns_mean"] == 3.0 and h["env/errors"] == 0.0
        assert h["env/observation_tokens_mean"] == 4.0      # two observations of [key, value]
        for group in h["env_trajectories"]:
            for member in group:
                assert member["end"] == "env done" and member["reward_from"] == "env"
                assert [t["policy_tokens"] for t in member["turns"]] == [3, 3, 3]
                assert [t["observation_tokens"] for t in member["turns"]] == [2, 2, 0]
                assert member["tokens"] == 13 and member["trained_tokens"] == 9
                assert member["reward"] in (0.0, 1.0)
        assert h["grpo/mismatch_abs_max"] < 1e-9      # decode's trajectory is what it trains on
        assert h["grpo/grad_norm"] > 0 or h["grpo/zero_advantage_frac"] == 1.0


@pytest.mark.parametrize("extra,message", [
    (["--longstraw-env", "nomodule"], "must be 'module:factory'"),
    (["--longstraw-env-max-turns", "0"], "env_max_turns must be an integer >= 1, got 0 "
                                         "(--longstraw-env-max-turns"),
    (["--longstraw-env-timeout", "0"], "env_timeout must be a number of seconds > 0, got 0.0 "
                                       "(--longstraw-env-timeout"),
])
def test_bad_environment_settings_are_refused_at_start(tmp_path, extra, message):
    from megatron_longstraw.runtime.errors import UserError
    from megatron_longstraw.training import train

    with pytest.raises(UserError) as caught:
        train.main(_agent_flags(tmp_path, "bad", _agent_prompts(tmp_path), *extra))
    assert message in str(caught.value)


def test_an_environment_factory_that_fails_names_the_record(tmp_path):
    from megatron_longstraw.runtime.errors import UserError
    from megatron_longstraw.training import train

    data = _agent_prompts(tmp_path, {"answer_turn": 0})     # LookupEnv refuses answer_turn 0
    with pytest.raises(UserError, match=r"agent.jsonl line \d \(id 'agent-\d'\): the environment "
                                        r"factory .*lookup raised ValueError: .*answer_turn=0"):
        train.main(_agent_flags(tmp_path, "factory", data))


def test_the_readme_agents_command_runs(tmp_path):
    """The README's "Agents" command as written (its output folder moved to a temporary one):
    it trains, and every step line reports the members' turns."""
    import os
    import re
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    start = readme.index("## Agents")
    section = readme[start:readme.index("\n## ", start + 3)]
    (block,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    script = block.replace("--longstraw-out-dir runs", f"--longstraw-out-dir {tmp_path}")
    assert script != block
    env = {"PATH": f"{root / '.venv' / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path),
           "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1",
           "PYTHONWARNINGS": "ignore", "TMPDIR": os.environ.get("TMPDIR", "/tmp")}
    out = subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    steps = re.findall(r"^step\s+\d+ \|.*\| turns (\d\.\d)", out.stdout, flags=re.M)
    assert steps == ["3.0", "3.0"], out.stdout[-2000:]
    assert (tmp_path / "agent" / "receipt.json").is_file()
    assert len((tmp_path / "agent" / "trajectories" / "replica0.jsonl").read_text()
               .splitlines()) == 2    # the README's trajectories file: a group per step


def test_an_environment_that_raises_ends_its_members_not_the_run(tmp_path, monkeypatch):
    """Through the launcher: an environment whose tool call raises ends each member with the
    error in the history (env/errors, the member's end), and the run trains on."""
    from megatron_longstraw.training import train

    (tmp_path / "broken_env.py").write_text(
        "from megatron_longstraw.rollout.env import EnvStep\n"
        "class Broken:\n"
        "    stop_ids = ()\n"
        "    def step(self, turn_ids):\n"
        "        raise RuntimeError('the tool is down')\n"
        "def make(meta, prompt_ids, tokenizer):\n"
        "    return Broken()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    flags = _agent_flags(tmp_path, "broken", _agent_prompts(tmp_path), "--longstraw-reward",
                         "longstraw:exact_match")
    flags[flags.index("--longstraw-env") + 1] = "broken_env:make"
    receipt = train.main(flags)
    for h in receipt["history"]:
        assert h["env/errors"] == 2.0 and h["env/turns_mean"] == 0.0
        for member in (m for group in h["env_trajectories"] for m in group):
            assert member["end"] == "env error: env.step raised RuntimeError: the tool is down"
            assert member["tokens"] == member["trained_tokens"] == 3
            assert member["reward_from"] == "reward function"


def test_environments_under_cp_are_called_once_and_feed_every_rank(tmp_path):
    """Real gloo ranks (GLM-5.2 CP2/EP2, Qwen3.6 CP2): CP rank 0 calls each member's environment
    and broadcasts the observation, so the tool runs once per call and every rank's trajectory
    (tokens, masks, log-probs <= 1e-9) equals one process's; the ranks feed the observations
    (30 and 17 ids) in blocks of 16 rows, the one process token by token."""
    import dist_workers
    from distributed import run_ranks

    cases, references, jobs = [("glm52", 2, 2, 40), ("qwen36", 2, 1, 50)], [], []
    for family, cp, ep, prompt_len in cases:
        cfg, model = _build(family)
        path = tmp_path / f"{family}.pt"
        torch.save({k: v.clone() for k, v in model.state_dict().items()
                    if not k.endswith("_extra_state")}, path)
        prompt = torch.randint(0, cfg.vocab_size, (prompt_len,),
                               generator=torch.Generator().manual_seed(4))
        ls = _ls(2)
        captured = capture_prompt(model, prompt, ls)
        tools = [LongObservations(30 - 13 * m, cfg.vocab_size, salt=m) for m in range(2)]
        references.append(generate(model, captured, 2, SamplingParams(max_new_tokens=72, seed=7),
                                   ls, envs=tools,
                                   env_limits=EnvLimits(max_turns=3, turn_tokens=3,
                                                        prefill_block=1)))
        jobs.append((family, cp, ep, str(path), prompt_len))
    outs = run_ranks(dist_workers.decode_worker, 2, cases=jobs, envs=True)
    for case, (family, cp, ep, _) in enumerate(cases):
        worst = 0.0
        for rank, out in enumerate(outs):
            for (tokens, logps, mask, calls), ref in zip(out[case], references[case]):
                assert torch.equal(tokens, ref.token_ids) and torch.equal(mask, ref.loss_mask)
                assert calls == (len(ref.turns) if rank == 0 else 0)
                worst = max(worst, float((logps - ref.logprobs).abs().max()))
        assert len(references[case][0].turns) == 3
        assert int((~references[case][0].loss_mask).sum()) == 60
        print(f"{family} CP{cp}/EP{ep}: env trajectory in blocks of 16 vs one process token by "
              f"token max |d logp| {worst:.1e}")
        assert worst <= 1e-9
