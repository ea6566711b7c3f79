"""Every Megatron flag the launcher parses but does not implement is refused by name when given
with a non-default value (training/megatron_flags.py), and docs/design.md lists the honoured
ones."""

import re
from pathlib import Path

import pytest

from megatron_longstraw.runtime.errors import ConfigError
from megatron_longstraw.training import train
from megatron_longstraw.training.megatron_flags import HONOURED

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "glm52" / "tiny.yaml")
BASE = ["--longstraw", "--longstraw-config", TINY]


@pytest.mark.parametrize("flags,named", [
    (["--optimizer", "sgd"], "--optimizer sgd (the launcher's optimizer is Adam with decoupled "
                             "weight decay (AdamW))"),
    (["--fp16"], "--fp16 (use --bf16 or --longstraw-dtype)"),
    (["--no-load-optim"], "--no-load-optim"),
    (["--log-interval", "10"], "--log-interval 10 (every step is logged)"),
    (["--linear-num-key-heads", "2"], "--linear-num-key-heads 2"),   # Qwen3.6's, not GLM-5.2's
])
def test_unimplemented_megatron_flags_are_refused_by_name(flags, named):
    with pytest.raises(ConfigError) as info:
        train.configure(BASE + flags)
    message = str(info.value)
    assert message.startswith("Megatron flag not implemented by the LongStraw launcher (it would "
                              f"be ignored): {named}. Drop it;"), message


def test_every_unimplemented_flag_is_named_and_defaults_pass():
    with pytest.raises(ConfigError, match=r"flags not implemented .*: --optimizer sgd .*; "
                                          r"--finetune.*Drop them"):
        train.configure(BASE + ["--optimizer", "sgd", "--finetune"])
    # The defaults a Megatron script passes change nothing: accepted.
    train.configure(BASE + ["--optimizer", "adam", "--micro-batch-size", "1",
                            "--distributed-backend", "nccl", "--lr", "1e-5"])


def test_design_doc_lists_the_honoured_flags():
    from megatron_longstraw.training.arguments import build_parser

    section = (ROOT / "docs" / "design.md").read_text().split("## 12. Megatron flags", 1)[1]
    listed = set(re.findall(r"`(--[a-z0-9_-]+)`", section.split("Every other", 1)[0]))
    listed -= {"--num-layers", "--hidden-size"}   # the examples of the family's model flags
    options = {a.dest: a.option_strings for a in build_parser()._actions if a.option_strings}
    for dests in HONOURED.values():
        for dest in dests:
            named = listed & set(options[dest])
            assert len(named) == 1, dest
            listed -= named
    assert not listed, listed
