"""Settings declared once (config/settings.py, config/fields.py): each setting is one field with
its docstring, and its flag, type, default, help, YAML key and checks come from it.

The flags, the YAML files and a command line giving every setting flag are compared with what the
code resolved them to before the settings were declared once (tests/settings_before_76ddc8e.json,
dumped from 76ddc8e with `launcher_flags` and `plain` below): the same flags, flag by flag (their
`--help` text included; only the group a flag is listed under changed, now its section), and the
same values."""

import argparse
import ast
import dataclasses
import enum
import json
import re
import subprocess
from pathlib import Path

import pytest

from megatron_longstraw.config import fields
from megatron_longstraw.config.settings import (SECTIONS, CaptureSettings, LongStrawConfig,
                                                all_settings, capture_section)

ROOT = Path(__file__).resolve().parents[1]
NEW_SECTIONS = ("reuse",)
"""Sections added after 76ddc8e: their settings are new flags and keys, at their defaults in every
YAML of before."""
NEW_SETTINGS = ("env_max_concurrency", "env_prefill_block", "trajectories", "trajectories_max_mb")
"""Settings added after 76ddc8e to a section of before (issue 43: environments, trajectories),
likewise."""
EXTENDED = {"--longstraw-control": "issue 43: the blind control of an agent task"}
"""Flags of before whose choices grew since (each old choice kept, the old help text the start of
the new one); nothing else of them changed."""
BEFORE = json.loads((ROOT / "tests" / "settings_before_76ddc8e.json").read_text())


def plain(value):
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [plain(v) for v in value]
    return value


def launcher_flags(parser: argparse.ArgumentParser) -> dict:
    """Every --longstraw-* action: what argparse does with it and what --help prints."""
    titles = {id(a): g.title for g in parser._action_groups for a in g._group_actions}
    out = {}
    for a in parser._actions:
        if not any(o.startswith(("--longstraw", "--no-longstraw")) for o in a.option_strings):
            continue
        out[a.option_strings[0]] = {
            "option_strings": a.option_strings, "dest": a.dest, "action": type(a).__name__,
            "type": getattr(a.type, "__name__", None) if a.type is not None else None,
            "choices": list(a.choices) if a.choices is not None else None,
            "default": plain(a.default), "nargs": a.nargs, "const": a.const,
            "metavar": a.metavar, "help": a.help, "group": titles.get(id(a))}
    return out


@pytest.fixture(scope="module")
def parser():
    from megatron_longstraw.training.command_line import build_parser

    return build_parser()


def test_every_flag_is_the_one_before(parser):
    now, before = launcher_flags(parser), BEFORE["flags"]
    # the flags since are the settings of the sections added after (issue 42: reuse)
    added = {s.option for s in all_settings()
             if s.section in NEW_SECTIONS or s.key in NEW_SETTINGS}
    added |= {"--no-" + o[2:] for o in added if now.get(o, {}).get("action") ==
              "BooleanOptionalAction"}
    assert set(now) - set(before) == {o for o in added if o in now} and set(before) <= set(now)
    for flag, spec in before.items():
        changed = {k: (v, now[flag][k]) for k, v in spec.items()
                   if k != "group" and now[flag][k] != v}
        if flag in EXTENDED:
            (old_choices, choices), (old_help, help_) = changed.pop("choices"), changed.pop("help")
            assert set(old_choices) < set(choices) and help_.startswith(old_help.rstrip(".")), flag
        assert not changed, f"{flag}: {changed}"
    # The settings' flags are listed by section now; the launcher's own keep their groups.
    by_group = {now[f]["group"] for f in now}
    assert {f"longstraw: {name} (YAML longstraw: keys)" for name in SECTIONS} <= by_group


def test_every_yaml_loads_to_the_same_values():
    from megatron_longstraw.training.arguments import longstraw_config_from_yaml

    tracked = subprocess.run(["git", "ls-files", "*.yaml"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    assert set(BEFORE["yaml"]) <= set(tracked)
    for path in tracked:
        cfg = longstraw_config_from_yaml(str(ROOT / path))
        flat = {k: plain(v) for k, v in cfg.flat().items()}
        if path in BEFORE["yaml"]:
            assert {k: flat[k] for k in BEFORE["yaml"][path]} == BEFORE["yaml"][path], path
        import yaml
        section = (yaml.safe_load((ROOT / path).read_text()) or {}).get("longstraw") or {}
        for key in ("lora", "qlora", "fp8_base", "lora_rank", "lora_alpha", "lora_dropout"):
            if key in section:
                assert flat[key] == section[key], (path, key)


def test_a_command_line_with_every_setting_flag_resolves_as_before(parser):
    from megatron_longstraw.training.arguments import longstraw_config_from_args, lora_settings

    args = parser.parse_args(BEFORE["argv"].split())
    cfg = longstraw_config_from_args(args)
    flat = {k: plain(v) for k, v in cfg.flat().items()}
    assert {k: flat[k] for k in BEFORE["argv_values"]} == BEFORE["argv_values"]
    # Every setting flag was given with a value other than its default (but the three that
    # would not go with the rest: --longstraw-control zeros needs the detached prompt gradient,
    # --longstraw-lora excludes --longstraw-qlora and --longstraw-fp8-base), so a flag that did
    # not reach its field would show here.
    defaults = LongStrawConfig().flat()
    new = {s.key for s in all_settings() if s.section in NEW_SECTIONS or s.key in NEW_SETTINGS}
    assert all(flat[k] == plain(defaults[k]) for k in new)
    assert sorted(k for k in flat if flat[k] == plain(defaults[k]) and k not in new) == \
        ["fp8_base", "prompt_grad", "qlora"]
    lora = lora_settings(cfg.adapters, ("default",), cfg.run.seed)
    assert lora.record() == BEFORE["argv_lora"]


def test_one_declaration_per_setting():
    """Each setting is a field with a docstring whose first paragraph is its help; keys are
    unique; the launcher's flag code names no setting (its flags come from the fields) and
    keeps no flag-to-field table."""
    settings = all_settings()
    keys = [s.key for s in settings]
    assert len(keys) == len(set(keys)) == 51 + len(NEW_SETTINGS) + sum(
        len(fields.section_settings(SECTIONS[name], name)) for name in NEW_SECTIONS)
    for s in settings:
        assert s.doc and s.help == " ".join(s.doc.split("\n\n")[0].split())
        assert s.option == "--longstraw-" + s.key.replace("_", "-")
    source = (ROOT / "megatron_longstraw" / "training" / "arguments.py").read_text()
    literal = set(re.findall(r'"--longstraw-([a-z-]+)"', source))
    assert not literal & {k.replace("_", "-") for k in keys}, literal & set(keys)
    tree = ast.parse(source)
    tables = [t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
              for t in node.targets if isinstance(t, ast.Name) and isinstance(node.value, ast.Dict)
              and any(isinstance(k, ast.Constant) and str(k.value).startswith("longstraw_")
                      for k in node.value.keys)]
    assert not tables, tables
    assert not (ROOT / "megatron_longstraw" / "training" / "rl_arguments.py").exists()


@pytest.mark.parametrize("values,message", [
    ({"group_size": "4"}, r"longstraw group_size must be an integer >= 2, got '4' "
                          r"\(--longstraw-group-size, YAML longstraw.group_size\)"),
    ({"group_size": True}, r"group_size must be an integer"),
    ({"offload_pages": "yes"}, r"offload_pages must be true or false, got 'yes'"),
    ({"stop_ids": "1"}, r"stop_ids must be a list of integers, got '1'"),
    ({"stop_ids": [1, 2.5]}, r"stop_ids must be a list of integers"),
    ({"lora_rank": 0}, r"lora_rank must be an integer >= 1, got 0 \(--longstraw-lora-rank"),
    ({"tis_cap": float("nan")}, r"tis_cap must be a number >= 1, got nan"),
    ({"loss_constant": 0}, r"loss_constant must be an integer >= 1 or null, got 0"),
    ({"kernels": None}, r"kernels must be text, got None"),
    ({"rollout": "offlien"}, r"rollout must be one of \['offline', 'online'\], got 'offlien'"),
])
def test_bad_values_name_the_key_and_the_flag(values, message):
    with pytest.raises(ValueError, match=message):
        LongStrawConfig.of(**values)


def test_sections_and_flat_keys():
    cfg = LongStrawConfig.of(group_size=3, capture="whole", rollout="online",
                             reward="longstraw:exact_match", stop_ids=[7], lora_targets="a,b")
    assert (cfg.group.group_size, cfg.capture.mode, cfg.rollout.mode) == (3, "whole", "online")
    assert cfg.rollout.stop_ids == (7,) and cfg.adapters.lora_targets == ("a,b",)
    again = cfg.replace(page_tokens=64)
    assert again.capture.page_tokens == 64 and cfg.capture.page_tokens == 65536
    assert {k: v for k, v in again.flat().items() if k != "page_tokens"} == \
        {k: v for k, v in cfg.flat().items() if k != "page_tokens"}
    with pytest.raises(ValueError, match=r"Unknown longstraw settings \['mode'\]"):
        LongStrawConfig.of(mode="whole")   # an attribute name is not a key
    with pytest.raises(TypeError, match="LongStrawConfig.capture must be a CaptureSettings"):
        LongStrawConfig(capture="whole")
    assert capture_section(cfg) is cfg.capture and capture_section(cfg.capture) is cfg.capture
    with pytest.raises(TypeError, match="expected CaptureSettings or a LongStrawConfig"):
        capture_section({"page_tokens": 8})


def test_a_field_without_a_docstring_is_refused():
    @dataclasses.dataclass
    class Bare(fields.Section):
        size: int = fields.setting(3)

    with pytest.raises(TypeError, match="Bare.size has no docstring"):
        fields.section_settings(Bare)


def test_the_help_is_the_first_paragraph_and_percent_prints(tmp_path):
    @dataclasses.dataclass
    class Odd(fields.Section):
        ratio: float = fields.setting(0.5, low=0, metavar="R")
        """Share of the rows, in % of the
        whole.

        Not in the help."""

    parser = argparse.ArgumentParser()
    fields.add_flags(parser, fields.section_settings(Odd, "odd"), "odd")
    text = parser.format_help()
    assert "Share of the rows, in % of the whole." in text and "Not in the help" not in text
    assert parser.parse_args(["--longstraw-ratio", "0.25"]).longstraw_ratio == 0.25
    assert parser.parse_args([]).longstraw_ratio is None      # unset: the YAML decides
    assert Odd(ratio=2).ratio == 2
    with pytest.raises(ValueError, match=r"ratio must be a number >= 0, got -1"):
        Odd(ratio=-1)
