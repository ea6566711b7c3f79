"""Pre-step scoring and serial replay (docs/design.md section 2, steps 2 and 3).

A member's branch is `[x_P, y_1 .. y_{R-1}]` at positions `P-1 .. P+R-2` over the captured prefix;
its outputs score `y_1 .. y_R`. Scoring runs the branch without autograd and records each full DSA
indexer layer's top-k ("indexer replay"); replay runs it again under autograd with those selections,
every decoder layer wrapped in activation checkpointing, computes the member's loss and its
statistics (once) and backpropagates the loss before the next member starts. Live autograd memory
is one block of one branch, whatever P, R and G. When the group carries the engine's DSA
selections or MoE routing (routing replay, routing_replay.py), scoring uses them and replay
reuses them.

Blocks. A branch longer than `ReplaySettings.response_block` runs in blocks (`member_blocks`):
scoring runs them in order without autograd, each block's pass (`AttentionPass.branch`) reading
the earlier blocks' state from host pages (`_Blocks`: their key rows, GDN's carried state) and
handing its own to them. Replay runs the same forward, then walks the blocks in reverse: each
block is recomputed under autograd over the earlier blocks' rows (their cotangents go to buffers
beside them) and one backward takes the block's loss plus the cotangents later blocks left on
its own state; then its rows are dropped. The same update as the whole branch
(tests/test_blockwise_replay.py), device memory bounded by a block (test_blockwise_memory.py).

Under context parallelism each rank owns a contiguous share of every block's rows (padded to
equal shares; one block: of the branch) for token-wise work and the loss; attention exchanges a
block's queries and partial outputs (`models/context_parallel.py`); the shares' losses and
statistics are combined after backward. The DSA selections scoring keeps are this rank's rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from megatron_longstraw.distributed import collectives
from megatron_longstraw.distributed.cp_layout import CPLayout
from megatron_longstraw.state.attention_pass import (AttentionPass, CPPass, EarlierBlocks,
                                                     PromptGrad)
from megatron_longstraw.state.pages import PageStore
from megatron_longstraw.runtime.memory import note_host
from megatron_longstraw.config.settings import LongStrawConfig
from megatron_longstraw.models.common import (decoder_groups, embed, head_logprobs,
                                               head_logprobs_entropy, mixer_of, run_group,
                                               selection_kinds)
from megatron_longstraw.context.capture import CapturedPrompt
from megatron_longstraw.grpo.loss import combine_shares
from megatron_longstraw.step import routing_replay


@dataclass
class Branch:
    """This rank's rows of one member's branch, or of one block of it."""

    input_ids: torch.Tensor   # [c] token ids (padding: 0)
    targets: torch.Tensor     # [c] next tokens (padding: 0)
    positions: torch.Tensor   # [c] global positions
    valid: torch.Tensor       # [c] bool, False on padding
    rows: slice               # this rank's rows within the (padded) branch
    length: int               # R (unpadded)
    padded_length: int        # rows of the branch or block, padded to the CP size
    start: int = 0            # the block's first row in the branch (0: the whole branch)


def branch_blocks(length: int, block: int, cp_size: int) -> list[tuple[int, int]]:
    """`CPLayout.branch_blocks` for a CP size: (first row, padded end) of each block."""
    return CPLayout(None, cp_size, 0).branch_blocks(length, block)


def make_branch(captured: CapturedPrompt, response_ids: torch.Tensor, start: int = 0,
                end: int | None = None) -> Branch:
    """This rank's rows of the branch rows [start, end) (a block of `branch_blocks`; default:
    the whole padded branch). Rank r holds the r-th of CP equal contiguous shares of them."""
    layout = captured.layout
    length = int(response_ids.numel())
    if end is None:
        end = layout.branch_rows(length)[2]
    per_rank = (end - start) // layout.size
    rows = slice(start + layout.rank * per_rank, start + (layout.rank + 1) * per_rank)
    device = response_ids.device

    def tokens(lo: int, hi: int) -> torch.Tensor:
        """Response tokens [lo, hi), zeros past the response (padding): this block's only."""
        part = response_ids[min(lo, length):min(hi, length)]
        return torch.cat([part, part.new_zeros(hi - lo - part.numel())])

    # Row j reads token j - 1 of the response (row 0: the prompt's last token) and scores token j.
    if rows.start == 0:
        first = torch.tensor([captured.last_token], dtype=response_ids.dtype, device=device)
        input_ids = torch.cat([first, tokens(0, rows.stop - 1)])
    else:
        input_ids = tokens(rows.start - 1, rows.stop - 1)
    positions = torch.arange(captured.prefix_len + rows.start, captured.prefix_len + rows.stop,
                             device=device)
    valid = torch.arange(rows.start, rows.stop, device=device) < length
    return Branch(input_ids, tokens(rows.start, rows.stop), positions, valid, rows, length,
                  end - start, start)


def member_blocks(captured: CapturedPrompt, response_ids: torch.Tensor,
                  cfg: LongStrawConfig) -> list[Branch]:
    """The member's branch in blocks of `cfg.replay.response_block` rows (one block when it fits)."""
    bounds = captured.layout.branch_blocks(int(response_ids.numel()), cfg.replay.response_block)
    if len(bounds) == 1:
        return [make_branch(captured, response_ids)]
    return [make_branch(captured, response_ids, start, end) for start, end in bounds]


def _pass(captured: CapturedPrompt, branch: Branch, cfg: LongStrawConfig,
          selections: dict | None, mode: str = "replay",
          prompt_grad: PromptGrad = PromptGrad.DETACHED,
          earlier: EarlierBlocks | None = None) -> AttentionPass:
    cp = CPPass.for_branch(captured.layout, captured.positions, captured.prefix_len,
                           branch.padded_length, branch.start)
    if selections is not None:
        selections = _block_selections(selections, branch, captured.layout)
    return AttentionPass(mode=mode, positions=branch.positions, pages=captured.pages,
                         prefix_len=captured.prefix_len, selections=dict(selections or {}),
                         reuse_selections=selections is not None, query_block=cfg.capture.query_block,
                         key_block=cfg.capture.key_block, token_block=cfg.capture.token_block, cp=cp,
                         prompt_grad=prompt_grad, branch=earlier)


def _block_selections(selections: dict[int, torch.Tensor], branch: Branch,
                      layout: CPLayout) -> dict[int, torch.Tensor]:
    """This rank's rows of a member's selections ({layer: [R_pad / CP, k]}, `score_member`'s)
    -> every row of the block or branch `branch` ({layer: [rows, k]}, what a branch pass reads:
    under CP every rank selects for all of them), gathered from the ranks (one block's worth)."""
    first = branch.start // layout.size
    count = branch.padded_length // layout.size
    return {layer: collectives.gather_tensor(sel[first:first + count].contiguous(), layout)
            for layer, sel in selections.items()}


def _own_selections(selections: dict[int, torch.Tensor], branch: Branch, layout: CPLayout,
                    device) -> dict[int, torch.Tensor]:
    """A branch pass's selections ({layer: [rows of the block, k]}) -> this rank's rows of them
    (int32 on `device`: host memory when pages are offloaded), what scoring keeps per block."""
    count = branch.padded_length // layout.size
    own = {}
    for layer, sel in selections.items():
        rows = sel[layout.rank * count:(layout.rank + 1) * count]
        own[layer] = rows.to(device=device, dtype=torch.int32, copy=True)
        if own[layer].device.type == "cpu" and device is not None:
            note_host(own[layer])
    return own


def gather_selections(selections: dict[int, torch.Tensor], length: int, cfg: LongStrawConfig,
                      layout: CPLayout) -> dict[int, torch.Tensor]:
    """`score_member`'s selections (this rank's rows) -> the whole member's [R_pad, k] on every
    rank, in row order (tests and tools; collective under CP)."""
    if layout.size == 1:
        return selections
    order = torch.cat([CPLayout(None, layout.size, r).own_branch_rows(length, cfg.replay.response_block)
                       for r in range(layout.size)])
    out = {}
    for layer, sel in selections.items():
        every = collectives.gather_tensor(sel.contiguous(), layout)
        whole = torch.empty_like(every)
        whole[order.to(every.device)] = every
        out[layer] = whole
    return out


def _run_layers(model, captured: CapturedPrompt, branch: Branch, state: AttentionPass,
                checkpoint_layers: bool) -> torch.Tensor:
    """The last hidden states [c, 1, h] of this rank's branch rows in the pass `state`. A
    checkpointed layer gets the pass as an argument, so its recompute in backward runs in the
    same pass."""
    hidden = embed(model, branch.input_ids)                           # [c, 1, h]
    groups = decoder_groups(model)
    for layer_idx, group in enumerate(groups):
        if captured.prefix_len and layer_idx + 1 < len(groups):
            captured.pages.prefetch(layer_idx + 1, hidden.device)    # one layer ahead
        if checkpoint_layers and torch.is_grad_enabled():
            hidden = checkpoint(run_group, group, hidden, state, use_reentrant=False)
        else:
            hidden = run_group(group, hidden, state)
        captured.pages.release(layer_idx)
    return hidden


def _run_branch(model, captured: CapturedPrompt, branch: Branch, state: AttentionPass,
                checkpoint_layers: bool):
    """Log-probs [c] of this rank's branch rows in the pass `state` (`_run_layers`)."""
    hidden = _run_layers(model, captured, branch, state, checkpoint_layers)
    return head_logprobs(model, hidden, branch.targets)


class _Blocks:
    """A blockwise branch's earlier blocks on this rank (module docstring): their key rows in
    host pages (a `PageStore` like the prompt's, in the model's dtype: the rows later blocks read
    are the rows a whole-branch pass computes), their positions, and the carried state (GDN) at
    each block's start. Forward appends block by block; the reverse walk drops them block by
    block (`rewind`)."""

    def __init__(self, model, captured: CapturedPrompt, device):
        prompt = captured.pages
        self.pages = PageStore(page_tokens=prompt.page_tokens, pin_memory=prompt.pin_memory,
                               storage_device=prompt.storage_device)
        self.carried_kinds = {kind for group in decoder_groups(model)
                              for kind in getattr(mixer_of(group), "carried_kinds", ())}
        self.selection_kinds = selection_kinds(model)
        self.device = device
        self.positions: list[torch.Tensor] = []       # per block kept: this rank's positions
        self.starts: list[dict] = [{}]                # per block: carried state at its start

    def view(self, index: int) -> EarlierBlocks:
        """The earlier blocks as block `index` reads them (the pages hold exactly those). The
        last block's state is not kept (`_forward_blocks`): nothing reads it."""
        held = self.positions[:index]
        positions = (torch.cat(held) if held
                     else torch.empty(0, dtype=torch.long, device=self.device))
        return EarlierBlocks(pages=self.pages, positions=positions)

    def keep(self, view: EarlierBlocks, branch: Branch) -> None:
        """After a block's forward: its rows join the pages; its end state is the next block's
        start (a fixed kind of the pages, and kept for the reverse walk)."""
        start = {}
        for (layer, kind), tensor in view.emitted.items():
            if kind in self.carried_kinds:
                self.pages.put(layer, kind, tensor)
                start[(layer, kind)] = note_host(
                    tensor.detach().to(self.pages.storage_device, copy=True))
            else:
                self.pages.append(layer, kind, tensor)
        self.positions.append(branch.positions)
        self.starts.append(start)

    def keep_grads(self) -> None:
        """The reverse walk: cotangent buffers beside the kept rows and the carried state (index
        keys get none: they only select)."""
        kinds = {kind for layer in self.pages.layers() for kind in self.pages.kinds(layer)}
        self.pages.keep_grads(sorted(kinds - self.selection_kinds))

    def rewind(self, index: int) -> dict[tuple[int, str], torch.Tensor]:
        """Before block `index`'s backward: the cotangents its rows collected from the later
        blocks (by (layer, kind)); the pages then hold the blocks before it only, and the state
        at its start."""
        first = sum(p.numel() for p in self.positions[:index])
        seeds = {}
        # the last block's state is not kept (nothing reads it): no cotangents wait for it
        for layer in (self.pages.layers() if index < len(self.positions) else ()):
            count = self.positions[index].numel()
            for kind in self.pages.kinds(layer):
                grad = self.pages.grad(layer, kind)
                if kind in self.carried_kinds or grad is None:
                    continue
                seeds[(layer, kind)] = grad[first:first + count].clone()
        self.pages.truncate(first)
        for (layer, kind), tensor in self.starts[index].items():
            self.pages.put(layer, kind, tensor)
        return seeds

    def carried_grads(self) -> dict[tuple[int, str], torch.Tensor]:
        """After a block's backward: the cotangent of the state at its start (the previous
        block's end state's), taken from the buffers, which are zeroed for the next block."""
        out = {}
        for layer in self.pages.layers():
            for kind in self.pages.kinds(layer):
                grad = self.pages.grad(layer, kind)
                if kind in self.carried_kinds and grad is not None:
                    out[(layer, kind)] = grad.clone()
                    grad.zero_()
        return out


def _forward_blocks(model, captured: CapturedPrompt, blocks: list[Branch], cfg: LongStrawConfig,
                    selections: dict | None, routed_experts, head: bool, keep_on=None):
    """No autograd: a blockwise branch's blocks in order, each over the prompt's pages and the
    earlier blocks' state, which then gains its own. -> (`_Blocks`, per block: log-probs [c] of
    this rank's rows (`head`) or None, and this rank's rows of the selections the block used,
    moved to `keep_on` after the block)."""
    device = blocks[0].input_ids.device
    kept = _Blocks(model, captured, device)
    logps, chosen = [], []
    for index, block in enumerate(blocks):
        if not head and index + 1 == len(blocks):
            break                      # replay: nothing reads the last block's state
        view = kept.view(index)
        state = _pass(captured, block, cfg, selections, mode="score", earlier=view)
        with (torch.no_grad(),
              routing_replay.replay_routing(model, routed_experts, block.rows, block.length)):
            hidden = _run_layers(model, captured, block, state, checkpoint_layers=False)
            logps.append(head_logprobs(model, hidden, block.targets) if head else None)
        if index + 1 < len(blocks):
            kept.keep(view, block)
        if head:                       # scoring keeps them for replay; replay has them
            chosen.append(_own_selections(state.selections, block, captured.layout, keep_on))
    return kept, logps, chosen


def _gather_blocks(values: list[torch.Tensor], blocks: list[Branch],
                   captured: CapturedPrompt) -> torch.Tensor:
    """Per block this rank's rows [c_b] -> the whole member [R] on every rank (no autograd)."""
    whole = torch.cat([collectives.gather_tensor(v.detach(), captured.layout) for v in values])
    return whole[:blocks[0].length]


def _join_selections(chosen: list[dict[int, torch.Tensor]], host: bool) -> dict[int, torch.Tensor]:
    """Per block {layer: [rows, k_b]} -> {layer: [all rows, k]}: a block whose keys were fewer
    than the top-k has a narrower selection, widened with -1 (none)."""
    if len(chosen) == 1:
        return chosen[0]
    joined = {}
    for layer in chosen[0]:
        parts = [c[layer] for c in chosen]
        width = max(p.shape[1] for p in parts)
        out = parts[0].new_full((sum(p.shape[0] for p in parts), width), -1)
        if host:
            note_host(out)
        row = 0
        for part in parts:
            out[row:row + part.shape[0], :part.shape[1]] = part
            row += part.shape[0]
        joined[layer] = out
    return joined


def score_member(model, captured: CapturedPrompt, response_ids: torch.Tensor,
                 cfg: LongStrawConfig, selections: dict[int, torch.Tensor] | None = None,
                 routed_experts: torch.Tensor | None = None, keep_pages: bool = False,
                 ) -> tuple:
    """Per-token log-probs [R] of one response (no autograd; whole member on every rank) and the DSA
    selections it used: this rank's rows of them (global key positions, int32, kept in host memory
    when pages are offloaded: all G members' selections wait for replay, [R_pad / CP, top-k] per
    full indexer layer each; every rank selects for every row of a block, and keeps its share,
    `CPLayout.own_branch_rows`; `gather_selections` gives the whole member's). A response longer
    than `cfg.replay.response_block` runs block by block (`_forward_blocks`: each block over the earlier
    blocks' state in host pages; the same log-probs and selections).

    Routing replay (routing_replay.py): `selections` (the engine's, this rank's rows as
    `routing_replay.member_inputs` gives them) are used instead of computed ones, and returned;
    `routed_experts` [R, L, k] route this rank's rows in every MoE layer.

    `keep_pages` (`ReplaySettings.reuse_branch_pages`): also return the blocks' state as replay
    takes it (`replay_member(..., pages=)`; None for a branch of one block): the same weights and
    selections write the same pages, so replay skips its own forward. -> (logp, selections,
    pages)"""
    blocks = member_blocks(captured, response_ids, cfg)
    keep = "cpu" if cfg.capture.offload_pages else None
    if len(blocks) == 1:
        branch = blocks[0]
        state = _pass(captured, branch, cfg, selections=selections, mode="score")
        with (torch.no_grad(),
              routing_replay.replay_routing(model, routed_experts, branch.rows, branch.length)):
            logps = [_run_branch(model, captured, branch, state, checkpoint_layers=False)]
        chosen = [_own_selections(state.selections, branch, captured.layout, keep)]
        pages = None
    else:
        pages, logps, chosen = _forward_blocks(model, captured, blocks, cfg, selections,
                                               routed_experts, head=True, keep_on=keep)
    scored = (_gather_blocks(logps, blocks, captured), _join_selections(chosen, keep == "cpu"))
    return scored + (pages,) if keep_pages else scored


class ReplayedMember(NamedTuple):
    """What `replay_member` returns: the whole member on every rank, nothing holding a graph."""

    logp: torch.Tensor
    """[R] the member's log-probs under the current parameters."""
    loss: torch.Tensor
    """0-d, detached: the member's loss (grpo.loss.member_loss: its 1/(G R_i) share included),
    the sum of the CP ranks' (and blocks') shares."""
    stats: dict[str, torch.Tensor]
    """member_loss's statistics of the whole member (ratio, clip fraction, KL)."""
    entropy: torch.Tensor
    """[R] the entropy of the policy's next-token distribution at each of the member's tokens
    (nats; no autograd: taken from the head's log-softmax replay computes anyway)."""


def replay_member(model, captured: CapturedPrompt, response_ids: torch.Tensor,
                  selections: dict[int, torch.Tensor] | None, cfg: LongStrawConfig,
                  loss_fn: Callable[[torch.Tensor, slice], tuple[torch.Tensor, dict]],
                  routed_experts: torch.Tensor | None = None,
                  pages: _Blocks | None = None) -> ReplayedMember:
    """Rebuild one member's graph, compute its loss once, backpropagate, free the graph.

    `loss_fn(logp, tokens)` -> (loss, stats): grpo.loss.member_loss (as the schedule binds it)
    of this rank's share of the member, from the log-probs of its tokens `tokens` (a slice of
    the member's R tokens; padding excluded; may be empty). It is called once per block, under
    autograd; the loss is backpropagated, then the shares (CP ranks, blocks) are combined into
    the member's loss and statistics, the same on every rank (`_whole_member`). Every rank calls
    backward (the exchanges in attention are collectives), even with an empty share. Gradients
    accumulate into `.grad` (plain sums across members: the loss carries the 1/(G R_i) share).
    `routed_experts` [R, L, k]: the engine's routing, kept through backward (the checkpoint
    recompute routes the same way; routing_replay.py). The head also gives the policy's entropy
    at every token (`ReplayedMember.entropy`: the step's `entropy` statistic).

    A branch longer than `cfg.replay.response_block` is replayed block by block (module docstring):
    a forward without autograd keeps every block's state in host pages, then the blocks run in
    reverse, each under autograd over the earlier blocks' pages, backpropagating its loss and
    the cotangents the later blocks left on its own state. `pages`: that forward's state, kept
    by scoring with the same weights and selections (`score_member(..., keep_pages=True)`), used
    instead of running it again (consumed: the reverse walk drops it block by block).
    """
    blocks = member_blocks(captured, response_ids, cfg)
    kept = None
    if len(blocks) > 1:
        kept = pages
        if kept is None:
            kept, _, _ = _forward_blocks(model, captured, blocks, cfg, selections, routed_experts,
                                         head=False)
        kept.keep_grads()
    logps, entropies, shares, carried = [None] * len(blocks), [None] * len(blocks), [], {}
    for index in reversed(range(len(blocks))):
        block = blocks[index]
        seeds, view = {}, None
        if kept is not None:
            seeds = kept.rewind(index)
            view = kept.view(index)
        # Exact prompt gradient: pages as leaves, their cotangents summed over the members.
        state = _pass(captured, block, cfg, selections=selections, mode="replay",
                      prompt_grad=cfg.replay.prompt_grad, earlier=view)
        # Backward recomputes checkpointed layers (in `state`, their argument): keep the routing.
        with routing_replay.replay_routing(model, routed_experts, block.rows, block.length):
            hidden = _run_layers(model, captured, block, state, cfg.replay.checkpoint_layers)
            logp, entropy = head_logprobs_entropy(model, hidden, block.targets, with_entropy=True)
            del hidden   # the head's chunks hold their rows; each chunk's backward frees them
            num_valid = int(block.valid.sum())
            loss, stats = loss_fn(logp[:num_valid],
                                  slice(block.rows.start, block.rows.start + num_valid))
            outputs, cotangents = [loss], [torch.ones_like(loss)]
            for key, tensor in (view.emitted.items() if view is not None else ()):
                seed = carried.get(key) if key in carried else seeds.get(key)
                if seed is not None and tensor.requires_grad:
                    outputs.append(tensor)
                    cotangents.append(seed.to(tensor.device, tensor.dtype).reshape(tensor.shape))
                # Only the seeded outputs stay referenced: an emitted tensor no cotangent reaches
                # (the last block's state) would keep its checkpointed layer's recompute of the
                # saved tensors behind it (never unpacked) alive through the whole backward. The
                # key stays, so the recompute's re-emission is still ignored (`emit_branch`).
                view.emitted[key] = None
            torch.autograd.backward(outputs, cotangents)
            del outputs, cotangents
            if view is not None:     # the pass is reachable from the graph (a page sink's
                view.emitted.clear()  # closure): no cycle keeps the block's graph alive
        if kept is not None:
            carried = kept.carried_grads()
        logps[index], entropies[index] = logp.detach(), entropy
        shares.append((loss.detach(), stats, num_valid))
    loss, stats = _whole_member(shares[::-1], captured.layout)
    return ReplayedMember(_gather_blocks(logps, blocks, captured), loss, stats,
                          _gather_blocks(entropies, blocks, captured))


def _whole_member(shares: list[tuple[torch.Tensor, dict[str, torch.Tensor], int]],
                  layout) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This rank's shares of the member's (loss, stats, rows), one per block -> the member's, on
    every rank: under CP one all-gather of each rank's few numbers per block, then
    `grpo.loss.combine_shares` (no divisor applied again)."""
    if layout.size == 1 and len(shares) == 1:
        return shares[0][0], shares[0][1]
    if layout.size == 1:
        return combine_shares(shares)
    loss = shares[0][0]
    keys = sorted(shares[0][1])
    # float64 holds the fp32 / fp64 figures and the row count exactly
    mine = torch.stack([torch.stack([share_loss, *(stats[k] for k in keys),
                                     share_loss.new_tensor(rows)]).to(torch.float64)
                        for share_loss, stats, rows in shares])          # [blocks, 2 + stats]
    gathered = collectives.gather_tensor(mine, layout)                     # [CP * blocks, ...]
    return combine_shares([(row[0].to(loss.dtype),
                            {k: row[1 + j].to(loss.dtype) for j, k in enumerate(keys)},
                            int(row[-1])) for row in gathered])
