"""GRPO loss math (pure PyTorch).

For one prompt we sample a group of ``G`` responses; member ``i`` has ``R_i``
response tokens and scalar reward ``r_i``::

    A_i      = (r_i - mean(r)) / (std(r) + eps)
    rho_it   = exp(logp_it - logp_old_it)
    L_policy = -(1/G) * sum_i (1/R_i) * sum_t w_it * min(rho_it*A_i, clip(rho_it, 1-eps_lo, 1+eps_hi)*A_i)
    L_kl     = beta * (1/G) * sum_i (1/R_i) * sum_t (exp(ref-logp) - (ref-logp) - 1)   # k3

``logp_old`` is the trainer's own pre-step log-prob. ``w_it`` is an optional per-token constant
weight (default 1): the engine-trainer importance weight of offpolicy.py (truncated or masked
pi_old / pi_engine) when the responses came from an inference engine that reported its
log-probs. It multiplies the policy term only; the KL term is the trainer's own and unweighted.
It changes no divisor: a token whose ``w_it`` is 0 (masked importance sampling drops it: its two
log-probs disagree) loses its policy term but still counts in ``R_i`` (and in ``T`` under
token_mean), as in TIS / MIS. A loss mask is another thing (below): an untrained token leaves the
divisors too.

Divisors. The loss is a mean over members (``1/G``) of per-member token means
(``1/R_i``). Because the prompt is huge, members are processed one at a time
(each sharing the cached prompt), so :func:`member_loss` returns member ``i``'s
contribution *already scaled by* ``1/(G*R_i)``. Nothing divides again later:
the group loss and its gradients are plain sums over members, which is exactly
what :func:`grpo_loss` computes and what a per-member schedule must reproduce.

Options (``GRPOLossConfig``; each off by default, today's loss unchanged). With
``s_it = w_it * min(rho_it*A_i, clip(rho_it)*A_i)`` and ``k_it`` the k3 term:

    aggregation "sequence_mean" (default)  L = (1/G) sum_i (1/R_i) sum_t (-s_it + beta*k_it)
    aggregation "token_mean" (DAPO)        L = (1/T) sum_i sum_t (-s_it + beta*k_it),  T = sum_i R_i
    aggregation "constant" (Dr. GRPO)      L = (1/G) sum_i (1/C) sum_t (-s_it + beta*k_it),  C const
    dual_clip c (> 1)     A_i < 0: s_it = w_it * max(min(rho_it*A_i, clip(rho_it)*A_i), c*A_i)
    log_ratio_clamp d     rho_it = exp(clamp(logp_it - logp_old_it, -d, d))
    kl_clamp k            k_it = min(exp(ref-logp) - (ref-logp) - 1, k)

Loss masks (agent trajectories; ``m_it`` = 1 where the policy produced token t, 0 for tool
observations and other context): every sum over t runs over trained tokens only, and ``R_i`` and
``T`` count trained tokens (``sum_t m_it``, ``sum_i sum_t m_it``); the masked tokens still run
through the forward as context, only their terms go. Without a mask every ``m_it`` is 1.

Every divisor is known before replay (the response lengths are): member ``i``'s share divides by
``G*R_i``, ``T`` (the whole group's token count, the same for every member) or ``G*C``
(:func:`loss_divisor`), so the member-by-member sum is still the group loss and its gradient.
A clamp is flat outside its range: a clamped token's term gets no gradient through it.

:class:`GRPOGroup` (data/group.py) is the input all of this is about (one prompt, its G
responses and rewards); data/groups.py reads it, step/schedule.py steps on it.
"""

from __future__ import annotations

import math

from collections.abc import Sequence

import torch

from megatron_longstraw.config.loss import GRPOLossConfig

__all__ = ["group_advantages", "loss_divisor", "member_loss", "combine_shares", "grpo_loss",
           "validate_group"]


def _nonfinite_members(rewards: torch.Tensor) -> list[int]:
    """Indices of members whose reward is NaN or +-inf. rewards: [G]."""
    return torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6, std_unbiased: bool = False) -> torch.Tensor:
    """Group-relative advantages ``A_i = (r_i - mean(r)) / (std(r) + eps)``.

    Args:
        rewards: [G] float rewards of one group, G >= 2.
        eps: added to the std so a near-constant group does not blow up (> 0).
        std_unbiased: False (default) = population std (divide by G);
            True = sample std (divide by G-1).

    Returns:
        [G] advantages in ``rewards.dtype`` (computed in float64). A group with
        all-equal rewards gives exactly zero advantages.

    Raises:
        ValueError: rewards not 1-D, G < 2, non-finite rewards, or eps <= 0.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [G], got shape {tuple(rewards.shape)}.")
    g = rewards.numel()
    if g < 2:
        raise ValueError(
            f"group of one (G={g}): GRPO advantages are relative to the group, so it needs at "
            "least two members per prompt; sample more responses per prompt."
        )
    if not eps > 0:
        raise ValueError(f"eps={eps!r} must be > 0.")
    bad = _nonfinite_members(rewards)
    if bad:
        raise ValueError(f"reward is NaN/inf for group member(s) {bad}; fix the reward function for these responses.")
    r = rewards.to(torch.float64)
    if bool(torch.all(r == r[0])):
        # Explicit: float rounding in mean() could otherwise leave ~1e-17 residues.
        return torch.zeros_like(rewards)
    std = r.std(correction=1 if std_unbiased else 0)
    return ((r - r.mean()) / (std + eps)).to(rewards.dtype)


def loss_divisor(cfg: GRPOLossConfig, num_members: int, num_tokens: int,
                 group_tokens: int | None = None) -> int:
    """The divisor of member ``i``'s summed token terms (module docstring): ``G * R_i``
    (sequence_mean), ``T = sum_j R_j`` (token_mean: `group_tokens`, the whole group's tokens, so
    every member divides by the same T) or ``G * C`` (constant: ``cfg.norm_constant``)."""
    if cfg.aggregation == "token_mean":
        if group_tokens is None or group_tokens < num_tokens:
            raise ValueError(f"aggregation 'token_mean' divides by the group's token count: pass "
                             f"group_tokens (sum of the G response lengths, >= this member's "
                             f"{num_tokens}), got {group_tokens!r}.")
        return group_tokens
    if cfg.aggregation == "constant":
        return num_members * cfg.norm_constant
    return num_members * num_tokens


def member_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantage: float | torch.Tensor,
    num_members: int,
    cfg: GRPOLossConfig,
    logp_ref: torch.Tensor | None = None,
    num_tokens: int | None = None,
    loss_scale: float = 1.0,
    token_weight: torch.Tensor | None = None,
    group_tokens: int | None = None,
    loss_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Contribution of ONE group member to the GRPO loss, scaled by ``1/(G*R_i)`` (by
    :func:`loss_divisor` under another ``cfg.aggregation``).

    Args:
        logp: [R_i] current-policy log-probs of the response tokens (carries autograd).
        logp_old: [R_i] log-probs of the sampling policy (treated as constant).
        advantage: scalar ``A_i`` (treated as constant).
        num_members: G, the group size.
        cfg: loss config.
        logp_ref: [R_i] reference-policy log-probs; required if ``cfg.kl_coef > 0``.
        num_tokens: R_i when ``logp`` holds only this rank's share of the member's tokens
            (context parallelism: the shares' losses then sum to the member's loss); default
            ``logp.numel()``. A share may be empty (its loss is an exact zero with a graph).
        loss_scale: 1/N when one optimizer step averages N groups (data parallelism).
        token_weight: [R_i] per-token weights ``w_it`` of the policy term (treated as constant;
            default 1): offpolicy.importance_weights. ``num_tokens`` still divides: a weight of
            0 removes a token's term, not the token from the mean.
        group_tokens: T = sum_j R_j, the group's response tokens (every member's, not this
            share's); needed by ``cfg.aggregation == "token_mean"`` only.
        loss_mask: [R_i] bool, True where the token is trained (an agent trajectory's policy
            tokens; False: tool observations, headers: context only). A masked token has no
            term (its policy and KL terms are zero, no gradient flows through them) and is not
            in the statistics; ``num_tokens`` and ``group_tokens`` then count trained tokens
            (the caller's, for the whole member and group: R_i and T over trained tokens), and
            the stats gain ``trained`` (this share's trained-token count).

    Returns:
        ``(loss, stats)``: ``loss`` is a 0-d tensor; summing it over the G members
        gives the group loss. ``stats`` are detached 0-d per-member values
        (unscaled by 1/G): ``policy_loss`` = -(1/R_i) sum_t s_it, ``kl`` = k3
        token mean (0 if disabled), ``clip_frac`` = fraction of tokens where the
        clipped term is the (strictly smaller) active one, ``ratio_mean/max/min``.
        So under sequence_mean ``loss == (policy_loss + kl_coef * kl) / G``; the statistics are
        per-member token means whatever the aggregation.
    """
    if logp.dim() != 1 or (logp.numel() == 0 and num_tokens is None):
        raise ValueError(f"logp must be a non-empty 1-D [R_i] tensor, got shape {tuple(logp.shape)}.")
    if logp_old.shape != logp.shape:
        raise ValueError(f"logp_old shape {tuple(logp_old.shape)} != logp shape {tuple(logp.shape)}.")
    if token_weight is not None and token_weight.shape != logp.shape:
        raise ValueError(f"token_weight shape {tuple(token_weight.shape)} != logp shape {tuple(logp.shape)}.")
    if loss_mask is not None and loss_mask.shape != logp.shape:
        raise ValueError(f"loss_mask shape {tuple(loss_mask.shape)} != logp shape {tuple(logp.shape)}.")
    if logp_ref is not None and logp_ref.shape != logp.shape:
        raise ValueError(f"logp_ref shape {tuple(logp_ref.shape)} != logp shape {tuple(logp.shape)}.")
    if cfg.kl_coef > 0 and logp_ref is None:
        raise ValueError(f"kl_coef={cfg.kl_coef} > 0 needs logp_ref (reference log-probs); pass it or set kl_coef=0.")
    if num_members < 2:
        raise ValueError(f"num_members={num_members}: group of one; GRPO needs at least two members per group.")

    dtype = torch.promote_types(logp.dtype, torch.float32)  # never do the loss math in bf16
    lp = logp.to(dtype)
    adv = torch.as_tensor(advantage, dtype=dtype, device=lp.device).detach()
    trained = None if loss_mask is None else loss_mask.to(device=lp.device, dtype=torch.bool)
    held = lp.numel() if trained is None else int(trained.sum())   # this share's trained tokens
    num_tokens = held if num_tokens is None else num_tokens
    if num_tokens <= 0 or num_tokens < held:
        raise ValueError(f"num_tokens={num_tokens} must be positive and cover logp's trained "
                         f"tokens ({held}).")

    divisor = loss_divisor(cfg, num_members, num_tokens, group_tokens)

    log_ratio = lp - logp_old.detach().to(dtype)
    if cfg.log_ratio_clamp is not None:  # flat outside [-d, d]: no gradient there
        log_ratio = torch.clamp(log_ratio, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    # Where the term is flat in the token (masked, clipped, dual-clipped, A = 0) its gradient is
    # exactly 0, whatever the ratio: there the log-ratio enters detached and capped below exp's
    # overflow, so exp's backward never meets 0 * inf (NaN). The term's value is unchanged: below
    # the cap the detached value is the same number, above it the term is the bound it is held at.
    true_ratio = torch.exp(log_ratio.detach())              # statistics, and which tokens are flat
    flat = _flat_policy_tokens(true_ratio, adv, cfg, trained)
    if bool(flat.any()):
        cap = math.log(torch.finfo(dtype).max) - 1.0
        log_ratio = torch.where(flat, log_ratio.detach().clamp(max=cap), log_ratio)
    ratio = torch.exp(log_ratio)  # [R_i]
    del log_ratio, flat  # exp saves its output: the difference is not kept (replay's peak)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high) * adv
    surrogate = torch.minimum(unclipped, clipped)  # [R_i]
    if cfg.dual_clip is not None:  # A < 0: the surrogate is at least c*A (loss <= c|A|)
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, cfg.dual_clip * adv), surrogate)
    if token_weight is not None:  # w_it: a constant, outside the min (it scales both branches)
        surrogate = surrogate * token_weight.detach().to(dtype)
    if trained is not None:  # a masked token's term is 0 (where: no gradient, whatever its value)
        surrogate = torch.where(trained, surrogate, 0.0)
    policy_sum = -surrogate.sum()
    policy_tok_mean = policy_sum / num_tokens  # 1/R_i: per-member token mean

    kl_sum = kl_tok_mean = torch.zeros((), dtype=dtype, device=lp.device)
    if cfg.kl_coef > 0 and logp_ref is not None:
        d = logp_ref.detach().to(dtype) - lp  # ref - logp
        # Flat where masked or clamped (k3 above k): d enters detached and capped there (as the
        # log-ratio above), so the gradient is exactly 0 and exp's backward finite.
        kl_flat = torch.zeros_like(d, dtype=torch.bool) if trained is None else ~trained
        if cfg.kl_clamp is not None:
            dd = d.detach()
            kl_flat = kl_flat | (torch.exp(dd) - dd - 1.0 > cfg.kl_clamp)
        if bool(kl_flat.any()):
            cap = math.log(torch.finfo(dtype).max) - 1.0
            d = torch.where(kl_flat, d.detach().clamp(max=cap), d)
        k3 = torch.exp(d) - d - 1.0
        if cfg.kl_clamp is not None:  # flat above k: no gradient there
            k3 = torch.clamp(k3, max=cfg.kl_clamp)
        if trained is not None:
            k3 = torch.where(trained, k3, 0.0)
        kl_sum = k3.sum()
        del d, k3
        kl_tok_mean = kl_sum / num_tokens  # 1/R_i: per-member token mean

    if cfg.aggregation == "sequence_mean":
        # 1/G: the group loss is the mean over members; member losses are later plain-summed.
        loss = (policy_tok_mean + cfg.kl_coef * kl_tok_mean) / num_members
    else:
        # 1/T (token_mean) or 1/(G*C) (constant), loss_divisor: the same for every share of the
        # member and, for T, every member of the group; member losses are later plain-summed.
        loss = (policy_sum + cfg.kl_coef * kl_sum) / divisor
    loss = loss * loss_scale  # 1/N groups per step (1 by default); nothing divides again later

    with torch.no_grad():
        r = true_ratio if trained is None else true_ratio[trained]
        r = r if r.numel() else torch.ones(1, dtype=dtype, device=lp.device)  # an empty share
        stats = {
            "policy_loss": policy_tok_mean.detach(),
            "kl": kl_tok_mean.detach(),
            "clip_frac": ((clipped.detach() < unclipped.detach()) if trained is None else
                          (clipped.detach() < unclipped.detach()) & trained).to(dtype).sum()
                         / num_tokens,
            "ratio_mean": r.mean(),
            "ratio_max": r.max(),
            "ratio_min": r.min(),
        }
        if trained is not None:
            stats["trained"] = torch.tensor(float(held), dtype=dtype, device=lp.device)
    return loss, stats


def _flat_policy_tokens(ratio: torch.Tensor, adv: torch.Tensor, cfg: GRPOLossConfig,
                        trained: torch.Tensor | None) -> torch.Tensor:
    """[R_i] bool: the tokens whose policy term does not depend on the ratio (strictly past a
    bound: at a bound itself the min's gradient is shared, as before): masked ones, A = 0, the
    PPO clip's flat side (A > 0 above 1 + eps_high, A < 0 below 1 - eps_low) and the dual clip's
    (A < 0 above c)."""
    flat = torch.zeros_like(ratio, dtype=torch.bool) if trained is None else ~trained
    a = float(adv)
    if a == 0.0:
        return torch.ones_like(flat)
    if a > 0:
        return flat | (ratio > 1.0 + cfg.clip_eps_high)
    flat = flat | (ratio < 1.0 - cfg.clip_eps_low)
    if cfg.dual_clip is not None:
        flat = flat | (ratio > cfg.dual_clip)
    return flat


def combine_shares(
    shares: Sequence[tuple[torch.Tensor, dict[str, torch.Tensor], int]],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One member's ``(loss, stats)`` from :func:`member_loss` over disjoint shares of its tokens.

    Args:
        shares: per share (context parallelism: per rank's rows) ``(loss, stats, num_rows)`` of
            :func:`member_loss` called with the whole member's ``num_tokens`` = R_i; a share may
            hold no rows (its ratio figures are a placeholder 1).

    Returns:
        ``(loss, stats)`` of the member, as :func:`member_loss` over all its tokens gives them up
        to summation order. No divisor is applied again: the loss, ``policy_loss``, ``kl`` and
        ``clip_frac`` of each share already divide by R_i (and G, and the loss scale) and add
        up; ``ratio_mean`` is the shares' means weighted by their rows, over R_i (the rows of all
        shares); ``ratio_max`` / ``ratio_min`` are over the shares that hold rows.
    """
    losses, stats, rows = zip(*shares)
    if sum(rows) <= 0:
        raise ValueError(f"the shares hold no tokens (rows {list(rows)}).")
    if "trained" in stats[0]:   # a loss mask: the ratio figures are over trained tokens
        rows = [int(s["trained"]) for s in stats]
    held = [s for s, n in zip(stats, rows) if n > 0]
    keys = ("policy_loss", "kl", "clip_frac") + (("trained",) if "trained" in stats[0] else ())
    merged = {key: torch.stack([s[key] for s in stats]).sum() for key in keys}
    # 1/R_i: the token mean of the ratio over the whole member
    merged["ratio_mean"] = torch.stack([s["ratio_mean"] * n for s, n in zip(stats, rows)]).sum() \
        / max(sum(rows), 1)
    merged["ratio_max"] = torch.stack([s["ratio_max"] for s in held]).max()
    merged["ratio_min"] = torch.stack([s["ratio_min"] for s in held]).min()
    return torch.stack(list(losses)).sum(), merged


def grpo_loss(
    logps: list[torch.Tensor],
    logps_old: list[torch.Tensor],
    rewards: torch.Tensor,
    cfg: GRPOLossConfig,
    logps_ref: list[torch.Tensor] | None = None,
    token_weights: list[torch.Tensor] | None = None,
    loss_masks: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Whole-group GRPO loss: the plain sum of :func:`member_loss` over members (token_mean's T:
    the sum of the members' lengths, or of their trained tokens with `loss_masks`).

    Args:
        logps, logps_old (, logps_ref, token_weights): G tensors, member i of shape [R_i].
        rewards: [G] rewards; advantages come from :func:`group_advantages`.

    Returns:
        0-d loss tensor.
    """
    g = len(logps)
    if len(logps_old) != g or rewards.numel() != g or (logps_ref is not None and len(logps_ref) != g) \
            or (token_weights is not None and len(token_weights) != g):
        raise ValueError(
            f"group size mismatch: {g} logps, {len(logps_old)} logps_old, {rewards.numel()} rewards"
            + ("" if logps_ref is None else f", {len(logps_ref)} logps_ref")
            + ("" if token_weights is None else f", {len(token_weights)} token_weights")
        )
    adv = group_advantages(rewards, eps=cfg.adv_eps, std_unbiased=cfg.std_unbiased)
    masks = [None] * g if loss_masks is None else [m.bool() for m in loss_masks]
    group_tokens = sum(int(lp.numel()) if m is None else int(m.sum())
                       for lp, m in zip(logps, masks))  # T of token_mean
    total: torch.Tensor | None = None
    for i in range(g):
        ref = None if logps_ref is None else logps_ref[i]
        weight = None if token_weights is None else token_weights[i]
        loss_i, _ = member_loss(logps[i], logps_old[i], adv[i], g, cfg, ref, token_weight=weight,
                                group_tokens=group_tokens, loss_mask=masks[i])
        total = loss_i if total is None else total + loss_i
    assert total is not None
    return total


def validate_group(
    response_lens: Sequence[int], rewards: Sequence[float] | torch.Tensor, max_response_len: int
) -> None:
    """Reject a malformed group before any (expensive) prefill/decode work.

    Args:
        response_lens: G response lengths in tokens.
        rewards: G rewards (sequence or [G] tensor).
        max_response_len: the largest response length allowed.

    Raises:
        ValueError naming the problem (and the member index where there is one).
    """
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    g = len(response_lens)
    if g == 0:
        raise ValueError("empty group: no responses for this prompt; GRPO needs at least two members.")
    if r.numel() != g:
        raise ValueError(f"len(rewards)={r.numel()} != number of responses={g}; give one reward per response.")
    if g < 2:
        raise ValueError("group of one: GRPO advantages are group-relative and need at least two members per prompt.")
    for i, n in enumerate(response_lens):
        if n <= 0:
            raise ValueError(f"group member {i} has response length {n} (empty response); every member needs >= 1 token.")
        if n > max_response_len:
            raise ValueError(
                f"group member {i} has response length {n} > limit {max_response_len}; "
                "raise it with --longstraw-max-response-len or truncate the response."
            )
    bad = _nonfinite_members(r)
    if bad:
        raise ValueError(f"reward is NaN/inf for group member(s) {bad}; fix the reward function for these responses.")
