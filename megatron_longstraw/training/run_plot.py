"""The run's curves, one PNG beside the launcher's receipt.json (`run_curves.png`; rank 0, after
the last step): per step, from the receipt's `history`, the mean reward (with its within-group
std as a band), the loss, the gradient norm, the policy's entropy, the fraction of groups with
zero advantage (guards.py), and the wall time of the step with its phases.

matplotlib is optional (the `bench` extra, pinned in constraints.txt): without it `pyplot()`
raises an ImportError naming the package and how to install it, and the launcher writes no PNG
(it says so). tools/demo_rl.py draws its seed-by-seed figure with `pyplot` and `moving_average`.
"""

from __future__ import annotations

import math
from pathlib import Path

PANELS = (
    ("grpo/reward_mean", "mean reward (band: within-group std)"),
    ("grpo/loss", "loss"),
    ("grpo/grad_norm", "gradient norm"),
    ("grpo/entropy", "policy entropy (nats / trained token)"),
    ("grpo/zero_advantage_frac", "groups with zero advantage (fraction)"),
    ("time/step_s", "wall time per step (s; phases dashed)"),
)
"""(history key, panel title) of each panel, in reading order."""
DRIFT_PANEL = ("grpo/drift/logp_abs_mean",
               "drift of the kept capture: mean |d logp| (dashed: max; --longstraw-drift-every / -first-last)")
"""A seventh panel, for a run that measured its kept captures' drift."""


def moving_average(curve: list[float], window: int) -> list[float]:
    """The mean of each value and the `window - 1` before it (fewer at the start)."""
    out = []
    for i in range(len(curve)):
        part = curve[max(0, i - window + 1): i + 1]
        out.append(sum(part) / len(part))
    return out


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend; ImportError naming the package when
    matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("the run's PNG needs matplotlib: pip install matplotlib (or the "
                          "package's `bench` extra, pinned in constraints.txt)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(history: list[dict], key: str) -> list[float]:
    return [float(h.get(key, math.nan)) for h in history]


def write_run_png(history: list[dict], path: str | Path, title: str) -> Path:
    """The PNG of the module docstring at `path` (a 2 x 3 grid, one panel per `PANELS` entry, and
    a seventh, `DRIFT_PANEL`, when the history has the drift of kept captures;
    a figure the run did not record, such as the entropy of a run without replay, is an empty
    panel saying so). ImportError without matplotlib (`pyplot`)."""
    plt = pyplot()
    path = Path(path)
    steps = [int(h["step"]) for h in history]
    panels = PANELS + ((DRIFT_PANEL,) if any(DRIFT_PANEL[0] in h for h in history) else ())
    columns = (len(panels) + 1) // 2
    fig, axes = plt.subplots(2, columns, figsize=(13 * columns / 3, 6.5), sharex=True)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    for ax, (key, label) in zip(axes.flat, panels):
        values = _series(history, key)
        ax.set_title(label, fontsize=9)
        if all(math.isnan(v) for v in values):
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes,
                    color="grey")
            continue
        ax.plot(steps, values, marker="." if len(steps) < 50 else None, lw=1.2,
                label="step" if key == "time/step_s" else None)
        if key == "grpo/reward_mean":
            spread = _series(history, "grpo/reward_group_std")
            ax.fill_between(steps, [v - s for v, s in zip(values, spread)],
                            [v + s for v, s in zip(values, spread)], alpha=0.2, lw=0)
        if key == "grpo/zero_advantage_frac":
            ax.set_ylim(-0.05, 1.05)
        if key == DRIFT_PANEL[0]:
            ax.plot(steps, _series(history, "grpo/drift/logp_abs_max"), ls="--", lw=0.9)
            ax.set_yscale("log")
        if key == "time/step_s":
            phases = sorted({k for h in history for k in h
                             if k.startswith("time/") and k != "time/step_s"})
            for phase in phases:
                ax.plot(steps, _series(history, phase), ls="--", lw=0.9,
                        label=phase[len("time/"):-len("_s")])
            if phases:
                ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
