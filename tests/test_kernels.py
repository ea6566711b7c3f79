"""Kernel backends against `refs`, and backend selection.

Three kinds of check:
- the Triton sparse-MLA kernels, forward and backward, in Triton's CPU interpreter (a subprocess:
  TRITON_INTERPRET must be set before triton is imported) and, where CUDA exists, on the GPU;
- every wrapper against its reference on the GPU where its package is installed (skipped with the
  reason otherwise), and on the CPU against a stand-in for the upstream function written from its
  documented contract, which checks our mapping (layouts, padding, LSE base, FP8 scaling);
- selection: explicit missing backends fail naming the package, auto falls back to ref and logs,
  per-part specs, malformed specs.
Errors are relative to the largest magnitude of an fp64 reference (`parity.relative_error`);
tolerances are `parity.TOLERANCE` unless a test says otherwise, with the reason.
"""

import importlib.machinery
import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from megatron_longstraw.kernels import packages, parity, refs, select

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def fresh_selection():
    select.reset()
    yield
    select.reset()


def _fake_module(monkeypatch, name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def _usable(backend: str) -> str | None:
    return select.unusable_reason(backend)


# ---- Triton sparse MLA in the CPU interpreter ---------------------------------------------------

_INTERPRETER_SCRIPT = """
import json
import torch
from megatron_longstraw.kernels import parity, select, triton_sparse_mla
report = parity.triton_interpreter_report()
# Per-part selection routes to the Triton kernels: capture-style (no grad) and replay-style calls.
chosen = select.use("sparse_mla=triton,sparse_mla_grad=triton,indexer=ref")
case = parity.sparse_mla_case()
args = (case["query"], case["latents"], case["indices"], case["scale"], case["v_dim"])
with torch.no_grad():
    via_select = chosen.sparse_mla_attention(*args)[0]
direct = triton_sparse_mla.sparse_mla_attention(*args)[0]
report["selection"] = {"choices": chosen.choices,
                       "same_as_direct": bool(torch.equal(via_select, direct)),
                       "differs_from_ref": bool(not torch.equal(via_select,
                           parity.refs.sparse_mla_attention(*args)[0]))}
print("REPORT " + json.dumps(report))
"""


@pytest.fixture(scope="module")
def interpreter_report():
    env = dict(os.environ, TRITON_INTERPRET="1", TORCHDYNAMO_DISABLE="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", _INTERPRETER_SCRIPT], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, f"interpreter run failed:\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("REPORT "):])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_triton_sparse_mla_forward_in_interpreter(interpreter_report, dtype):
    entry = interpreter_report[dtype]
    for name in ("out", "lse"):  # includes an empty row (lse -inf, out 0): inf error otherwise
        assert entry["errors"][name] <= entry["tolerance"], (name, entry)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_triton_sparse_mla_backward_in_interpreter(interpreter_report, dtype):
    entry = interpreter_report[dtype]
    for name in ("grad_query", "grad_latents"):
        assert entry["errors"][name] <= entry["tolerance"], (name, entry)


def test_per_part_selection_runs_triton_in_interpreter(interpreter_report):
    selection = interpreter_report["selection"]
    assert selection["choices"]["sparse_mla"] == "triton"
    assert selection["choices"]["indexer"] == "ref"
    assert selection["same_as_direct"] and selection["differs_from_ref"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (Triton kernels on GPU)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_sparse_mla_on_gpu(dtype):
    from megatron_longstraw.kernels import triton_sparse_mla

    case = parity.sparse_mla_case(num_heads=64, d_qk=576, v_dim=512, num_keys=3000, topk=256,
                                  num_queries=33, dtype=dtype, device="cuda")
    errors = parity.sparse_mla_errors(triton_sparse_mla.sparse_mla_attention, case)
    assert max(errors.values()) <= parity.TOLERANCE[dtype], errors


# ---- FlashMLA ----------------------------------------------------------------------------------


def _fake_flash_mla_sparse_fwd(base2: bool, empty_lse: float):
    """flash_mla_sparse_fwd as its README / tests/ref.py define it, on the CPU. `base2`: the
    September-2025 convention (lse over logits scaled by log2 e); `empty_lse`: what rows with no
    valid index get (-inf there, +inf in later versions)."""

    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
        assert q.dtype == kv.dtype == torch.bfloat16 and indices.dtype == torch.int32
        assert q.shape[1] in (64, 128) and q.shape[2] in (512, 576) and d_v == 512
        assert kv.shape[1] == 1 and indices.shape[1] == 1 and indices.shape[2] % 64 == 0
        idx = indices[:, 0].long()
        invalid = (idx < 0) | (idx >= kv.shape[0])
        rows = kv[:, 0].float()[idx.clamp(0, kv.shape[0] - 1)]                   # [s, k, d]
        logits = torch.einsum("shd,skd->shk", q.float(), rows) * sm_scale
        logits = logits.masked_fill(invalid[:, None], float("-inf"))
        lse = torch.logsumexp(logits, -1)
        probs = torch.exp(logits - lse.nan_to_num(neginf=0.0)[..., None])
        out = torch.einsum("shk,skv->shv", probs, rows[..., :d_v])
        empty = torch.isneginf(lse)
        lse = lse * (1.4426950408889634 if base2 else 1.0)
        lse = lse.masked_fill(empty, empty_lse)
        return out.to(torch.bfloat16), logits.max(-1).values, lse

    return flash_mla_sparse_fwd


@pytest.mark.parametrize("base2,empty_lse", [(True, float("-inf")), (False, float("inf"))])
@pytest.mark.parametrize("num_heads", [20, 130])  # padded to 64; sliced into 128 + (2 -> 64)
def test_flashmla_wrapper_against_documented_contract(monkeypatch, base2, empty_lse, num_heads):
    from megatron_longstraw.kernels import flashmla

    _fake_module(monkeypatch, "flash_mla",
                 flash_mla_sparse_fwd=_fake_flash_mla_sparse_fwd(base2, empty_lse))
    monkeypatch.setattr(flashmla, "_on_gpu", lambda x: True)
    monkeypatch.setattr(flashmla, "_LSE_TO_NATURAL", {})
    case = parity.sparse_mla_case(num_queries=4, num_heads=num_heads, d_qk=576, v_dim=512,
                                  num_keys=50, topk=37, dtype=torch.bfloat16)
    errors = parity.sparse_mla_errors(flashmla.sparse_mla_attention, case, backward=False)
    # out: bf16 (see TOLERANCE); lse: float32 from bf16 inputs, summation-order differences only.
    assert errors["out"] <= parity.TOLERANCE[torch.bfloat16], errors
    assert errors["lse"] <= 1e-5, errors


def test_flashmla_wrapper_leaves_unsupported_calls_to_the_reference():
    from megatron_longstraw.kernels import flashmla

    case = parity.sparse_mla_case()  # fp32 on the CPU
    got = flashmla.sparse_mla_attention(case["query"], case["latents"], case["indices"],
                                        case["scale"], case["v_dim"])
    ref = refs.sparse_mla_attention(case["query"], case["latents"], case["indices"], case["scale"],
                                    case["v_dim"])
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_flashmla_on_gpu():
    reason = _usable("flashmla")
    if reason is not None:
        pytest.skip(f"flashmla: {reason}")
    from megatron_longstraw.kernels import flashmla

    case = parity.sparse_mla_case(num_queries=64, num_heads=64, d_qk=576, v_dim=512,
                                  num_keys=5000, topk=2048, dtype=torch.bfloat16, device="cuda")
    errors = parity.sparse_mla_errors(flashmla.sparse_mla_attention, case, backward=False)
    assert errors["out"] <= parity.TOLERANCE[torch.bfloat16] and errors["lse"] <= 1e-4, errors


# ---- DeepGEMM indexer --------------------------------------------------------------------------


def _fake_fp8_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=True,
                         max_seqlen_k=0):
    """deep_gemm.fp8_mqa_logits as DeepGEMM's README defines it, on the CPU."""
    k_fp8, k_scale = kv
    assert q.dtype == k_fp8.dtype == torch.float8_e4m3fn and k_scale.dtype == torch.float32
    assert weights.dtype == torch.float32 and cu_seq_len_k_start.dtype == torch.int32
    keys = k_fp8.float() * k_scale[:, None]
    logits = (torch.einsum("mhd,nd->mhn", q.float(), keys).relu() * weights[..., None]).sum(1)
    cols = torch.arange(keys.shape[0])
    inside = (cols[None] >= cu_seq_len_k_start[:, None]) & (cols[None] < cu_seq_len_k_end[:, None])
    return logits.masked_fill(~inside, float("-inf")) if clean_logits else logits


# FP8 e4m3 keeps 3 mantissa bits (element error up to 2^-4 relative); over 128-term dot products
# and 32 weighted heads the score error stays around 1-3% of the largest score: bound 6e-2.
# Selections then differ only among near-ties: recall of the reference top-k >= 0.85.
FP8_SCORE_TOLERANCE, FP8_MIN_RECALL = 6e-2, 0.85


def test_deepgemm_wrapper_against_documented_contract(monkeypatch):
    from megatron_longstraw.kernels import deepgemm

    _fake_module(monkeypatch, "deep_gemm", fp8_mqa_logits=_fake_fp8_mqa_logits)
    monkeypatch.setattr(deepgemm, "_sm_major", lambda x: 10)
    case = parity.indexer_case(num_queries=48, num_keys=300, dtype=torch.float32)
    args = (case["q"], case["weights"])
    scores = deepgemm.indexer_scores(*args, case["keys"], case["scale"], relu=True)
    ref = refs.indexer_scores(case["q"].double(), case["weights"].double(), case["keys"].double(),
                              case["scale"], relu=True)
    assert parity.relative_error(scores, ref) <= FP8_SCORE_TOLERANCE
    idx, _ = deepgemm.indexer_topk(*args, case["keys"], case["query_positions"],
                                   case["key_positions"], 64, case["scale"], True, key_block=128)
    ref_idx, _ = refs.indexer_topk(*args, case["keys"], case["query_positions"],
                                   case["key_positions"], 64, case["scale"], True, key_block=128)
    assert parity.topk_recall(idx, ref_idx) >= FP8_MIN_RECALL


def test_deepgemm_running_topk_equals_reference():
    """The blockwise top-k the DeepGEMM wrapper uses, fed reference scores, is the reference:
    same indices (ties included: integer-valued scores), same -1 padding, future blocks skipped."""
    from megatron_longstraw.kernels import deepgemm

    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-2, 3, (40, 4, 8), generator=gen).double()
    weights = torch.randint(0, 3, (40, 4), generator=gen).double()
    keys = torch.randint(-2, 3, (200, 8), generator=gen).double()
    query_positions = torch.cat([torch.arange(5), torch.arange(165, 200)])
    key_positions = torch.arange(200)
    for topk, block in [(16, 37), (16, 300), (300, 64)]:
        ref = refs.indexer_topk(q, weights, keys, query_positions, key_positions, topk, 0.5, True,
                                key_block=block)
        got = deepgemm.running_topk(lambda k: refs.indexer_scores(q, weights, k, 0.5, True), q, keys,
                                    query_positions, key_positions, topk, block)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_deepgemm_leaves_unsupported_calls_to_the_reference():
    from megatron_longstraw.kernels import deepgemm

    case = parity.indexer_case(num_queries=8, num_heads=4, head_dim=16, num_keys=50,
                               dtype=torch.float32)
    for relu in (True, False):  # CPU tensors; relu=False is never DeepGEMM's
        got = deepgemm.indexer_scores(case["q"], case["weights"], case["keys"], 0.3, relu)
        assert torch.equal(got, refs.indexer_scores(case["q"], case["weights"], case["keys"], 0.3, relu))


def test_deepgemm_on_gpu():
    reason = _usable("deepgemm")
    if reason is not None:
        pytest.skip(f"deepgemm: {reason}")
    from megatron_longstraw.kernels import deepgemm

    case = parity.indexer_case(num_queries=512, num_keys=8192, device="cuda")
    args = (case["q"], case["weights"])
    scores = deepgemm.indexer_scores(*args, case["keys"], case["scale"], relu=True)
    ref = refs.indexer_scores(case["q"].double(), case["weights"].double(), case["keys"].double(),
                              case["scale"], relu=True)
    assert parity.relative_error(scores, ref) <= FP8_SCORE_TOLERANCE
    positional = (case["query_positions"], case["key_positions"], 2048, case["scale"], True)
    idx, _ = deepgemm.indexer_topk(*args, case["keys"], *positional)
    ref_idx, _ = refs.indexer_topk(*args, case["keys"], *positional)
    assert parity.topk_recall(idx, ref_idx) >= FP8_MIN_RECALL


# ---- DeepEP, TransformerEngine, apex -----------------------------------------------------------


def test_deepep_overrides_are_megatron_config_fields(monkeypatch):
    from megatron_longstraw.kernels import deepep
    from megatron_longstraw.models.glm52.config import GLM52Config

    _fake_module(monkeypatch, "deep_ep", Buffer=object)
    assert deepep.transformer_config_overrides(expert_parallel_size=1) == {}
    overrides = deepep.transformer_config_overrides(expert_parallel_size=4)
    assert overrides["moe_token_dispatcher_type"] == "flex"
    cfg = GLM52Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                      v_head_dim=8, intermediate_size=32, moe_intermediate_size=16,
                      n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                      index_n_heads=2, index_head_dim=8, index_topk=4)
    tcfg = cfg.to_transformer_config(expert_model_parallel_size=4, **overrides)
    assert tcfg.moe_token_dispatcher_type == "flex"
    assert tcfg.moe_flex_dispatcher_backend == "deepep"


def test_deepep_on_gpu():
    reason = _usable("deepep")
    if reason is not None:
        pytest.skip(f"deepep: {reason}")
    from megatron_longstraw.kernels import deepep

    overrides = deepep.transformer_config_overrides(expert_parallel_size=2)
    assert overrides["moe_flex_dispatcher_backend"] == "deepep"


def test_te_provider_builds_the_glm52_spec():
    reason = _usable("te")
    if reason is not None:
        pytest.skip(f"te: {reason}")
    from megatron.core.extensions.transformer_engine import TELinear, TENorm

    from megatron_longstraw.kernels import te
    from megatron_longstraw.models.glm52.spec import glm52_stack_spec

    spec = glm52_stack_spec(backend=te.spec_provider())
    attention = spec.submodules.dsa_layer.submodules.self_attention.submodules
    assert attention.core_attention.submodules.indexer.submodules.linear_wk is TELinear
    assert spec.submodules.dsa_layer.submodules.input_layernorm is TENorm


def test_apex_fused_adam_matches_adamw():
    reason = _usable("apex")
    if reason is not None:
        pytest.skip(f"apex: {reason}")
    from megatron_longstraw.kernels import nvidia_apex

    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(1000, generator=gen, device="cuda") for _ in range(2)]
    grads = [torch.randn(1000, generator=gen, device="cuda") for _ in range(2)]
    results = []
    for cls in (nvidia_apex.optimizer_class(), torch.optim.AdamW):
        ps = [torch.nn.Parameter(p.clone()) for p in params]
        opt = cls(ps, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        for _ in range(3):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opt.step()
        results.append(torch.cat([p.detach() for p in ps]))
    # fp32 updates of O(1e-2) from fused vs foreach kernels: rounding differences only.
    assert parity.relative_error(results[0], results[1]) <= 1e-5


# ---- selection ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend,package", [("flashmla", "flash_mla"), ("deepgemm", "deep_gemm"),
                                             ("deepep", "deep_ep"), ("te", "transformer_engine"),
                                             ("apex", "apex")])
def test_explicit_missing_backend_fails_naming_the_package(backend, package):
    if packages.is_installed(package):
        pytest.skip(f"`{package}` is installed here")
    with pytest.raises(packages.MissingKernelPackage) as info:
        select.use(backend)
    message = str(info.value)
    assert f"`{package}` is not installed" in message
    assert packages.PACKAGES[package].install in message
    assert select.choices()["sparse_mla"] == "ref"  # nothing changed


def test_wrappers_fail_naming_the_package_when_called_without_it(monkeypatch):
    from megatron_longstraw.kernels import deepep, te

    for name in ("deep_ep", "transformer_engine"):
        if packages.is_installed(name):
            pytest.skip(f"`{name}` is installed here")
    with pytest.raises(packages.MissingKernelPackage, match="DeepEP"):
        deepep.transformer_config_overrides(expert_parallel_size=8)
    with pytest.raises(packages.MissingKernelPackage, match="TransformerEngine"):
        te.spec_provider()


def test_registry_snapshot_without_the_api_is_rejected(monkeypatch):
    _fake_module(monkeypatch, "flash_mla")  # importable, but no flash_mla_sparse_fwd
    with pytest.raises(packages.MissingKernelPackage, match="has no `flash_mla_sparse_fwd`"):
        packages.require("flash_mla")


def test_auto_falls_back_to_ref_and_logs(monkeypatch, caplog):
    monkeypatch.setattr(select, "_cuda_available", lambda: False)
    with caplog.at_level(logging.INFO, logger="megatron_longstraw.kernels.select"):
        chosen = select.use("auto")
    assert set(chosen.choices.values()) == {"ref"}
    assert chosen.sparse_mla_attention.__self__ is chosen  # dispatching method, ref functions
    assert chosen.indexer_topk is refs.indexer_topk
    assert "auto selected" in caplog.text and "sparse_mla=ref" in caplog.text
    assert "triton: no CUDA device" in caplog.text
    assert select.moe_config_overrides(expert_parallel_size=4) == {}
    assert select.dense_spec_provider() is None
    assert select.optimizer_class() is torch.optim.AdamW


def test_auto_prefers_a_usable_backend(monkeypatch):
    monkeypatch.setattr(select, "unusable_reason",
                        lambda name, for_auto=False: None if name in ("ref", "triton") else "absent")
    chosen = select.use("auto,sparse_mla_grad=ref")
    assert chosen.choices == {"sparse_mla": "triton", "sparse_mla_grad": "ref", "indexer": "ref",
                              "attention": "ref", "moe": "ref", "dense": "ref", "optimizer": "ref",
                              "fp8_gemm": "ref"}


def test_per_part_specs():
    assert select.parse_spec("sparse_mla=triton,indexer=ref") == {
        "sparse_mla": "triton", "sparse_mla_grad": "ref", "indexer": "ref", "attention": "ref",
        "moe": "ref", "dense": "ref", "optimizer": "ref", "fp8_gemm": "ref"}
    assert select.parse_spec("triton")["sparse_mla_grad"] == "triton"
    assert select.parse_spec("flashmla") == {**select.parse_spec("ref"), "sparse_mla": "flashmla"}
    assert select.parse_spec("auto, indexer = ref")["indexer"] == "ref"
    assert select.use("sparse_mla=ref,indexer=ref").choices["indexer"] == "ref"


def test_the_step_adopts_its_spec_and_selects_only_when_it_is_not_active(monkeypatch):
    """`select.adopt` (the step's and the scoring loop's call): a spec that is not the active one is
    selected (a library caller who never called `use`); the active one is left as set-up made it."""
    chosen = select.adopt("sparse_mla=ref,indexer=ref")         # nobody selected: adopt selects
    assert select.kernels() is chosen and chosen.choices["indexer"] == "ref"
    calls = []
    monkeypatch.setattr(select, "use", lambda spec: calls.append(spec))
    assert select.adopt("sparse_mla=ref,indexer=ref") is chosen and calls == []
    select.adopt("ref")                                         # a different spec: selected
    assert calls == ["ref"]


def test_calls_under_autograd_go_to_the_grad_backend():
    calls = []
    kernel_set = select.KernelSet(
        choices={}, indexer_topk=refs.indexer_topk,
        _sparse_mla=lambda *a: calls.append("sparse_mla") or refs.sparse_mla_attention(*a),
        _sparse_mla_grad=lambda *a: calls.append("grad") or refs.sparse_mla_attention(*a))
    case = parity.sparse_mla_case(num_queries=2, num_heads=2, topk=4)
    args = (case["indices"], case["scale"], case["v_dim"])
    kernel_set.sparse_mla_attention(case["query"], case["latents"], *args)
    kernel_set.sparse_mla_attention(case["query"].requires_grad_(), case["latents"], *args)
    with torch.no_grad():
        kernel_set.sparse_mla_attention(case["query"], case["latents"], *args)
    assert calls == ["sparse_mla", "grad", "sparse_mla"]


@pytest.mark.parametrize("spec", ["flashy", "", "bogus=ref", "indexer=triton", "auto,ref",
                                  "sparse_mla=ref,sparse_mla=triton", "sparse_mla=", "auto,,ref"])
def test_malformed_specs_are_rejected(spec):
    with pytest.raises(ValueError):
        select.use(spec)


def test_cli_choices_accept_backends_and_part_specs():
    from megatron_longstraw.training.arguments import KERNELS

    assert {"auto", "ref", "flashmla", "triton", "deepgemm", "deepep", "te", "apex"} <= set(KERNELS)
    assert "sparse_mla=triton,indexer=ref" in KERNELS
    assert "flashy" not in KERNELS and "indexer=triton" not in KERNELS


# ---- Qwen3.6 Gated DeltaNet: the parity harness (kernels/parity.py, tools/device_check.py) --------
# On a GPU the harness compares FLA's chunk kernel with the fp64 reference; here it runs with
# Megatron's torch rule (fp32) on both sides, so the harness itself is checked on CPU.


def _device_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("device_check", REPO / "tools" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gdn_split_property_harness_with_the_torch_rule():
    """[0, n) then [n, N) from the carried state equals [0, N) in one call (fp32 torch rule vs the
    fp64 reference, tolerance `parity.GDN_TOLERANCE[fp32]`: measured ~1e-6, see parity.py), at a
    chunk-aligned and an unaligned split; and the check is not vacuous: a rule that drops the
    carried state passes the one-call check (zero initial state) but fails every split."""
    from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule

    dc = _device_check()
    tol = parity.GDN_TOLERANCE[torch.float32]
    for initial_state in (False, True):
        case = parity.gdn_case(150, **dc.TINY_GDN, dtype=torch.float32, initial_state=initial_state)
        errors = parity.gdn_errors(torch_chunk_gated_delta_rule, case, split_at=(64, 101))
        assert set(errors) == {"one call", "split at 64", "split at 101"}
        assert max(max(e.values()) for e in errors.values()) <= tol, errors

    def drops_state(*args, initial_state=None, **kwargs):
        return torch_chunk_gated_delta_rule(*args, initial_state=None, **kwargs)

    case = parity.gdn_case(150, **dc.TINY_GDN, dtype=torch.float32)
    broken = parity.gdn_errors(drops_state, case, split_at=(64, 101))
    assert max(broken["one call"].values()) <= tol
    for split in ("split at 64", "split at 101"):
        assert broken[split]["out"] > 100 * tol and broken[split]["state"] > 100 * tol, broken


def test_device_check_gdn_section_runs_on_cpu():
    """Without CUDA the section runs the torch rule at a tiny shape (one call, splits, gradients)
    with no failure and reports FLA as skipped with the reason."""
    dc = _device_check()
    result = dc.qwen36_gdn_parity()
    assert dc.RESULTS["failures"] == []
    assert "no CUDA" in result["fla"]["skipped"]
    assert result["torch fp32, initial state"]["split at 101"]["ok"]
    assert result["torch fp32, gradients"]["ok"]


def test_device_check_capacity_section_runs_on_cpu():
    """Part 8 of tools/device_check.py without CUDA: streamed capture of the tiny GLM-5.2 at two
    prompt lengths, the device peak (host storage left out) beside the planner's capture lines;
    its growth is the planner's positions table exactly."""
    dc = _device_check()
    import argparse

    result = dc.capacity(argparse.Namespace(kernels="ref", start_prompt_len=512))
    assert result["ok"] and dc.RESULTS["failures"] == []
    assert result["device_peak_growth_bytes"] == result["planned_growth_bytes"] == 8 * 384
    for point in result["points"]:
        assert point["measured_device_peak_bytes"] > 0
        assert point["measured_host_peak_bytes"] == point["page_bytes"] + sum(
            point["planned_host_bytes"].values())
