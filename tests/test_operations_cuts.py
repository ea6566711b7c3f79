"""Small cuts a new user met: flags named as the entry point spells them, the family following
from the config, a progress bar fit for log files, and torchrun's failure report naming the
user error."""

import io
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
QWEN_TINY = str(ROOT / "examples" / "qwen36" / "tiny.yaml")


def test_errors_name_the_flag_of_the_entry_point(tmp_path):
    import generate

    from megatron_longstraw.data.groups import DataError, read_records
    from megatron_longstraw.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^--reward 'nocolon': expected 'module:function'"):
        generate.main(["--family", "qwen36", "--config", QWEN_TINY, "--random-init", "--input",
                       str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o.jsonl"),
                       "--group-size", "2", "--max-new-tokens", "2", "--reward", "nocolon"])
    data = tmp_path / "g.jsonl"
    data.write_text(json.dumps({"prompt": "some text", "response_ids": [[1], [2]],
                                "rewards": [0, 1]}) + "\n")
    with pytest.raises(DataError, match=r"the launcher's --longstraw-tokenizer PATH, or "
                                        r"--tokenizer PATH of tools/score\.py"):
        list(read_records(data))


def test_the_family_follows_from_the_config():
    import plan_memory

    from megatron_longstraw.training import train

    args = plan_memory.parse_args(["--config", str(ROOT / "examples/qwen36/full.yaml")])
    assert args.family == "qwen36"
    assert plan_memory.build_spec(args).family == "qwen36"
    assert plan_memory.parse_args([]).family == "glm52"   # no config: the default family
    args, given = train.parse(["--longstraw", "--longstraw-config", QWEN_TINY])
    assert train.resolve(args, given)[0] == "qwen36"


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_progress_bar_redraws_on_a_terminal_and_writes_plain_lines_into_logs():
    from megatron_longstraw.training.metrics import ProgressBar

    log = io.StringIO()
    bar = ProgressBar("step 0 capture", stream=log, interval_s=3600)
    for done in range(1, 9):
        bar(done, 8)
    assert "\r" not in log.getvalue()
    assert log.getvalue().splitlines() == [log.getvalue().strip()]   # only the final line
    assert log.getvalue().startswith("step 0 capture [##############################] 8/8 layers")
    log = io.StringIO()
    bar = ProgressBar("step 0 capture", stream=log, interval_s=0)
    for done in range(1, 5):
        bar(done, 4)
    assert len(log.getvalue().splitlines()) == 4 and "\r" not in log.getvalue()
    term = _Terminal()
    bar = ProgressBar("step 0 capture", stream=term)
    for done in range(1, 5):
        bar(done, 4)
    assert term.getvalue().count("\r") == 4 and term.getvalue().endswith("\n")


def test_torchrun_reports_the_user_error_as_the_root_cause(tmp_path, monkeypatch, capsys):
    """A worker's user error goes to its TORCHELASTIC_ERROR_FILE; torchrun's summary reads it."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from megatron_longstraw.runtime import errors

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def main():
        raise errors.ConfigError("--optimizer sgd: not implemented.")

    with pytest.raises(SystemExit) as info:
        errors.run_entry(main)
    assert info.value.code == errors.EXIT_USER_ERROR
    assert capsys.readouterr().err.strip() == "error: --optimizer sgd: not implemented."
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    report = ChildFailedError("examples/pretrain_gpt.py", {0: failure}).format_msg()
    assert "traceback : error: --optimizer sgd: not implemented." in report


def test_a_converted_folder_or_checkpoint_supplies_the_model_config(tmp_path):
    """Without --longstraw-config the launcher takes family and model config from the run's
    starting point: a tools/convert_hf.py output (--pretrained-checkpoint or --load) or the latest
    training checkpoint in --load; Megatron's model flags still win; another family is refused."""
    import torch

    from megatron_longstraw.checkpointing import checkpoint, model_format
    from megatron_longstraw.models.qwen36.config import Qwen36Config
    from megatron_longstraw.runtime.errors import FlagError
    from megatron_longstraw.training import train

    cfg = Qwen36Config.from_yaml(QWEN_TINY)
    converted = tmp_path / "converted"
    model_format.write_model(converted, {"w": torch.zeros(1)}, "qwen36", cfg.to_dict(),
                             torch.float32, layout={})
    for flags in (["--pretrained-checkpoint", str(converted)], ["--load", str(converted)]):
        args, given = train.parse(["--longstraw", *flags])
        family, model_cfg, _, _ = train.resolve(args, given)
        assert family == "qwen36" and model_cfg == cfg
        assert args.longstraw_model_source == str(converted / model_format.MODEL_META)
    args, given = train.parse(["--longstraw", "--pretrained-checkpoint", str(converted),
                               "--hidden-size", "96"])
    assert train.resolve(args, given)[1].hidden_size == 96          # a typed flag wins
    args, given = train.parse(["--longstraw", "--pretrained-checkpoint", str(converted),
                               "--longstraw-family", "glm52"])
    with pytest.raises(FlagError, match=r"--longstraw-family glm52: .* holds a 'qwen36' model"):
        train.resolve(args, given)
    # A folder of the run's checkpoints (resume): the latest one's meta.json.
    step = tmp_path / "ckpt" / "step_00000003"
    step.mkdir(parents=True)
    (step / checkpoint.TRAIN_META).write_text(json.dumps({
        "format": checkpoint.TRAIN_FORMAT, "format_version": 1, "family": "qwen36",
        "model": {**cfg.to_dict(), "hidden_size": 128}}))
    (tmp_path / "ckpt" / checkpoint.LATEST).write_text("step_00000003\n")
    args, given = train.parse(["--longstraw", "--load", str(tmp_path / "ckpt")])
    family, model_cfg, _, _ = train.resolve(args, given)
    assert family == "qwen36" and model_cfg.hidden_size == 128
    # A YAML, when given, is the model config; nothing given names none.
    args, given = train.parse(["--longstraw", "--load", str(tmp_path / "ckpt"),
                               "--longstraw-config", QWEN_TINY])
    assert train.resolve(args, given)[1].hidden_size == 64 and not args.longstraw_model_source
    args, given = train.parse(["--longstraw"])
    with pytest.raises(FlagError, match="a tools/convert_hf.py output as --pretrained-checkpoint"):
        train.resolve(args, given)


def test_score_reads_family_and_config_from_a_training_checkpoint(tmp_path):
    """tools/score.py --checkpoint of a training checkpoint (a step_N folder, or the --save folder:
    its latest) needs no --family / --config: its meta.json records them. (tests/test_walkthrough.py
    scores a real one this way; tests/test_score.py the model-format directory.)"""
    from megatron_longstraw.checkpointing import checkpoint
    from megatron_longstraw.checkpointing.model_source import resolve_model_source
    from megatron_longstraw.models.qwen36.config import Qwen36Config
    from megatron_longstraw.runtime.errors import CheckpointError, ConfigError

    model = Qwen36Config.from_yaml(QWEN_TINY).to_dict()
    step = tmp_path / "ckpt" / "step_00000002"
    step.mkdir(parents=True)
    (step / checkpoint.TRAIN_META).write_text(json.dumps({
        "format": checkpoint.TRAIN_FORMAT, "format_version": 1, "family": "qwen36",
        "model": model}))
    for path in (tmp_path / "ckpt", step):
        assert resolve_model_source(None, None, str(path)) == ("qwen36", model)
    assert resolve_model_source(None, QWEN_TINY, str(step)) == ("qwen36", QWEN_TINY)
    with pytest.raises(CheckpointError, match="holds a 'qwen36' model, not --family glm52"):
        resolve_model_source("glm52", None, str(step))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"--family and --config needed: --checkpoint .*empty is "
                                          r"neither a model-format directory"):
        resolve_model_source(None, None, str(tmp_path / "empty"))


def test_the_on_policy_zero_loss_is_explained_once():
    """The first step line whose loss is the on-policy surrogate's zero (ratio 1, advantages of
    zero mean) says why, once; a nonzero loss or an off-policy ratio says nothing."""
    from types import SimpleNamespace

    from megatron_longstraw.training.metrics import ZERO_LOSS_NOTE, StepLogger

    def result(loss, ratio=1.0):
        stats = {"reward_mean": 0.5, "reward_group_std": 0.5, "clip_frac": 0.0,
                 "ratio_mean": ratio, "kl": 0.0, "grad_norm": 1.0}
        return SimpleNamespace(stats=stats, loss=loss, page_bytes=0, page_bytes_by_kind={},
                               phase_seconds={"capture": 0.0, "scoring": 0.0, "replay": 0.0})

    logger = StepLogger(None, enabled=False)
    assert ZERO_LOSS_NOTE not in logger.log(0, result(0.03), {})      # e.g. token_mean
    assert ZERO_LOSS_NOTE not in logger.log(1, result(2e-9, ratio=1.02), {})
    line = logger.log(2, result(-3e-9), {})
    assert f"| loss -0.000000 {ZERO_LOSS_NOTE} | reward" in line
    assert "gradient is not" in ZERO_LOSS_NOTE
    assert ZERO_LOSS_NOTE not in logger.log(3, result(0.0), {})       # once
    # The prompt backward's time follows replay's when the step ran one (exact mode).
    exact = result(0.1)
    exact.phase_seconds["prompt_backward"] = 2.25
    assert "replay 0.0s prompt-backward 2.2s | pages" in logger.log(4, exact, {})
