"""Step logging: TensorBoard scalars, one summary line per step, a capture progress bar (rank 0),
and the launcher's logging rule (`configure_logging`)."""

from __future__ import annotations

import logging
import os
import sys
import time

from megatron_longstraw.training.receipts import human_bytes


class _RankFormatter(logging.Formatter):
    """Megatron's record format; warnings and errors carry the rank that logged them."""

    def __init__(self, rank: int, base: logging.Formatter | None):
        super().__init__(logging.BASIC_FORMAT)
        self.rank, self.base = rank, base

    def format(self, record: logging.LogRecord) -> str:
        text = (self.base or super()).format(record)
        return f"[rank {self.rank}] {text}" if record.levelno >= logging.WARNING else text


def configure_logging(rank: int | None = None, world_size: int | None = None) -> None:
    """The launcher's rule (examples/pretrain_gpt.py, tools/score.py): informational output comes
    from rank 0 only (e.g. the kernel selection, kernels/select.py, logged once, not once per
    rank); every rank logs its own warnings and errors, tagged `[rank N]` when there are several.
    Applies to the root logger, which Megatron configures when megatron.training is imported
    (INFO to stdout on every rank), so call it after that (after parsing the flags); without a
    handler (nothing configured logging) only warnings print, as before. Rank and
    world size default to torchrun's RANK / WORLD_SIZE (no process group is needed)."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    root = logging.getLogger()
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if world_size > 1:
        for handler in root.handlers:
            current = handler.formatter
            if isinstance(current, _RankFormatter):
                current.rank = rank
            else:
                handler.setFormatter(_RankFormatter(rank, current))


class ProgressBar:
    """A plain progress bar on stderr (no dependency), for capture's layer loop on rank 0. On a
    terminal it redraws one line (`\\r`); into a log file or pipe (SLURM's output, torchrun's
    --redirects) it writes a plain line every `interval_s` and when done, never `\\r`."""

    def __init__(self, label: str, width: int = 30, stream=None, interval_s: float = 30.0):
        self.label, self.width, self.interval_s = label, width, interval_s
        self.stream = stream if stream is not None else sys.stderr   # the current one
        isatty = getattr(self.stream, "isatty", None)
        self.terminal = bool(isatty and isatty())
        self.start = self.last = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        filled = int(self.width * done / max(total, 1))
        now = time.perf_counter()
        text = (f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} "
                f"layers {now - self.start:6.1f} s")
        if self.terminal:
            self.stream.write("\r" + text + ("\n" if done == total else ""))
        elif done == total or now - self.last >= self.interval_s:
            self.stream.write(text + "\n")
            self.last = now
        else:
            return
        self.stream.flush()


ZERO_LOSS_NOTE = "(on-policy: the loss value is 0 by construction, its gradient is not)"
"""Printed once, after the first step line's loss that is zero for this reason."""


def on_policy_zero_loss(result) -> bool:
    """Whether the step's printed loss is the on-policy GRPO surrogate's zero: with the ratio at 1
    (replay's log-probs equal scoring's) the policy term of a member is -A_i times its token mean
    of 1, and the advantages of a group sum to zero, so the value is -mean(A) = 0 while the
    gradient, -mean(A_i * grad log p), is not. (token_mean / constant aggregation, engine
    importance weights or a KL term make the value nonzero; then nothing needs saying.)"""
    ratio = result.stats.get("ratio_mean", float("nan"))
    return abs(float(result.loss)) < 1e-6 and abs(ratio - 1.0) < 1e-4


class StepLogger:
    """Scalars per step to TensorBoard (when a directory is given) and a summary line to stdout."""

    def __init__(self, tensorboard_dir: str | None, enabled: bool):
        self.enabled = enabled
        self.writer = None
        self.explained_zero_loss = False   # `log` says why once
        if enabled and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=tensorboard_dir)

    def scalars(self, result, extra: dict) -> dict[str, float]:
        values = {f"grpo/{k}": float(v) for k, v in result.stats.items()}
        values["grpo/loss"] = float(result.loss)
        values.update({f"time/{k}_s": float(v) for k, v in result.phase_seconds.items()})
        values["memory/page_bytes"] = float(result.page_bytes)
        values.update({f"memory/page_bytes/{kind}": float(nbytes)
                       for kind, nbytes in result.page_bytes_by_kind.items()})
        values.update({k: float(v) for k, v in extra.items()})
        return values

    def log(self, step: int, result, extra: dict) -> str:
        values = self.scalars(result, extra)
        # the spread is within each group (the G rewards one advantage compares), not over steps
        line = (f"step {step:5d} | loss {result.loss:+.6f} | reward {result.stats['reward_mean']:.3f}"
                f" (within-group std {result.stats['reward_group_std']:.3f})"
                f" | clip {result.stats['clip_frac']:.3f}"
                f" | ratio {result.stats['ratio_mean']:.4f} | kl {result.stats['kl']:.2e}"
                f" | grad {result.stats.get('grad_norm', float('nan')):.3e}"
                f" | capture {result.phase_seconds['capture']:.1f}s"
                f" scoring {result.phase_seconds['scoring']:.1f}s"
                f" replay {result.phase_seconds['replay']:.1f}s")
        if "prompt_backward" in result.phase_seconds:   # --longstraw-prompt-grad exact
            line += f" prompt-backward {result.phase_seconds['prompt_backward']:.1f}s"
        if "drift" in result.phase_seconds:   # drift measured: a fresh capture
            line += f" drift {result.phase_seconds['drift']:.1f}s"
        if "update_in_capture" in result.stats:   # --longstraw-updates-per-capture K > 1
            line += f" | update {int(result.stats['update_in_capture']) + 1} of the capture"
        if "drift/logp_abs_mean" in result.stats:   # the kept capture against a fresh one
            s = result.stats
            line += (f" | drift |dlogp| {s['drift/logp_abs_mean']:.2e} max "
                     f"{s['drift/logp_abs_max']:.2e} kl {s['drift/kl']:.2e} grad cos "
                     f"{s['drift/grad_cosine']:.4f}"
                     + (" (recaptured)" if s.get("drift/recaptured") else ""))
        line += f" | pages {human_bytes(result.page_bytes)}"
        if not self.explained_zero_loss and on_policy_zero_loss(result):
            self.explained_zero_loss = True
            line = line.replace(" | reward", f" {ZERO_LOSS_NOTE} | reward", 1)
        if "zero_advantage_frac" in result.stats:   # guards.py reads these two
            line += f" | zero-adv groups {result.stats['zero_advantage_frac']:.2f}"
        if "entropy" in result.stats:
            line += f" | entropy {result.stats['entropy']:.3f}"
        if "env/turns_mean" in extra:   # environments (rollout/env.py): per member, this rank
            line += (f" | turns {extra['env/turns_mean']:.1f} (observation tokens "
                     f"{extra['env/observation_tokens_mean']:.1f})")
            if "env/ends_done" in extra:   # members per end kind (train.py end_kind)
                line += " | ends: " + ", ".join(
                    f"{kind.replace('_', ' ')} {int(extra['env/ends_' + kind])}"
                    for kind in ("done", "env_error", "timeout", "budget", "stop"))
        if "mismatch_abs_mean" in result.stats:   # the engine's log-probs (offpolicy.py)
            line += (f" | mismatch |d| {result.stats['mismatch_abs_mean']:.2e} max "
                     f"{result.stats['mismatch_abs_max']:.2e} kl {result.stats['mismatch_kl']:.2e}")
            if "tis_frac" in result.stats:
                line += f" tis_frac {result.stats['tis_frac']:.3f}"
        if "rollout" in result.phase_seconds:   # the online loop (rollout.py)
            line += (f" | rollout {result.phase_seconds['rollout']:.1f}s len "
                     f"{result.stats.get('response_len_mean', float('nan')):.1f}")
        if "sampling/dropped_groups" in extra:   # dynamic sampling (rollout/online.py)
            line += (f" | dropped {int(extra['sampling/dropped_groups'])} resampled "
                     f"{int(extra['sampling/resampled_groups'])} in "
                     f"{int(extra['sampling/extra_rounds'])} extra rounds")
            if extra["sampling/short_groups"]:
                line += f" short {int(extra['sampling/short_groups'])}"
        if "time/step_s" in extra:
            line += f" | step {float(extra['time/step_s']):.1f}s"
        if "optimizer/lr" in extra:
            line += f" | lr {float(extra['optimizer/lr']):.3e}"
        if "skipped_steps" in extra:
            line += f" | skipped_steps {int(extra['skipped_steps'])}"
        return self._emit(line, values, step)

    def _emit(self, line: str, values: dict, step: int) -> str:
        """Print `line` and write `values` to TensorBoard at `step` (rank 0); return the line."""
        if self.enabled:
            print(line, flush=True)
            if self.writer is not None:
                for key, value in values.items():
                    self.writer.add_scalar(key, value, step)
                self.writer.flush()
        return line

    def log_eval(self, steps_done: int, values: dict[str, float]) -> str:
        """One held-out evaluation (evaluate.py) after `steps_done` steps."""
        line = (f"eval after step {steps_done - 1:5d} | groups {int(values['eval/groups'])} | "
                f"logprob/token {values['eval/logprob_token_mean']:+.6f} | perplexity "
                f"{values['eval/perplexity']:.4f} | logprob/sequence "
                f"{values['eval/logprob_seq_mean']:+.4f}")
        if "eval/kl_to_old" in values:
            line += (f" | kl_to_old {values['eval/kl_to_old']:.3e} | |logp - logp_old| "
                     f"{values['eval/logprob_abs_diff_to_old']:.3e}")
        return self._emit(line, values, steps_done)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
