"""tools/convert_hf.py on a transformers `GlmMoeDsaForCausalLM` and a `Qwen3_5ForCausalLM` checkpoint
(save_pretrained, sharded): converted to the model format and loaded into our Megatron model, its
log-probs equal transformers' own forward, both for a full-sequence forward and for LongStraw
capture + replay; the way back reproduces the HF files bit for bit; unsupported input fails with a
clear message.

Tolerance 1e-9 on fp64 log-probs, as in test_glm52_hf.py (its module docstring gives the budget):
the reference runs in float64 with transformers' float32 islands (RMSNorm, RoPE angles, eager
softmax, router) upcast by that file's `_upcast_reference`; what remains is float64 rounding
(~1e-15). A wrong mapping (swapped gate/up, a transposed or dropped tensor, a misplaced expert) is
~1e-2 or more. The weights come from float32 files, so fp32 -> fp64 -> fp32 is exact. The Qwen3.6
tests use test_qwen36_hf.py's reference upcasting and its tolerance (same budget: float64 rounding
~1e-15 against ~1e-1 for a wrong gate layout or norm offset); the GDN output norm's w - 1 and + 1 are
exact in float64 for float32 w, so its way back is bitwise too.
"""

import importlib.util
import json
import sys

import pytest
import torch

from helpers import ROOT
from megatron_longstraw.checkpointing import model_format
from megatron_longstraw.checkpointing.hf import hf_weight_files
from megatron_longstraw.runtime import precision
from megatron_longstraw.models.glm52.config import GLM52Config
from megatron_longstraw.models.glm52.hf import hf_config
from megatron_longstraw.models.qwen36.config import Qwen36Config
from test_glm52_hf import TINY, TOL, _upcast_reference
from test_qwen36_hf import TINY as QWEN_TINY
from test_qwen36_hf import TOL as QWEN_TOL
from test_qwen36_hf import _upcast_reference as _upcast_qwen_reference

pytestmark = pytest.mark.usefixtures("single_process")

F64 = torch.float64
PROMPT_LEN, RESPONSE_LEN = 80, 16   # 96 tokens: DSA (top-16) is sparse over the prompt


def _tool():
    spec = importlib.util.spec_from_file_location("convert_hf", ROOT / "tools" / "convert_hf.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
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
    return _save_sharded(model, tmp_path_factory.mktemp("hf"), "300KB")


def _save_sharded(model, path, max_shard_size: str):
    """save_pretrained in several shards (the converter must read an index); (path, state)."""
    model.save_pretrained(path, max_shard_size=max_shard_size)
    assert (path / "model.safetensors.index.json").exists()  # sharded input
    return path, {k: v.clone() for k, v in model.state_dict().items()}


def _convert(hf_dir, out, family: str | None):
    """tools/convert_hf.py HF -> model format in fp64 (family None: --family left out, so the
    config's model_type picks it); returns `out`."""
    given = ["--family", family] if family else []
    assert convert_hf.main([*given, "--hf-dir", str(hf_dir), "--out", str(out),
                            "--dtype", "fp64"]) == 0
    return out


@pytest.fixture(scope="module")
def converted(hf_checkpoint, tmp_path_factory):
    return _convert(hf_checkpoint[0], tmp_path_factory.mktemp("converted") / "glm52", "glm52")


def _our_model(model_dir, family: str = "glm52"):
    """The converted directory loaded into this package's model of `family` (fp64)."""
    from megatron_longstraw.models.registry import FAMILIES

    meta, _ = model_format.read_model(model_dir)
    spec = FAMILIES[family]
    precision.use_dtype(F64)
    model = spec.build(spec.config_class.from_dict(meta["model"]), F64, 1)
    before = {n: t.clone() for n, t in model.state_dict().items() if torch.is_tensor(t)}
    model_format.load_model(model_dir, model, family=family)
    unchanged = [n for n, t in model.state_dict().items()
                 if torch.is_tensor(t) and torch.equal(t, before[n])]
    assert not unchanged, unchanged[:5]  # every weight came from the file
    return model.eval()


def test_format_is_the_single_process_state_dict(converted):
    from megatron_longstraw.models.glm52.model import build_glm52_model

    meta, tensors = model_format.read_model(converted)
    assert (meta["format"], meta["family"], meta["dtype"]) == ("longstraw-model", "glm52", "float64")
    assert meta["parallel"]["expert_parallel_size"] == 1
    precision.use_dtype(F64)
    model = build_glm52_model(GLM52Config.from_dict(meta["model"]), params_dtype=F64)
    expected = {n for n, t in model.state_dict().items() if torch.is_tensor(t)}
    assert set(tensors) == expected
    assert tensors["decoder.layers.7.mlp.router.expert_bias"].dtype == torch.float32
    assert tensors["decoder.layers.7.mlp.experts.local_experts.7.linear_fc1.weight"].dtype == F64


def _fidelity(model, reference, vocab_size: int, label: str, tolerance: float) -> None:
    """Our converted model against the transformers model it came from (fp64): the full-sequence
    log-softmax over every position, and capture + replay of a response after a prompt."""
    from megatron_longstraw.context.capture import capture_prompt
    from megatron_longstraw.config.settings import LongStrawConfig
    from megatron_longstraw.step.replay import score_member
    from megatron_longstraw.state.attention_pass import AttentionPass

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab_size, (PROMPT_LEN + RESPONSE_LEN,), generator=gen)
    prompt, response = ids[:PROMPT_LEN], ids[PROMPT_LEN:]
    rows = slice(PROMPT_LEN - 1, PROMPT_LEN + RESPONSE_LEN - 1)   # outputs scoring the response
    with torch.no_grad():
        ref_all = torch.log_softmax(reference(ids[None]).logits[0], -1)          # [S, V]
        state = AttentionPass(mode="full", positions=torch.arange(ids.numel()), token_block=40,
                              query_block=24, key_block=32)
        ours_all = torch.log_softmax(model(ids[None], None, attention_mask=state)[0], -1)  # [S, V]
        ls = LongStrawConfig.of(group_size=2, query_block=29, key_block=37, token_block=50)
        captured = capture_prompt(model, prompt, ls)
        replayed, _ = score_member(model, captured, response, ls)                # [R]
    ref = ref_all[rows].gather(-1, response[:, None]).squeeze(-1)
    full_error = (ours_all - ref_all).abs().max().item()
    replay_error = (replayed - ref).abs().max().item()
    print(f"{label} HF fidelity (fp64): full-sequence max |d log_softmax| {full_error:.2e}, "
          f"capture+replay max |d logp| {replay_error:.2e}")
    assert full_error <= tolerance and replay_error <= tolerance


def test_converted_model_matches_transformers(hf_checkpoint, converted, monkeypatch):
    from transformers import GlmMoeDsaForCausalLM

    model = _our_model(converted)
    reference = GlmMoeDsaForCausalLM.from_pretrained(
        hf_checkpoint[0], attn_implementation="eager", experts_implementation="eager").to(F64).eval()
    _upcast_reference(reference, monkeypatch, router_fp64=model.config.moe_router_dtype == "fp64")
    _fidelity(model, reference, TINY["vocab_size"], "GLM-5.2", TOL)


def test_back_to_hf_is_exact(hf_checkpoint, converted, tmp_path):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    hf_dir, original = hf_checkpoint
    back = tmp_path / "hf"
    assert convert_hf.main(["--family", "glm52", "--hf-dir", str(back), "--out", str(converted),
                            "--to-hf", "--dtype", "fp32", "--max-shard-size", "200KB"]) == 0
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    # The files: same names, dtypes and values as save_pretrained's.
    ours = model_format.SafetensorsReader(hf_weight_files(back))
    theirs = model_format.SafetensorsReader(hf_weight_files(hf_dir))
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

    # A GLM-5.2 checkpoint is not a Qwen3.6 one: the message names the family it is.
    with pytest.raises(SystemExit, match=r"model_type 'glm_moe_dsa' \(that is --family glm52\) is "
                                         r"not 'qwen3_5_text' or 'qwen3_5'"):
        convert_hf.main(["--family", "qwen36", "--hf-dir", str(hf_checkpoint[0]),
                         "--out", str(tmp_path / "qwen")])
    assert not (tmp_path / "qwen").exists()

    # One file with a tensor removed and an MTP layer added: MTP is skipped, the gap is reported.
    hf_dir, original = hf_checkpoint
    files = model_format.SafetensorsReader(hf_weight_files(hf_dir))
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


# ---- Qwen3.6 -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_checkpoint(tmp_path_factory):
    """A random float32 Qwen3_5ForCausalLM saved in shards, with every norm away from its initial
    value (zero-centred gains around 0, the GDN output norm's plain gain around 1) and decays and
    dt biases spread as in a trained model."""
    from transformers import Qwen3_5ForCausalLM

    from megatron_longstraw.models.qwen36.hf import hf_config as qwen_hf_config

    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(qwen_hf_config(Qwen36Config(**QWEN_TINY))).float().eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("linear_attn.norm.weight"):
                tensor.copy_(1.0 + 0.1 * torch.randn_like(tensor))
            elif "norm" in name:
                tensor.copy_(0.1 * torch.randn_like(tensor))
            elif name.endswith("A_log"):
                tensor.copy_(torch.empty_like(tensor).uniform_(0.02, 0.5).log())
            elif name.endswith("dt_bias"):
                tensor.copy_(0.5 * torch.randn_like(tensor))
    return _save_sharded(model, tmp_path_factory.mktemp("hf_qwen"), "100KB")


@pytest.fixture(scope="module")
def qwen_converted(qwen_checkpoint, tmp_path_factory):
    return _convert(qwen_checkpoint[0], tmp_path_factory.mktemp("converted_qwen") / "qwen36",
                    None)   # the family from model_type 'qwen3_5_text'; loaded as qwen36 below


def test_qwen36_format_is_the_single_process_state_dict(qwen_converted):
    from megatron_longstraw.models.qwen36.model import build_qwen36_model

    meta, tensors = model_format.read_model(qwen_converted)
    assert (meta["format"], meta["family"], meta["dtype"]) == ("longstraw-model", "qwen36", "float64")
    assert meta["hf_config"]["model_type"] == "qwen3_5_text"
    precision.use_dtype(F64)
    model = build_qwen36_model(Qwen36Config.from_dict(meta["model"]), params_dtype=F64)
    assert Qwen36Config.from_dict(meta["model"]) == Qwen36Config(**QWEN_TINY)
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items() if torch.is_tensor(t)}
    assert {n: tensors.shape(n) for n in tensors} == expected
    assert all(tensors[n].dtype == F64 for n in tensors)


def test_qwen36_converted_model_matches_transformers(qwen_checkpoint, qwen_converted, monkeypatch):
    from transformers import Qwen3_5ForCausalLM

    model = _our_model(qwen_converted, "qwen36")
    reference = Qwen3_5ForCausalLM.from_pretrained(
        qwen_checkpoint[0], attn_implementation="eager").to(F64).eval()
    _upcast_qwen_reference(reference, monkeypatch)
    _fidelity(model, reference, QWEN_TINY["vocab_size"], "Qwen3.6", QWEN_TOL)


def test_qwen36_back_to_hf_is_exact(qwen_checkpoint, qwen_converted, tmp_path):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    hf_dir, original = qwen_checkpoint
    back = tmp_path / "hf"
    # --family left out: the model-format directory records it
    assert convert_hf.main(["--hf-dir", str(back), "--out",
                            str(qwen_converted), "--to-hf", "--dtype", "fp32",
                            "--max-shard-size", "150KB"]) == 0
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ours = model_format.SafetensorsReader(hf_weight_files(back))
    theirs = model_format.SafetensorsReader(hf_weight_files(hf_dir))
    assert set(ours) == set(theirs)
    assert all(ours[n].dtype == theirs[n].dtype and torch.equal(ours[n], theirs[n]) for n in theirs)
    loaded = Qwen3_5ForCausalLM.from_pretrained(back).state_dict()
    assert loaded.keys() == original.keys()
    assert all(torch.equal(loaded[n], original[n]) for n in original)
    assert (Qwen3_5TextConfig.from_pretrained(back).to_dict()
            == Qwen3_5TextConfig.from_pretrained(hf_dir).to_dict())
    with pytest.raises(SystemExit, match="not empty"):  # never overwrites a checkpoint
        convert_hf.main(["--family", "qwen36", "--hf-dir", str(back), "--out",
                         str(qwen_converted), "--to-hf"])


def _write_hf(folder, config: dict, tensors: dict) -> None:
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_qwen36_vision_language_layout_converts_its_text_model(qwen_checkpoint, qwen_converted,
                                                                tmp_path):
    """A `qwen3_5` checkpoint (the released Qwen3.6 layout): text model under
    model.language_model.*, config under text_config; the vision tower and the MTP head are
    skipped, the result equals the text checkpoint's, and --to-hf gives a text-only model."""
    hf_dir, _ = qwen_checkpoint
    files = model_format.SafetensorsReader(hf_weight_files(hf_dir))
    tensors = {n.replace("model.", "model.language_model.", 1): files[n] for n in files}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    text = json.loads((hf_dir / "config.json").read_text())
    _write_hf(tmp_path / "vlm", {"model_type": "qwen3_5", "architectures":
                                 ["Qwen3_5ForConditionalGeneration"], "text_config": text},
              tensors)
    out = tmp_path / "from_vlm"
    assert convert_hf.main(["--family", "qwen36", "--hf-dir", str(tmp_path / "vlm"),
                            "--out", str(out), "--dtype", "fp64"]) == 0
    (meta, ours), (_, reference) = model_format.read_model(out), model_format.read_model(qwen_converted)
    assert meta["model"] == Qwen36Config(**QWEN_TINY).to_dict()
    assert set(ours) == set(reference) and all(torch.equal(ours[n], reference[n]) for n in ours)
    assert convert_hf.main(["--family", "qwen36", "--hf-dir", str(tmp_path / "back"), "--out",
                            str(out), "--to-hf"]) == 0
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["model_type"] == "qwen3_5_text" and back["architectures"] == ["Qwen3_5ForCausalLM"]
    assert set(model_format.SafetensorsReader(hf_weight_files(tmp_path / "back"))) == set(files)


def test_qwen36_bad_input_fails_clearly(qwen_checkpoint, converted, tmp_path):
    hf_dir, _ = qwen_checkpoint
    config = json.loads((hf_dir / "config.json").read_text())
    files = model_format.SafetensorsReader(hf_weight_files(hf_dir))
    tensors = {n: files[n] for n in files}

    def fails(folder, match):
        with pytest.raises(SystemExit, match=match):
            convert_hf.main(["--family", "qwen36", "--hf-dir", str(folder),
                             "--out", str(tmp_path / "out")])
        assert not (tmp_path / "out").exists()  # nothing written

    # A Qwen3.6 checkpoint is not a GLM-5.2 one, and an unsupported Qwen variant is named.
    with pytest.raises(SystemExit, match=r"model_type 'qwen3_5_text' \(that is --family qwen36\)"):
        convert_hf.main(["--family", "glm52", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "g")])
    _write_hf(tmp_path / "moe", {**config, "model_type": "qwen3_5_moe_text"}, tensors)
    fails(tmp_path / "moe", r"model_type 'qwen3_5_moe_text' is not 'qwen3_5_text' or 'qwen3_5'")
    # A missing tensor, a misshapen one, one with no place in the model.
    _write_hf(tmp_path / "gap", config, {n: t for n, t in tensors.items()
                                         if n != "model.layers.1.linear_attn.in_proj_b.weight"})
    fails(tmp_path / "gap", r"lacks tensor model\.layers\.1\.linear_attn\.in_proj_b\.weight")
    _write_hf(tmp_path / "shape", config,
              {**tensors, "model.layers.3.self_attn.k_proj.weight": torch.zeros(3, 64)})
    fails(tmp_path / "shape", r"model\.layers\.3\.self_attn\.k_proj\.weight has shape \(3, 64\), "
                              r"but config\.json implies \(64, 64\)")
    _write_hf(tmp_path / "extra", config,
              {**tensors, "model.layers.3.linear_attn.A_log": torch.zeros(6)})
    fails(tmp_path / "extra", r"1 tensors with no place in the model, e\.g\. "
                              r"\['model\.layers\.3\.linear_attn\.A_log'\]")
    # Without --family an unknown model_type is refused naming the ones that convert.
    _write_hf(tmp_path / "llama", {**config, "model_type": "llama"}, tensors)
    with pytest.raises(SystemExit, match=r"model_type 'llama' is none that converts; known: "
                                         r".*'qwen3_5_text' \(qwen36\)"):
        convert_hf.main(["--hf-dir", str(tmp_path / "llama"), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
    # A GLM-5.2 model-format directory does not go back as Qwen3.6.
    with pytest.raises(SystemExit, match="holds a 'glm52' model, not qwen36"):
        convert_hf.main(["--family", "qwen36", "--hf-dir", str(tmp_path / "h"), "--out",
                         str(converted), "--to-hf"])
