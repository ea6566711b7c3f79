"""Scoring responses over a captured prompt, outside a training step (tools/score.py): for every
group the prompt is captured once and each response scored over the captured state, exactly as the
training step's pre-step scoring does (`capture_prompt` + `score_member`, with the engine's
`routed_experts` / `dsa_topk` when the group has them: routing replay; no autograd, no optimizer).
`iter_scores` yields one result per group: id, prompt_len, response_lens, per-token `logprobs` of
every member, their `logprob_sum` and `logprob_mean`, and, when the group carries `logps_old`
(the engine's per-token log-probs), a `mismatch` summary (`MismatchStats`: diff = ours - engine's).
A group with loss masks (multi-turn members: data/masks.py) also gets its `loss_masks` (0/1 per
token: 0 marks a context token, e.g. a tool observation), `trained_logprob_sum` /
`trained_logprob_mean` over the trained tokens, and its mismatch over the trained tokens only
(the engine's log-probs may be absent at the others).
Under context parallelism every rank reads the same groups (`agreed_records`) and gets the same
results.
"""

from __future__ import annotations

import time

import torch


class MismatchStats:
    """Running comparison of our per-token log-probs with the engine's (diff = ours - old)."""

    def __init__(self, threshold: float = 0.1, num_worst: int = 10):
        self.threshold, self.num_worst = threshold, num_worst
        self.num_tokens, self.num_over = 0, 0
        self.sum_abs, self.sum_diff, self.max_abs = 0.0, 0.0, 0.0
        self.worst: list[dict] = []

    def add(self, logp: torch.Tensor, logp_old: torch.Tensor, response_ids: torch.Tensor,
            group_id, member_idx: int, prompt_len: int, mask: torch.Tensor | None = None) -> None:
        """One member: logp, logp_old, response_ids [R]; `mask` (bool [R]): count only the
        trained tokens (an untrained token's engine log-prob may be NaN; token_idx stays the
        position in the response)."""
        diff = logp.double() - logp_old.double().to(logp.device)
        token_idx = torch.arange(diff.numel())
        if mask is not None:
            diff, token_idx = diff[mask.to(diff.device)], token_idx[mask.cpu()]
        abs_diff = diff.abs()
        self.num_tokens += diff.numel()
        self.num_over += int((abs_diff > self.threshold).sum())
        self.sum_abs += float(abs_diff.sum())
        self.sum_diff += float(diff.sum())
        self.max_abs = max(self.max_abs, float(abs_diff.max()) if diff.numel() else 0.0)
        order = torch.argsort(abs_diff, descending=True, stable=True)[:self.num_worst]
        self._keep([{"id": group_id, "member_idx": member_idx, "token_idx": int(token_idx[t]),
                     "position": prompt_len + int(token_idx[t]),
                     "token_id": int(response_ids[token_idx[t]]),
                     "logprob": float(logp[token_idx[t]]),
                     "logprob_old": float(logp_old[token_idx[t]]), "diff": float(diff[t])}
                    for t in order])

    def merge(self, other: "MismatchStats") -> None:
        self.num_tokens += other.num_tokens
        self.num_over += other.num_over
        self.sum_abs += other.sum_abs
        self.sum_diff += other.sum_diff
        self.max_abs = max(self.max_abs, other.max_abs)
        self._keep(other.worst)

    def _keep(self, entries: list[dict]) -> None:
        # Stable sort: among equal |diff|, earlier groups / members / tokens come first.
        self.worst = sorted(self.worst + entries, key=lambda e: -abs(e["diff"]))[:self.num_worst]

    def summary(self) -> dict:
        n = max(self.num_tokens, 1)
        return {"num_tokens": self.num_tokens, "max_abs_diff": self.max_abs,
                "mean_abs_diff": self.sum_abs / n, "mean_diff": self.sum_diff / n,
                "threshold": self.threshold, "frac_abs_diff_over_threshold": self.num_over / n,
                "worst": list(self.worst)}


def iter_scores(model, groups, cfg, threshold: float = 0.1, num_worst: int = 10,
                overall: MismatchStats | None = None, log=None):
    """Yield one result dict per group. `groups`: `GroupRecord`s (megatron_longstraw.data.groups) or
    `GRPOGroup`s (id: their index). `cfg`: LongStrawConfig (block sizes). `overall` accumulates
    the mismatch over all groups that carry logps_old. Under CP every rank passes the same groups
    and gets the same results. Kernels: `cfg.run.kernels`'s selection, adopted here (`select.adopt`:
    selected now unless set-up already made it the active one; tools/score.py leaves it to here)."""
    from megatron_longstraw.context.capture import capture_prompt
    from megatron_longstraw.kernels import select
    from megatron_longstraw.step import routing_replay
    from megatron_longstraw.step.replay import score_member

    select.adopt(cfg.run.kernels)
    for idx, item in enumerate(groups):
        group, group_id = getattr(item, "group", item), getattr(item, "id", idx)
        prompt_len = int(group.prompt_ids.numel())
        start = time.perf_counter()
        try:
            routing_replay.validate_group(model, group)   # the engine's routing, when given
            with torch.no_grad():
                captured = capture_prompt(model, group.prompt_ids, cfg.capture)
                logps = [score_member(model, captured, r, cfg, *routing_replay.member_inputs(
                             model, group, i, captured.prefix_len, captured.layout,
                             cfg.replay.response_block))[0]
                         for i, r in enumerate(group.response_ids)]
            del captured
        except ValueError as exc:
            raise ValueError(f"group {group_id!r}: {exc}") from exc
        result = {"id": group_id, "prompt_len": prompt_len,
                  "response_lens": [int(r.numel()) for r in group.response_ids],
                  "logprobs": [lp.double().tolist() for lp in logps],
                  "logprob_sum": [float(lp.double().sum()) for lp in logps],
                  "logprob_mean": [float(lp.double().mean()) for lp in logps]}
        masks = ([None] * len(logps) if group.loss_masks is None
                 else [torch.as_tensor(m).bool() for m in group.loss_masks])
        if group.loss_masks is not None:
            trained = [lp.double()[m.to(lp.device)] for lp, m in zip(logps, masks)]
            result["loss_masks"] = [m.long().tolist() for m in masks]
            result["trained_logprob_sum"] = [float(t.sum()) for t in trained]
            result["trained_logprob_mean"] = [float(t.mean()) for t in trained]
        if group.logps_old is not None:
            stats = MismatchStats(threshold, num_worst)
            for member_idx, (lp, old, ids, m) in enumerate(zip(logps, group.logps_old,
                                                               group.response_ids, masks)):
                stats.add(lp, old, ids, group_id, member_idx, prompt_len, m)
            result["mismatch"] = stats.summary()
            if overall is not None:
                overall.merge(stats)
        if log is not None:
            log(f"group {group_id}: prompt {prompt_len} tokens, {len(logps)} responses, "
                f"{time.perf_counter() - start:.1f} s")
        yield result


def agreed_records(records, layout):
    """Yield records; under CP the ranks first agree that they read the same group (or the same
    end of file), and a rank that failed to read takes every rank down with its message."""
    from megatron_longstraw.distributed.agreement import check_agreement

    records = iter(records)
    while True:
        record, error, own = None, None, None
        try:
            record = next(records)
        except StopIteration:
            pass
        except (ValueError, OSError) as exc:
            if layout.size == 1:
                raise
            error, own = str(exc), exc
        if layout.size > 1:
            try:
                check_agreement(error, _fingerprint(record), layout)
            except ValueError:
                if own is not None:   # this rank's own error (a DataError names file and line)
                    raise own from None
                raise
        if record is None:
            return
        yield record


def _fingerprint(record) -> dict:
    if record is None:
        return {"end_of_file": True}
    prompt = record.group.prompt_ids.long()
    weights = torch.arange(1, prompt.numel() + 1) % 1009
    return {"id": record.id, "line": record.line, "prompt_len": int(prompt.numel()),
            "prompt_checksum": int((prompt * weights).sum()),
            "response_lens": [int(r.numel()) for r in record.group.response_ids]}
