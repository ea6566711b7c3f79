"""Guards against a run that has stopped learning (the launcher's; issue 32): after each step,
`SignalGuard.check` reads the step's statistics (schedule.StepResult.stats, merged over the
step's groups and the data-parallel replicas, so every rank reads the same figures and decides
the same) and

- warns, once per run, when every group of the step has zero advantage (`zero_advantage_frac`
  1: within each group all rewards are equal, so the policy term has no gradient), naming the
  likely cause from the entropy and the reward;
- warns, once per run, when the policy's entropy over the trained tokens falls below
  `GuardSettings.entropy_floor` (`--longstraw-entropy-floor`; 0 disables it);
- with `GuardSettings.stop_after_no_signal` N > 0 (`--longstraw-stop-after-no-signal`), returns
  a reason to stop after N consecutive steps with no signal (every group zero advantage); the
  launcher then stops as an exit condition does (a checkpoint with --save, the receipt).

Warnings go to stdout on rank 0 (`warning: step N: ...`), beside the step lines.
"""

from __future__ import annotations


class SignalGuard:
    """The per-run state of the guards (module docstring)."""

    def __init__(self, entropy_floor: float, stop_after_no_signal: int, enabled: bool = True):
        self.entropy_floor = entropy_floor
        self.stop_after = stop_after_no_signal
        self.enabled = enabled
        """Print the warnings (rank 0); the decision to stop is the same on every rank."""
        self.warned: set[str] = set()
        self.no_signal_steps = 0
        """Consecutive steps, up to the last one checked, in which every group had zero advantage."""

    def check(self, step: int, stats: dict[str, float]) -> str | None:
        """Warn as the module docstring says; return why the run should stop, or None."""
        entropy = stats.get("entropy")
        no_signal = stats.get("zero_advantage_frac", 0.0) >= 1.0
        self.no_signal_steps = self.no_signal_steps + 1 if no_signal else 0
        if no_signal:
            self._warn_once("zero_advantage", f"step {step}: every group's rewards are all equal "
                            f"(reward mean {stats.get('reward_mean', float('nan')):.4g}), so every "
                            "advantage is zero and the policy term of the loss has no gradient. "
                            + self._zero_advantage_cause(entropy, stats))
        if entropy is not None and self.entropy_floor > 0 and entropy < self.entropy_floor:
            self._warn_once("entropy", f"step {step}: the policy's entropy is {entropy:.3g} nats "
                            f"per trained token, below --longstraw-entropy-floor "
                            f"{self.entropy_floor:g}: the policy samples (nearly) one response, so "
                            "a group's members soon all get the same reward and no signal "
                            "(entropy collapse). Unless the reward is already at its best, likely "
                            "causes: a learning rate too high for the model (try a lower --lr / "
                            "--decoupled-lr), too low a --longstraw-temperature, or too wide a "
                            "clip (--longstraw-clip-eps-high).")
        if self.stop_after and self.no_signal_steps >= self.stop_after:
            return (f"no learning signal for {self.no_signal_steps} consecutive steps (every "
                    "group's rewards all equal; --longstraw-stop-after-no-signal "
                    f"{self.stop_after})")
        return None

    def _zero_advantage_cause(self, entropy: float | None, stats: dict[str, float]) -> str:
        if entropy is not None and self.entropy_floor > 0 and entropy < self.entropy_floor:
            return (f"Likely cause: the policy collapsed (entropy {entropy:.3g} nats per token): "
                    "every member of a group gives the same answer. Lower the learning rate, "
                    "raise --longstraw-temperature, or resume from an earlier checkpoint.")
        return ("Likely cause: the task is out of reach or solved at this policy (every member "
                "of a group fails, or every one succeeds), or the reward function gives one value "
                "whatever the response. Check the reward, try --longstraw-dynamic-sampling (drops "
                "such groups and generates more), a larger --longstraw-group-size or a higher "
                "--longstraw-temperature.")

    def _warn_once(self, kind: str, message: str) -> None:
        if kind in self.warned:
            return
        self.warned.add(kind)
        if self.enabled:
            print(f"warning: {message}", flush=True)
