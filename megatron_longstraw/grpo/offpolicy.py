"""Off-policy correction between the inference engine that sampled the responses and the trainer.

The engine (SGLang, vLLM, ...) samples response tokens from pi_engine and may report their
log-probs (`logprobs_old` in the JSONL). The trainer's own pre-step scoring gives pi_old, the
policy the PPO ratio is taken against. Both should be the same policy, but kernels, precision,
MoE routing and DSA selections differ between the two stacks, so they are not. The step uses

    rho_t = pi_theta / pi_old                                   the PPO ratio (always the trainer's
                                                                 own pi_old: a biased denominator
                                                                 would bias every clip decision)
    r_t   = pi_old / pi_engine = exp(logp_old_t - logp_engine_t)  the engine-trainer ratio
    w_t   = truncate: min(r_t, C)                               truncated importance sampling (TIS)
            mask:     r_t if 1/C <= r_t <= C, else 0            masked importance sampling: a token
                                                                 whose two log-probs disagree by
                                                                 more than log C contributes nothing
            off:      1                                         (the mismatch is only logged)

and multiplies w_t, a constant (no gradient), into token t's policy term (grpo.member_loss's
`token_weight`). Without engine log-probs there is nothing to correct: w_t = 1 and no mismatch
figures are logged.

Mismatch figures per step (`mismatch_stats`), over the response tokens that carry engine log-probs,
with d_t = logp_old_t - logp_engine_t:

    mismatch_abs_mean   mean |d_t|
    mismatch_abs_max    max |d_t|
    mismatch_kl         KL(engine || trainer), the k3 estimator over the engine's samples:
                        mean(exp(d_t) - 1 - d_t); unbiased for the KL since E_engine[exp(d)] = 1,
                        and >= 0 token by token (k1, mean(-d_t), can go negative on few tokens)
    tis_frac            the fraction of tokens truncated (r_t > C) or masked (r_t outside
                        [1/C, C]); absent with `off`
"""

from __future__ import annotations

import math

import torch

from megatron_longstraw.config.loss import check_tis


def importance_weights(logp_old: torch.Tensor, logp_engine: torch.Tensor, mode: str,
                       cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weights w_t of one member (module docstring) and which tokens were corrected.

    Args:
        logp_old: [R_i] the trainer's pre-step log-probs of the response tokens.
        logp_engine: [R_i] the engine's log-probs of the same tokens.
        mode: "off" | "truncate" | "mask".
        cap: C >= 1.

    Returns:
        ``(weights, corrected)``: [R_i] float64 weights (constants, no graph) and a [R_i] bool
        mask of the tokens truncated (r_t > C) or masked (r_t outside [1/C, C]); none with "off".
    """
    check_tis(mode, cap)
    if logp_old.shape != logp_engine.shape:
        raise ValueError(f"engine log-probs shape {tuple(logp_engine.shape)} != the trainer's "
                         f"{tuple(logp_old.shape)}; give one engine log-prob per response token.")
    d = logp_old.detach().double() - logp_engine.detach().double()   # log r_t
    ratio = torch.exp(d)   # may be inf for a huge d: min(inf, C) = C, and inf > C is masked
    if mode == "off":
        return torch.ones_like(d), torch.zeros_like(d, dtype=torch.bool)
    log_cap = math.log(cap)
    if mode == "truncate":
        corrected = d > log_cap
        return torch.clamp(ratio, max=cap), corrected
    corrected = (d > log_cap) | (d < -log_cap)
    return torch.where(corrected, torch.zeros_like(ratio), ratio), corrected


def mismatch_stats(logps_old: list[torch.Tensor], logps_engine: list[torch.Tensor],
                   corrected: list[torch.Tensor] | None) -> dict[str, float]:
    """The mismatch figures of one group (module docstring) over all its members' tokens.

    Args:
        logps_old, logps_engine: G tensors [R_i], the trainer's and the engine's log-probs.
        corrected: G bool tensors [R_i] from `importance_weights`, or None with mode "off"
            (then `tis_frac` is left out).
    """
    d = torch.cat([o.detach().double() - e.detach().double()
                   for o, e in zip(logps_old, logps_engine)])
    stats = {"mismatch_abs_mean": float(d.abs().mean()),
             "mismatch_abs_max": float(d.abs().max()),
             "mismatch_kl": float((torch.expm1(d) - d).mean())}
    if corrected is not None:
        stats["tis_frac"] = float(torch.cat(corrected).double().mean())
    return stats
