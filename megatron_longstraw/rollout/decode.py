"""Generation from the captured prompt state (mode `decode`, docs/design.md section 2).

The pages that capture wrote for training are exactly the KV cache decoding needs: MLA latent
rows and DSA index keys, K/V rows, GDN's recurrent state and conv tail. `generate` samples G
responses from them, so one prompt pass serves rollout and training:

    capture(prompt)                              (or reuse the step's capture)
    each step: every active member's rows, run through the model together: its last token, and
        with an environment's observation queued, up to `EnvLimits.prefill_block` - 1 of its ids
        (a block: the rows a token-by-token feed would run over as many steps)
        token-wise work (projections, norms, FFN / MoE, the head) batched over all rows;
        each mixer appends a member's rows' state to its branch pages (`DecodeCache`) and the
        member's queries attend over the prompt's pages plus its own rows up to each query's
        position (DSA: top-k over the prompt's and the member's index keys; GDN: continues the
        member's state over its rows, the chunked rule for a block)
    the rows that predict queued observation ids record the model's log-prob of them; the last
        row of a member with nothing queued samples its next token (temperature, top-k, top-p;
        one generator per member, seeded from `seed`, drawn once per sampled token, so the
        samples do not depend on the block size)

No autograd; the prompt is never copied. Each member's generated rows are pages too (one
`PageStore` per member, in host memory when pages are offloaded), appended as they are run, and
a step reads its keys as streamed capture does: dense attention one key window at a time, DSA's
top-k over the index keys one key window at a time and MLA over only the selected latent rows
(`DecodeKeys`: the prompt's pages and the member's generated rows on one row axis). So a step's
device memory is a window and a selection per layer, not the tokens generated so far
(`tests/test_decode.py` measures it). The log-probs returned are the model's (temperature 1, no
truncation: what scoring computes for the same tokens, `tests/test_decode.py`); the sampling
distribution's are returned beside them (what an engine reports when it samples with a
temperature).

Under context parallelism every rank of the CP group runs the same rows (the members' rows)
and keeps the same branch caches; its pages are its prompt shard. Attention attends each query
over this rank's shard (rank 0 also over the member's generated rows) and merges the ranks' partial
outputs by log-sum-exp (`context_parallel.merge_replicated`, rank order on every rank: the same
bits everywhere); DSA merges every rank's top-k candidates (`collectives.merge_topk_candidates`);
GDN runs this rank's heads from its pages' state and gathers the heads' outputs; MoE dispatches
each rank's copy of the rows (EP). So every rank samples the same tokens
(`tests/test_decode.py`: CP2 and CP2/EP2 equal one process).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from megatron_longstraw.config.sampling import SamplingParams
from megatron_longstraw.config.settings import CaptureSettings, LongStrawConfig, capture_section
from megatron_longstraw.context.capture import CapturedPrompt
from megatron_longstraw.models.common import (
    HEAD_CHUNK_ROWS,
    decoder_groups,
    embed,
    head_logits,
    run_group,
)
from megatron_longstraw.rollout.env import (
    EnvError,
    EnvLimits,
    EnvSetupError,
    LocalEnvs,
    observation_ids,
)
from megatron_longstraw.state.attention_pass import AttentionPass, CPPass
from megatron_longstraw.state.pages import LayerRows, PageStore


@dataclass
class Generation:
    """One member's response (with an environment: its whole trajectory, observations included)."""

    token_ids: torch.Tensor
    """[n] sampled ids (int64), a stop id included when one ended it; with an environment, the
    observations' ids in place."""
    logprobs: torch.Tensor
    """[n] the model's log-probs of them (temperature 1: what scoring computes)."""
    sample_logprobs: torch.Tensor
    """[n] log-probs under the sampling distribution (temperature, top-k, top-p applied); an
    observation token's: the model's (it was not sampled; masked out of the loss)."""
    stopped: bool
    """True when a stop id ended it (False: `max_new_tokens` reached, or the environment)."""
    loss_mask: torch.Tensor | None = None
    """[n] bool, with an environment: True where the policy sampled the token, False for the
    observations' tokens (context). None without one (every token is the policy's)."""
    turns: list[dict] = field(default_factory=list)
    """With an environment, one entry per env call: {"policy_tokens", "observation_tokens",
    "reward"} (reward: the step's, or None)."""
    env_reward: float | None = None
    """The final reward an environment gave with `done` (None: the reward function decides)."""
    end_reason: str = ""
    """Why the member ended: "stop id", "max_new_tokens", "env done", "max turns", or
    "env error: ..." naming what went wrong (the environment raised, ran past its timeout, its
    worker process died, or it returned something that is not ids in the vocabulary / a finite
    reward: env.py)."""


@dataclass
class DecodeCache:
    """Each member's branch-local state, per (layer, kind): the rows its tokens wrote, appended
    to the member's own `PageStore` (pages of `page_tokens` rows on `storage_device`: host memory
    when pages are offloaded, as capture's), or a carried state (GDN: fixed size, kept as it is).
    `segments` are the current step's rows by member, in row order: (member, first row, end
    row), one row for a sampled token, several for a block of an observation (`generate`).
    Nothing here grows on the device with the tokens generated: a step reads the rows back a key
    window or a selection at a time (`keys`)."""

    page_tokens: int
    storage_device: torch.device | str = "cpu"
    segments: list[tuple[int, int, int]] = field(default_factory=list)
    _pages: dict[int, PageStore] = field(default_factory=dict)
    _carried: dict[tuple[int, int, str], torch.Tensor] = field(default_factory=dict)

    def rows(self, segment: int) -> slice:
        """The current step's rows of segment `segment`."""
        _, start, end = self.segments[segment]
        return slice(start, end)

    def append(self, segment: int, layer: int, kind: str, rows: torch.Tensor) -> None:
        """Append the segment's `rows` [n, ...] of (layer, kind) to its member's pages."""
        member = self.segments[segment][0]
        store = self._pages.get(member)
        if store is None:
            store = self._pages[member] = PageStore(page_tokens=self.page_tokens,
                                                    storage_device=self.storage_device)
        store.append(layer, kind, rows)

    def keys(self, segment: int, layer: int, state: AttentionPass,
             branch_here: bool = True) -> DecodeKeys:
        """The key rows of `layer` the segment's queries read (`DecodeKeys`): this process's
        prompt pages, then, with `branch_here`, its member's rows (the segment's appended
        already: each query sees those up to its own position)."""
        branch = self._pages[self.segments[segment][0]]
        prompt = LayerRows(state.pages, layer) if state.pages is not None and \
            layer in state.pages.layers() else None
        positions = state.cp.prefix_positions
        return DecodeKeys(prompt=prompt,
                          prompt_positions=positions if prompt is not None
                          else torch.empty(0, dtype=torch.long, device=state.positions.device),
                          branch=LayerRows(branch, layer),
                          num_generated=branch.num_tokens(layer, branch.kinds(layer)[0]),
                          prefix_len=state.prefix_len, branch_here=branch_here)

    def carried(self, segment: int, layer: int, kind: str) -> torch.Tensor | None:
        return self._carried.get((self.segments[segment][0], layer, kind))

    def carry(self, segment: int, layer: int, kind: str, tensor: torch.Tensor) -> None:
        self._carried[(self.segments[segment][0], layer, kind)] = tensor


@dataclass(frozen=True)
class DecodeKeys:
    """One member's key rows of one layer in a decode step, on one row axis: this process's
    prompt rows (its pages: the whole prompt on one process, where row = position; its shard
    under CP), then the member's generated rows when `branch_here` (under CP they are counted on
    one rank). Read a key window (`window`) or a selection (`gather`) at a time, as streamed
    capture reads `pages.LayerRows`: never all of them on the device."""

    prompt: LayerRows | None
    """This process's prompt pages of the layer (None: nothing captured)."""
    prompt_positions: torch.Tensor
    """[num_prompt_rows] global positions of the prompt rows, ascending."""
    branch: LayerRows
    """The member's rows of the layer (row i: position prefix_len + i)."""
    num_generated: int
    """The member's rows so far, the current step's included."""
    prefix_len: int
    branch_here: bool = True

    @property
    def num_prompt_rows(self) -> int:
        return self.prompt_positions.numel()

    @property
    def num_rows(self) -> int:
        return self.num_prompt_rows + (self.num_generated if self.branch_here else 0)

    def visible(self, last: int) -> int:
        """Rows at positions <= `last` (a query's position): every prompt row, the member's up
        to it. The rows are in position order, so they are the first ones."""
        if not self.branch_here:
            return self.num_prompt_rows
        return self.num_prompt_rows + max(0, min(self.num_generated, last - self.prefix_len + 1))

    def positions(self, index: torch.Tensor) -> torch.Tensor:
        """Global positions of rows `index` (any shape, >= 0)."""
        first = self.num_prompt_rows
        if first == 0:
            return self.prefix_len + index
        prompt = self.prompt_positions.to(index.device)[index.clamp(max=first - 1)]
        return torch.where(index < first, prompt, self.prefix_len + index - first)

    def window(self, kind: str, start: int, end: int, device=None, dtype=None) -> torch.Tensor:
        """Rows [start, end) of `kind` [end - start, ...] on `device` (in `dtype`)."""
        first, parts = self.num_prompt_rows, []
        if start < first:
            parts.append(self.prompt.window(kind, start, min(end, first), device, dtype))
        if end > first:
            parts.append(self.branch.window(kind, max(start, first) - first, end - first,
                                            device, dtype))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def gather(self, kind: str, index: torch.Tensor, device=None, dtype=None) -> torch.Tensor:
        """Rows `index` (1-D, any order, < `num_rows`) of `kind` [n, ...] on `device`."""
        in_prompt = index < self.num_prompt_rows
        if self.num_prompt_rows and bool(in_prompt.all()):
            return self.prompt.gather(kind, index, device, dtype)
        generated = self.branch.gather(kind, index[~in_prompt] - self.num_prompt_rows, device,
                                       dtype)
        if not bool(in_prompt.any()):
            return generated
        out = generated.new_empty((index.numel(), *generated.shape[1:]))
        out[in_prompt.to(out.device)] = self.prompt.gather(kind, index[in_prompt], device, dtype)
        out[~in_prompt.to(out.device)] = generated
        return out


def generate(model, captured: CapturedPrompt, num_members: int, params: SamplingParams,
             settings: CaptureSettings | LongStrawConfig, envs: Sequence | None = None,
             env_limits: EnvLimits | None = None, tokenizer=None) -> list[Generation]:
    """Sample `num_members` responses continuing the captured prompt (module docstring).

    `envs` (one per member; env.py): multi-turn trajectories. A member's turn ends at one of
    its env's stop ids (or after `env_limits.turn_tokens` tokens); the calls of the members whose
    turns end at one step run together (at most `env_limits.max_concurrency` at a time), and each
    env's observation is then fed in as the member's next input rows, in blocks of up to
    `env_limits.prefill_block` rows per step beside the other members' rows (prefilled into its
    branch pages exactly as sampled tokens are), with loss mask 0. `envs` is a list of environment objects (called in this process,
    env.LocalEnvs) or env_workers.WorkerEnvs (each made and called in a worker process); an
    environment that would never be called, or a factory that fails, raises env.EnvSetupError.
    `settings`: the capture section, for the block sizes and where pages live (a whole
    `LongStrawConfig` gives its `capture`)."""
    capture = capture_section(settings)
    if num_members < 1:
        raise ValueError(f"num_members={num_members}: generate at least one response.")
    if envs is not None and len(envs) != num_members:
        raise ValueError(f"{len(envs)} environments for {num_members} members: give one each.")
    limits = env_limits or EnvLimits()
    device = next(model.parameters()).device
    groups = decoder_groups(model)
    # Branch pages no longer than a response can fill (a page is allocated whole: a member's
    # first row would otherwise take page_tokens rows per layer and kind).
    cache = DecodeCache(page_tokens=min(capture.page_tokens, params.max_new_tokens),
                        storage_device="cpu" if capture.offload_pages else device)
    active = list(range(num_members))
    last = [captured.last_token] * num_members
    tokens: list[list[int]] = [[] for _ in range(num_members)]
    logps: list[list[float]] = [[] for _ in range(num_members)]
    sample_logps: list[list[float]] = [[] for _ in range(num_members)]
    stopped = [False] * num_members
    trajectories = [_Trajectory() for _ in range(num_members)]
    # One generator per member: a member's samples do not depend on when the others stop.
    samplers = [torch.Generator(device="cpu").manual_seed(params.seed * 1_000_003 + m)
                for m in range(num_members)]
    stop_ids = set(params.stop_ids)
    cp = CPPass(layout=captured.layout, global_len=captured.prefix_len,
                prefix_positions=captured.positions.to(device))
    runner = None if envs is None else envs if hasattr(envs, "call") else LocalEnvs(envs)
    try:
        env_stop_ids = None if runner is None else _start_envs(runner, limits, captured.layout)
        with torch.no_grad():
            while active:
                # A member's rows this step: its last token, then (with an observation queued)
                # up to `prefill_block` - 1 of the observation's ids; the rows predict the
                # queued ids (forced) and, once they are all in, the member's next token.
                segments, inputs, positions = [], [], []
                for member in active:
                    done, pending = len(tokens[member]), trajectories[member].pending
                    count = min(1 + min(len(pending), limits.prefill_block - 1),
                                params.max_new_tokens - done)
                    segments.append((member, len(inputs), len(inputs) + count))
                    inputs += [last[member]] + pending[:count - 1]
                    positions += range(captured.prefix_len + done, captured.prefix_len + done + count)
                cache.segments = segments
                state = AttentionPass(
                    mode="decode", positions=torch.tensor(positions, device=device),
                    pages=captured.pages, prefix_len=captured.prefix_len, cp=cp,
                    query_block=capture.query_block, key_block=capture.key_block,
                    token_block=capture.token_block, decode=cache,
                    member_selections=[{} for _ in segments])
                hidden = embed(model, torch.tensor(inputs, device=device))
                for group in groups:
                    hidden = run_group(group, hidden, state)
                forced_rows, forced_ids, sampled = [], [], []
                for member, start, end in segments:
                    queued = trajectories[member].pending[:end - start]
                    forced_rows += range(start, start + len(queued))
                    forced_ids += queued
                    if len(queued) < end - start:
                        sampled.append((member, end - 1))
                forced_logps = iter(_forced_logprobs(model, hidden, forced_rows, forced_ids))
                if sampled:
                    logits = head_logits(model, hidden[[row for _, row in sampled]]).double().cpu()
                    model_logp = F.log_softmax(logits, dim=-1)                # [A, vocab]
                    sample_logp = _sampling_logprobs(logits, params)
                    picked = _sample(sample_logp, params, [samplers[m] for m, _ in sampled])
                ended, due = set(), []     # due: members whose turn closed (an env call each)
                for member, start, end in segments:
                    path = trajectories[member]
                    forced = path.pending[:end - start]
                    del path.pending[:len(forced)]
                    for token in forced:            # an observation's ids: the model's log-probs
                        logp = next(forced_logps)
                        tokens[member].append(token)
                        logps[member].append(logp)
                        sample_logps[member].append(logp)
                        path.mask.append(False)
                        last[member] = token
                for i, (member, _) in enumerate(sampled):
                    path, token = trajectories[member], int(picked[i])
                    tokens[member].append(token)
                    logps[member].append(float(model_logp[i, token]))
                    sample_logps[member].append(float(sample_logp[i, token]))
                    path.mask.append(True)
                    last[member] = token
                    if token in stop_ids:
                        stopped[member], path.end_reason = True, "stop id"
                        ended.add(member)
                    elif runner is not None:
                        path.turn.append(token)
                        if token in env_stop_ids[member] or (
                                limits.turn_tokens and len(path.turn) >= limits.turn_tokens):
                            due.append(member)
                if due:
                    outcomes = _call_envs(runner, [(m, trajectories[m].turn) for m in due],
                                          limits, model_logp.shape[-1], tokenizer,
                                          captured.layout)
                    for member, outcome in zip(due, outcomes):
                        if _take_outcome(trajectories[member], outcome, limits,
                                         room=params.max_new_tokens - len(tokens[member])):
                            ended.add(member)
                active = [m for m in active
                          if m not in ended and len(tokens[m]) < params.max_new_tokens]
    finally:
        if runner is not None:
            runner.close()
    return [Generation(torch.tensor(tokens[m], dtype=torch.long),
                       torch.tensor(logps[m], dtype=torch.float64),
                       torch.tensor(sample_logps[m], dtype=torch.float64), stopped[m],
                       loss_mask=(torch.tensor(trajectories[m].mask, dtype=torch.bool)
                                  if envs is not None else None),
                       turns=trajectories[m].turns, env_reward=trajectories[m].reward,
                       end_reason=trajectories[m].end_reason or "max_new_tokens")
            for m in range(num_members)]


@dataclass
class _Trajectory:
    """One member's multi-turn state during `generate`."""

    mask: list[bool] = field(default_factory=list)
    turn: list[int] = field(default_factory=list)        # the policy's tokens of the open turn
    pending: list[int] = field(default_factory=list)     # observation ids not yet fed in
    turns: list[dict] = field(default_factory=list)
    reward: float | None = None
    end_reason: str = ""


def _from_rank0(value, layout):
    """Under CP: rank 0's `value` on every rank of the group (the other ranks pass None)."""
    if layout is not None and layout.size > 1:
        box = [value]
        torch.distributed.broadcast_object_list(
            box, src=torch.distributed.get_global_rank(layout.group, 0), group=layout.group)
        value = box[0]
    return value


def _start_envs(runner, limits: EnvLimits, layout) -> list[set[int]]:
    """Each member's env stop ids. Under CP, CP rank 0 makes the environments (a worker
    process's factory runs once) and broadcasts their stop ids, or the error every rank then
    raises (EnvSetupError: the run's, not a member's)."""
    outcome = None
    if layout is None or layout.rank == 0:
        try:
            outcome = runner.start(limits)
        except ValueError as exc:
            outcome = str(exc)
    outcome = _from_rank0(outcome, layout)
    if isinstance(outcome, str):
        raise EnvSetupError(outcome)
    return [set(ids) for ids in outcome]


def _call_envs(runner, due: list[tuple[int, list[int]]], limits: EnvLimits, vocab_size: int,
               tokenizer, layout) -> list:
    """The due calls, concurrently (the runner) -> per call (observation ids, the step) or
    "env error: ...". Under CP every rank runs the same rows and reaches the same calls: CP
    rank 0 calls the environments and broadcasts the outcomes, so a tool runs once per call
    and every rank feeds the same observation."""
    outcomes = None
    if layout is None or layout.rank == 0:
        outcomes = []
        for outcome in runner.call(due, limits):
            if not isinstance(outcome, str):
                try:
                    outcome = (observation_ids(outcome, vocab_size, tokenizer), outcome)
                except EnvError as exc:
                    outcome = f"env error: {exc}"
            outcomes.append(outcome)
    return _from_rank0(outcomes, layout)


def _take_outcome(path: _Trajectory, outcome, limits: EnvLimits, room: int) -> bool:
    """A member's call outcome: queue its observation (cut to the `room` left) or record why it
    ends. True when the member ends here."""
    if isinstance(outcome, str):
        path.end_reason = outcome
        return True
    observation, step = outcome
    path.turns.append({"policy_tokens": len(path.turn), "observation_tokens": len(observation),
                       "reward": step.reward})
    path.turn = []
    if step.done:
        path.reward = step.reward
        path.end_reason = "env done"
        return True
    if len(path.turns) >= limits.max_turns:
        path.end_reason = "max turns"
        return True
    if len(observation) > room:
        path.pending = observation[:room]
        path.end_reason = "max_new_tokens (observation cut)"
        return False          # the cut observation is still fed in; the length limit ends it
    path.pending = observation
    return False


def _forced_logprobs(model, hidden: torch.Tensor, rows: list[int], ids: list[int]) -> list[float]:
    """The model's log-probs (fp64 softmax, as sampled rows') of the queued observation ids
    `ids` at rows `rows` of `hidden` [R, 1, h], `HEAD_CHUNK_ROWS` rows at a time: a block of
    observation rows never forms [block, vocab] logits at once."""
    out = []
    for at in range(0, len(rows), HEAD_CHUNK_ROWS):
        logits = head_logits(model, hidden[rows[at:at + HEAD_CHUNK_ROWS]]).double()
        picked = torch.tensor(ids[at:at + HEAD_CHUNK_ROWS], device=logits.device)
        out += F.log_softmax(logits, dim=-1).gather(-1, picked[:, None])[:, 0].tolist()
    return out


def _sampling_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probs of the sampling distribution [A, vocab]: temperature, then top-k, then top-p
    (the smallest set of most likely tokens whose probability reaches top_p), renormalised;
    -inf outside. Greedy (temperature 0): 0 at the argmax."""
    if params.temperature == 0:
        out = torch.full_like(logits, float("-inf"))
        return out.scatter_(-1, logits.argmax(-1, keepdim=True), 0.0)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        probs, order = F.softmax(logits, dim=-1).sort(dim=-1, descending=True)
        before = probs.cumsum(-1) - probs                   # mass of the more likely tokens
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order,
                                                                  before >= params.top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    return F.log_softmax(logits, dim=-1)


def _sample(logp: torch.Tensor, params: SamplingParams,
            samplers: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row, each row from its member's generator (greedy: the argmax)."""
    if params.temperature == 0:
        return logp.argmax(-1)
    return torch.stack([torch.multinomial(row.exp(), 1, generator=g)[0]
                        for row, g in zip(logp, samplers)])
