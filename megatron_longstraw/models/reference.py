"""The reference LongStraw's log-probs and gradients are checked against: one plain Megatron forward
of the whole sequence [prompt; response], no capture, no scoring or replay pass. The tests, the
evidence tool (tools/evidence.py), the bench's conventional GRPO (tools/bench.py) and the GPU
device check all call this one function."""

from __future__ import annotations

import torch

# The MLA modules whose outputs are the captured latent rows: `linear_kv_down_proj` gives
# [c_kv; k_pe] (k_pe is what rope rotates), `kv_layernorm` gives kv_norm(c_kv).
_LATENT_MODULES = ("linear_kv_down_proj", "kv_layernorm")


def full_sequence_logprobs(model, prompt: torch.Tensor, response: torch.Tensor,
                           detach_prompt_state: bool = False) -> torch.Tensor:
    """Log-probs of `response` after `prompt` from one plain forward `model(ids[None], None, None)`
    of ids = [prompt; response] (no LongStraw pass; gradients follow autograd's defaults, so the
    caller decides with `torch.no_grad()`).

    prompt: [P] token ids (long); response: [R] token ids (long). Returns [R]: row i is
    log p(response[i] | prompt, response[:i]), i.e. the logits' rows P-1 .. P+R-2, in the logits'
    dtype promoted to at least float32 (bf16 -> fp32, fp32 stays, fp64 stays). Only those R rows
    are normalised (log_softmax is per row, so the values equal those of the whole [S, V]; the
    [S, V] float32 copy is never made).

    detach_prompt_state: detach, at every layer, the MLA latent rows `[kv_norm(c_kv); rope(k_pe)]`
    of the tokens before the prompt's last one (P-1 rows), i.e. the state LongStraw captures: the
    `linear_kv_down_proj` output rows (k_pe) and the `kv_layernorm` output rows (c_kv). The indexer
    runs without autograd anyway, so the gradient is then exactly the conditional gradient at fixed
    prompt state, what LongStraw's detached prompt gradient computes. Models without MLA modules
    (Qwen3.6) have nothing to detach.
    """
    ids = torch.cat([prompt, response])                                # [S], S = P + R
    num_captured = prompt.numel() - 1
    hooks = []
    if detach_prompt_state:
        def detach_rows(module, args, output):
            if isinstance(output, tuple):  # Megatron linear: (output [s, 1, n], bias)
                out, bias = output
                return torch.cat([out[:num_captured].detach(), out[num_captured:]]), bias
            return torch.cat([output[:num_captured].detach(), output[num_captured:]])
        for name, module in model.named_modules():
            if name.endswith(_LATENT_MODULES):
                hooks.append(module.register_forward_hook(detach_rows))
    try:
        logits = model(ids[None], None, None)[0]                       # [S, V]
    finally:
        for hook in hooks:
            hook.remove()
    start = prompt.numel() - 1                                         # the row scoring response[0]
    rows = logits[start:start + response.numel()]                      # [R, V]
    logp = torch.log_softmax(rows.to(torch.promote_types(rows.dtype, torch.float32)), dim=-1)
    return logp.gather(-1, response[:, None]).squeeze(-1)
