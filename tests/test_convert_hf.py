"""tools/convert_hf.py on a transformers `GlmMoeDsaForCausalLM` checkpoint (save_pretrained,
sharded): converted to the model format and loaded into our Megatron model, its log-probs equal
transformers' own forward, both for a full-sequence forward and for LongStraw capture + replay; the
way back reproduces the HF files bit for bit; unsupported input fails with a clear message.

Tolerance 1e-9 on fp64 log-probs, as in test_glm52_hf.py (its module docstring gives the budget):
the reference runs in float64 with transformers' float32 islands (RMSNorm, RoPE angles, eager
softmax, router) upcast by that file's `_upcast_reference`; what remains is float64 rounding
(~1e-15). A wrong mapping (swapped gate/up, a transposed or dropped tensor, a misplaced expert) is
~1e-2 or more. The weights come from float32 files, so fp32 -> fp64 -> fp32 is exact.
"""

import importlib.util
import json

import pytest
import torch

from helpers import ROOT
from megatron_longstraw import checkpoint
from megatron_longstraw.models.glm52.config import GLM52Config
from megatron_longstraw.models.glm52.hf import hf_config
from test_glm52_hf import TINY, TOL, _upcast_reference

pytestmark = pytest.mark.usefixtures("single_process")

F64 = torch.float64
PROMPT_LEN, RESPONSE_LEN = 80, 16   # 96 tokens: DSA (top-16) is sparse over the prompt


def _tool():
    spec = importlib.util.spec_from_file_location("convert_hf", ROOT / "tools" / "convert_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


convert_hf = _tool()


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A random float32 GlmMoeDsaForCausalLM saved in shards, with norms, the indexer's k_norm
    bias and the routing correction bias away from their trivial initial values."""
    from transformers import GlmMoeDsaForCausalLM

    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(hf_config(GLM52Config(**TINY))).float().eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if "norm" in name:
                base = 1.0 if name.endswith("weight") else 0.0
                tensor.copy_(base + 0.1 * torch.randn_like(tensor))
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(0.05 * torch.randn_like(tensor))
    path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(path, max_shard_size="300KB")
    assert (path / "model.safetensors.index.json").exists()  # sharded input
    return path, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def converted(hf_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("converted") / "glm52"
    assert convert_hf.main(["--family", "glm52", "--hf-dir", str(hf_checkpoint[0]),
                            "--out", str(out), "--dtype", "fp64"]) == 0
    return out


def _our_model(model_dir):
    from megatron_longstraw.models.glm52.model import build_glm52_model

    meta, _ = checkpoint.read_model(model_dir)
    model = build_glm52_model(GLM52Config.from_dict(meta["model"]), params_dtype=F64)
    before = {n: t.clone() for n, t in model.state_dict().items() if torch.is_tensor(t)}
    checkpoint.load_model(model_dir, model)
    unchanged = [n for n, t in model.state_dict().items()
                 if torch.is_tensor(t) and torch.equal(t, before[n])]
    assert not unchanged, unchanged[:5]  # every weight came from the file
    return model.eval()


def test_format_is_the_single_process_state_dict(converted):
    from megatron_longstraw.models.glm52.model import build_glm52_model

    meta, tensors = checkpoint.read_model(converted)
    assert (meta["format"], meta["family"], meta["dtype"]) == ("longstraw-model", "glm52", "float64")
    assert meta["parallel"]["expert_parallel_size"] == 1
    model = build_glm52_model(GLM52Config.from_dict(meta["model"]), params_dtype=F64)
    expected = {n for n, t in model.state_dict().items() if torch.is_tensor(t)}
    assert set(tensors) == expected
    assert tensors["decoder.layers.7.mlp.router.expert_bias"].dtype == torch.float32
    assert tensors["decoder.layers.7.mlp.experts.local_experts.7.linear_fc1.weight"].dtype == F64


def test_converted_model_matches_transformers(hf_checkpoint, converted, monkeypatch):
    from transformers import GlmMoeDsaForCausalLM

    from megatron_longstraw.capture import capture_prompt
    from megatron_longstraw.config import LongStrawConfig
    from megatron_longstraw.replay import score_member

    model = _our_model(converted)
    reference = GlmMoeDsaForCausalLM.from_pretrained(
        hf_checkpoint[0], attn_implementation="eager", experts_implementation="eager").to(F64).eval()
    _upcast_reference(reference, monkeypatch, router_fp64=model.config.moe_router_dtype == "fp64")

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, TINY["vocab_size"], (PROMPT_LEN + RESPONSE_LEN,), generator=gen)
    prompt, response = ids[:PROMPT_LEN], ids[PROMPT_LEN:]
    rows = slice(PROMPT_LEN - 1, PROMPT_LEN + RESPONSE_LEN - 1)   # outputs scoring the response
    with torch.no_grad():
        ref_all = torch.log_softmax(reference(ids[None]).logits[0], -1)          # [S, V]
        ours_all = torch.log_softmax(model(ids[None], None, None)[0], -1)        # [S, V]
        ls = LongStrawConfig(group_size=2, query_block=29, key_block=37, token_block=50)
        captured = capture_prompt(model, prompt, ls)
        replayed, _ = score_member(model, captured, response, ls)                # [R]
    ref = ref_all[rows].gather(-1, response[:, None]).squeeze(-1)
    full_error = (ours_all - ref_all).abs().max().item()
    replay_error = (replayed - ref).abs().max().item()
    print(f"HF fidelity (fp64): full-sequence max |d log_softmax| {full_error:.2e}, "
          f"capture+replay max |d logp| {replay_error:.2e}")
    assert full_error <= TOL and replay_error <= TOL


def test_back_to_hf_is_exact(hf_checkpoint, converted, tmp_path):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    hf_dir, original = hf_checkpoint
    back = tmp_path / "hf"
    assert convert_hf.main(["--family", "glm52", "--hf-dir", str(back), "--out", str(converted),
                            "--to-hf", "--dtype", "fp32", "--max-shard-size", "200KB"]) == 0
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    # The files: same names, dtypes and values as save_pretrained's.
    ours = checkpoint.SafetensorsReader(convert_hf.hf_weight_files(back))
    theirs = checkpoint.SafetensorsReader(convert_hf.hf_weight_files(hf_dir))
    assert set(ours) == set(theirs)
    assert all(ours[n].dtype == theirs[n].dtype and torch.equal(ours[n], theirs[n]) for n in theirs)
    # transformers loads them into the same state dict, with the same config.
    loaded = GlmMoeDsaForCausalLM.from_pretrained(back).state_dict()
    assert loaded.keys() == original.keys()
    assert all(torch.equal(loaded[n], original[n]) for n in original)
    assert (GlmMoeDsaConfig.from_pretrained(back).to_dict()
            == GlmMoeDsaConfig.from_pretrained(hf_dir).to_dict())
    with pytest.raises(SystemExit, match="not empty"):  # never overwrites a checkpoint
        convert_hf.main(["--family", "glm52", "--hf-dir", str(back), "--out", str(converted),
                         "--to-hf"])


def test_unsupported_input_fails_clearly(hf_checkpoint, tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(SystemExit, match=r"--family qwen36 is not implemented yet.*only GLM-5\.2"):
        convert_hf.main(["--family", "qwen36", "--hf-dir", str(hf_checkpoint[0]),
                         "--out", str(tmp_path / "qwen")])
    assert not (tmp_path / "qwen").exists()

    # One file with a tensor removed and an MTP layer added: MTP is skipped, the gap is reported.
    hf_dir, original = hf_checkpoint
    files = checkpoint.SafetensorsReader(convert_hf.hf_weight_files(hf_dir))
    tensors = {n: files[n] for n in files}
    tensors["model.layers.8.eh_proj.weight"] = torch.zeros(4, 4)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((hf_dir / "config.json").read_text())
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    assert convert_hf.main(["--family", "glm52", "--hf-dir", str(broken),
                            "--out", str(tmp_path / "mtp_skipped"), "--dtype", "fp32"]) == 0
    del tensors["model.layers.5.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SystemExit, match=r"lacks tensor model\.layers\.5\.mlp\.experts\.3\.up_proj"):
        convert_hf.main(["--family", "glm52", "--hf-dir", str(broken),
                         "--out", str(tmp_path / "gap"), "--dtype", "fp32"])
