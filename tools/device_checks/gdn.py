"""Part 5 of tools/device_check.py: Qwen3.6 Gated DeltaNet. FLA's Triton `chunk_gated_delta_rule`
(what Megatron's GatedDeltaNet runs on a GPU) and Megatron's `torch_chunk_gated_delta_rule` in
fp32 against the same algorithm in fp64, at Qwen3.6 head shapes: output and final state from zero
and from a nonzero initial state, split runs, gradients, timing. Without CUDA or FLA only the torch
rule runs, at a tiny shape."""

from __future__ import annotations

import time

import torch

from megatron_longstraw.kernels.parity import (
    GDN_GRAD_TOLERANCE, GDN_TOLERANCE, gdn_case, gdn_errors, gdn_grad_errors, gdn_run,
)

from .common import check, median_ms, say
from .environment import fla_version

QWEN_GDN = dict(num_key_heads=16, num_value_heads=48, head_dim=128)   # examples/qwen36/full.yaml
TINY_GDN = dict(num_key_heads=2, num_value_heads=6, head_dim=16)      # CPU: the torch rule only

# What the GPU part needs at most: FLA autotunes and compiles its Triton kernels at first use (a
# cost paid once per process: the Qwen3.6 step runs the same kernels at the same head shapes).
GDN_SECONDS = 120.0


def _gdn_checks(label: str, rule, case: dict, dtype, split_at, tolerance: float) -> dict:
    out = {}
    for name, errors in gdn_errors(rule, case, dtype, split_at).items():
        out[name] = check(f"{label}: {name}", errors, tolerance)
    return out


def qwen36_gdn_parity(deadline: float | None = None) -> dict:
    """FLA's chunk kernel (GPU) and Megatron's torch rule in fp32 against the fp64 reference at
    Qwen3.6 shapes: from zero state, from a nonzero initial state, split runs; gradients; timing.
    Without CUDA or FLA: the torch rule alone at a tiny shape (checks this harness), FLA skipped."""
    from megatron.core.ssm.gated_delta_net import common as gdn_common

    if torch.cuda.is_available():
        fla_reason = None if gdn_common.HAVE_FLA else fla_version()
        shape, num_tokens, device = QWEN_GDN, 4096, "cuda"
        if deadline is not None and time.perf_counter() + GDN_SECONDS > deadline:
            say(f"  skipped: fewer than {GDN_SECONDS:.0f} s of the time budget left")
            return {"skipped": "time budget"}
    else:
        fla_reason = "no CUDA device (FLA's chunk kernel is Triton, GPU only)"
        shape, num_tokens, device = TINY_GDN, 200, "cpu"
    # One chunk-aligned split (FLA and the torch rule work in chunks of 64 tokens) and one inside
    # a chunk: replay starts at any prefix length, capture's last block ends anywhere.
    aligned = 64 * (num_tokens // 128)
    split_at = (aligned, aligned + 37)
    say(f"  {num_tokens} tokens, {shape['num_value_heads']} value heads ({shape['num_key_heads']} "
        f"QK heads expanded), d_k = d_v = {shape['head_dim']}, on {device}; reference: Megatron's "
        "torch_chunk_gated_delta_rule in fp64; splits at " + " and ".join(map(str, split_at)))
    result = {"shape": dict(shape, num_tokens=num_tokens)}
    cases = {"zero state": gdn_case(num_tokens, **shape, device=device),
             "initial state": gdn_case(num_tokens, **shape, device=device, initial_state=True)}
    torch_rule = gdn_common.torch_chunk_gated_delta_rule
    for case_name, case in cases.items():
        result[f"torch fp32, {case_name}"] = _gdn_checks(
            f"torch rule fp32, {case_name}", torch_rule, case, torch.float32, split_at,
            GDN_TOLERANCE[torch.float32])
    result["torch fp32, gradients"] = check(
        "torch rule fp32, initial state: gradients",
        gdn_grad_errors(torch_rule, cases["initial state"], torch.float32),
        GDN_GRAD_TOLERANCE[torch.float32])
    if fla_reason is not None:
        say(f"  skipped: FLA chunk_gated_delta_rule: {fla_reason}")
        result["fla"] = {"skipped": fla_reason}
        return result

    fla_rule = gdn_common.chunk_gated_delta_rule
    for case_name, case in cases.items():
        result[f"fla bf16, {case_name}"] = _gdn_checks(
            f"FLA chunk_gated_delta_rule bf16, {case_name}", fla_rule, case, None, split_at,
            GDN_TOLERANCE[torch.bfloat16])
    result["fla bf16, gradients"] = check(
        "FLA chunk_gated_delta_rule bf16, initial state: gradients",
        gdn_grad_errors(fla_rule, cases["initial state"]), GDN_GRAD_TOLERANCE[torch.bfloat16])
    result["timing"] = _gdn_timing(fla_rule, torch_rule)
    return result


def _gdn_timing(fla_rule, torch_rule) -> dict:
    out = {}
    say("  Gated DeltaNet forward, 48 value heads x 128, from an initial state (median ms):")
    for num_tokens in (4096, 65536):
        case = gdn_case(num_tokens, **QWEN_GDN, device="cuda", initial_state=True)
        rules = {"fla bf16": (fla_rule, None)}
        if num_tokens == 4096:
            rules["torch fp32"] = (torch_rule, torch.float32)
        for name, (rule, dtype) in rules.items():
            with torch.no_grad():
                ms = median_ms(lambda: gdn_run(rule, case, dtype), warmup=2, repeats=5)
            out[f"{name}, {num_tokens} tokens"] = {"forward_ms": ms,
                                                   "tokens_per_s": num_tokens / ms * 1e3}
            say(f"    {name:10s} {num_tokens:6d} tokens: {ms:8.2f} ms "
                f"({num_tokens / ms * 1e3:11.0f} tokens/s per layer)")
    return out
