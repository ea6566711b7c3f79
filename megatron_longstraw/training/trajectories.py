"""The online loop's trajectories, written for audit and reuse (`--longstraw-trajectories`).

    <out-dir>/<run-name>/trajectories/
        replica<r>.jsonl        one line per group trained on, data-parallel replica r
        prompts/<hash>.bin      each distinct prompt once (int32 little-endian ids)

A line is a group in the offline format (examples/data/README.md), so `tools/score.py --input`
and the offline launcher (`--longstraw-data`) read it as it is:

    {"id": "step 3 group 1", "prompt_file": "prompts/3f2a....bin",
     "response_ids": [[..], ..], "loss_masks": [[1, 1, 0, ..], ..], "rewards": [..],
     "logprobs_old": [[-0.7, -1.2, null, ..], ..], "meta": <the prompt line's meta>,
     "trajectory": {"step": 3, "updates": 1, "source": "line 7", "members": [
         {"end": "env done", "reward_from": "env", "turns": [{"policy_tokens": 4,
          "observation_tokens": 3, "reward": null}, ..]}, ..]}}

`logprobs_old` are the sampling distribution's log-probs of each sampled token (what the online
step trains against), null at observation tokens (loss mask 0: not sampled). Members are the
capture's G x K (K updates per capture: the step is the first of its K updates). Only the groups a
step trained on are written (dynamic sampling's dropped groups are not).

One writer per replica: the replica's first context-parallel rank (its ranks generate the same
groups). Lines are appended and flushed after each step; a resumed run first drops the lines of
steps at or past the step it resumes from (what a failed attempt wrote), rewriting the file
atomically. Past `--longstraw-trajectories-max-mb` (prompts and lines together) nothing more is
written; the step it stopped at is printed once and recorded in the receipt.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import torch

FOLDER = "trajectories"


def wanted(ls) -> bool:
    """Whether this online run writes its trajectories (auto: when it has an environment)."""
    rollout = ls.rollout
    if rollout.mode != "online" or rollout.trajectories == "off":
        return False
    return rollout.trajectories == "on" or ls.environment.env is not None


class TrajectoryWriter:
    """Appends each step's groups to `folder`/replica<r>.jsonl (module docstring)."""

    def __init__(self, folder: str | os.PathLike, replica: int, first_step: int,
                 max_bytes: float):
        self.folder = Path(folder)
        self.path = self.folder / f"replica{replica}.jsonl"
        self.max_bytes = max_bytes
        (self.folder / "prompts").mkdir(parents=True, exist_ok=True)
        self._drop_from(first_step)
        self.bytes = sum(f.stat().st_size for f in self.folder.rglob("*") if f.is_file())
        self.groups = 0
        self.stopped_at: int | None = None
        self._file = self.path.open("a", encoding="utf-8")

    def _drop_from(self, step: int) -> None:
        """Keep only the lines of steps before `step` (a resumed run writes the rest again)."""
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text(encoding="utf-8").splitlines(keepends=True)
                if line.strip() and json.loads(line)["trajectory"]["step"] < step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, self.path)

    def write(self, step: int, updates: int, rollouts) -> None:
        """The step's groups (online.Rollout, trajectories or not): the prompt files first, then
        the lines, flushed; nothing once the size bound is passed."""
        if self.stopped_at is not None:
            return
        lines, prompts = [], {}
        for index, rollout in enumerate(rollouts):
            ids = rollout.group.prompt_ids.to(torch.int32).contiguous()
            data = ids.numpy().astype("<i4").tobytes()
            name = f"prompts/{hashlib.sha1(data).hexdigest()[:20]}.bin"
            if not (self.folder / name).exists():
                prompts[name] = data
            lines.append(json.dumps(group_line(step, index, updates, rollout, name)) + "\n")
        size = sum(map(len, prompts.values())) + sum(len(line.encode()) for line in lines)
        if self.bytes + size > self.max_bytes:
            self.stopped_at = step
            print(f"trajectories: {self.path} stops at step {step}: writing it would pass "
                  f"--longstraw-trajectories-max-mb {self.max_bytes / 2**20:g} "
                  f"({self.bytes / 2**20:.1f} MB written)", flush=True)
            return
        for name, data in prompts.items():
            tmp = self.folder / (name + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, self.folder / name)
        self._file.writelines(lines)
        self._file.flush()
        self.bytes += size
        self.groups += len(lines)

    def summary(self) -> dict:
        """The receipt's record of what was written."""
        return {"file": str(self.path), "groups": self.groups, "bytes": self.bytes,
                "stopped_at_step": self.stopped_at}

    def close(self) -> None:
        self._file.close()


def group_line(step: int, index: int, updates: int, rollout, prompt_file: str) -> dict:
    """One group as an offline data line (module docstring)."""
    group = rollout.group
    responses = [r.tolist() for r in group.response_ids]
    masks = ([m.to(torch.int64).tolist() for m in group.loss_masks]
             if group.loss_masks is not None else [[1] * len(r) for r in responses])
    logprobs = [[(float(v) if keep and math.isfinite(float(v)) else None)
                 for v, keep in zip(lp.tolist(), mask)]
                for lp, mask in zip(group.logps_old, masks)]
    members = [{"end": t["end"], "reward_from": t["reward_from"], "turns": t["turns"]}
               for t in rollout.trajectories] if rollout.trajectories else None
    line = {"id": f"step {step} group {index}", "prompt_file": prompt_file,
            "response_ids": responses, "loss_masks": masks,
            "rewards": [float(r) for r in group.rewards.tolist()],
            "logprobs_old": logprobs}
    if rollout.meta is not None:
        line["meta"] = rollout.meta
    line["trajectory"] = {"step": step, "updates": updates,
                          "source": getattr(group, "source", None), "members": members}
    return line
