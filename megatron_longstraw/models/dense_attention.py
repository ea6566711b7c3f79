"""Dense causal attention over key rows as a state-aware mixer: the modes Qwen3.6's gated attention
and DeepSeek-V3's MLA share, written once.

Both attend every query causally over every key row, blockwise (the kernel selector's
`blockwise_attention` through `partials.blockwise`: per query block and per key block, merged by
log-sum-exp), and keep per-token key rows as their pages: Qwen3.6 its K and V after norm and RoPE,
DeepSeek-V3 its MLA latent rows (keys the whole rows, values their c_kv part: MQA). So every mode
is the same algorithm over "this layer's key rows": capture writes them and attends the rows so far
(`StateAwareMixer.causal_in_order`, or a block over `capture_keys`' windows when streamed); replay
attends over the prompt's pages (`_page_keys`) plus the branch's own rows, two parts merged by
log-sum-exp (`models/partials.py`); decode over the prompt's pages and the member's generated rows
(its branch pages), one key window at a time (`_decode_part`); the exact prompt gradient streams the pages
(`partials.PageKeys`); under CP the `*_sharded` modes call `models/context_parallel.py`
(`attend_branch`, `merge_replicated`, the differentiable prompt gather).

A family's class derives from `DenseStateAttention` placed before Megatron's own module (or before
`AbsorbedMLA`, which ends in Megatron's `MLASelfAttention`), and supplies the math as hooks:

    page_kinds                          its page kinds (one key-row tensor each)
    _project(x, positions)              -> (key rows per kind, query rows, gate or None)
    _key_rows / _query_rows             the two halves of `_project` (default: from it)
    _key_part(rows, positions)          key rows as one part of keys for `_kernel`
    _keys_values(rows)                  key rows -> (keys [t, g, d], values [t, g, d_v])
    _key_value_dims()                   (g, d_v)
    _page_key_grads(state)              a window's (grad_k, grad_v) -> the page buffers, or None
    _kernel_queries(q_rows, positions)  the kernel's queries (default: the query rows; MLA
                                        absorbs W_UK, per query block)
    _kernel_parts(parts)                parts as the kernel reads them (default: as they are)
    _kernel(q, parts, positions, kb)    one query block's attention -> (out, lse)
    _kernel_out(out)                    the kernel's output in the heads' value space (default:
                                        it is; MLA up-projects by W_UV)
    _output(out, gate)                  -> the layer's (output [s, 1, hidden], bias)

Query rows are what the queries are made of: Qwen3.6's roped q; DeepSeek-V3's layer input x (its
absorbed queries, [s, heads, d_qk], several times x's size, are made per query block).

Whole-shard capture under CP (`forward_capture_sharded`) stays in each family: what it holds for
the ring differs (Qwen3.6 the shard's q and gate; DeepSeek-V3 only the layer input, its queries
made again per query block). So does DeepSeek-V3's streamed capture block, which drops its latent
rows before its queries attend (`forward_capture_block` here holds one projection's rows and
queries: Qwen3.6's one GEMM makes both).
"""

from __future__ import annotations

import torch

from megatron_longstraw.models import context_parallel, partials
from megatron_longstraw.models.mixer import StateAwareMixer
from megatron_longstraw.state.attention_pass import AttentionPass


DECODE_BLOCK_TILE = 512
"""Query rows and key rows per tile (at most; the run's --longstraw-query-block and key block
when smaller) of a block segment's attention in a decode pass, an observation's ids fed as one
block. The reference kernel builds a [queries x heads x keys] score tile per key block: at 512 x
512 it stays in cache, and the block's queries skip the key blocks after their own positions
(2.3x faster than 1,024 x 4,096 for a 2,048-row block over 3,072 keys, one CPU thread; the
decode memory bound only shrinks). A one-row segment (a sampled token) keeps the run's key block:
one query over many keys is faster in few blocks. Results agree within rounding (the key blocks'
log-sum-exp merge order)."""


class DenseStateAttention(StateAwareMixer):
    """The modes of a dense causal attention over per-token key rows (module docstring); the
    family's subclass supplies the hooks."""

    page_kinds: tuple[str, ...]

    # ---- modes ------------------------------------------------------------------------------

    def forward_full(self, x: torch.Tensor, state: AttentionPass):
        """The current tokens as one sequence (the full-sequence reference)."""
        if not torch.is_grad_enabled():
            return self._causal_in_order(x, state, write_pages=False)
        rows, queries, gate = self._project(x, state.positions)
        out = self._attend(queries, [self._key_part(rows, state.positions)], state.positions,
                           state)
        return self._output(out, gate)

    def forward_capture(self, x: torch.Tensor, state: AttentionPass):
        """The prompt (whole-shard reference, one process): its key rows become pages."""
        return self._causal_in_order(x, state, write_pages=True)

    def forward_capture_block(self, x: torch.Tensor, state: AttentionPass):
        """One token block of the prompt (streamed capture, one process): its key rows are
        appended to the pages, and its queries attend over the pages' rows so far
        (`_attend_capture_keys`)."""
        rows, queries, gate = self._project(x, state.positions)
        self._write_key_rows(state, rows)
        return self._attend_capture_keys(queries, gate, state)

    def forward_capture_rows(self, x: torch.Tensor, state: AttentionPass):
        """Streamed capture under CP, a layer's first phase: the block's key rows to the pages;
        nothing attended."""
        self._write_key_rows(state, self._key_rows(x, state.positions))
        return torch.zeros_like(x), None

    def forward_capture_block_sharded(self, x: torch.Tensor, state: AttentionPass):
        """Streamed capture under CP: the block's queries over every rank's key rows of the layer
        (gathered in host memory by `capture_exchange`)."""
        queries, gate = self._query_rows(x, state.positions)
        return self._attend_capture_keys(queries, gate, state)

    def forward_prompt_backward(self, x: torch.Tensor, state: AttentionPass):
        """One token block of the prompt under autograd (one process): its queries attend over
        the layer's pages (`_page_keys`, streamed: each key window's cotangents go to the page
        buffers); its own key rows get theirs in `prompt_rows`."""
        queries, gate = self._query_rows(x, state.positions)
        part = self._page_keys(state, x.device, queries.dtype, state.cp.prefix_positions)
        return self._output(self._attend(queries, [part], state.positions, state), gate)

    def forward_prompt_rows(self, x: torch.Tensor, state: AttentionPass):
        """The block's key rows (what capture wrote) to `emit`; nothing attended."""
        for kind, rows in zip(self.page_kinds, self._key_rows(x, state.positions)):
            self.emit(state, kind, rows)
        return torch.zeros_like(x), None

    def forward_prompt_backward_sharded(self, x: torch.Tensor, state: AttentionPass):
        """The prompt (this rank's shard) under autograd, causal over the whole prompt's key rows
        (gathered under autograd under CP); its own key rows go to `emit`."""
        rows, queries, gate = self._project(x, state.positions)
        for kind, kind_rows in zip(self.page_kinds, rows):
            self.emit(state, kind, kind_rows)
        keys, positions = rows, state.positions
        if state.cp.size > 1:
            keys = tuple(context_parallel.gather_prompt_keys_differentiable(r, state) for r in rows)
            positions = torch.arange(state.cp.global_len, device=x.device)
        out = self._attend(queries, [self._key_part(keys, positions)], state.positions, state)
        return self._output(out, gate)

    def forward_replay(self, x: torch.Tensor, state: AttentionPass):
        """One branch (or one block of it) over the captured pages, the earlier blocks' rows and
        its own rows, parts of keys (`models/partials.py`: no gradient buffer spans the prompt's
        rows). Every earlier key precedes every current query: one position (0) stands for them
        (`partials.prompt_key_positions`)."""
        rows, queries, gate = self._project(x, state.positions)
        self._emit_branch_rows(state, rows)
        parts = [self._key_part(rows, state.positions)]
        for source in (self.earlier_pass(state), state if state.prefix_len > 0 else None):
            if source is not None:
                count = state.prefix_len if source is state else state.branch.num_rows
                parts.insert(0, self._page_keys(source, x.device, rows[0].dtype,
                                                partials.prompt_key_positions(count, x.device)))
        return self._output(self._attend(queries, parts, state.positions, state), gate)

    def forward_replay_sharded(self, x: torch.Tensor, state: AttentionPass):
        """A branch pass (or a block of one) with the prompt pages sharded over CP: all its
        queries (the kernel's, gathered) attend over this rank's page shard, its rows of the
        earlier blocks and the current rows (visible on rank 0 only), merged by log-sum-exp to
        the row owners (`context_parallel.attend_branch`; before `_kernel_out`: linear, so the
        merge commutes with it)."""
        rows, queries, gate = self._project(x, state.positions)
        self._emit_branch_rows(state, rows)
        q = self._kernel_queries(queries, state.positions)
        earlier = self.earlier_pass(state)

        def attend(all_q, *all_rows):
            parts = [self._page_keys(state, x.device, rows[0].dtype, state.cp.prefix_positions)]
            if earlier is not None:
                parts.append(self._page_keys(earlier, x.device, rows[0].dtype,
                                             state.branch.positions))
            parts.append(self._key_part(all_rows, context_parallel.branch_key_positions(state)))
            return self._attend_kernel(all_q, parts, state.cp.branch_positions, state)

        merged = context_parallel.attend_branch(state, (q, *rows), attend)
        return self._output(self._kernel_out(merged), gate)

    def _emit_branch_rows(self, state: AttentionPass, rows) -> None:
        """A blockwise branch pass: the block's key rows, one tensor per page kind."""
        for kind, kind_rows in zip(self.page_kinds, rows):
            self.emit_branch(state, kind, kind_rows)

    def forward_decode(self, x: torch.Tensor, state: AttentionPass):
        """The step's rows by member (`decode.DecodeCache.segments`: a new token, or a block of an
        observation's ids): a segment's key rows join its member's branch pages, and its queries
        attend over the prompt's pages and the member's rows up to each query's position, one
        key window at a time (`_decode_part`). With the prompt's pages sharded over CP every rank
        runs the same rows and keeps the same branch pages: each attends over its shard (rank 0
        also over the member's rows) and the partial outputs merge by log-sum-exp
        (`context_parallel.merge_replicated`)."""
        rows, queries, gate = self._project(x, state.positions)
        sharded = state.cp.size > 1
        here = context_parallel.branch_keys_counted_here(state)
        outputs = []
        for segment in range(len(state.decode.segments)):
            span = state.decode.rows(segment)
            keys = self.decode_rows(state, segment, {kind: kind_rows[span] for kind, kind_rows
                                                     in zip(self.page_kinds, rows)}, here)
            tile = (state.query_block, state.key_block) if span.stop - span.start == 1 else (
                min(state.query_block, DECODE_BLOCK_TILE), min(state.key_block, DECODE_BLOCK_TILE))
            out = self._attend(queries[span], [self._decode_part(keys, x.device, rows[0].dtype)],
                               state.positions[span], state, return_lse=sharded, tile=tile)
            outputs.append(context_parallel.merge_replicated(*out, state) if sharded else out)
        return self._output(torch.cat(outputs), gate)

    # ---- shared pieces ----------------------------------------------------------------------

    def _causal_in_order(self, x: torch.Tensor, state: AttentionPass, write_pages: bool):
        """No autograd (capture, or a full forward under no_grad): `StateAwareMixer.causal_in_order`
        over the key rows; a block's queries attend over the rows written so far.
        -> (output [s, 1, hidden], None)"""

        def rows(x_block, positions):
            key_rows, queries, gate = self._project(x_block, positions)
            return key_rows, (queries, gate)

        def attend(query_gate, key_rows, positions, key_positions):
            queries, gate = query_gate
            out = self._attend(queries, [self._key_part(key_rows, key_positions)], positions, state)
            return self._output(out, gate)

        return self.causal_in_order(x, state, self.page_kinds, write_pages, rows, attend)

    def _attend_capture_keys(self, queries: torch.Tensor, gate, state: AttentionPass):
        """The block's queries over the layer's key rows at positions up to the block's last, read
        one key window at a time from `capture_keys` (the pages, or under CP every rank's rows in
        host memory; `partials.PageWindows`)."""
        keys, device, dtype = self.capture_keys(state), queries.device, queries.dtype

        def read(start, end):
            return self._keys_values(tuple(keys.window(kind, start, end, device).to(dtype)
                                           for kind in self.page_kinds))

        part = partials.PageWindows(read, int(state.positions[-1]) + 1, *self._key_value_dims())
        return self._output(self._attend(queries, [part], state.positions, state), gate)

    def _page_keys(self, state: AttentionPass, device, dtype, positions) -> partials.PageKeys:
        """This layer's pages as a dense attention part at key `positions` (with the exact prompt
        gradient, streamed: each key window's cotangents go to the page buffers)."""
        rows = tuple(self.read_page(state, kind, device, dtype, differentiable=False)
                     for kind in self.page_kinds)
        return partials.PageKeys(*self._keys_values(rows), positions, self._page_key_grads(state))

    def _write_key_rows(self, state: AttentionPass, rows) -> None:
        for kind, kind_rows in zip(self.page_kinds, rows):
            self.write_rows(state, kind, kind_rows)

    def _decode_part(self, keys, device, dtype) -> partials.PageWindows:
        """A decode segment's keys (`decode.DecodeKeys`) as one dense part read one key window at
        a time (`partials.PageWindows`: a window of rows of every kind on the device, never all
        of them), at the rows' global positions (a CP shard's, then the member's), so each query
        sees the member's rows up to its own position."""

        def read(start, end):
            return self._keys_values(tuple(keys.window(kind, start, end, device, dtype)
                                           for kind in self.page_kinds))

        return partials.PageWindows(read, keys.num_rows, *self._key_value_dims(), rows=keys)

    def _attend(self, queries: torch.Tensor, key_parts, q_positions: torch.Tensor,
                state: AttentionPass, return_lse: bool = False, tile: tuple | None = None):
        """Query rows, per query block (the kernel's queries made per block), over all given parts
        of keys in key blocks, causal by position; `tile`: (query block, key block), default the
        run's. -> out [s, heads, d_v] (and lse [s, heads] with `return_lse`)."""
        query_block, key_block = tile or (state.query_block, state.key_block)
        outs, lses = [], []
        for start in range(0, queries.shape[0], query_block):
            end = min(start + query_block, queries.shape[0])
            q = self._kernel_queries(queries[start:end], q_positions[start:end])
            out, lse = self._kernel(q, self._kernel_parts(key_parts), q_positions[start:end],
                                    key_block)
            outs.append(self._kernel_out(out))
            lses.append(lse)
        out = torch.cat(outs)
        return (out, torch.cat(lses)) if return_lse else out

    def _attend_kernel(self, q: torch.Tensor, key_parts, q_positions: torch.Tensor,
                       state: AttentionPass):
        """The kernel's queries [s, heads, d_qk], per query block, over all given parts of keys.
        -> (out in the kernel's value space, lse [s, heads])"""
        parts = self._kernel_parts(key_parts)
        blocks = [self._kernel(q[start:start + state.query_block], parts,
                               q_positions[start:start + state.query_block], state.key_block)
                  for start in range(0, q.shape[0], state.query_block)]
        out, lse = (torch.cat(p) for p in zip(*blocks))
        return out, lse

    # ---- hooks with a default ---------------------------------------------------------------

    def _key_rows(self, x: torch.Tensor, positions: torch.Tensor) -> tuple:
        return self._project(x, positions)[0]

    def _query_rows(self, x: torch.Tensor, positions: torch.Tensor):
        _, queries, gate = self._project(x, positions)
        return queries, gate

    def _kernel_queries(self, queries: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return queries

    def _kernel_parts(self, key_parts):
        return key_parts

    def _kernel_out(self, out: torch.Tensor) -> torch.Tensor:
        return out
