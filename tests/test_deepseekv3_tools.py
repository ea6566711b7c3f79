"""The entry points with --family deepseekv3: tools/convert_hf.py on a transformers
`DeepseekV3ForCausalLM` checkpoint (save_pretrained, sharded; MTP layers skipped) and back, bit for
bit; tools/score.py on the converted model equal to transformers' own log-probs; one launcher step
(examples/pretrain_gpt.py --longstraw --longstraw-family deepseekv3) on the tiny example.

Tolerance 1e-9 on fp64 log-probs, as in test_deepseekv3.py (its module docstring gives the budget):
the reference runs in float64 with transformers' float32 islands upcast
(`test_deepseekv3.upcast_reference`); the weights come from float32 files, so fp32 -> fp64 -> fp32
is exact and the way back is bitwise."""

import importlib.util
import json
import re
import subprocess
import sys

import pytest
import torch

from helpers import ROOT
from megatron_longstraw.checkpointing import model_format
from megatron_longstraw.checkpointing.hf import hf_weight_files
from megatron_longstraw.models.deepseekv3.hf import hf_config
from test_deepseekv3 import TOL, tiny_config, upcast_reference
import processes

pytestmark = pytest.mark.usefixtures("single_process")

F64 = torch.float64
PROMPT_LEN, RESPONSE_LEN = 80, 16
TINY = ROOT / "examples" / "deepseekv3" / "tiny.yaml"


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


convert_hf = _tool("convert_hf")


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A random float32 DeepseekV3ForCausalLM of the tiny example's shape (YaRN, group-limited
    routing; weights std 0.08 as test_deepseekv3.py builds them) saved in shards, with norms and
    the routing correction bias away from their trivial initial values."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(hf_config(tiny_config(init_std=0.08))).float().eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if "norm" in name:
                tensor.copy_(1.0 + 0.1 * torch.randn_like(tensor))
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(0.05 * torch.randn_like(tensor))
    path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(path, max_shard_size="300KB")
    assert (path / "model.safetensors.index.json").exists()  # sharded input
    return path, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def converted(hf_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("converted") / "deepseekv3"
    assert convert_hf.main(["--family", "deepseekv3", "--hf-dir", str(hf_checkpoint[0]),
                            "--out", str(out), "--dtype", "fp64"]) == 0
    return out


def _reference(hf_dir, monkeypatch):
    from transformers import DeepseekV3ForCausalLM

    reference = DeepseekV3ForCausalLM.from_pretrained(
        hf_dir, attn_implementation="eager", experts_implementation="eager").to(F64).eval()
    upcast_reference(reference, monkeypatch)
    return reference


def _ids():
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, tiny_config().vocab_size, (PROMPT_LEN + RESPONSE_LEN,), generator=gen)


def test_converted_model_matches_transformers(hf_checkpoint, converted, monkeypatch):
    """The model format holds the single-process state dict; loaded into our model, capture +
    replay and a full forward equal transformers' log-probs (fp64)."""
    from megatron_longstraw.runtime import precision
    from megatron_longstraw.context.capture import capture_prompt
    from megatron_longstraw.config.settings import LongStrawConfig
    from megatron_longstraw.models.registry import get_family
    from megatron_longstraw.step.replay import score_member

    meta, tensors = model_format.read_model(converted)
    assert (meta["family"], meta["dtype"]) == ("deepseekv3", "float64")
    assert tensors["decoder.layers.3.mlp.router.expert_bias"].dtype == torch.float32
    family = get_family("deepseekv3")
    cfg = family.config_class.from_dict(meta["model"])
    assert cfg == tiny_config(init_std=0.08)
    precision.use_dtype(F64)
    model = family.build(cfg, F64, 1)
    model_format.load_model(converted, model, family="deepseekv3")
    model.eval()
    ids = _ids()
    prompt, response = ids[:PROMPT_LEN], ids[PROMPT_LEN:]
    rows = slice(PROMPT_LEN - 1, PROMPT_LEN + RESPONSE_LEN - 1)
    with torch.no_grad():
        ref_all = torch.log_softmax(_reference(hf_checkpoint[0], monkeypatch)(ids[None]).logits[0], -1)
        ours_all = torch.log_softmax(model(ids[None], None, None)[0], -1)
        ls = LongStrawConfig.of(group_size=2, query_block=29, key_block=37, token_block=50)
        replayed, _ = score_member(model, capture_prompt(model, prompt, ls), response, ls)
    ref = ref_all[rows].gather(-1, response[:, None]).squeeze(-1)
    full_error = (ours_all - ref_all).abs().max().item()
    replay_error = (replayed - ref).abs().max().item()
    print(f"DeepSeek-V3 converted vs transformers (fp64): full {full_error:.2e}, capture+replay "
          f"{replay_error:.2e}")
    assert full_error <= TOL and replay_error <= TOL


def test_back_to_hf_is_exact(hf_checkpoint, converted, tmp_path):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    hf_dir, original = hf_checkpoint
    back = tmp_path / "hf"
    assert convert_hf.main(["--family", "deepseekv3", "--hf-dir", str(back), "--out",
                            str(converted), "--to-hf", "--dtype", "fp32",
                            "--max-shard-size", "200KB"]) == 0
    ours = model_format.SafetensorsReader(hf_weight_files(back))
    theirs = model_format.SafetensorsReader(hf_weight_files(hf_dir))
    assert set(ours) == set(theirs)
    assert all(ours[n].dtype == theirs[n].dtype and torch.equal(ours[n], theirs[n]) for n in theirs)
    loaded = DeepseekV3ForCausalLM.from_pretrained(back).state_dict()
    assert loaded.keys() == original.keys()
    assert all(torch.equal(loaded[n], original[n]) for n in original)
    assert (DeepseekV3Config.from_pretrained(back).to_dict()
            == DeepseekV3Config.from_pretrained(hf_dir).to_dict())


def test_mtp_layers_are_skipped_and_gaps_reported(hf_checkpoint, tmp_path):
    from safetensors.torch import save_file

    hf_dir, _ = hf_checkpoint
    files = model_format.SafetensorsReader(hf_weight_files(hf_dir))
    tensors = {n: files[n] for n in files}
    tensors["model.layers.4.eh_proj.weight"] = torch.zeros(4, 4)   # DeepSeek-V3's MTP layer 61
    broken = tmp_path / "mtp"
    broken.mkdir()
    (broken / "config.json").write_text((hf_dir / "config.json").read_text())
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    assert convert_hf.main(["--family", "deepseekv3", "--hf-dir", str(broken),
                            "--out", str(tmp_path / "skipped"), "--dtype", "fp32"]) == 0
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SystemExit, match=r"lacks tensor model\.layers\.2\.mlp\.experts\.5\.up_proj"):
        convert_hf.main(["--family", "deepseekv3", "--hf-dir", str(broken),
                         "--out", str(tmp_path / "gap"), "--dtype", "fp32"])
    with pytest.raises(SystemExit, match=r"model_type 'deepseek_v3' \(that is --family deepseekv3\)"):
        convert_hf.main(["--family", "glm52", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "g")])


def test_score_tool_equals_transformers(hf_checkpoint, converted, tmp_path, monkeypatch):
    """tools/score.py --family deepseekv3 on the converted checkpoint: the scored log-probs of two
    responses after one prompt equal transformers' (fp64)."""
    ids = _ids()
    prompt = ids[:PROMPT_LEN]
    responses = [ids[PROMPT_LEN:], ids[PROMPT_LEN:PROMPT_LEN + 5]]
    (tmp_path / "groups.jsonl").write_text(json.dumps(
        {"id": "a", "prompt_ids": prompt.tolist(), "response_ids": [r.tolist() for r in responses],
         "rewards": [1.0, 0.0]}) + "\n")
    out = _tool("score").main(["--family", "deepseekv3", "--config", str(TINY), "--checkpoint",
                               str(converted), "--input", str(tmp_path / "groups.jsonl"),
                               "--out", str(tmp_path / "scores.jsonl"), "--dtype", "fp64"])
    line = json.loads((tmp_path / "scores.jsonl").read_text().splitlines()[0])
    assert line == json.loads(json.dumps(out["results"][0]))
    reference = _reference(hf_checkpoint[0], monkeypatch)
    worst = 0.0
    with torch.no_grad():
        for got, response in zip(line["logprobs"], responses):
            seq = torch.cat([prompt, response])
            logp = torch.log_softmax(reference(seq[None]).logits[0], -1)
            ref = logp[PROMPT_LEN - 1:-1].gather(-1, response[:, None]).squeeze(-1)
            worst = max(worst, (torch.tensor(got, dtype=F64) - ref).abs().max().item())
    print(f"DeepSeek-V3 tools/score.py vs transformers (fp64): max |d logp| {worst:.2e}")
    assert worst <= TOL


def test_launcher_runs_one_step(tmp_path):
    """examples/pretrain_gpt.py on one process with the tiny DeepSeek-V3: the step runs and the
    receipt's pages are latent rows only."""
    out = processes.run(
        [str(ROOT / ".venv" / "bin" / "python"), str(ROOT / "examples" / "pretrain_gpt.py"),
         "--longstraw", "--longstraw-family", "deepseekv3", "--longstraw-config", str(TINY),
         "--train-iters", "1", "--longstraw-synthetic-prompt-len", "256",
         "--longstraw-synthetic-response-len", "8", "--longstraw-group-size", "2",
         "--tensorboard-dir", str(tmp_path / "tb"), "--longstraw-out-dir", str(tmp_path),
         "--longstraw-run-name", "t"], cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "TORCHDYNAMO_DISABLE": "1", "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"step\s+0 \| loss", out.stdout)
    assert "deepseekv3 (4 layers: dense MLA, 1 dense FFN + 3 MoE" in out.stdout, out.stdout[-2000:]
    receipt = json.loads((tmp_path / "t" / "receipt.json").read_text())
    assert receipt["family"] == "deepseekv3" and receipt["prompt_len"] == 256
    # fp32 latents [32 + 8] on 4 layers for the 255 captured tokens; nothing else.
    assert receipt["page_bytes_by_kind"] == {"latent": 255 * 4 * 40 * 4}
    assert receipt["page_bytes_per_token"] == 4 * 40 * 4
    assert receipt["fixed_page_kinds"] == [] and receipt["fixed_page_bytes"] == 0


def test_slurm_script_parses_and_resolves():
    """examples/deepseekv3/deepseekv3_32xH20.slurm: valid bash, CP32/EP32, LoRA over the full-size
    config (the planner's layout)."""
    from megatron_longstraw.training import train
    from test_launch import _slurm_command

    path = ROOT / "examples" / "deepseekv3" / "deepseekv3_32xH20.slurm"
    subprocess.run(["bash", "-n", str(path)], check=True)
    args, given = train.parse(_slurm_command(path))
    assert args.longstraw_family == "deepseekv3"
    assert (args.context_parallel_size, args.expert_model_parallel_size) == (32, 32)
    args.longstraw_config = str(ROOT / "examples" / "deepseekv3" / "full.yaml")
    family, cfg, ls, dtype = train.resolve(args, given)
    assert cfg.num_hidden_layers == 61 and cfg.rope_type == "yarn" and dtype == torch.bfloat16
    lora, ls = train.resolve_lora(args, family, ls)
    assert lora.config.rank == 16 and not lora.quantize_base and ls.run.kernels == "auto,dense=ref"
