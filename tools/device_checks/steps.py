"""Parts 6 and 7 of tools/device_check.py: one LongStraw GRPO step (capture, scoring, replay with
backward) of GLM-5.2 with 4 layers at the real widths, and of Qwen3.6 with 4 layers at the
full.yaml widths, at prompt lengths doubling until memory or the step's share of the time budget
runs out (sweep.py). Each step is written for its family (registry name)."""

from __future__ import annotations

import dataclasses
import gc
import time
import traceback

import torch

from megatron_longstraw.models.reference import full_sequence_logprobs
from megatron_longstraw.models.registry import get_family
from megatron_longstraw.kernels import select

from .common import REPO, RESULTS, check, say
from .environment import fla_version
from .sweep import build_on_gpu, cuda_group, prompt_sweep

QWEN_FULL = REPO / get_family("qwen36").full_config
# Replay vs a full-sequence forward of the bf16 Qwen3.6 step, max |log-prob difference| in nats.
# Both compute the same function with different blocking (FLA chunks restart at the replayed
# prefix, capture's token blocks, attention's key blocks), so they differ by rounding alone:
# every layer's output is rounded to bf16 (2^-9 relative) and the logits come out of the output
# layer in bf16, where one ulp at |logit| in [2, 4) is 2^-6 = 1.6e-2. A few ulps of the largest
# logits: 1e-1. For scale the check also reports how much dropping the prompt changes the
# log-probs (a replay that lost the prompt state would be off by about that much).
QWEN_LOGP_TOLERANCE = 1e-1
QWEN_STEP_MIN_SECONDS = 60.0   # building the 4.1B-parameter model, the first step and its checks


def _build_model():
    from megatron_longstraw.distributed import parallel
    from megatron_longstraw.runtime import precision

    glm52 = get_family("glm52")
    parallel.initialize(context_parallel_size=1, expert_parallel_size=1)
    precision.use_dtype(torch.bfloat16)
    cfg = glm52.config_class(num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=16)
    model = build_on_gpu(lambda **kw: glm52.build_model(cfg, params_dtype=torch.bfloat16, **kw))
    num_params = sum(p.numel() for p in model.parameters())
    say(f"  GLM-5.2, {cfg.num_hidden_layers} layers ({cfg.hybrid_layer_pattern()}), hidden "
        f"{cfg.hidden_size}, {cfg.num_attention_heads} heads, {cfg.n_routed_experts} experts: "
        f"{num_params / 1e9:.2f}B parameters, bf16")
    return cfg, model


def model_step(args, deadline: float) -> dict:
    from megatron_longstraw.config.settings import LongStrawConfig
    from megatron_longstraw.step.schedule import forward_backward_longstraw

    cfg, model = _build_model()
    ls = LongStrawConfig.of(group_size=2, max_response_len=args.response_len, kernels=args.kernels,
                         token_block=8192, query_block=1024, key_block=4096, offload_pages=True)
    out = {"kernels": args.kernels, "steps": []}

    # Kernels vs reference, end to end: scoring log-probs of one small group (forward only).
    try:
        group = cuda_group(cfg, 4096, min(64, args.response_len), seed=1)
        logps = {}
        for spec in ("ref", args.kernels):
            result = forward_backward_longstraw(model, group, LongStrawConfig.of(
                **{**ls.__dict__, "kernels": spec}), forward_only=True)
            logps[spec] = torch.cat(result.logps).float()
        diff = (logps["ref"] - logps[args.kernels]).abs().max().item()
        out["logp_max_diff_vs_ref"] = diff
        say(f"  scoring log-probs, kernels {args.kernels!r} ({select.choices()}) vs ref, P = 4096: "
            f"max |diff| {diff:.3e} (bf16 model; FP8 indexer selections may differ at near-ties)")
    except Exception:  # noqa: BLE001
        RESULTS["failures"].append("model step: kernels vs ref")
        say("FAILED: kernels vs ref log-probs\n" + traceback.format_exc())

    prompt_sweep(model, cfg, ls, args, deadline, out)
    return out


# Qwen3.6 ------------------------------------------------------------------------------------------

def _build_qwen36(args):
    """Qwen3.6 with 4 decoder layers (`G-G-G-*`) at the full.yaml widths, bf16, on the GPU, with
    the dense backend of --kernels, and slow GDN decays."""
    from megatron_longstraw.distributed import parallel
    from megatron_longstraw.runtime import precision

    qwen36 = get_family("qwen36")
    parallel.initialize(context_parallel_size=1, expert_parallel_size=1)
    precision.use_dtype(torch.bfloat16)
    cfg = dataclasses.replace(qwen36.config_class.from_yaml(QWEN_FULL), num_hidden_layers=4)
    select.use(args.kernels)
    backend = select.dense_spec_provider()

    def build(backend):
        return build_on_gpu(lambda **kw: qwen36.build_model(
            cfg, params_dtype=torch.bfloat16, backend=backend, **kw))

    try:
        model = build(backend)
    except Exception:  # noqa: BLE001
        if backend is None:
            raise
        RESULTS["failures"].append("qwen36 build with dense=te")
        say("FAILED: Qwen3.6 with TransformerEngine's linear layers; building with dense=ref\n"
            + traceback.format_exc())
        model = build(None)
    # Megatron initialises A in [1, 16]: every head forgets within a few tokens, so the GDN state
    # would carry almost nothing from the prompt into the responses. A in [0.02, 0.5] (as
    # tests/helpers.build_tiny_qwen) keeps it carrying.
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(0.02, 0.5, generator=gen).log())
    num_params = sum(p.numel() for p in model.parameters())
    say(f"  Qwen3.6, {cfg.num_hidden_layers} layers ({cfg.hybrid_layer_pattern()}), hidden "
        f"{cfg.hidden_size}, GDN {cfg.linear_num_value_heads} value / {cfg.linear_num_key_heads} "
        f"QK heads x {cfg.linear_key_head_dim}, attention {cfg.num_attention_heads} / "
        f"{cfg.num_key_value_heads} heads x {cfg.head_dim}: {num_params / 1e9:.2f}B parameters, "
        f"bf16, dense={select.choices()['dense']}")
    num_full = cfg.num_full_attention_layers()
    num_gdn = cfg.num_hidden_layers - num_full
    say(f"  captured state per prompt: GDN {num_gdn * cfg.gdn_state_bytes() / 2**20:.1f} MiB "
        f"({num_gdn} layers, fixed) + K/V {cfg.page_bytes_per_token() / 2**10:.0f} KiB per token "
        f"({num_full} layer, bf16)")
    return cfg, model


def _replay_vs_full_sequence(model, result, group, out: dict) -> None:
    """Replay (and scoring) log-probs of the step against a full-sequence forward per member."""
    diffs = {"replay": 0.0, "scoring": 0.0}
    prompt_effect = 0.0
    for i, response in enumerate(group.response_ids):
        with torch.no_grad():
            full = full_sequence_logprobs(model, group.prompt_ids, response)
            alone = full_sequence_logprobs(model, group.prompt_ids[-1:], response)
        for name, logp in (("replay", result.logps[i]), ("scoring", result.logps_old[i])):
            diffs[name] = max(diffs[name],
                              (logp.detach().to(full) - full).abs().max().item())
        prompt_effect = max(prompt_effect, (alone - full).abs().max().item())
    out["logps_vs_full_sequence"] = check(
        f"qwen36 log-probs vs a full-sequence forward, P = {group.prompt_ids.numel()} (bf16, "
        "max |diff| in nats)", diffs, QWEN_LOGP_TOLERANCE)
    out["logps_vs_full_sequence"]["prompt_effect"] = prompt_effect
    say(f"    for scale: dropping the prompt changes the log-probs by up to {prompt_effect:.3e}"
        + ("" if prompt_effect > QWEN_LOGP_TOLERANCE else "; NOTE: no more than the tolerance, so "
           "this check cannot tell a lost prompt state from rounding"))


def qwen36_step(args, deadline: float) -> dict:
    """One LongStraw GRPO step of a 4-layer, full-width Qwen3.6 at doubling prompt lengths."""
    if not torch.cuda.is_available():
        say("  skipped: no CUDA device")
        return {"skipped": "no CUDA device"}
    from megatron.core.ssm.gated_delta_net import common as gdn_common

    if not gdn_common.HAVE_FLA:
        reason = f"flash-linear-attention {fla_version()}"
        say(f"  skipped: {reason}")
        return {"skipped": reason}
    if deadline - time.perf_counter() < QWEN_STEP_MIN_SECONDS:
        say(f"  skipped: fewer than {QWEN_STEP_MIN_SECONDS:.0f} s of the time budget left")
        return {"skipped": "time budget"}
    from megatron_longstraw.config.settings import LongStrawConfig

    gc.collect()                  # the GLM-5.2 model of the previous section
    torch.cuda.empty_cache()
    cfg, model = _build_qwen36(args)
    ls = LongStrawConfig.from_yaml(QWEN_FULL).replace(group_size=2,
                             max_response_len=args.response_len, kernels=args.kernels,
                             offload_pages=True)
    say(f"  blocks from full.yaml: token {ls.capture.token_block}, query {ls.capture.query_block}, key "
        f"{ls.capture.key_block}; deadline in {deadline - time.perf_counter():.0f} s")
    out = {"kernels": args.kernels, "steps": []}

    def first_step(result, group):
        try:
            _replay_vs_full_sequence(model, result, group, out)
        except Exception:  # noqa: BLE001
            RESULTS["failures"].append("qwen36 log-probs vs full sequence")
            say("FAILED: qwen36 log-probs vs full sequence\n" + traceback.format_exc())

    prompt_sweep(model, cfg, ls, args, deadline, out, on_first_step=first_step)
    if out["steps"]:
        fixed = {s["prompt_len"]: s["fixed_page_bytes"] for s in out["steps"]}
        out["gdn_state_fixed"] = len(set(fixed.values())) == 1
        say(f"  GDN state bytes per prompt length: {fixed} "
            f"({'fixed' if out['gdn_state_fixed'] else 'NOT fixed'})")
        if not out["gdn_state_fixed"]:
            RESULTS["failures"].append("qwen36 GDN state not fixed-size")
    return out
