"""The Megatron-style launcher: flags (Megatron's parser + --longstraw-*), YAML resolution,
SLURM scripts, and one short step through examples/pretrain_gpt.py."""

import importlib.util
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

from megatron_longstraw.training import train
import processes

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "glm52" / "tiny.yaml")
TINY_QWEN = str(ROOT / "examples" / "qwen36" / "tiny.yaml")


def test_yaml_supplies_defaults_and_flags_win():
    args, given = train.parse(["--longstraw", "--longstraw-config", TINY,
                               "--longstraw-group-size", "6", "--hidden-size", "96",
                               "--longstraw-kl-coef", "0.05", "--seed", "7"])
    family, model_cfg, ls, _ = train.resolve(args, given)
    assert family == "glm52"
    assert ls.group.group_size == 6            # flag beats the YAML's 4
    assert ls.loss.kl_coef == 0.05
    assert ls.loss.clip_eps_high == 0.28      # from the YAML
    assert ls.run.seed == 7                  # Megatron's --seed when the YAML has none
    assert model_cfg.hidden_size == 96   # Megatron model flag beats the YAML's 64
    assert model_cfg.num_hidden_layers == 8  # --num-layers not given: the YAML's value stays


def test_megatron_defaults_do_not_override_yaml():
    # --num-layers has a Megatron default; only a flag that was typed overrides the YAML.
    args, given = train.parse(["--longstraw", "--longstraw-config", TINY])
    _, model_cfg, _, _ = train.resolve(args, given)
    assert model_cfg.num_hidden_layers == 8 and model_cfg.hidden_size == 64


def test_qwen36_yaml_and_megatron_flags():
    base = ["--longstraw", "--longstraw-family", "qwen36", "--longstraw-config", TINY_QWEN]
    args, given = train.parse(base)
    family, model_cfg, ls, dtype = train.resolve(args, given)
    assert family == "qwen36" and type(model_cfg).__name__ == "Qwen36Config"
    # Megatron's defaults (--num-query-groups 1, --linear-num-key-heads 16, --rotary-percent 1.0,
    # --kv-channels None) leave the YAML alone.
    assert (model_cfg.num_key_value_heads, model_cfg.linear_num_key_heads) == (2, 4)
    assert (model_cfg.partial_rotary_factor, model_cfg.head_dim) == (0.25, 32)
    assert ls.group.group_size == 4 and dtype == torch.float32
    args, given = train.parse(base + [
        "--num-query-groups", "3", "--kv-channels", "16", "--rotary-percent", "0.5",
        "--linear-num-key-heads", "2", "--linear-num-value-heads", "6",
        "--linear-attention-freq", "2", "--untie-embeddings-and-output-weights",
        "--rotary-base", "500000", "--bf16"])
    _, model_cfg, _, dtype = train.resolve(args, given)
    assert (model_cfg.num_key_value_heads, model_cfg.head_dim) == (3, 16)
    assert model_cfg.partial_rotary_factor == 0.5 and model_cfg.rope_theta == 500000.0
    assert (model_cfg.linear_num_key_heads, model_cfg.linear_num_value_heads) == (2, 6)
    assert model_cfg.full_attention_interval == 2 and model_cfg.tie_word_embeddings is False
    assert model_cfg.hybrid_layer_pattern() == "G-*-" * 4
    assert dtype == torch.bfloat16
    # Megatron's list form of --linear-attention-freq (1 = linear, 0 = full attention).
    args, given = train.parse(base + ["--linear-attention-freq", "([1]*3+[0])*2"])
    assert train.resolve(args, given)[1].full_attention_interval == 4
    args, given = train.parse(base + ["--linear-attention-freq", "[1,0,0,1,1,1,1,0]"])
    with pytest.raises(ValueError, match="every n-th layer full attention"):
        train.resolve(args, given)


def test_qwen36_has_no_experts_to_shard():
    args, given = train.parse(["--longstraw", "--longstraw-family", "qwen36", "--longstraw-config",
                               TINY_QWEN, "--expert-model-parallel-size", "2"])
    with pytest.raises(ValueError, match=r"--expert-model-parallel-size 2: Qwen3\.6 has no MoE"):
        train.resolve(args, given)
    # A GLM-5.2 field in a Qwen3.6 YAML is named in the error.
    args, given = train.parse(["--longstraw", "--longstraw-family", "qwen36", "--longstraw-config",
                               TINY])
    with pytest.raises(ValueError, match=r"Unknown Qwen3\.6 config fields \['first_k_dense_replace'"):
        train.resolve(args, given)


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


def test_help_prints_every_flag(capsys):
    # Megatron's help for --moe-paged-stash-buffer-size-factor-cuda ends "(e.g. 1.10 = 10%)": a
    # bare % argparse's formatter rejected (ValueError) before arguments.escape_help_percents.
    with pytest.raises(SystemExit) as info:
        train.parse(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "(e.g. 1.10 = 10%)" in " ".join(text.split())
    for flag in ("--longstraw-config", "--longstraw-family", "--longstraw-adv-eps",
                 "--longstraw-std-unbiased", "--longstraw-lora-rank", "--longstraw-save-merged",
                 "--tensor-model-parallel-size"):
        assert flag in text, flag
    # Only the help strings that did not format are touched.
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    from megatron_longstraw.training.arguments import escape_help_percents

    plain = add_megatron_arguments(argparse.ArgumentParser())
    assert "--moe-paged-stash-buffer-size-factor-cuda" in escape_help_percents(plain)
    assert escape_help_percents(plain) == []                 # now every help string formats


@pytest.mark.parametrize("flag,size", [("--tensor-model-parallel-size", 2),
                                       ("--pipeline-model-parallel-size", 4),
                                       ("--expert-tensor-parallel-size", 2)])
def test_tensor_and_pipeline_parallelism_are_refused(flag, size):
    """TP / PP > 1 used to be forced to 1 silently (the ranks became data-parallel); refused by
    resolve, before any process group starts, saying what is supported."""
    args, given = train.parse(["--longstraw", "--longstraw-config", TINY, flag, str(size)])
    with pytest.raises(ValueError, match=rf"{flag} {size} is not supported\. LongStraw runs "
                                         r"tensor- and pipeline-parallel size 1: .*context "
                                         r"parallelism .*expert parallelism folded .*data "
                                         r"parallelism"):
        train.resolve(args, given)
    args, given = train.parse(["--longstraw", "--longstraw-config", TINY, flag, "1"])
    train.resolve(args, given)   # size 1 is what runs

ALLOCATION = {"WORLD_SIZE": "32", "GPUS_PER_NODE": "8", "SLURM_NNODES": "4"}


def _slurm_command(path: Path) -> list[str]:
    """The arguments the script passes to examples/pretrain_gpt.py, with the allocation's numbers
    substituted and other variables standing for paths."""
    # "${LOAD[@]}": --load CHECKPOINT_DIR on a resubmitted job (test_operations_load.py runs
    # the script's choice between a first run and a resume).
    text = path.read_text().replace("\\\n", " ")
    text = text.replace('"${LOAD[@]}"', '--load "$CHECKPOINT_DIR"')
    line = next(l for l in text.splitlines() if "pretrain_gpt.py" in l and "srun" in l)
    line = re.sub(r"\$\{?(\w+)\}?", lambda m: ALLOCATION.get(m.group(1), f"/path/{m.group(1)}"), line)
    words = shlex.split(line)
    words = words[:-1] if words[-1] == "&" else words   # run in the background: the shell waits
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
    # The YAML and flags resolve to a valid configuration.
    args.longstraw_config = str(ROOT / "examples" / family / "full.yaml")
    _, model_cfg, ls, dtype = train.resolve(args, given)
    assert model_cfg.num_hidden_layers == {"glm52": 78, "qwen36": 64}[family]
    assert ls.group.group_size == 8 and dtype == torch.bfloat16
    lora, ls = train.resolve_lora(args, family, ls)
    if family == "qwen36":
        # The paper's QLoRA: rank 19 on the default targets, 115,267,072 trainable parameters
        # (test_adapters.py::test_qwen36_full_size_counts); the base from --pretrained-checkpoint.
        assert lora.quantize_base and lora.config.rank == 19 and not lora.targets_given
        assert "pretrained_checkpoint" in given and ls.run.kernels == "auto,dense=ref"
    else:
        assert lora is None


def _launch(tmp_path, *flags: str) -> tuple[str, dict]:
    """examples/pretrain_gpt.py on one process, one step unless `flags` say otherwise (the last
    occurrence of a flag wins): (stdout, receipt of run "t")."""
    out = processes.run(
        [str(ROOT / ".venv" / "bin" / "python"), str(ROOT / "examples" / "pretrain_gpt.py"),
         "--longstraw", "--train-iters", "1", "--longstraw-synthetic-response-len", "8",
         "--longstraw-group-size", "2", "--tensorboard-dir", str(tmp_path / "tb"),
         "--longstraw-out-dir", str(tmp_path), "--longstraw-run-name", "t", *flags],  # flags win, cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "TORCHDYNAMO_DISABLE": "1", "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert any((tmp_path / "tb").iterdir())  # TensorBoard event file written
    return out.stdout, json.loads((tmp_path / "t" / "receipt.json").read_text())


def test_pretrain_gpt_runs_one_step(tmp_path):
    """The entry point end to end on one process (tiny model, short prompt)."""
    stdout, receipt = _launch(tmp_path, "--longstraw-config", TINY,
                              "--longstraw-synthetic-prompt-len", "256")
    assert re.search(r"step\s+0 \| loss", stdout)
    assert receipt["prompt_len"] == 256 and receipt["group_size"] == 2
    assert receipt["world_size"] == 1 and receipt["page_bytes"] == 255 * (8 * 40 + 4 * 16) * 4
    # fp32 latents [32 + 8] on 8 layers, index keys [16] on the 4 full indexer layers.
    assert receipt["page_bytes_by_kind"] == {"latent": 255 * 8 * 40 * 4, "index_key": 255 * 4 * 16 * 4}
    assert receipt["fixed_page_kinds"] == [] and receipt["fixed_page_bytes"] == 0
    assert receipt["page_bytes_per_token"] == (8 * 40 + 4 * 16) * 4
    # Peak live tensor bytes per phase (memory.LiveBytesMeter), from the step's start: the pages
    # are live from capture on, so every phase after capture holds at least them.
    live = receipt["peak_live_bytes"]
    assert set(live) == {"step", "capture", "scoring", "replay", "prompt_backward"}
    assert live["prompt_backward"] == 0                     # detached: no prompt backward
    assert live["step"] == max(live.values())
    assert min(live["scoring"], live["replay"]) >= receipt["page_bytes_per_rank"] > 0
    assert "peak live tensors" in stdout
    # What produced it: the installed versions (read here from the distributions' metadata) and
    # the CPU capability torch dispatches on.
    from importlib import metadata

    env = receipt["environment"]
    assert env["torch"] == torch.__version__                 # with its local tag (+cu130)
    for dist in ("megatron-core", "bitsandbytes", "transformers"):
        assert env[dist.replace("-", "_")] == metadata.version(dist), dist
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def _qwen36_model_format(folder: Path) -> dict:
    """A model-format directory (what tools/convert_hf.py writes) of the tiny Qwen3.6 with random
    weights unlike the launcher's seeded initialisation; returns its tensors. Needs the
    single_process fixture."""
    from megatron_longstraw.checkpointing import model_format
    from megatron_longstraw.models.qwen36.config import Qwen36Config
    from megatron_longstraw.models.qwen36.model import build_qwen36_model

    model = build_qwen36_model(Qwen36Config.from_yaml(TINY_QWEN))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    model_format.save_model(folder, model, family="qwen36")
    return {n: t.clone() for n, t in model_format.read_model(folder)[1].items()}


@pytest.mark.usefixtures("single_process")  # conftest: one-process Megatron state, to build the init
def test_pretrain_gpt_runs_one_qwen36_step(tmp_path, single_process):
    """--longstraw-family qwen36 end to end: model summary, checkpoint, receipt with the fixed-size
    GDN state apart from the per-token K/V pages; --load takes a model-format directory (initial
    weights) or a training checkpoint (resume)."""
    weights = _qwen36_model_format(tmp_path / "qwen36-init")
    stdout, receipt = _launch(tmp_path, "--longstraw-family", "qwen36", "--longstraw-config",
                              TINY_QWEN, "--longstraw-synthetic-prompt-len", "300",
                              "--load", str(tmp_path / "qwen36-init"), "--lr", "0",
                              "--save", str(tmp_path / "ckpt"), "--save-interval", "1")
    assert re.search(r"step\s+0 \| loss", stdout)
    assert f"initialised from model-format weights {tmp_path / 'qwen36-init'}" in stdout
    assert "qwen36 (8 layers: 6 Gated DeltaNet + 2 full attention, dense FFN)" in stdout
    assert receipt["family"] == "qwen36" and receipt["expert_parallel_size"] == 1
    # Hand count (fp32): 6 GDN layers x state [12 V heads, 16, 16] and conv tail
    # [3, 2 x 4 x 16 + 12 x 16]; 2 full-attention layers x 299 captured tokens x [2 K/V heads, 32].
    gdn_state, conv_tail = 6 * 12 * 16 * 16 * 4, 6 * 3 * 320 * 4
    key = 299 * 2 * 2 * 32 * 4
    assert receipt["page_bytes_by_kind"] == {"gdn_state": gdn_state, "conv_tail": conv_tail,
                                             "key": key, "value": key}
    assert receipt["page_bytes_by_kind_per_rank"] == [receipt["page_bytes_by_kind"]]
    assert receipt["fixed_page_kinds"] == ["conv_tail", "gdn_state"]
    assert receipt["fixed_page_bytes"] == gdn_state + conv_tail
    assert receipt["page_bytes"] == gdn_state + conv_tail + 2 * key
    assert receipt["page_bytes_per_token"] == 2 * 2 * 2 * 32 * 4  # K/V only, as docs/design.md section 9
    saved = tmp_path / "ckpt" / "step_00000001"
    assert json.loads((saved / "meta.json").read_text())["model"]["linear_num_key_heads"] == 4
    rank_state = torch.load(saved / "rank_00000.pt", weights_only=False)
    assert rank_state["extra"]["family"] == "qwen36"
    # lr 0: the step saved exactly the weights it started from, i.e. the model-format ones.
    from megatron_longstraw.checkpointing.model_format import SafetensorsReader

    trained = SafetensorsReader([saved / "model.safetensors"])
    assert set(trained) == set(weights)
    assert all(torch.equal(trained[n], weights[n]) for n in weights)
    # Resuming from it runs the second step only. Another --lr / --train-iters changes the LR
    # schedule the checkpoint saved: as in Megatron, a flag says which one wins.
    stdout, receipt = _launch(tmp_path, "--longstraw-family", "qwen36", "--longstraw-config",
                              TINY_QWEN, "--longstraw-synthetic-prompt-len", "300",
                              "--load", str(tmp_path / "ckpt"), "--train-iters", "2",
                              "--override-opt_param-scheduler")
    assert f"resumed from {saved} at step 1" in stdout
    assert re.search(r"step\s+1 \| loss", stdout) and not re.search(r"step\s+0 \| loss", stdout)


def _compare_tool():
    spec = importlib.util.spec_from_file_location("compare_receipts",
                                                  ROOT / "tools" / "compare_receipts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _receipt(folder: Path, prompt_len: int, gdn_state: int = 73728, family: str = "qwen36") -> Path:
    """A launcher-style receipt of a Qwen3.6 run: fixed GDN kinds, K/V growing with P - 1."""
    from megatron_longstraw.training.receipts import page_bytes_summary

    key = (prompt_len - 1) * 512
    pages = page_bytes_summary([{"gdn_state": gdn_state, "conv_tail": 23040, "key": key,
                                 "value": key}], ["gdn_state", "conv_tail"], prompt_len - 1)
    receipt = {"family": family, "prompt_len": prompt_len,
               "page_bytes": gdn_state + 23040 + 2 * key, **pages}
    folder.mkdir(parents=True)
    (folder / "receipt.json").write_text(json.dumps(receipt))
    return folder / "receipt.json"


def test_compare_receipts_shows_fixed_state_and_growing_pages(tmp_path, capsys):
    tool = _compare_tool()
    half, full = _receipt(tmp_path / "half", 2049), _receipt(tmp_path / "full", 4097)
    assert tool.main([str(half.parent), str(full), "--expect-constant", "gdn_state",
                      "conv_tail"]) == 0
    out = capsys.readouterr().out
    assert "captured prompt tokens x2.00" in out
    assert re.search(r"gdn_state\s+72\.0 KiB\s+72\.0 KiB\s+1\.00  fixed", out)
    assert re.search(r"key\s+1\.0 MiB\s+2\.0 MiB\s+2\.00\n", out)
    assert "constant as the prompt grows (gdn_state, conv_tail): yes" in out

    # A state that grew is caught, and so is a kind neither run has.
    grown = _receipt(tmp_path / "grown", 4097, gdn_state=2 * 73728)
    assert tool.main([str(half), str(grown), "--expect-constant", "gdn_state"]) == 1
    out = capsys.readouterr().out
    assert "constant as the prompt grows (gdn_state): NO" in out
    assert "problem: gdn_state: 73728 B at P=2049 but 147456 B at P=4097" in out
    assert tool.main([str(half), str(full), "--expect-constant", "latent"]) == 1
    assert "problem: latent: no such page kind in" in capsys.readouterr().out
    # Receipts of different families are not comparable.
    glm = _receipt(tmp_path / "glm", 4097, family="glm52")
    assert tool.main([str(half), str(glm)]) == 1
    assert "different families (qwen36 and glm52)" in capsys.readouterr().out


def test_compare_receipts_rejects_old_or_missing_receipts(tmp_path):
    tool = _compare_tool()
    old = tmp_path / "old" / "receipt.json"
    old.parent.mkdir()
    old.write_text(json.dumps({"prompt_len": 256, "page_bytes": 1}))
    half = _receipt(tmp_path / "half", 2049)
    with pytest.raises(SystemExit, match=r"missing \['page_bytes_by_kind', 'fixed_page_kinds'\]"):
        tool.main([str(half), str(old)])
    with pytest.raises(SystemExit, match="no such receipt"):
        tool.main([str(half), str(tmp_path / "nowhere")])
