"""tools/convert_hf.py --to-peft (checkpointing/peft_export.py): a LoRA training checkpoint as a
PEFT LoRA adapter for the Hugging Face base model, loaded by transformers + peft.

Per family, one fp64 LoRA step by the launcher from a converted random HF checkpoint (the tiny
configs), under torchrun at CP 2 / EP 2 for the checks against score.py (QLoRA and the FP8 base
too; in-process, one process, for the rest); the adapter is loaded with
`peft.PeftModel.from_pretrained` onto that HF checkpoint, and its log-probs on 40 held-out token
ids (more than the tiny top-k of 16: DSA selects) are compared with the merged export's
(`--to-hf`) under transformers and with tools/score.py's on the model the run merged. Tolerance
1e-9 on fp64 log-probs (relative to the largest |log-prob|): the two differ only by where s B A
is added (W + s B A once, or W x + s B (A x)), float64 rounding (observed < 1e-12);
transformers' float32 islands (norms, RoPE, eager softmax, router, DSA indexer) are run in
float64 on both sides by the families' parity helpers, without which a one-ulp float32 flip
(~6e-8) could show, and GLM-5.2's indexer breaks exact zero-score ties as ours (4 index heads
tie often; tests/hf_fp64.py `dsa_indexer`). A wrong row split or
permutation of a fused B (q/gate interleaving, GDN in_proj, [gate; up]) is ~1e-2 or more.

GLM-5.2 / DeepSeek-V3 (peft's v4 -> v5 conversion takes every gate_proj / up_proj / down_proj
target for the stacked routed experts): stock peft is tested on adapters trained without FFN
adapters; an adapter with dense / shared-expert FFN adapters is refused by default, and the files
`--peft-keep-ffn` writes are checked with that conversion switched off (the files, not stock peft).

Also: QLoRA (DeepSeek-V3; the adapter on the original base against the merged export over the NF4
base, and on the NF4-dequantised base exactly), LoRA on the FP8 base (GLM-5.2; the adapter on the
dequantised base; the merged export on the FP8 base thereby tested) and a CP2/EP2 LoRA run with
routed-expert adapters (GLM-5.2: each EP rank's experts in its shard; the merged export at EP 2
against the run's own in-memory merge, bitwise; the experts refused by --to-peft, by name).
"""

import json
import re
import shutil

import pytest
import torch
import yaml

from helpers import ROOT
from megatron_longstraw.checkpointing import model_format
from test_convert_hf import convert_hf

pytestmark = pytest.mark.usefixtures("single_process")

F64 = torch.float64
TOL = 1e-9
RANK = 4
SEQ = 40
PROMPT = 32   # score.py's capture; SEQ > the tiny top-k of 16: DSA selects


def _hf_base(family: str, out):
    """A random float32 HF checkpoint of `family`'s tiny config (tools/tiny_hf.py's writer)."""
    from megatron_longstraw.checkpointing.hf import write_random_hf
    from megatron_longstraw.models.registry import FAMILIES

    fam = FAMILIES[family]
    write_random_hf(fam, fam.config_class.from_yaml(ROOT / fam.tiny_config), out, seed=0)
    return out


def _prepared(family: str, tmp):
    """`tmp/hf` (a random HF checkpoint), `tmp/converted` (its fp64 conversion) and `tmp/tiny.yaml`
    (the family's tiny config with the converted model's values), each made once."""
    from megatron_longstraw.models.registry import FAMILIES

    tmp.mkdir(parents=True, exist_ok=True)
    if not (tmp / "hf").exists():
        _hf_base(family, tmp / "hf")
    converted = tmp / "converted"
    if not converted.exists():
        assert convert_hf.main(["--family", family, "--hf-dir", str(tmp / "hf"), "--out",
                                str(converted), "--dtype", "fp64"]) == 0
    meta, _ = model_format.read_model(converted)
    config = yaml.safe_load((ROOT / FAMILIES[family].tiny_config).read_text())
    config["model"] = meta["model"]
    (tmp / "tiny.yaml").write_text(yaml.safe_dump(config))
    return tmp


def _train_lora(family: str, tmp, *extra: str):
    """One fp64 LoRA step (in-process launcher, one gloo process) from `tmp/hf` converted; returns
    the --save folder."""
    from megatron_longstraw.training import train

    _prepared(family, tmp)
    save = tmp / f"ckpt{len(list(tmp.glob('ckpt*')))}"
    train.main(["--longstraw", "--longstraw-family", family, "--longstraw-config",
                str(tmp / "tiny.yaml"), "--pretrained-checkpoint", str(tmp / "converted"),
                "--longstraw-synthetic-prompt-len", "48", "--longstraw-synthetic-response-len",
                "4", "--longstraw-group-size", "2", "--lr", "1e-2",
                "--longstraw-out-dir", str(tmp), "--longstraw-run-name", save.name,
                "--longstraw-lora-rank", str(RANK), "--longstraw-lora-alpha", "8",
                "--train-iters", "1", "--save", str(save), "--save-interval", "1", *extra])
    return save


def _upcast(family: str, model, monkeypatch):
    if family == "glm52":
        from test_glm52_hf import _upcast_reference
        _upcast_reference(model, monkeypatch, router_fp64=True)
    elif family == "qwen36":
        from test_qwen36_hf import _upcast_reference
        _upcast_reference(model, monkeypatch)
    else:
        from test_deepseekv3 import upcast_reference
        upcast_reference(model, monkeypatch)


def _load(family: str, hf_dir):
    import transformers
    from megatron_longstraw.models.registry import FAMILIES

    cls = getattr(transformers, FAMILIES[family].hf.hf_model_class)
    kwargs = {"experts_implementation": "eager"} if family != "qwen36" else {}
    return cls.from_pretrained(hf_dir, attn_implementation="eager", **kwargs).to(F64).eval()


def _held_out(vocab):
    return torch.randint(0, vocab, (SEQ,), generator=torch.Generator().manual_seed(5))


def _logprobs(family, model, monkeypatch, vocab):
    """fp64 log-probs of the held-out ids' tokens 1..SEQ-1 under a transformers model."""
    _upcast(family, model, monkeypatch)
    ids = _held_out(vocab)
    with torch.no_grad():
        logits = model(ids[None]).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(-1, ids[1:, None]).squeeze(-1)


def _relative(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _export(save, out, *flags):
    assert convert_hf.main(["--hf-dir", str(out), "--out", str(save), *flags]) == 0
    return out


def _peft_vs_merged(family, save, base_hf, tmp, monkeypatch, *, dtype="fp64", flags=(),
                    files_only=False):
    """(max relative log-prob difference of transformers + peft on `base_hf` against the merged
    export, the PEFT model, the adapter folder, the merged export's log-probs, the PEFT model's
    log-probs), on the held-out ids. `files_only`:
    peft's v4 -> v5 MoE target rewrite switched off, which checks the adapter's files, not
    stock peft."""
    from peft import PeftModel
    from peft.utils import transformers_weight_conversion

    if files_only:
        monkeypatch.setattr(transformers_weight_conversion, "_convert_peft_config_moe",
                            lambda config, model: None)
    adapter, merged = tmp / f"peft-{save.name}", tmp / f"merged-{save.name}"
    if not adapter.exists():
        _export(save, adapter, "--to-peft", "--dtype", dtype, *flags)
    if not merged.exists():
        _export(save, merged, "--to-hf", "--dtype", "fp64", "--fp8", "dequantize")
    vocab = json.loads((merged / "config.json").read_text())["vocab_size"]
    reference = _logprobs(family, _load(family, merged), monkeypatch, vocab)
    peft_model = PeftModel.from_pretrained(_load(family, base_hf), adapter).eval()
    ours = _logprobs(family, peft_model.get_base_model(), monkeypatch, vocab)
    return _relative(ours, reference), peft_model, adapter, reference, ours


def _checked_adapter(adapter, base):
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["lora_alpha"] == 8 and config["lora_dropout"] == 0
    assert config["peft_type"] == "LORA" and config["target_modules"]
    assert config["base_model_name_or_path"] == str(base.resolve())
    return config


FFN = ("gate_proj", "up_proj", "down_proj")
NO_FFN = ("--longstraw-lora-exclude", "linear_fc1", "linear_fc2")   # attention adapters only
NO_EXPERTS = ("--longstraw-lora-exclude", "*.experts.*")           # dense + shared FFN too


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs(family, *flags) -> (tmp folder, --save folder): one fp64 LoRA step per (family,
    flags), the HF base and its conversion shared by a family's runs."""
    made: dict = {}

    def run(family: str, *flags: str):
        if (family, flags) not in made:
            tmp = tmp_path_factory.getbasetemp() / f"runs-{family}"
            made[family, flags] = tmp, _train_lora(family, tmp, "--longstraw-lora",
                                                   "--longstraw-dtype", "fp64", *flags)
        return made[family, flags]
    return run


def _cp2_lora(family: str, tmp, out, *flags: str):
    """One fp64 LoRA step of `family` by torchrun on two gloo processes at CP 2 with EP 2
    (Qwen3.6's tiny model has a dense FFN: CP 2, EP 1) from `tmp`'s converted base (`_prepared`);
    returns (the --save folder, the model the ranks merged in memory: --longstraw-save-merged)."""
    from test_export_hf import _torchrun

    save, run_merged = out / "ckpt", out / "run-merged"
    ep = ["--expert-model-parallel-size", "2"] if family != "qwen36" else []
    _torchrun(2, ["--longstraw-family", family, "--context-parallel-size", "2", *ep,
                  "--longstraw-config", str(tmp / "tiny.yaml"), "--longstraw-dtype", "fp64",
                  "--pretrained-checkpoint", str(tmp / "converted"), "--train-iters", "1",
                  "--lr", "1e-2", "--seed", "3", "--longstraw-group-size", "2",
                  "--longstraw-synthetic-prompt-len", "64", "--longstraw-synthetic-response-len",
                  "4", "--longstraw-lora", "--longstraw-lora-rank", str(RANK),
                  "--longstraw-lora-alpha", "8", *flags, "--save", str(save),
                  "--save-interval", "1", "--longstraw-save-merged", str(run_merged),
                  "--longstraw-out-dir", str(out), "--longstraw-run-name", "t",
                  "--tensorboard-dir", str(out / "tb")])
    return save, run_merged


def _score_py(family, tmp, checkpoint, vocab, out):
    """tools/score.py's fp64 log-probs on `checkpoint` of the held-out ids after their first
    PROMPT (the capture), indexed as `_logprobs(...)[PROMPT - 1:]`."""
    from test_score import load_score_tool

    ids = _held_out(vocab)
    (out / "g.jsonl").write_text(json.dumps({"prompt_ids": ids[:PROMPT].tolist(),
                                             "response_ids": [ids[PROMPT:].tolist()]}) + "\n")
    scored = load_score_tool().main([
        "--family", family, "--config", str(tmp / "tiny.yaml"), "--checkpoint", str(checkpoint),
        "--input", str(out / "g.jsonl"), "--out", str(out / "s.jsonl"), "--dtype", "fp64"])
    return torch.tensor(scored["results"][0]["logprobs"][0], dtype=F64)


@pytest.mark.parametrize("family", ["glm52", "qwen36", "deepseekv3"])
def test_cp2_ep2_peft_adapter_scores_like_score_py_and_the_merged_export(
        family, tmp_path_factory, tmp_path, monkeypatch):
    """Stock peft on a LoRA step trained at CP 2 / EP 2 (`_cp2_lora`), fp64. GLM-5.2 /
    DeepSeek-V3: attention adapters only (FFN adapters: the tests below); Qwen3.6: every linear,
    FFN included. transformers + peft log-probs of held-out text equal the merged export's
    (--to-hf of the checkpoint) and tools/score.py's on the model the run's ranks merged in
    memory (--longstraw-save-merged; score.py refuses an adapter-only checkpoint), within TOL."""
    tmp = _prepared(family, tmp_path_factory.getbasetemp() / f"runs-{family}")
    save, run_merged = _cp2_lora(family, tmp, tmp_path,
                                 *(NO_EXPERTS if family == "qwen36" else NO_FFN))
    vs_merged, peft_model, adapter, reference, ours = _peft_vs_merged(
        family, save, tmp / "hf", tmp_path, monkeypatch)
    _checked_adapter(adapter, tmp / "hf")
    vocab = peft_model.get_base_model().config.vocab_size
    vs_score = _relative(ours[PROMPT - 1:], _score_py(family, tmp, run_merged, vocab, tmp_path))
    print(f"{family} LoRA at CP2{'/EP2' if family != 'qwen36' else ''}: max relative |peft - "
          f"merged export| {vs_merged:.2e}, |peft - score.py on the run's merged model| "
          f"{vs_score:.2e} (stock peft, tol {TOL:.0e})")

    wrapped = {n.rsplit(".", 1)[-1] for n, m in peft_model.named_modules()
               if hasattr(m, "lora_A")}
    fused = {"glm52": ("q_a_proj", "kv_a_proj_with_mqa", "o_proj"),
             "deepseekv3": ("q_a_proj", "kv_a_proj_with_mqa", "o_proj"),
             "qwen36": ("q_proj", "k_proj", "v_proj", "in_proj_qkv", "in_proj_z", "in_proj_b",
                        "in_proj_a", "gate_proj", "up_proj")}[family]
    assert set(fused) <= wrapped, wrapped
    if family != "qwen36":
        assert not wrapped & set(FFN)
    assert vs_merged <= TOL and vs_score <= TOL
    # The adapter matters: the base alone is far from the trained policy.
    with peft_model.disable_adapter():
        base = _logprobs(family, peft_model.get_base_model(), monkeypatch, vocab)
    assert _relative(base, reference) > 1e-6


@pytest.mark.parametrize("family", ["glm52", "deepseekv3"])
def test_ffn_adapters_refused_unless_kept(family, runs, monkeypatch):
    """Dense-layer and shared-expert FFN adapters on a model type whose gate_proj / up_proj /
    down_proj targets peft remaps: refused by default, named, nothing written; --peft-keep-ffn
    writes them. Stock peft on those files drops them (the reason for the refusal); with peft's
    rewrite switched off the files equal the merged export (the files, not stock peft)."""
    tmp, save = runs(family, *NO_EXPERTS)
    adapter = tmp / f"peft-{save.name}"
    with pytest.raises(SystemExit, match=r"silently drop the adapters of \d+ dense-layer / "
                       r"shared-expert FFN modules \(model\.layers\.0\.mlp\.gate_proj, .*"
                       r"--to-hf.*--longstraw-lora-targets.*--longstraw-lora-exclude "
                       r"linear_fc1 linear_fc2.*--peft-keep-ffn.*stock peft drops them"):
        _export(save, adapter, "--to-peft", "--dtype", "fp64")
    assert not adapter.exists() and not list(tmp.glob(".tmp-*"))   # nothing written
    error, _, adapter, *_ = _peft_vs_merged(family, save, tmp / "hf", tmp, monkeypatch,
                                           flags=("--peft-keep-ffn",))
    assert {t for t in _checked_adapter(adapter, tmp / "hf")["target_modules"]} >= set(FFN)
    print(f"{family} LoRA + FFN, --peft-keep-ffn, stock peft: max relative |peft - merged| "
          f"{error:.2e} (the FFN adapters dropped)")
    assert error > 1e-6
    error, *_ = _peft_vs_merged(family, save, tmp / "hf", tmp, monkeypatch, files_only=True)
    print(f"{family} LoRA + FFN, --peft-keep-ffn files (peft's MoE rewrite off): max relative "
          f"|peft - merged| {error:.2e}")
    assert error <= TOL


def test_remapped_leaves_follow_the_pinned_peft():
    """peft_remapped_leaves reads the installed peft; PEFT_REMAPPED (used without peft) agrees
    with it."""
    from megatron_longstraw.checkpointing.peft_export import PEFT_REMAPPED, peft_remapped_leaves

    for model_type, leaves in PEFT_REMAPPED.items():
        assert peft_remapped_leaves(model_type) == leaves
    assert set(FFN) <= set(PEFT_REMAPPED["glm_moe_dsa"])
    assert peft_remapped_leaves("qwen3_5_text") == () == peft_remapped_leaves("qwen3_5")


def _zero_adapters_copy(save, out):
    """A copy of the run's latest step with every lora_B zeroed: its merged export is the base
    the run trained over (QLoRA: the NF4-dequantised base), as transformers loads it."""
    from safetensors.torch import load_file

    step = out / "step"
    shutil.copytree(export_step(save), step)
    for file in step.glob("*.safetensors"):
        tensors = load_file(str(file))
        tensors.update({n: torch.zeros_like(t) for n, t in tensors.items()
                        if n.endswith(".lora_B")})
        model_format.write_safetensors(file, tensors)
    return step


def export_step(save):
    return sorted(save.glob("step_*"))[-1]


QLORA_TOL = 5e-2
"""QLoRA, the adapter on the original base against the merged export (over the NF4 base): NF4
keeps 16 levels per 64-weight block (a weight moves by up to ~0.14 of its block's absmax, half the
widest gap between levels), so the two policies differ by the base's NF4 error: 7.4e-3 of the
largest |log-prob| on the tiny random model; 5e-2 bounds it with margin. It cannot tell a wrong
adapter of that size, so the exact check is the one on the NF4-dequantised base (TOL)."""


def test_qlora_adapter_over_the_original_and_the_nf4_base(tmp_path_factory, tmp_path,
                                                          monkeypatch):
    """DeepSeek-V3 QLoRA at CP 2 / EP 2 (fp64, attention adapters): the adapter sits on the
    original base; the merged export is over the NF4-dequantised base it trained on. peft on the
    original base equals the merged export within QLORA_TOL; peft on the NF4-dequantised base (the
    merged export of the checkpoint with its adapters zeroed) equals the merged export and
    tools/score.py on the run's own merged model within TOL."""
    family = "deepseekv3"
    tmp = _prepared(family, tmp_path_factory.getbasetemp() / f"runs-{family}")
    save, run_merged = _cp2_lora(family, tmp, tmp_path, "--longstraw-qlora", *NO_FFN)
    error, _, adapter, *_ = _peft_vs_merged(family, save, tmp / "hf", tmp_path, monkeypatch)
    _checked_adapter(adapter, tmp / "hf")            # names the original base
    nf4_base = _export(_zero_adapters_copy(save, tmp_path / "zeroed"), tmp_path / "nf4-base",
                       "--to-hf", "--dtype", "fp64")
    exact, peft_model, _, _, ours = _peft_vs_merged(family, save, nf4_base, tmp_path, monkeypatch)
    vocab = peft_model.get_base_model().config.vocab_size
    vs_score = _relative(ours[PROMPT - 1:], _score_py(family, tmp, run_merged, vocab, tmp_path))
    print(f"QLoRA at CP2/EP2: max relative |peft - merged|: on the original base {error:.2e} "
          f"(tol {QLORA_TOL:.0e}), on the NF4-dequantised base {exact:.2e}; |peft on it - "
          f"score.py on the run's merged model| {vs_score:.2e} (tol {TOL:.0e})")
    assert 1e-6 < error <= QLORA_TOL and exact <= TOL and vs_score <= TOL


def test_fp8_base_adapter_and_merged_export(tmp_path_factory, tmp_path, monkeypatch):
    """GLM-5.2 LoRA on the FP8 base at CP 2 / EP 2 (fp64, attention adapters) from a block-FP8 HF
    checkpoint: the adapter sits on the dequantised base (`--to-hf --fp8 dequantize` of the
    converted base; transformers here cannot load the FP8 files themselves: accelerate's
    quantizer is not installed). peft on it equals the merged export of the FP8-base run (the
    merged export on the FP8 base, dequantised) and tools/score.py on the run's own merged model,
    within TOL."""
    from test_convert_fp8 import fp8_checkpoint as make_fp8   # the fixture's function
    from test_export_hf import _Factory

    tmp = tmp_path_factory.mktemp("fp8")
    hf_dir, _ = make_fp8.__wrapped__(_Factory(tmp))
    hf_dir.rename(tmp / "hf")
    _prepared("glm52", tmp)
    save, run_merged = _cp2_lora("glm52", tmp, tmp_path, "--longstraw-fp8-base", *NO_FFN)
    base = _export(tmp / "converted", tmp_path / "dequantised", "--to-hf", "--dtype", "fp64",
                   "--fp8", "dequantize")
    error, peft_model, adapter, _, ours = _peft_vs_merged("glm52", save, base, tmp_path,
                                                          monkeypatch)
    _checked_adapter(adapter, tmp / "hf")            # names the FP8 checkpoint
    vocab = peft_model.get_base_model().config.vocab_size
    vs_score = _relative(ours[PROMPT - 1:], _score_py("glm52", tmp, run_merged, vocab, tmp_path))
    print(f"LoRA on the FP8 base at CP2/EP2: max relative |peft on the dequantised base - "
          f"merged| {error:.2e}, - score.py on the run's merged model {vs_score:.2e} "
          f"(tol {TOL:.0e})")
    assert error <= TOL and vs_score <= TOL


def test_cp2_ep2_lora_merged_and_adapter(tmp_path_factory, tmp_path, monkeypatch):
    """GLM-5.2 fp64 LoRA at CP2/EP2 (two gloo processes by torchrun), adapters on the attention
    and the routed experts (each EP rank saves its experts' adapters in its own shard). The
    merged export (both shards reassembled by name: the merged export at EP 2) equals the run's
    own merged model (--longstraw-save-merged) bitwise; --to-peft refuses an expert by name; the checkpoint with the experts' adapters taken out of its shards exports as PEFT
    equal to its merged export (stock peft, within TOL)."""
    from safetensors.torch import load_file

    family = "glm52"
    tmp = _prepared(family, tmp_path_factory.getbasetemp() / f"runs-{family}")
    save, _ = _cp2_lora(family, tmp, tmp_path, "--longstraw-lora-exclude", "*.mlp.linear_fc1",
                        "*.mlp.linear_fc2", "*.shared_experts.*")
    step = export_step(save)
    shards = sorted(step.glob("experts_ep*.safetensors"))
    assert [p.name for p in shards] == ["experts_ep000.safetensors", "experts_ep001.safetensors"]
    assert all(any(n.endswith(".lora_B") for n in load_file(str(p))) for p in shards)

    # The merged export at EP 2 against the run's own merged model (--longstraw-save-merged,
    # merged in memory by the two ranks), both through --to-hf: bitwise.
    from test_export_hf import _hf_tensors
    merged = _export(save, tmp_path / "merged", "--to-hf", "--dtype", "fp64")
    by_run = _export(tmp_path / "run-merged", tmp_path / "merged-by-run", "--to-hf", "--dtype",
                     "fp64")
    ours, theirs = _hf_tensors(merged), _hf_tensors(by_run)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)
    initial = _hf_tensors(tmp / "hf")
    half = json.loads((tmp / "hf" / "config.json").read_text())["n_routed_experts"] // 2
    rank1 = [n for n in initial if (m := re.search(r"\.experts\.(\d+)\.", n))
             and int(m.group(1)) >= half]              # EP rank 1's experts
    assert rank1 and any(not torch.allclose(ours[n].to(initial[n]), initial[n])
                         for n in rank1)       # EP rank 1's trained adapters are in the merge

    with pytest.raises(SystemExit, match=r"local_experts\.\d+\.linear_fc1 maps to .*"
                                         r"experts\.\d+\.gate_proj.* no nn.Linear.*--to-hf"):
        _export(save, tmp_path / "adapter", "--to-peft")

    copy = tmp_path / "attention-only" / step.name   # the experts' adapters taken out
    shutil.copytree(step, copy)
    for shard in copy.glob("experts_ep*.safetensors"):
        model_format.write_safetensors(shard, {n: t for n, t in load_file(str(shard)).items()
                                               if ".lora_" not in n})
    meta = json.loads((copy / "meta.json").read_text())
    meta["lora"]["exclude"] = [*meta["lora"]["exclude"], "*.experts.*"]   # as if trained so
    (copy / "meta.json").write_text(json.dumps(meta))
    error, *_ = _peft_vs_merged(family, copy, tmp / "hf", tmp_path, monkeypatch)
    print(f"CP2/EP2 LoRA, attention adapters: max relative |peft - merged| {error:.2e}")
    assert error <= TOL


def test_selection_reads_row_moves_and_refuses_value_changes():
    from megatron_longstraw.checkpointing.peft_export import _selection
    from megatron_longstraw.models.qwen36 import hf as qwen_hf
    from megatron_longstraw.models.qwen36.config import Qwen36Config

    cfg = Qwen36Config.from_yaml(ROOT / "examples" / "qwen36" / "tiny.yaml")
    shape = (cfg.num_key_value_heads * (2 * cfg.num_attention_heads // cfg.num_key_value_heads
                                        + 2) * cfg.head_dim, cfg.hidden_size)
    weight = torch.randn(shape, dtype=F64)
    for j in range(3):   # q_proj (per head [q; gate]), k_proj, v_proj of the per-group linear_qkv
        transform = lambda t, j=j: qwen_hf._qkv_to_hf(cfg, t)[j]  # noqa: E731
        rows, cols = _selection(transform, shape)
        assert torch.equal(transform(weight), weight[rows][:, cols])
    assert _selection(lambda t: t + 1, (4, 3)) is None          # Qwen3.6's gated norm gain
    assert _selection(lambda t: 2 * t, (4, 3)) is None
    assert _selection(lambda t: t.t(), (4, 3)) is None          # not rows and columns
    rows, cols = _selection(lambda t: t[:, 1:][[2, 0]], (4, 3))  # a fused input: A's columns
    assert rows.tolist() == [2, 0] and cols.tolist() == [1, 2]


def test_expert_adapters_are_refused_by_name(runs, tmp_path):
    """Routed experts' adapters (transformers stacks the experts into parameters, which PEFT's
    LoRA layers do not wrap): refused, the module named, the merged export pointed to."""
    from safetensors.torch import load_file

    _, save = runs("glm52", *NO_FFN)
    step = tmp_path / "step_00000001"
    shutil.copytree(save / "step_00000001", step)
    tensors = load_file(str(step / "model.safetensors"))
    expert = "decoder.layers.15.mlp.experts.local_experts.1.linear_fc1"   # HF layer 7
    tensors[f"{expert}.lora_A"] = torch.zeros(RANK, 64, dtype=F64)
    tensors[f"{expert}.lora_B"] = torch.zeros(2 * 32, RANK, dtype=F64)
    model_format.write_safetensors(step / "model.safetensors", tensors)
    with pytest.raises(SystemExit, match=rf"{expert} maps to .*experts\.1\.gate_proj.* no "
                                         r"nn.Linear.*--to-hf"):
        convert_hf.main(["--hf-dir", str(tmp_path / "adapter"), "--out", str(step), "--to-peft"])
    assert not (tmp_path / "adapter").exists()          # nothing partial written
    meta = json.loads((step / "meta.json").read_text())
    del meta["lora"]
    (step / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(SystemExit, match="full-parameter checkpoint.*use --to-hf"):
        convert_hf.main(["--hf-dir", str(tmp_path / "adapter"), "--out", str(step), "--to-peft"])


SERVING = "## Serving the trained model"


def test_readme_serving_commands(tmp_path):
    """README's "Serving the trained model": its bash blocks, in order, in one bash process from
    the repository root, `runs/serving` moved to a temporary folder (as test_walkthrough.py does);
    then the adapter's and the merged export's files are there."""
    import re
    import subprocess

    readme = (ROOT / "README.md").read_text()
    assert SERVING in readme, "README.md lost its 'Serving the trained model' section"
    start = readme.index(SERVING)
    end = readme.find("\n## ", start + len(SERVING))
    blocks = re.findall(r"```bash\n(.*?)```", readme[start:end if end >= 0 else None], flags=re.S)
    script = "\n".join(blocks).replace("runs/serving", str(tmp_path / "serving"))
    out = subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         env={"PATH": f"{ROOT / '.venv' / 'bin'}:/usr/bin:/bin",
                              "TORCHDYNAMO_DISABLE": "1", "PYTHONWARNINGS": "ignore",
                              "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)})
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert (tmp_path / "serving" / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "serving" / "merged" / "config.json").is_file()
    assert "LoRA modules: 62" in out.stdout   # the tiny Qwen3.6's HF linears with adapters
