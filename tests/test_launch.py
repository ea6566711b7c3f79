"""The Megatron-style launcher: flags (Megatron's parser + --longstraw-*), YAML resolution,
SLURM scripts, and one short step through examples/pretrain_gpt.py."""

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from megatron_longstraw import train

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "glm52" / "tiny.yaml")


def test_yaml_supplies_defaults_and_flags_win():
    args, given = train.parse(["--longstraw", "--longstraw-config", TINY,
                               "--longstraw-group-size", "6", "--hidden-size", "96",
                               "--longstraw-kl-coef", "0.05", "--seed", "7"])
    family, model_cfg, ls, _ = train.resolve(args, given)
    assert family == "glm52"
    assert ls.group_size == 6            # flag beats the YAML's 4
    assert ls.kl_coef == 0.05
    assert ls.clip_eps_high == 0.28      # from the YAML
    assert ls.seed == 7                  # Megatron's --seed when the YAML has none
    assert model_cfg.hidden_size == 96   # Megatron model flag beats the YAML's 64
    assert model_cfg.num_hidden_layers == 8  # --num-layers not given: the YAML's value stays


def test_megatron_defaults_do_not_override_yaml():
    # --num-layers has a Megatron default; only a flag that was typed overrides the YAML.
    args, given = train.parse(["--longstraw", "--longstraw-config", TINY])
    _, model_cfg, _, _ = train.resolve(args, given)
    assert model_cfg.num_hidden_layers == 8 and model_cfg.hidden_size == 64


def test_without_longstraw_flag_the_launcher_explains():
    args, given = train.parse(["--longstraw-config", TINY])
    with pytest.raises(SystemExit, match="--longstraw"):
        train.resolve(args, given)


def test_bad_values_are_reported():
    args, given = train.parse(["--longstraw", "--longstraw-config", TINY,
                               "--longstraw-group-size", "1"])
    with pytest.raises(ValueError, match="group_size"):
        train.resolve(args, given)
    with pytest.raises(SystemExit):
        train.parse(["--longstraw", "--longstraw-kernels", "flashy"])


ALLOCATION = {"WORLD_SIZE": "32", "GPUS_PER_NODE": "8", "SLURM_NNODES": "4"}


def _slurm_command(path: Path) -> list[str]:
    """The arguments the script passes to examples/pretrain_gpt.py, with the allocation's numbers
    substituted and other variables standing for paths."""
    text = path.read_text().replace("\\\n", " ")
    line = next(l for l in text.splitlines() if "pretrain_gpt.py" in l and "srun" in l)
    line = re.sub(r"\$\{?(\w+)\}?", lambda m: ALLOCATION.get(m.group(1), f"/path/{m.group(1)}"), line)
    words = shlex.split(line)
    return words[words.index(next(w for w in words if w.endswith("pretrain_gpt.py"))) + 1:]


@pytest.mark.parametrize("script,family,cp,ep", [
    ("examples/glm52/glm52_32xH20.slurm", "glm52", 32, 32),
    ("examples/qwen36/qwen36_8xH20.slurm", "qwen36", 8, 1),
])
def test_slurm_scripts_are_valid_bash_and_parse(script, family, cp, ep):
    path = ROOT / script
    subprocess.run(["bash", "-n", str(path)], check=True)
    text = path.read_text()
    assert re.search(r"#SBATCH --nodes=\d", text) and "rdzv-endpoint" in text
    argv = _slurm_command(path)
    args, given = train.parse(argv)
    assert args.longstraw and args.longstraw_family == family
    assert (args.context_parallel_size, args.expert_model_parallel_size) == (cp, ep)
    assert {"save", "load", "tensorboard_dir", "longstraw_data"} <= given
    if family == "glm52":  # the YAML and flags resolve to a valid configuration
        args.longstraw_config = str(ROOT / "examples" / "glm52" / "full.yaml")
        _, model_cfg, ls, dtype = train.resolve(args, given)
        assert model_cfg.num_hidden_layers == 78 and ls.group_size == 8
        assert str(dtype) == "torch.bfloat16"


def test_pretrain_gpt_runs_one_step(tmp_path):
    """The entry point end to end on one process (tiny model, short prompt)."""
    out = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), str(ROOT / "examples" / "pretrain_gpt.py"),
         "--longstraw", "--longstraw-config", TINY, "--train-iters", "1",
         "--longstraw-synthetic-prompt-len", "256", "--longstraw-group-size", "2",
         "--longstraw-synthetic-response-len", "8", "--tensorboard-dir", str(tmp_path / "tb"),
         "--longstraw-out-dir", str(tmp_path), "--longstraw-run-name", "t"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "TORCHDYNAMO_DISABLE": "1", "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"step\s+0 \| loss", out.stdout)
    receipt = __import__("json").loads((tmp_path / "t" / "receipt.json").read_text())
    assert receipt["prompt_len"] == 256 and receipt["group_size"] == 2
    assert receipt["world_size"] == 1 and receipt["page_bytes"] == 255 * (8 * 40 + 4 * 16) * 4
    assert any((tmp_path / "tb").iterdir())  # TensorBoard event file written
