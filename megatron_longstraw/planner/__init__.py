"""Memory planner: per-rank device peak and host page bytes of one LongStraw GRPO step, from a model
config and a layout (docs/design.md sections 2, 3 and 9), and the largest prompt that fits.

Every figure is a formula over the shapes the code allocates, each naming the tensor (and file) it
stands for. Three groups of figures are checked against the built models on CPU
(tests/test_planner.py), for both families:

- host pages: `host_page_bytes_per_rank(_logical)` equal `CapturedPrompt.pages.nbytes()` exactly
  (allocated and logical; Qwen3.6's fixed GDN state and conv tail and its per-token K/V rows at two
  prompt lengths, CP = 1 and, per rank, CP = 2);
- replay activations: `glm52_replay_saved` and `qwen36_replay_saved` reproduce, tensor kind by
  tensor kind, what autograd saves during replay as `memory.SavedTensorMeter` counts it (each saved
  reference by its own bytes), with whole-layer checkpointing on and off: GLM-5.2 at CP = 1 (tests)
  and CP = 2, 4 (tools/evidence.py, level 1); Qwen3.6 at CP = 1 in fp32 and bf16, and CP = 2;
- parameter and LoRA-adapter counts equal the built model's (and `adapters.apply_lora`'s); the
  full-size Qwen3.6 is built on the meta device and counted.

- GLM-5.2's capture phases (per layer kind: block scratch, selected rows, MoE dispatch),
  scoring and replay phases (the page window, the LM head, the selections, the backward
  transient with the lines above), summed as `phase_bytes` sums them, against the live-bytes
  meter at two prompt lengths, the pages copied on every read as to a device: an upper bound at
  CP 1 and 2 (the CP-only lines), which the runs reach to 75-99%
  (tests/test_capture_streamed.py, tests/test_replay_memory.py,
  tests/test_capture_streamed_cp.py); Qwen3.6's capture (per layer kind: gated attention, GDN,
  MLP; at CP 2 with GDN's head-parallel exchange), scoring and replay the same way with
  `gdn_kernels="torch"` (the delta rule the CPU runs), 0.89-0.99; DeepSeek-V3's capture,
  scoring and replay: upper bounds.

The rest (the GPU kernels' working sets: FLA's delta rule and l2norm instead of the PyTorch ones
the CPU runs, Qwen3.6's default plan) is analytic: read off the code, not measured on a GPU; the
report labels each item so.

A family is one function `(spec, prompt_len) -> Footprint` (`glm52` against this package's GLM-5.2
model, `qwen36` against its Qwen3.6 model), in the family's folder (models/<family>/planner.py)
and named by its record (`Family.planner`, models/<family>/family.py); `FAMILIES` is that view of
the registry (megatron_longstraw/models/registry.py); the vocabulary they share is
models/footprint.py. Imports: every wing below (it reads the families through the registry).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from megatron_longstraw.config.choices import PromptGrad
from megatron_longstraw.models import registry as _registry
# The public names of the family modules and the vocabulary, importable from `planner`.
from megatron_longstraw.models.footprint import (
    DTYPE_BYTES, Footprint, GPU_BYTES, GiB, Item, MiB, PageKind, ParamGroup, PlanSpec,
    TRAINABLE, local_prompt_rows, lse_merge_saved, page_bytes, phase_bytes,
    prompt_backward_inputs_bytes,
)
from megatron_longstraw.models.glm52.planner import (
    glm52, glm52_pages, glm52_params, glm52_replay_saved,
)
from megatron_longstraw.models.qwen36.planner import (
    GDN_CHUNK, fla_chunk_delta_rule_saved, qwen36, qwen36_pages, qwen36_params,
    qwen36_replay_saved, torch_chunk_delta_rule_saved, zero_centred_norm_saved,
)

__all__ = [
    "DTYPE_BYTES",
    "FAMILIES",
    "Footprint",
    "GDN_CHUNK",
    "GPU_BYTES",
    "GiB",
    "Item",
    "MiB",
    "PageKind",
    "ParamGroup",
    "Plan",
    "PlanSpec",
    "TRAINABLE",
    "base_weight_bytes",
    "fla_chunk_delta_rule_saved",
    "format_plan",
    "glm52",
    "glm52_pages",
    "glm52_params",
    "glm52_replay_saved",
    "local_prompt_rows",
    "lse_merge_saved",
    "page_bytes",
    "phase_bytes",
    "plan",
    "prompt_backward_inputs_bytes",
    "qwen36",
    "qwen36_pages",
    "qwen36_params",
    "qwen36_replay_saved",
    "torch_chunk_delta_rule_saved",
    "trainable_count",
    "zero_centred_norm_saved",
]

FAMILIES: dict[str, Callable[[PlanSpec, int], Footprint]] = {
    name: family.planner.footprint for name, family in _registry.FAMILIES.items()}
"""Family name -> its planner function, from the registry."""


# ---- the plan -----------------------------------------------------------------------------------


def trainable_count(spec: PlanSpec, params: list[ParamGroup]) -> tuple[float, float]:
    """(dense, expert) trainable parameters held by one rank (experts: this rank's share)."""
    if spec.trainable_params is not None:
        return float(spec.trainable_params), 0.0
    mode = spec.trainable
    if mode == "lora":
        count = lambda g: sum(spec.lora_rank * (i + o) for i, o in g.lora_shapes)
        return (float(sum(count(g) for g in params if not g.expert)),
                sum(count(g) for g in params if g.expert) / spec.ep if spec.lora_experts else 0.0)
    pick = {"all": lambda g: True, "none": lambda g: False,
            "non_expert": lambda g: not g.expert,
            "attention": lambda g: g.kind == "attention",
            "head": lambda g: g.kind == "head"}[mode]
    dense = sum(g.count for g in params if pick(g) and not g.expert)
    expert = sum(g.count for g in params if pick(g) and g.expert) / spec.ep
    return float(dense), float(expert)


@dataclass
class Plan:
    spec: PlanSpec
    static: list[Item]
    phases: dict[str, list[Item]]
    phase_totals: dict[str, float]
    device_peak_bytes_per_rank: float
    peak_phase: str
    page_bytes_per_token: float
    host_page_bytes_per_rank: float
    host_page_bytes_per_rank_logical: float
    host_bytes_per_node: float
    replay_saved: dict[str, float]
    notes: list[str]
    host_items: list[Item] = field(default_factory=list)
    """Host bytes per rank beside the pages (Footprint.host)."""
    max_prompt_len_device: int | None = None
    max_prompt_len_host: int | None = None
    max_response_len_device: int | None = None
    """Longest response whose step fits the device at this prompt length."""
    max_response_len_host: int | None = None
    """Longest response whose step fits the host (per node) at this prompt length."""
    response_limit: str = ""
    """What stops the response one token past the largest: the phase or host line that grows
    past the budget there (`_limit`)."""

    @property
    def max_response_len(self) -> int | None:
        vals = [self.max_response_len_device, self.max_response_len_host]
        return None if None in vals else min(vals)

    @property
    def max_prompt_len(self) -> int | None:
        vals = [self.max_prompt_len_device, self.max_prompt_len_host]
        return None if None in vals else min(vals)

    @property
    def device_fits(self) -> bool:
        return self.device_peak_bytes_per_rank <= self.spec.gpu_bytes - self.spec.device_reserve

    @property
    def host_fits(self) -> bool:
        return self.host_bytes_per_node <= self.spec.host_bytes

    def to_dict(self) -> dict:
        s = self.spec
        return {
            "family": s.family, "prompt_len": s.prompt_len, "group_size": s.group_size,
            "response_len": s.response_len, "cp": s.cp, "ep": s.ep, "trainable": s.trainable,
            "gpu_bytes": s.gpu_bytes, "device_reserve": s.device_reserve,
            "host_bytes_per_node": s.host_bytes, "ranks_per_node": s.ranks_per_node,
            "page_bytes_per_token": self.page_bytes_per_token,
            "host_page_bytes_per_rank": self.host_page_bytes_per_rank,
            "host_page_bytes_per_rank_logical": self.host_page_bytes_per_rank_logical,
            "host_bytes_per_node_needed": self.host_bytes_per_node,
            "host_items_per_rank": {i.name: i.bytes for i in self.host_items},
            "device_peak_bytes_per_rank": self.device_peak_bytes_per_rank,
            "peak_phase": self.peak_phase, "device_fits": self.device_fits,
            "host_fits": self.host_fits,
            "static": {i.name: i.bytes for i in self.static},
            "phases": {p: {i.name: i.bytes for i in items} for p, items in self.phases.items()},
            "phase_totals": self.phase_totals,
            "replay_saved": self.replay_saved,
            "max_prompt_len": self.max_prompt_len,
            "max_prompt_len_device": self.max_prompt_len_device,
            "max_prompt_len_host": self.max_prompt_len_host,
            "max_response_len_device": self.max_response_len_device,
            "max_response_len_host": self.max_response_len_host,
            "max_response_len": self.max_response_len,
            "response_limit": self.response_limit,
            "response_block": s.response_block, "updates_per_capture": s.updates_per_capture,
            "drift": s.drift,
            "notes": self.notes,
        }


def base_weight_bytes(spec: PlanSpec, params: list[ParamGroup]) -> float:
    """One rank's base weights (routed experts / EP). NF4 (QLoRA, `adapters.apply_lora(...,
    quantize_base=True)`) quantises only the linears an adapter wraps (the groups' lora_shapes,
    routed experts with `lora_experts`); embedding, output layer, norms and the rest stay in the
    activation dtype. The FP8 base (`spec.fp8_base`, fp8_base.apply_fp8_base) holds the family's
    FP8 linears (the groups' fp8_shapes, adapters or not) in FP8 bytes plus an fp32 scale per
    128 x 128 block (`fp8.nbytes`, checked against the built model's resident bytes on CPU,
    tests/test_fp8_base.py); the rest stays in the activation dtype. Other dtypes apply to every
    parameter."""
    share = lambda g: 1 / spec.ep if g.expert else 1
    if spec.fp8_base:
        from megatron_longstraw.kernels.fp8 import nbytes as fp8_nbytes

        total = 0.0
        for g in params:
            quantised = sum(i * o for i, o, _ in g.fp8_shapes)
            stored = sum(fp8_nbytes(o, i, parts) for i, o, parts in g.fp8_shapes)
            total += share(g) * (stored + (g.count - quantised) * spec.act_bytes)
        return total
    if spec.weight_bytes >= 1:
        return sum(g.count * share(g) for g in params) * spec.weight_bytes
    total = 0.0
    for g in params:
        quantised = sum(i * o for i, o in g.lora_shapes) if spec.lora_experts or not g.expert else 0
        total += share(g) * (quantised * spec.weight_bytes + (g.count - quantised) * spec.act_bytes)
    return total


def _evaluate(spec: PlanSpec, prompt_len: int) -> Plan:
    fp = FAMILIES[spec.family](spec, prompt_len)
    weights = base_weight_bytes(spec, fp.params)
    dense, expert = trainable_count(spec, fp.params)
    # Adapters (and a given trainable count: QLoRA) are fp32 parameters of their own: no master
    # copy. Full fine-tuning of 16-bit weights keeps an fp32 master copy beside Adam's moments.
    own = spec.trainable == "lora" or spec.trainable_params is not None
    optimizer_bytes = 8 if own or spec.weight_bytes >= 4 else 12
    shard = spec.cp if spec.shard_optimizer else 1     # distributed optimizer over DP x CP (DP = 1)
    static = [
        Item((f"base weights (FP8 linears 1 B/param + an fp32 scale per 128x128 block, the rest "
              f"{spec.act_bytes:.4g} B" if spec.fp8_base else
              f"base weights ({spec.weight_bytes:.4g} B/param"
              + (f", adapted linears only, the rest {spec.act_bytes:.4g} B"
                 if spec.weight_bytes < 1 else ""))
             + f"; routed experts / EP={spec.ep})", weights),
        Item("adapter weights (fp32)", 4 * (dense + expert) if own else 0.0),
        Item("gradients (fp32 main_grad, trainable)", 4 * (dense + expert)),
        Item(("optimizer (Adam m, v fp32)" if optimizer_bytes == 8 else "optimizer (fp32 master + "
              "Adam m, v)") + (f"; dense sharded / {shard}" if shard > 1 else ""),
             optimizer_bytes * (dense / shard + expert)),
    ]
    static_total = sum(i.bytes for i in static)
    rows = local_prompt_rows(prompt_len, spec.cp)
    logical, allocated = page_bytes(fp.pages, rows, spec.page_tokens)
    if spec.prompt_grad is PromptGrad.EXACT:
        fp = _with_prompt_backward(spec, fp, prompt_len, rows, logical)
    totals = {p: static_total + phase_bytes(items) for p, items in fp.phases.items()}
    peak_phase = max(totals, key=totals.get)
    copies = 2 if spec.kl else 1
    per_token = sum(p.row_bytes * p.num_layers for p in fp.pages if p.sequence)
    host = fp.host + _member_tables(spec, allocated)
    return Plan(spec=spec, static=static, phases=fp.phases, phase_totals=totals,
                device_peak_bytes_per_rank=totals[peak_phase], peak_phase=peak_phase,
                page_bytes_per_token=per_token,
                host_page_bytes_per_rank=copies * allocated,
                host_page_bytes_per_rank_logical=copies * logical,
                host_bytes_per_node=spec.ranks_per_node
                * (copies * allocated + sum(i.bytes for i in host) + spec.host_reserve_per_rank),
                replay_saved=fp.replay_saved, notes=fp.notes + _blockwise_notes(spec),
                host_items=host)


def _member_tables(spec: PlanSpec, pages_allocated: float) -> list[Item]:
    """Host lines of the members themselves (every rank holds whole members): their token ids
    (int64), the capture-time log-probs (the PPO denominators) and the replayed ones (fp32), and
    when the data gives them the engine's log-probs and TIS weights (fp32) and loss masks (bool):
    G x K members of R tokens, held through the capture's K updates (step/schedule.py
    `train_on_capture`). With the drift measured (K > 1), the fresh capture's pages beside the
    kept ones while a measurement runs (staleness.measure_drift; the KL reference is not
    captured again)."""
    members = spec.group_size * spec.updates_per_capture
    items = [Item("members' tables: G x K x [R] token ids int64, capture-time and replayed "
                  "log-probs fp32, engine log-probs / TIS weights fp32 and loss masks (at most)",
                  members * spec.response_len * (8 + 4 + 4 + 4 + 4 + 1))]
    if spec.drift and spec.updates_per_capture > 1:
        items.append(Item("drift measurement: a fresh capture's pages beside the kept ones",
                          pages_allocated))
    return items


BLOCKWISE_CHECKED = {"glm52": "0.91-0.96", "qwen36": "0.94-0.99", "deepseekv3": "0.73-0.92"}
"""measured / planned scoring and replay peaks of a blockwise branch on the tiny models (fp32,
R = 32 and 128 in blocks of 16; tests/test_replay_memory.py asserts the plan bounds them)."""


def _blockwise_notes(spec: PlanSpec) -> list[str]:
    """A note on how far the blockwise scoring and replay lines are checked, when the response
    runs in more than one block."""
    if spec.response_block is None or spec.response_len <= spec.response_block:
        return []
    return [f"blockwise branch (response_block={spec.response_block:,}): the scoring and replay "
            f"lines against the live-bytes meter: measured / planned "
            f"{BLOCKWISE_CHECKED.get(spec.family, 'not measured')} on the tiny models (an upper "
            f"bound there)."]


def _with_prompt_backward(spec: PlanSpec, fp: Footprint, prompt_len: int, rows: int,
                          logical: float) -> Footprint:
    """The exact prompt gradient's additions (prompt_backward.py). Host: what capture keeps for
    the prompt backward (layer inputs, token ids, selections; checked on CPU), the running
    cotangent [P/CP, h], a cotangent buffer beside every page but the index keys (at least fp32),
    and (CP 1) the GDN state at every token block's start. Device: replay sends the prompt rows'
    cotangents to the host buffers (selected rows, or one key window, at a time: nothing beside
    replay's own working set); the prompt backward holds one layer's pages and one token block's
    graph through one decoder layer (CP 1; under CP, the whole shard's: O(P / CP))."""
    b = spec.act_bytes
    stored = lambda k: max(4.0, spec.act_bytes) if k.name == "gdn_state" else spec.latent_bytes
    buffers = sum(k.num_layers * (rows if k.sequence else 1) * k.row_bytes
                  * max(4.0, stored(k)) / stored(k) for k in fp.pages if k.name != "index_key")
    # The carried state at each token block's start; the first block starts from zeros (no state).
    fixed = {k.name: k for k in fp.pages if not k.sequence}
    blocks = -(-rows // spec.token_block)
    boundaries = 0.0
    if spec.cp == 1 and fixed:
        boundaries = sum(k.num_layers * (blocks - (k.name == "gdn_state")) * k.row_bytes
                         for k in fixed.values())
    branch_rows = max(spec.response_len, 1)
    block = min(spec.token_block, max(rows, 1)) if spec.cp == 1 else rows
    window = sum(k.row_bytes * rows for k in fp.pages if k.sequence)   # row_bytes: one layer's
    phases = dict(fp.phases)
    phases["prompt backward"] = [
        Item("one layer's pages (the page window)", window),
        Item(f"one decoder layer's graph over {'a token block' if spec.cp == 1 else 'the shard'}"
             " (replay's per-layer working set scaled to its rows)",
             fp.replay_saved.get("layer_working_set_device", 0.0) * block / branch_rows),
        Item("running cotangent rows of the block [rows, h] x2", 2 * block * spec.model.hidden_size
             * b)]
    host = fp.host + [
        Item("layer inputs, token ids and DSA selections kept for the prompt backward",
             prompt_backward_inputs_bytes(spec.model, rows, b, prompt_len)),
        Item("running cotangent [P/CP, h]", rows * spec.model.hidden_size * b),
        Item("page cotangent buffers (every page kind but index keys, >= fp32)", buffers),
        Item("GDN state at every token block's start (CP 1)", boundaries)]
    notes = fp.notes + ["exact prompt gradient: the prompt backward's device graph is replay's "
                        "per-layer working set scaled from R to the block's rows (analytic)"]
    return dataclasses.replace(fp, phases=phases, host=host, notes=notes)


def _largest(fits: Callable[[int], bool], hi: int = 1 << 34, lo: int = 1) -> int | None:
    """Largest x in [lo, hi] with fits(x) (fits is monotone decreasing in x); None if none."""
    if not fits(lo):
        return None
    if fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def plan(spec: PlanSpec, search_max: bool = True) -> Plan:
    """The plan at spec.prompt_len, with the largest prompt that fits the device and the host."""
    result = _evaluate(spec, spec.prompt_len)
    if search_max:
        result.max_prompt_len_device = _largest(lambda p: _evaluate(spec, p).device_fits, lo=2)
        result.max_prompt_len_host = _largest(lambda p: _evaluate(spec, p).host_fits, lo=2)
        at = lambda r: _evaluate(dataclasses.replace(spec, response_len=r), spec.prompt_len)
        result.max_response_len_device = _largest(lambda r: at(r).device_fits, hi=1 << 22)
        result.max_response_len_host = _largest(lambda r: at(r).host_fits, hi=1 << 22)
        longest = result.max_response_len
        if longest is not None and longest < 1 << 22:
            result.response_limit = _limit(at(longest), at(longest + 1))
    return result


def _limit(fits: Plan, breaks: Plan) -> str:
    """What breaks the plan one response token past the largest: the device (its peak phase and
    that phase's largest line) or the host (its largest line per rank)."""
    if not breaks.device_fits:
        items = breaks.phases[breaks.peak_phase]
        top = max(items, key=lambda i: i.bytes)
        return (f"device: the {breaks.peak_phase} phase, largest line '{top.name}' "
                f"({top.bytes / GiB:.2f} GiB)")
    top = max(breaks.host_items, key=lambda i: i.bytes, default=None)
    name = f", largest line beside the pages '{top.name}' ({top.bytes / GiB:.2f} GiB per rank)" \
        if top else ""
    return f"host: {breaks.host_bytes_per_node / GiB:.2f} GiB per node{name}"


def format_plan(p: Plan) -> str:
    """A readable breakdown (GiB)."""
    g = lambda x: f"{x / GiB:10.2f} GiB"
    s = p.spec
    lines = [f"LongStraw memory plan: {s.family}, P={s.prompt_len:,}, G={s.group_size}, "
             + (f"K={s.updates_per_capture} updates per capture"
                + (" (drift measured)" if s.drift else "") + ", " if s.updates_per_capture > 1
                else "")
             + 
             f"R={s.response_len}, CP={s.cp}, EP={s.ep}, trainable="
             + (f"{s.trainable_params:,} params (given)" if s.trainable_params is not None
                else s.trainable + (f" (rank {s.lora_rank})" if s.trainable == "lora" else "")),
             f"  page bytes per token (all layers)       {p.page_bytes_per_token:,.1f} B",
             "  static (every phase)"]
    lines += [f"    {g(i.bytes)}  {i.name}" for i in p.static]
    for phase, items in p.phases.items():
        lines.append(f"  {phase} (on top of static): total {g(p.phase_totals[phase]).strip()}")
        lines += [f"    {g(i.bytes)}  {i.name}{f'  (one of: {i.group})' if i.group else ''}"
                  f"{'  [checked on CPU]' if i.measured else ''}" for i in items if i.bytes]
    usable = s.gpu_bytes - s.device_reserve
    lines += [
        f"  device peak per rank ({p.peak_phase}): {g(p.device_peak_bytes_per_rank).strip()} of "
        f"{g(usable).strip()} usable ({g(s.gpu_bytes).strip()} - {g(s.device_reserve).strip()} reserve)"
        f" -> {'fits' if p.device_fits else 'DOES NOT FIT'}",
        f"  host pages per rank: {g(p.host_page_bytes_per_rank).strip()} allocated "
        f"({g(p.host_page_bytes_per_rank_logical).strip()} logical, page_tokens={s.page_tokens})",
        *[f"  host beside the pages per rank: {g(i.bytes).strip()}  {i.name}"
          f"{'  [checked on CPU]' if i.measured else ''}" for i in p.host_items],
        f"  host per node ({s.ranks_per_node} ranks, + {g(s.host_reserve_per_rank).strip()} each): "
        f"{g(p.host_bytes_per_node).strip()} of {g(s.host_bytes).strip()} -> "
        f"{'fits' if p.host_fits else 'DOES NOT FIT'}",
        f"  largest prompt: device {_fmt_len(p.max_prompt_len_device)}, host "
        f"{_fmt_len(p.max_prompt_len_host)} -> {_fmt_len(p.max_prompt_len)}",
        f"  largest response at P={s.prompt_len:,} (response_block={s.response_block:,}): device "
        f"{_fmt_len(p.max_response_len_device, 1)}, host {_fmt_len(p.max_response_len_host, 1)} -> "
        f"{_fmt_len(p.max_response_len, 1)}"
        + (f"; limited by {p.response_limit}" if p.response_limit else ""),
    ]
    lines += [f"  note: {n}" for n in p.notes]
    return "\n".join(lines)


def _fmt_len(n: int | None, smallest: int = 2) -> str:
    return f"none (does not fit even at {smallest})" if n is None else f"{n:,}"
