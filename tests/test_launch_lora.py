"""LoRA / QLoRA through the launcher (megatron_longstraw/training/train.py, in-process, one gloo process):
flags and YAML keys resolve and bad values are refused with their flag's name; a tiny Qwen3.6 QLoRA
run with a KL penalty changes only the adapters (base parameters and NF4 bytes bitwise equal), saves
adapter-only checkpoints that resume bit for bit and refuse another base or other adapters, records
parameter counts and NF4 bytes, and exports merged weights that equal the adapted model; a tiny
GLM-5.2 step with plain LoRA (no expert adapters) does the same for the MLA / MoE model."""

import itertools
import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from megatron_longstraw.training import train
from megatron_longstraw.adapters.lora import (
    lora_modules,
    lora_parameter_count,
    nf4_nbytes,
)
from megatron_longstraw.models.qwen36.family import LORA_TARGETS as QWEN36_TARGETS

pytestmark = pytest.mark.usefixtures("single_process")

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "glm52" / "tiny.yaml")
TINY_QWEN = str(ROOT / "examples" / "qwen36" / "tiny.yaml")
RANK = 4


def _flags(tmp_path: Path, *extra: str, family: str = "qwen36") -> list[str]:
    config = TINY_QWEN if family == "qwen36" else TINY
    return ["--longstraw", "--longstraw-family", family, "--longstraw-config", config,
            "--longstraw-synthetic-prompt-len", "48", "--longstraw-synthetic-response-len", "4",
            "--longstraw-group-size", "2", "--longstraw-dtype", "fp32", "--lr", "1e-2",
            "--longstraw-out-dir", str(tmp_path), "--longstraw-run-name", "t", *extra]


def _resolve(*flags: str):
    args, given = train.parse(["--longstraw", "--longstraw-family", "qwen36", *flags])
    family, _, ls, _ = train.resolve(args, given)
    return train.resolve_lora(args, family, ls)


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone()
            for n, t in itertools.chain(model.named_parameters(), model.named_buffers())}


@pytest.fixture
def runs(monkeypatch):
    """Every launcher run's Setup, with a snapshot of its tensors taken before the first step."""
    seen = []
    real = train.setup_model

    def spy(*args, **kwargs):
        run = real(*args, **kwargs)
        seen.append((run, _snapshot(run.model)))
        return run

    monkeypatch.setattr(train, "setup_model", spy)
    return seen


def _logits(model, ids):
    with torch.no_grad():
        return model(ids[None], None, None)


def test_lora_flags_and_yaml_resolve(tmp_path):
    lora, ls = _resolve("--longstraw-config", TINY_QWEN)
    assert lora is None and ls.run.kernels == "auto"            # full-parameter: nothing changes
    lora, ls = _resolve("--longstraw-config", TINY_QWEN, "--longstraw-qlora",
                        "--longstraw-lora-rank", "19", "--longstraw-lora-alpha", "32",
                        "--longstraw-lora-dropout", "0.05", "--longstraw-kl-coef", "0.01")
    assert lora.quantize_base and not lora.targets_given
    assert (lora.config.rank, lora.config.alpha, lora.config.dropout) == (19, 32.0, 0.05)
    assert lora.config.targets == QWEN36_TARGETS and lora.config.seed == ls.run.seed
    # LoRA wraps Megatron's local linears: auto keeps the dense layers off TransformerEngine.
    assert ls.run.kernels == "auto,dense=ref"
    # The YAML `longstraw:` section takes the same keys; flags win.
    config = yaml.safe_load(Path(TINY_QWEN).read_text())
    config["longstraw"].update(lora=True, lora_rank=8, lora_targets="linear_qkv, linear_fc*",
                               lora_exclude=["decoder.layers.0.*"])
    (tmp_path / "lora.yaml").write_text(yaml.safe_dump(config))
    lora, _ = _resolve("--longstraw-config", str(tmp_path / "lora.yaml"),
                       "--longstraw-lora-alpha", "4")
    assert not lora.quantize_base and lora.targets_given
    assert (lora.config.rank, lora.config.alpha) == (8, 4.0)
    assert lora.config.targets == ("linear_qkv", "linear_fc*")
    assert lora.config.exclude == ("decoder.layers.0.*",)
    # --no-longstraw-lora switches the YAML's LoRA off, settings and all.
    assert _resolve("--longstraw-config", str(tmp_path / "lora.yaml"), "--no-longstraw-lora")[0] \
        is None


@pytest.mark.parametrize("flags,message", [
    (["--longstraw-lora", "--longstraw-lora-rank", "0"],
     r"lora_rank must be an integer >= 1, got 0 \(--longstraw-lora-rank, YAML "
     r"longstraw.lora_rank\)"),
    (["--longstraw-qlora", "--longstraw-lora-alpha", "-1"], r"lora_alpha must be a number > 0, got -1.0 \(--longstraw-lora-alpha"),
    (["--longstraw-lora", "--longstraw-lora-dropout", "1"], r"lora_dropout must be a number in \[0, 1\), got 1.0 "
                                                            r"\(--longstraw-lora-dropout"),
    (["--longstraw-lora-rank", "8"], r"--longstraw-lora-rank given, but LoRA is off: add "
                                     r"--longstraw-lora"),
    (["--no-longstraw-lora", "--longstraw-qlora"], "LoRA is switched off"),
    (["--longstraw-kl-coef", "0.1"], "needs a reference policy"),
    (["--longstraw-lora", "--longstraw-kernels", "te"], r"add dense=ref"),
])
def test_bad_lora_values_are_reported(flags, message):
    with pytest.raises(ValueError, match=message):
        _resolve("--longstraw-config", TINY_QWEN, *flags)


def test_bad_lora_setups_are_reported_before_training(tmp_path):
    with pytest.raises(ValueError, match="--longstraw-save-merged writes base"):
        train.main(_flags(tmp_path, "--longstraw-save-merged", str(tmp_path / "m")))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    with pytest.raises(ValueError, match="exists and is not an empty directory"):
        train.main(_flags(tmp_path, "--longstraw-lora", "--longstraw-save-merged",
                          str(tmp_path / "full")))
    assert (tmp_path / "full" / "x").read_text() == "keep me"
    # A target that matches no linear layer is named, with the layers the model has.
    with pytest.raises(ValueError, match=r"LoRA targets \['linear_qvk'\] match no linear layer.*"
                                         r"'in_proj', 'linear_fc1'"):
        train.main(_flags(tmp_path, "--longstraw-lora", "--longstraw-lora-targets", "linear_qkv",
                          "linear_qvk"))
    with pytest.raises(ValueError, match="--pretrained-checkpoint .*nowhere: not a model-format"):
        train.main(_flags(tmp_path, "--longstraw-lora", "--pretrained-checkpoint",
                          str(tmp_path / "nowhere")))


def _qwen_linear_shapes():
    """(in, out) of every Qwen3.6 default target in a freshly built tiny model, and that model."""
    from megatron_longstraw.models.qwen36.config import Qwen36Config
    from megatron_longstraw.models.qwen36.model import build_qwen36_model

    model = build_qwen36_model(Qwen36Config.from_yaml(TINY_QWEN))
    shapes = [tuple(m.weight.shape[::-1]) for n, m in model.named_modules()
              if n.rsplit(".", 1)[-1] in QWEN36_TARGETS]
    return shapes, model


def test_qwen36_qlora_run_checkpoint_resume_and_export(tmp_path, runs, capsys):
    """Two steps of QLoRA with a KL penalty, a checkpoint per step, merged export; then a resume
    that continues from the adapters it saved; then resumes that must be refused."""
    from megatron_longstraw.checkpointing import model_format

    ckpt, merged = tmp_path / "ckpt", tmp_path / "merged"
    flags = ["--longstraw-qlora", "--longstraw-lora-rank", str(RANK), "--longstraw-kl-coef",
             "0.05", "--save", str(ckpt), "--save-interval", "1"]
    receipt = train.main(_flags(tmp_path, *flags, "--train-iters", "2",
                                "--longstraw-save-merged", str(merged)))
    (run, before), = runs
    model = run.model
    wrappers = dict(lora_modules(model))
    adapters = {f"{n}.{k}" for n in wrappers for k in ("lora_A", "lora_B")}
    after = _snapshot(model)

    # Only the adapters changed: every frozen parameter and every NF4 byte is as it was.
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and {n for n, p in model.named_parameters() if p.requires_grad} == adapters
    assert all(torch.equal(after[n], before[n]) for n in frozen)
    assert all(torch.equal(after[f"{n}.nf4_weight"], before[f"{n}.nf4_weight"]) for n in wrappers)
    assert all(model.get_parameter(n).grad is None for n in frozen)
    assert all(not torch.equal(after[f"{n}.lora_B"], before[f"{n}.lora_B"]) for n in wrappers)
    assert all(torch.isfinite(after[n]).all() for n in adapters)
    assert receipt["steps"] == 2 and torch.isfinite(torch.tensor(receipt["loss"]))
    assert 0 < receipt["stats"]["grad_norm"] < float("inf")
    # The reference is the base (adapters off): after one update the policy differs from it.
    assert receipt["stats"]["kl"] > 0

    # Receipt: counts from a model built without adapters.
    shapes, plain = _qwen_linear_shapes()
    assert receipt["trainable_params"] == lora_parameter_count(shapes, RANK)
    # Every parameter of the model (an NF4 weight counts its values) plus the adapters.
    assert receipt["total_params"] == sum(p.numel() for p in plain.parameters()) \
        + receipt["trainable_params"]
    assert receipt["nf4_base_bytes"] == receipt["nf4_base_bytes_per_rank"] \
        == sum(nf4_nbytes(i * o) for i, o in shapes)
    assert receipt["lora"] == {"rank": RANK, "alpha": 16.0, "dropout": 0.0,
                               "targets": list(QWEN36_TARGETS), "exclude": [],
                               "quantize_base": True}

    # The checkpoint holds the adapters only, and where the base came from.
    saved = ckpt / "step_00000002"
    meta = json.loads((saved / "meta.json").read_text())
    assert meta["lora"]["base"]["source"] is None and meta["lora"]["base"]["seed"] == 1234
    assert [len(f) for f in meta["lora"]["base"]["fingerprints"]] == [32]   # one rank
    tensors = model_format.SafetensorsReader([saved / "model.safetensors"])
    assert set(tensors) == adapters
    assert all(torch.equal(tensors[n], after[n]) for n in adapters)

    # Merged export = the adapted policy (dequantised NF4 base + scaling * B A), as a plain model.
    model_format.load_model(merged, plain, family="qwen36")
    ids = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(0))
    # fp32: the merged weight rounds W + s B A once; the wrapper adds x W^T and s (x A^T) B^T.
    assert torch.allclose(_logits(plain, ids), _logits(model, ids), atol=1e-4, rtol=0)
    assert json.loads((merged / "longstraw.json").read_text())["family"] == "qwen36"

    # Resume: the same adapters, optimizer state and base, then one more step.
    capsys.readouterr()
    # (another --train-iters changes the saved LR schedule: as in Megatron, a flag says who wins)
    receipt = train.main(_flags(tmp_path, *flags, "--load", str(ckpt), "--train-iters", "3",
                                "--override-opt_param-scheduler"))
    resumed, at_start = runs[1]
    out = capsys.readouterr().out
    assert f"resumed from {saved} at step 2" in out
    assert re.search(r"step\s+2 \| loss", out) and not re.search(r"step\s+1 \| loss", out)
    assert at_start.keys() == after.keys()
    assert all(torch.equal(at_start[n], after[n]) for n in after)   # adapters, base and NF4 bytes
    assert resumed.optimizer.state_dict()["state"][0]["step"] == 3      # 2 saved + 1 more
    final = _snapshot(resumed.model)
    assert all(not torch.equal(final[f"{n}.lora_B"], after[f"{n}.lora_B"]) for n in wrappers)

    # Refused resumes, each before any step: another base, other adapters, no adapters at all.
    with pytest.raises(ValueError, match=r"frozen base model differs .* random initialisation of "
                                         r"seed 1234, this run's base is the random "
                                         r"initialisation of seed 7.*--pretrained-checkpoint"):
        train.main(_flags(tmp_path, *flags, "--load", str(ckpt), "--train-iters", "4",
                          "--seed", "7"))
    with pytest.raises(ValueError, match=r"other LoRA settings: rank 4 \(this run: 8\)"):
        train.main(_flags(tmp_path, *flags, "--load", str(ckpt), "--train-iters", "4",
                          "--longstraw-lora-rank", "8"))
    with pytest.raises(ValueError, match="holds LoRA adapters.*--longstraw-qlora "
                                         "--longstraw-lora-rank 4"):
        train.main(_flags(tmp_path, "--load", str(ckpt), "--train-iters", "4"))
    assert len(runs) == 2


def test_glm52_lora_step_without_expert_adapters(tmp_path, runs):
    """GLM-5.2 (MLA + DSA + MoE), plain LoRA from a model-format directory, experts excluded:
    one step changes the adapters only, and the checkpoint records the base's directory."""
    from megatron_longstraw.checkpointing import model_format
    from megatron_longstraw.models.glm52.config import GLM52Config
    from megatron_longstraw.models.glm52.model import build_glm52_model

    init = tmp_path / "glm-init"
    source = build_glm52_model(GLM52Config.from_yaml(TINY))
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.01 * torch.randn_like(p))
    model_format.save_model(init, source, family="glm52")
    receipt = train.main(_flags(tmp_path, "--longstraw-lora", "--longstraw-lora-rank", str(RANK),
                                "--longstraw-lora-exclude", "*.experts.*", "--load", str(init),
                                "--save", str(tmp_path / "ckpt"), "--save-interval", "1",
                                family="glm52"))
    (run, before), = runs
    model = run.model
    wrappers = dict(lora_modules(model))
    assert wrappers and not any(".experts." in n for n in wrappers)
    after = _snapshot(model)
    adapters = {f"{n}.{k}" for n in wrappers for k in ("lora_A", "lora_B")}
    loaded = dict(source.named_parameters())
    for name, tensor in after.items():
        if name in adapters or name.endswith("local_tokens_per_expert"):   # routing statistics
            continue
        assert torch.equal(tensor, before[name]), name
        plain = name.replace(".base.", ".")
        if plain in loaded:                       # the base is the model-format directory's
            assert torch.equal(tensor, loaded[plain]), name
    # Every adapter is on the response path: its B moved off zero.
    assert all(not torch.equal(after[f"{n}.lora_B"], before[f"{n}.lora_B"]) for n in wrappers)
    assert receipt["trainable_params"] == sum(after[n].numel() for n in adapters)
    assert receipt["nf4_base_bytes"] == 0 and receipt["lora"]["quantize_base"] is False
    assert receipt["initial_weights"] == str(init.resolve())
    meta = json.loads((tmp_path / "ckpt" / "step_00000001" / "meta.json").read_text())
    assert meta["lora"]["base"]["source"] == str(init.resolve())
    assert meta["lora"]["exclude"] == ["*.experts.*"]


def test_step_config_from_a_yaml_with_adapter_keys(tmp_path):
    """Tools that read only the step settings (bench, plan_memory, the Python API) accept a
    training YAML that also carries the launcher's LoRA keys; a misspelt key still fails."""
    from megatron_longstraw.config.settings import LongStrawConfig

    path = tmp_path / "run.yaml"
    path.write_text("longstraw:\n  group_size: 3\n  qlora: true\n  lora_rank: 19\n")
    assert LongStrawConfig.from_yaml(path).group.group_size == 3
    path.write_text("longstraw:\n  group_size: 3\n  lora_rnak: 19\n")
    with pytest.raises(ValueError, match="lora_rnak"):
        LongStrawConfig.from_yaml(path)
