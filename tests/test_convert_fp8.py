"""tools/convert_hf.py on a block-FP8 GLM-5.2 checkpoint (transformers `GlmMoeDsaForCausalLM`'s
files with the DeepSeek-V3 / GLM-5.2 FP8 layout: each linear `weight` float8_e4m3fn plus
`weight_scale_inv` float32 [ceil(out / 128), ceil(in / 128)], `quantization_config` in
config.json): HF -> model format keeps every FP8 byte and scale (no dequantised copy; fused rows
stack the parts' grids), the model loads them dequantised exactly as HF defines them, and the way
back writes every tensor byte for byte; a scale of the wrong shape, an FP8 weight without its
scale and another block size are refused with the tensor named.

Widths above 128 (hidden 192, dense FFN 160) put partial blocks in both directions and give the
dense `linear_fc1` two row blocks per part."""

import importlib.util
import json
import sys

import pytest
import torch

from helpers import ROOT
from megatron_longstraw.kernels import fp8
from megatron_longstraw.checkpointing import model_format
from megatron_longstraw.checkpointing.hf import hf_weight_files
from megatron_longstraw.runtime import precision
from megatron_longstraw.models.glm52.config import GLM52Config
from megatron_longstraw.models.glm52.hf import hf_config

pytestmark = pytest.mark.usefixtures("single_process")

SHAPE = dict(vocab_size=256, hidden_size=192, num_hidden_layers=3, num_attention_heads=4,
             q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=16, intermediate_size=160, moe_intermediate_size=32, n_routed_experts=4,
             num_experts_per_tok=2, index_n_heads=4, index_head_dim=16, index_topk=16,
             first_k_dense_replace=1, rms_norm_eps=1e-6)
# What GLM-5.2's FP8 release holds in FP8 (models/glm52/family.py FP8_LINEARS, HF names).
FP8_HF = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
          "up_proj", "down_proj", "wq_b", "wk")


def _tool():
    spec = importlib.util.spec_from_file_location("convert_hf_fp8",
                                                  ROOT / "tools" / "convert_hf.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


convert_hf = _tool()


def _is_fp8(name: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and name.endswith(".weight") and name.split(".")[-2] in FP8_HF


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """save_pretrained's files of a random bf16 GlmMoeDsaForCausalLM, its linears then quantised
    as the FP8 release ships them; (folder, {name: tensor} as written)."""
    from safetensors.torch import load_file, save_file
    from transformers import GlmMoeDsaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf_fp8")
    GlmMoeDsaForCausalLM(hf_config(GLM52Config(**SHAPE))).bfloat16().save_pretrained(path)
    tensors = {}
    for name, tensor in load_file(str(path / "model.safetensors")).items():
        if _is_fp8(name, tensor):
            tensors[name], tensors[fp8.scale_name(name)] = fp8.quantize(tensor, name)
        elif name.endswith("e_score_correction_bias"):     # float32 in the released files
            tensors[name] = tensor.float()
        else:
            tensors[name] = tensor
    assert any(".experts.0.gate_proj" in n for n in tensors)   # the on-disk expert layout
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = dict(fp8.QUANTIZATION_CONFIG)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path, tensors


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == fp8.FP8_DTYPE else t


def test_round_trip_is_bitwise_and_keeps_fp8(fp8_checkpoint, tmp_path):
    hf_dir, original = fp8_checkpoint
    out = tmp_path / "ls"
    assert convert_hf.main(["--family", "glm52", "--hf-dir", str(hf_dir), "--out", str(out)]) == 0
    meta, ours = model_format.read_model(out)
    assert meta["dtype"] == "bfloat16" and meta["fp8"]["weight_block_size"] == [128, 128]
    num_fp8 = sum(1 for n in original if n.endswith(fp8.SCALE_SUFFIX))
    # No dequantised copy: the model format holds FP8 bytes + scales, the HF files' sizes.
    fp8_bytes = sum(t.numel() * t.element_size() for n, t in original.items()
                    if t.dtype == fp8.FP8_DTYPE or n.endswith(fp8.SCALE_SUFFIX))
    assert sum(ours[n].numel() * ours[n].element_size() for n in ours
               if ours[n].dtype == fp8.FP8_DTYPE or n.endswith(fp8.SCALE_SUFFIX)) == fp8_bytes
    fc1 = "decoder.layers.1.mlp.linear_fc1.weight"              # dense: [gate; up], 160 rows each
    hf = "model.layers.0.mlp"
    assert ours[fc1].dtype == fp8.FP8_DTYPE
    assert torch.equal(ours[fp8.scale_name(fc1)],
                       torch.cat([original[f"{hf}.gate_proj.weight_scale_inv"],
                                  original[f"{hf}.up_proj.weight_scale_inv"]]))
    assert tuple(ours[fp8.scale_name(fc1)].shape) == (4, 2)

    # The model loads them as HF defines them: each HF tensor's own blocks.
    from megatron_longstraw.models.registry import FAMILIES

    precision.use_dtype(torch.float32)
    model = FAMILIES["glm52"].build(GLM52Config.from_dict(meta["model"]), torch.float32, 1)
    model_format.load_model(out, model)
    expected = torch.cat([fp8.dequantize(original[f"{hf}.{p}_proj.weight"],
                                         original[f"{hf}.{p}_proj.weight_scale_inv"])
                          for p in ("gate", "up")])
    assert torch.equal(model.get_parameter(fc1), expected)

    back = tmp_path / "hf"
    assert convert_hf.main(["--family", "glm52", "--hf-dir", str(back), "--out", str(out),
                            "--to-hf", "--max-shard-size", "200KB"]) == 0
    files = model_format.SafetensorsReader(hf_weight_files(back))
    assert len(hf_weight_files(back)) > 1
    assert set(files) == set(original) and num_fp8 > 0
    for name, tensor in original.items():
        assert files[name].dtype == tensor.dtype, name
        assert torch.equal(_bytes(files[name]), _bytes(tensor)), name
    config = json.loads((back / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]


def test_misfit_fp8_checkpoints_are_refused(fp8_checkpoint, tmp_path):
    from safetensors.torch import save_file

    hf_dir, original = fp8_checkpoint
    config = json.loads((hf_dir / "config.json").read_text())
    name = "model.layers.1.self_attn.o_proj.weight"

    def write(folder, tensors, cfg=config):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(cfg))
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder

    bad_scale = {**original, fp8.scale_name(name): original[fp8.scale_name(name)][:1]}
    with pytest.raises(SystemExit, match=r"o_proj\.weight_scale_inv is F32 of shape \[1, 1\], "
                                         r"but .*o_proj\.weight \[192, 64\] in 128 x 128 blocks "
                                         r"needs F32 \[2, 1\]"):
        convert_hf.main(["--family", "glm52", "--hf-dir", str(write(tmp_path / "a", bad_scale)),
                         "--out", str(tmp_path / "a_out")])
    no_scale = {n: t for n, t in original.items() if n != fp8.scale_name(name)}
    with pytest.raises(SystemExit, match=r"o_proj\.weight is float8_e4m3fn but "
                                         r".*o_proj\.weight_scale_inv is missing"):
        convert_hf.main(["--family", "glm52", "--hf-dir", str(write(tmp_path / "b", no_scale)),
                         "--out", str(tmp_path / "b_out")])
    other_blocks = {**config, "quantization_config": {**config["quantization_config"],
                                                       "weight_block_size": [64, 64]}}
    with pytest.raises(SystemExit, match=r"weight_block_size \[64, 64\]; only \[128, 128\]"):
        convert_hf.main(["--family", "glm52", "--hf-dir",
                         str(write(tmp_path / "c", original, other_blocks)),
                         "--out", str(tmp_path / "c_out")])
    assert not any((tmp_path / f"{x}_out").exists() for x in "abc")
