"""tools/convert_hf.py --to-hf from training checkpoints (checkpointing/export.py).

The full-parameter case end to end: a GLM-5.2 HF checkpoint converted, trained one step by the
launcher on two gloo processes at CP2/EP2 (the routed experts saved in two per-rank shards),
exported to HF from the --save folder, loaded by transformers (GlmMoeDsaForCausalLM), whose
log-probs equal tools/score.py's capture + replay scoring of the training checkpoint itself.

Tolerance 1e-9 on fp64 log-probs, test_glm52_hf.py's (its module docstring gives the budget):
transformers' float32 islands are upcast by `_upcast_reference`; what remains is float64 rounding
(observed 7e-11 after the fp64 training step). A misplaced expert shard (EP rank 1's experts under rank 0's indices), a stale
(pre-training) tensor or a dropped one is ~1e-2 or more.
"""

import json

import pytest
import torch
import yaml

from helpers import ROOT, TINY_GLM
from megatron_longstraw.checkpointing import model_format
from test_convert_hf import _convert, convert_hf, hf_checkpoint  # noqa: F401 (fixture)
from test_glm52_hf import TOL, _upcast_reference
from test_score import load_score_tool
import processes

pytestmark = pytest.mark.usefixtures("single_process")

F64 = torch.float64
PROMPT_LEN, RESPONSE_LEN = 80, 16


def _torchrun(nproc: int, flags: list[str]) -> str:
    out = processes.run(
        [str(ROOT / ".venv" / "bin" / "torchrun"), "--standalone", "--nproc-per-node", str(nproc),
         str(ROOT / "examples" / "pretrain_gpt.py"), "--longstraw", *flags],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "TORCHDYNAMO_DISABLE": "1", "PYTHONWARNINGS": "ignore",
             "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return out.stdout


@pytest.fixture(scope="module")
def trained(hf_checkpoint, tmp_path_factory):  # noqa: F811
    """(converted model-format dir, the run's --save folder, its YAML): one full-parameter fp64
    step at CP2/EP2 from the converted weights."""
    tmp = tmp_path_factory.mktemp("trained")
    converted = _convert(hf_checkpoint[0], tmp / "converted", "glm52")
    meta, _ = model_format.read_model(converted)
    config = yaml.safe_load(TINY_GLM.read_text())
    config["model"] = meta["model"]
    (tmp / "tiny.yaml").write_text(yaml.safe_dump(config))
    _torchrun(2, ["--context-parallel-size", "2", "--expert-model-parallel-size", "2",
                  "--longstraw-config", str(tmp / "tiny.yaml"), "--longstraw-dtype", "fp64",
                  "--pretrained-checkpoint", str(converted), "--train-iters", "1",
                  "--lr", "1e-3", "--clip-grad", "1.0", "--seed", "3",
                  "--longstraw-group-size", "2", "--longstraw-synthetic-prompt-len", "128",
                  "--longstraw-synthetic-response-len", "8", "--save", str(tmp / "ckpt"),
                  "--save-interval", "1", "--longstraw-out-dir", str(tmp),
                  "--longstraw-run-name", "t", "--tensorboard-dir", str(tmp / "tb")])
    return converted, tmp / "ckpt", tmp / "tiny.yaml"


def test_cp2_ep2_full_parameter_export_scores_like_our_scoring(trained, hf_checkpoint,  # noqa: F811
                                                                tmp_path, monkeypatch):
    from transformers import GlmMoeDsaForCausalLM

    converted, save, config = trained
    step = save / "step_00000001"
    assert sorted(p.name for p in step.glob("experts_ep*")) == ["experts_ep000.safetensors",
                                                                "experts_ep001.safetensors"]
    hf_dir = tmp_path / "hf"
    assert convert_hf.main(["--family", "glm52", "--hf-dir", str(hf_dir), "--out", str(save),
                            "--to-hf", "--dtype", "fp64"]) == 0
    written = json.loads((hf_dir / "config.json").read_text())
    assert written["architectures"] == ["GlmMoeDsaForCausalLM"]
    # The HF config.json of the initial weights is kept (token ids and the like).
    original = json.loads((hf_checkpoint[0] / "config.json").read_text())
    assert written["eos_token_id"] == original["eos_token_id"]

    reference = GlmMoeDsaForCausalLM.from_pretrained(
        hf_dir, attn_implementation="eager", experts_implementation="eager").to(F64).eval()
    # Trained: every expert of both EP ranks moved away from the initial weights.
    before = hf_checkpoint[1]
    state = reference.state_dict()
    moved = [n for n in before if n.endswith("experts.gate_up_proj")
             and all(not torch.allclose(state[n][e].float(), before[n][e].float(), atol=0)
                     for e in range(before[n].shape[0]))]
    assert moved, "no routed expert changed in training"
    _upcast_reference(reference, monkeypatch, router_fp64=True)

    gen = torch.Generator().manual_seed(11)
    vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (PROMPT_LEN + RESPONSE_LEN,), generator=gen)
    prompt, response = ids[:PROMPT_LEN], ids[PROMPT_LEN:]
    with torch.no_grad():
        logits = reference(ids[None]).logits[0]
    rows = slice(PROMPT_LEN - 1, PROMPT_LEN + RESPONSE_LEN - 1)
    ref = torch.log_softmax(logits, -1)[rows].gather(-1, response[:, None]).squeeze(-1)

    (tmp_path / "g.jsonl").write_text(json.dumps({"prompt_ids": prompt.tolist(),
                                                  "response_ids": [response.tolist()]}) + "\n")
    out = load_score_tool().main([
        "--family", "glm52", "--config", str(config), "--checkpoint", str(save),
        "--input", str(tmp_path / "g.jsonl"), "--out", str(tmp_path / "s.jsonl"),
        "--dtype", "fp64"])
    ours = torch.tensor(out["results"][0]["logprobs"][0], dtype=F64)
    error = (ours - ref).abs().max().item()
    print(f"CP2/EP2 training checkpoint -> HF: max |our scoring - transformers| {error:.2e}")
    assert error <= TOL


def _hf_tensors(folder) -> dict:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def test_lora_checkpoint_exports_merged(tmp_path):
    """A Qwen3.6 QLoRA step on the seeded base (NF4, the base rebuilt from the seed and checked
    against the run's fingerprints): --to-hf from the adapter-only checkpoint writes exactly what
    --to-hf writes from the run's own merged export (--longstraw-save-merged), bitwise."""
    from megatron_longstraw.training import train

    ckpt, merged = tmp_path / "ckpt", tmp_path / "merged"
    train.main(["--longstraw", "--longstraw-family", "qwen36", "--longstraw-config",
                str(ROOT / "examples" / "qwen36" / "tiny.yaml"),
                "--longstraw-synthetic-prompt-len", "48", "--longstraw-synthetic-response-len",
                "4", "--longstraw-group-size", "2", "--longstraw-dtype", "fp32", "--lr", "1e-2",
                "--longstraw-out-dir", str(tmp_path), "--longstraw-run-name", "t",
                "--longstraw-qlora", "--longstraw-lora-rank", "4", "--train-iters", "1",
                "--save", str(ckpt), "--save-interval", "1",
                "--longstraw-save-merged", str(merged)])
    assert json.loads((ckpt / "step_00000001" / "meta.json").read_text())["lora"]
    for source, out in ((ckpt, tmp_path / "hf-ckpt"), (merged, tmp_path / "hf-merged")):
        assert convert_hf.main(["--family", "qwen36", "--hf-dir", str(out), "--out",
                                str(source), "--to-hf"]) == 0
    from_ckpt, from_merged = _hf_tensors(tmp_path / "hf-ckpt"), _hf_tensors(tmp_path / "hf-merged")
    assert from_ckpt.keys() == from_merged.keys()
    assert all(torch.equal(from_ckpt[n], from_merged[n]) for n in from_ckpt)


def test_training_checkpoint_errors_are_clear(trained, tmp_path):
    import shutil

    _, save, _ = trained
    broken = tmp_path / "broken"
    shutil.copytree(save / "step_00000001", broken)
    (broken / "experts_ep001.safetensors").unlink()
    with pytest.raises(SystemExit, match=r"saved with EP=2.*missing \['experts_ep001"):
        convert_hf.main(["--family", "glm52", "--hf-dir", str(tmp_path / "hf"), "--out",
                         str(broken), "--to-hf"])
    with pytest.raises(SystemExit, match=r"neither a model-format directory.*nor a training "
                                         r"checkpoint"):
        convert_hf.main(["--family", "glm52", "--hf-dir", str(tmp_path / "hf"), "--out",
                         str(tmp_path), "--to-hf"])
    with pytest.raises(SystemExit, match=r"holds a 'glm52' model, not qwen36"):
        convert_hf.main(["--family", "qwen36", "--hf-dir", str(tmp_path / "hf"), "--out",
                         str(save), "--to-hf"])


def test_fp8_kept_or_dequantised(tmp_path):
    """--fp8: a full-parameter run from a block-FP8 conversion exports its FP8 linears in FP8
    (trained ones quantised anew: within e4m3 rounding of the trained weight) by default, or
    with --fp8 dequantize as the trained weights themselves in --dtype (no quantization_config,
    loads into transformers)."""
    from test_convert_fp8 import fp8_checkpoint as make_fp8   # the fixture's function
    from megatron_longstraw.kernels import fp8
    from transformers import GlmMoeDsaForCausalLM

    hf_dir, original = make_fp8.__wrapped__(_Factory(tmp_path))
    converted = tmp_path / "converted"
    assert convert_hf.main(["--family", "glm52", "--hf-dir", str(hf_dir), "--out",
                            str(converted)]) == 0
    meta, _ = model_format.read_model(converted)
    config = yaml.safe_load(TINY_GLM.read_text())
    config["model"] = meta["model"]
    (tmp_path / "fp8.yaml").write_text(yaml.safe_dump(config))
    _torchrun(1, ["--longstraw-config", str(tmp_path / "fp8.yaml"), "--longstraw-dtype", "fp32",
                  "--pretrained-checkpoint", str(converted), "--train-iters", "1",
                  "--lr", "1e-2", "--longstraw-group-size", "2",
                  "--longstraw-synthetic-prompt-len", "48",
                  "--longstraw-synthetic-response-len", "4", "--save", str(tmp_path / "ckpt"),
                  "--save-interval", "1", "--longstraw-out-dir", str(tmp_path),
                  "--longstraw-run-name", "t", "--tensorboard-dir", str(tmp_path / "tb")])
    trained = model_format.SafetensorsReader([tmp_path / "ckpt" / "step_00000001" /
                                              "model.safetensors"])
    kept, plain = tmp_path / "hf-kept", tmp_path / "hf-plain"
    assert convert_hf.main(["--family", "glm52", "--hf-dir", str(kept), "--out",
                            str(tmp_path / "ckpt"), "--to-hf", "--dtype", "bf16"]) == 0
    assert convert_hf.main(["--family", "glm52", "--hf-dir", str(plain), "--out",
                            str(tmp_path / "ckpt"), "--to-hf", "--dtype", "bf16",
                            "--fp8", "dequantize"]) == 0
    kept_t, plain_t = _hf_tensors(kept), _hf_tensors(plain)
    fp8_names = [n for n, t in original.items() if t.dtype == fp8.FP8_DTYPE]
    assert fp8_names and all(kept_t[n].dtype == fp8.FP8_DTYPE for n in fp8_names)
    assert set(kept_t) == set(original)
    assert not any(n.endswith(fp8.SCALE_SUFFIX) for n in plain_t)
    assert "quantization_config" not in json.loads((plain / "config.json").read_text())
    assert json.loads((kept / "config.json").read_text())["quantization_config"]
    assert all(plain_t[n].dtype == torch.bfloat16 for n in fp8_names)
    changed = sum(not torch.equal(kept_t[n].view(torch.uint8), original[n].view(torch.uint8))
                  for n in fp8_names)
    assert changed > 0                          # trained weights were quantised anew
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    ours = trained["decoder.layers.0.self_attention.linear_proj.weight"]
    assert not torch.equal(ours, fp8.dequantize(original[o_proj],
                                                original[fp8.scale_name(o_proj)]))
    # dequantize: the trained weight itself (the run trained dequantised weights), in --dtype
    assert torch.equal(plain_t[o_proj], ours.bfloat16())
    # e4m3 keeps 3 mantissa bits: within 2^-4 relative (plus the block scale's floor)
    error = (fp8.dequantize(kept_t[o_proj], kept_t[fp8.scale_name(o_proj)]) - ours).abs()
    assert bool((error <= ours.abs() / 16 + 1e-6).all())
    # transformers loads FP8 checkpoints through accelerate's quantizer (not installed here): the
    # kept export is checked by its names, dtypes and config against the FP8 files it came from.
    GlmMoeDsaForCausalLM.from_pretrained(plain)


class _Factory:
    """tmp_path_factory for calling a module-scoped fixture's function directly."""

    def __init__(self, root):
        self.root = root

    def mktemp(self, name):
        path = self.root / name
        path.mkdir()
        return path
