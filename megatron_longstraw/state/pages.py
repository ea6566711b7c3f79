"""Paged host-memory store for captured prompt state.

Why pages
---------
A million-token prompt is run once without autograd ("capture"). Of everything the
forward pass produces, only the per-layer state that later response tokens read is
kept: MLA latent rows ``[c_kv; k_pe]`` (``[s, 576]``), DSA indexer keys (``[s, 128]``),
K/V rows, and fixed-size recurrent state (GDN state, conv tails). Summed over layers
this is O(P) in the prompt length P and does not fit next to the model on the device,
so it lives in host memory, in fixed-size pages of ``page_tokens`` rows along dim 0
(the sequence dim of Megatron's ``[s, b, h]`` layout). Fixed-size pages mean appends
never reallocate or copy earlier rows, and the allocator sees a few large, equal blocks.
During replay the device only holds a window of about one layer: ``iter_layers``
prefetches layer k+1 on a side stream while layer k is used, then ``release``\\ s k.

Pinned memory
-------------
Page-locked host memory makes host<->device copies asynchronous (``non_blocking``) and
faster, but it only exists with CUDA; ``pin_memory=None`` therefore pins iff
``torch.cuda.is_available()``. Without CUDA everything stays on CPU and prefetching
is a no-op.

Page formats
------------
A sequence kind is stored in the storage dtype ("model": the dtype appended, or
``storage_dtype``) unless ``formats`` names another format for it:

- ``"fp8"``: each row quantised on append to float8 e4m3 with one float32 scale (amax / 448,
  ``fp8.quantize_rows``: DeepGEMM's per-token cast) and dequantised on every read (``fetch``,
  ``window``, ``gather``) to the dtype appended, or the one asked for. A page of P rows of d values
  is one byte buffer ``[P * d values e4m3 | P scales float32]``, DeepGEMM's FP8 KV block layout
  (``fp8_paged_mqa_logits``, block = page): d + 4 bytes per row (132 B for GLM-5.2's 128-value
  index keys). Rows [a, b) of one page are two contiguous views (``window_fp8``), the
  ``(k [t, d] e4m3, k_scale [t] fp32)`` pair ``fp8_mqa_logits`` takes, with no copy. Lossy:
  for kinds that only select (DSA index keys), never for kinds that get a gradient.

Byte counts
-----------
``nbytes()`` is exact. By default it is *logical*: ``num_tokens * row_bytes`` for
sequence kinds (row_bytes = prod(row_shape) * element size of the storage dtype, or
prod(row_shape) + 4 for fp8 pages) and ``tensor.nbytes`` for fixed kinds; ``allocated=True``
counts whole allocated pages (``num_pages * page_tokens * row_bytes``), i.e. what host memory
actually holds.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from megatron_longstraw.config.choices import PAGE_FORMATS
from megatron_longstraw.kernels import fp8
from megatron_longstraw.runtime.memory import note_host

__all__ = ["PAGE_FORMATS", "LayerRows", "PageStore"]

class _IntoGradBuffer(torch.autograd.Function):
    """Identity on a page's value whose backward hands the cotangent to `sink` (a page's cotangent
    buffer) instead of returning it: `anchor` (an empty tensor that requires grad) is what puts
    the value in the graph."""

    @staticmethod
    def forward(ctx, anchor, value, sink):
        ctx.sink = sink
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        ctx.sink(grad)
        return None, None, None


@dataclass
class _SeqEntry:
    """Sequence-indexed state of one (layer, kind): pages of ``[page_tokens, *row_shape]``."""

    row_shape: tuple[int, ...]
    in_dtype: torch.dtype  # dtype callers append (validated on every append)
    dtype: torch.dtype  # storage dtype of the pages (fp8: the dtype reads return by default)
    pages: list[torch.Tensor] = field(default_factory=list)
    num_tokens: int = 0
    fp8: bool = False  # "fp8" format: pages are byte buffers [P * d e4m3 | P float32 scales]

    @property
    def row_values(self) -> int:
        return math.prod(self.row_shape)

    @property
    def row_bytes(self) -> int:
        if self.fp8:
            return self.row_values + 4      # e4m3 values + one float32 scale
        return self.row_values * torch.empty((), dtype=self.dtype).element_size()

    def fp8_views(self, page: int, page_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An fp8 page as (values [P, d] float8_e4m3fn, scales [P] float32), views of its buffer."""
        buffer, split = self.pages[page], page_tokens * self.row_values
        return (buffer[:split].view(fp8.FP8_DTYPE).view(page_tokens, self.row_values),
                buffer[split:].view(torch.float32))


class PageStore:
    """Per-layer, per-kind captured prompt state in paged (optionally pinned) host memory.

    ``device_copies`` (class default False): fetches and prefetches to the storage device copy,
    as they do to a GPU, instead of handing out views: on CPU the live-bytes meter then sees the
    page window a device holds (tests/test_replay_memory.py checks the planner's line with it).
    Results are unchanged (a copy of the same rows).

    Sequence kinds are filled with :meth:`append` (rows ``[n, *row_shape]``, dim 0 =
    tokens) and fetched as ``[num_tokens, *row_shape]``; fixed kinds are set with
    :meth:`put` and fetched as stored. Floating-point tensors are stored in
    ``storage_dtype`` when given (integer tensors keep their dtype), sequence kinds named in
    ``formats`` (kind -> one of ``PAGE_FORMATS``) in that format (module docstring).
    """

    def __init__(
        self,
        page_tokens: int = 65536,
        pin_memory: bool | None = None,
        storage_dtype: torch.dtype | None = None,
        storage_device: torch.device | str = "cpu",
        formats: Mapping[str, str] | None = None,
    ) -> None:
        if page_tokens <= 0:
            raise ValueError(f"page_tokens must be positive, got {page_tokens}")
        self.formats = dict(formats or {})
        for kind, name in self.formats.items():
            if name not in PAGE_FORMATS:
                raise ValueError(f"page format of kind {kind!r} must be one of {list(PAGE_FORMATS)}, "
                                 f"got {name!r}")
        self.storage_device = torch.device(storage_device)
        if self.storage_device.type != "cpu":
            pin_memory = False  # pages live on the accelerator itself (no offload)
        elif pin_memory is None:
            pin_memory = torch.cuda.is_available()
        elif pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True requires CUDA (page-locked memory is a CUDA feature)")
        self.page_tokens = page_tokens
        self.pin_memory: bool = bool(pin_memory)
        self.storage_dtype = storage_dtype
        self._seq: dict[int, dict[str, _SeqEntry]] = {}
        self._fixed: dict[int, dict[str, torch.Tensor]] = {}
        self._order: dict[int, list[str]] = {}  # kinds per layer, insertion order
        # layer -> (device, {kind: device tensor}, ready event or None)
        self._prefetched: dict[int, tuple[torch.device, dict[str, torch.Tensor], object | None]] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._d2h_event: torch.cuda.Event | None = None  # last async device->host copy
        self._grads: dict[tuple[int, str], torch.Tensor] = {}  # exact mode: d loss / d state

    device_copies: bool = False

    # ------------------------------------------------------------------ writing
    def _target_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if self.storage_dtype is not None and dtype.is_floating_point:
            return self.storage_dtype
        return dtype

    def _host_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A new buffer of the store (named host storage for the live-bytes meter when the store
        is in host memory: `memory.note_host`)."""
        out = torch.empty(shape, dtype=dtype, device=self.storage_device, pin_memory=self.pin_memory)
        return note_host(out) if self.storage_device.type == "cpu" else out

    def _register(self, layer_idx: int, kind: str, sequence: bool) -> None:
        other = self._fixed if sequence else self._seq
        if kind in other.get(layer_idx, {}):
            what = "fixed (put)" if sequence else "sequence (append)"
            raise ValueError(f"layer {layer_idx} kind {kind!r} is already a {what} kind")
        order = self._order.setdefault(layer_idx, [])
        if kind not in order:
            order.append(kind)
        self._prefetched.pop(layer_idx, None)  # device copy is stale now

    def _note_async_d2h(self, src: torch.Tensor) -> None:
        if self.pin_memory and src.is_cuda:
            self._d2h_event = torch.cuda.Event()
            self._d2h_event.record(torch.cuda.current_stream(src.device))

    def append(self, layer_idx: int, kind: str, rows: torch.Tensor) -> None:
        """Append ``rows`` ``[n, *row_shape]`` (dim 0 = tokens) to a sequence kind.

        Fills the current page, then allocates new ``[page_tokens, *row_shape]`` pages.
        Raises ValueError if trailing shape or dtype differ from earlier rows.
        """
        if rows.dim() < 1:
            raise ValueError(f"rows must have a token dim 0, got shape {tuple(rows.shape)}")
        rows = rows.detach()
        row_shape = tuple(rows.shape[1:])
        entry = self._seq.get(layer_idx, {}).get(kind)
        if entry is None:
            entry = self._new_entry(layer_idx, kind, row_shape, rows.dtype)
            self._register(layer_idx, kind, sequence=True)
            self._seq.setdefault(layer_idx, {})[kind] = entry
        else:
            if row_shape != entry.row_shape:
                raise ValueError(
                    f"layer {layer_idx} kind {kind!r}: row shape {row_shape} != earlier {entry.row_shape}"
                )
            if rows.dtype != entry.in_dtype:
                raise ValueError(
                    f"layer {layer_idx} kind {kind!r}: dtype {rows.dtype} != earlier {entry.in_dtype}"
                )
            self._prefetched.pop(layer_idx, None)
        P, n, i = self.page_tokens, rows.shape[0], 0
        scales = None
        if entry.fp8:   # quantised where the rows are (on the device: fewer bytes to copy)
            rows, scales = fp8.quantize_rows(rows.reshape(n, entry.row_values))
        while i < n:
            if entry.num_tokens == len(entry.pages) * P:
                shape = (P * entry.row_bytes,) if entry.fp8 else (P, *row_shape)
                entry.pages.append(self._host_empty(shape, torch.uint8 if entry.fp8 else entry.dtype))
            off = entry.num_tokens - (len(entry.pages) - 1) * P
            take = min(P - off, n - i)
            if entry.fp8:
                values, page_scales = entry.fp8_views(len(entry.pages) - 1, P)
                values[off:off + take].copy_(rows[i:i + take], non_blocking=self.pin_memory)
                page_scales[off:off + take].copy_(scales[i:i + take], non_blocking=self.pin_memory)
            else:
                entry.pages[-1][off : off + take].copy_(rows[i : i + take], non_blocking=self.pin_memory)
            entry.num_tokens += take
            i += take
        if n:
            self._note_async_d2h(rows)

    def _new_entry(self, layer_idx: int, kind: str, row_shape: tuple[int, ...],
                   dtype: torch.dtype) -> _SeqEntry:
        """A sequence kind's entry in its format (``formats``), checked."""
        if self.formats.get(kind, "model") != "fp8":
            return _SeqEntry(row_shape, dtype, self._target_dtype(dtype))
        values = math.prod(row_shape)
        if not dtype.is_floating_point:
            raise ValueError(f"layer {layer_idx} kind {kind!r}: fp8 pages hold floating-point rows, "
                             f"got {dtype}")
        if self.page_tokens * values % 4:
            raise ValueError(f"layer {layer_idx} kind {kind!r}: fp8 pages of {self.page_tokens} rows "
                             f"of {values} values do not put the float32 scales on a 4-byte "
                             "boundary (page_tokens x row values must be a multiple of 4)")
        return _SeqEntry(row_shape, dtype, dtype, fp8=True)

    def round_trip(self, kind: str, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` [n, *row_shape] as a read of `kind`'s pages would return them, in rows' dtype:
        quantised and dequantised (fp8 format), or unchanged. Capture that attends over the rows it
        just computed (not reading them back) uses this to see what later reads see."""
        if self.formats.get(kind, "model") != "fp8":
            return rows
        flat = rows.detach().reshape(rows.shape[0], -1)
        return fp8.dequantize_rows(*fp8.quantize_rows(flat), rows.dtype).view_as(rows)

    def put(self, layer_idx: int, kind: str, tensor: torch.Tensor) -> None:
        """Store a fixed-size (not sequence-indexed) state, replacing any previous one."""
        if self.formats.get(kind, "model") != "model":
            raise ValueError(f"kind {kind!r} has the {self.formats[kind]!r} page format, for "
                             "sequence kinds (append), not fixed-size state (put)")
        self._register(layer_idx, kind, sequence=False)
        tensor = tensor.detach()
        host = self._host_empty(tensor.shape, self._target_dtype(tensor.dtype))
        host.copy_(tensor, non_blocking=self.pin_memory)
        self._note_async_d2h(tensor)
        self._fixed.setdefault(layer_idx, {})[kind] = host

    # ------------------------------------------------------------------ queries
    def _entry(self, layer_idx: int, kind: str) -> _SeqEntry | torch.Tensor:
        if kind in self._seq.get(layer_idx, {}):
            return self._seq[layer_idx][kind]
        if kind in self._fixed.get(layer_idx, {}):
            return self._fixed[layer_idx][kind]
        raise KeyError(f"no state for layer {layer_idx} kind {kind!r}")

    def num_tokens(self, layer_idx: int, kind: str) -> int:
        """Tokens appended so far to a sequence kind (ValueError for fixed kinds)."""
        entry = self._entry(layer_idx, kind)
        if not isinstance(entry, _SeqEntry):
            raise ValueError(f"layer {layer_idx} kind {kind!r} is fixed-size, not sequence-indexed")
        return entry.num_tokens

    def kinds(self, layer_idx: int) -> list[str]:
        """Kinds stored for a layer, in insertion order."""
        return list(self._order.get(layer_idx, []))

    def layers(self) -> list[int]:
        """Layer indices with any stored state, ascending."""
        return sorted(self._order)

    def _keys(self, layer_idx: int | None, kind: str | None) -> list[tuple[int, str]]:
        layers = self.layers() if layer_idx is None else [layer_idx]
        return [(l, k) for l in layers for k in self.kinds(l) if kind is None or k == kind]

    def nbytes(self, layer_idx: int | None = None, kind: str | None = None, allocated: bool = False) -> int:
        """Exact bytes held (filtered by layer/kind): logical by default, whole pages if ``allocated``."""
        total = 0
        for l, k in self._keys(layer_idx, kind):
            e = self._entry(l, k)
            if isinstance(e, _SeqEntry):
                rows = len(e.pages) * self.page_tokens if allocated else e.num_tokens
                total += rows * e.row_bytes
            else:
                total += e.nbytes
        return total

    def bytes_by_kind(self) -> dict[str, int]:
        """Logical bytes per kind, summed over layers."""
        out: dict[str, int] = {}
        for l, k in self._keys(None, None):
            out[k] = out.get(k, 0) + self.nbytes(l, k)
        return out

    def fixed_kinds(self) -> list[str]:
        """Kinds stored with :meth:`put` in any layer (fixed size: independent of the number of
        prompt tokens, e.g. a recurrent state), in first-seen order over ascending layers. Every
        other kind is a sequence kind (bytes grow with the tokens appended)."""
        out: list[str] = []
        for l in self.layers():
            out += [k for k in self.kinds(l) if k in self._fixed.get(l, {}) and k not in out]
        return out

    def bytes_per_token(self, kinds: list[str] | None = None) -> float:
        """Logical bytes per prompt token over all layers for sequence kinds (default: all).

        Raises ValueError if the selected (layer, kind) entries hold different token counts.
        """
        entries = [
            e for l in self.layers() for k, e in self._seq.get(l, {}).items() if kinds is None or k in kinds
        ]
        if not entries:
            raise ValueError(f"no sequence state for kinds {kinds}")
        counts = {e.num_tokens for e in entries}
        if len(counts) != 1:
            raise ValueError(f"token counts differ across layers/kinds: {sorted(counts)}")
        n = counts.pop()
        return sum(e.num_tokens * e.row_bytes for e in entries) / n if n else 0.0

    # ------------------------------------------------------------------ reading
    def synchronize(self) -> None:
        """Wait for outstanding asynchronous device->host copies into pinned pages."""
        if self._d2h_event is not None:
            self._d2h_event.synchronize()
            self._d2h_event = None

    def _to_device(self, layer_idx: int, kind: str, device: torch.device) -> torch.Tensor:
        """Copy one (layer, kind) into a fresh tensor on another device than the storage one
        (fp8 pages: each page's bytes copied, then dequantised there)."""
        e = self._entry(layer_idx, kind)
        nb = self.pin_memory
        if not isinstance(e, _SeqEntry):
            return e.to(device, non_blocking=nb, copy=self.device_copies)
        out = torch.empty((e.num_tokens, *e.row_shape), dtype=e.dtype, device=device)
        for p, page in enumerate(e.pages):
            start = p * self.page_tokens
            take = min(self.page_tokens, e.num_tokens - start)
            if e.fp8:
                out[start:start + take] = self._decode(e, p, 0, take, device, e.dtype)
            else:
                out[start : start + take].copy_(page[:take], non_blocking=nb)
        return out

    def _decode(self, e: _SeqEntry, page: int, start: int, end: int, device: torch.device,
                dtype: torch.dtype) -> torch.Tensor:
        """Rows [start, end) of fp8 page `page`, copied to `device` as bytes, dequantised there to
        `dtype` -> [end - start, *row_shape]."""
        values, scales = e.fp8_views(page, self.page_tokens)
        values = values[start:end].to(device, non_blocking=self.pin_memory)
        scales = scales[start:end].to(device, non_blocking=self.pin_memory)
        return fp8.dequantize_rows(values, scales, dtype).view(end - start, *e.row_shape)

    def fetch(self, layer_idx: int, kind: str, device: torch.device | str = "cpu",
              dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole logical tensor on ``device``: ``[num_tokens, *row_shape]`` or the fixed state,
        in `dtype` (default: as stored; fp8 pages: dequantised to the dtype appended).

        On CPU a single page comes back as a view (several pages: one concat). A prefetch
        of this layer to ``device`` is waited on (current stream waits on its event) and used.
        """
        device = torch.device(device)
        cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))
        pre = self._prefetched.get(layer_idx)
        if pre is not None and pre[0] == device and kind in pre[1]:
            t, event = pre[1][kind], pre[2]
            if event is not None:
                stream = torch.cuda.current_stream(device)
                stream.wait_event(event)
                t.record_stream(stream)
            return cast(t)
        if device != self.storage_device or self.device_copies:
            if self._d2h_event is not None and device.type == "cuda":
                torch.cuda.current_stream(device).wait_event(self._d2h_event)
            return cast(self._to_device(layer_idx, kind, device))
        self.synchronize()
        e = self._entry(layer_idx, kind)
        if not isinstance(e, _SeqEntry):
            return cast(e)
        if e.fp8:
            return self.window(layer_idx, kind, 0, e.num_tokens, device, dtype)
        n, P = e.num_tokens, self.page_tokens
        if n == 0:
            return torch.empty((0, *e.row_shape), dtype=dtype or e.dtype, device=self.storage_device)
        used = -(-n // P)
        if used == 1:
            return cast(e.pages[0][:n])
        return cast(torch.cat([*e.pages[: used - 1], e.pages[used - 1][: n - (used - 1) * P]]))

    def _seq_entry(self, layer_idx: int, kind: str) -> _SeqEntry:
        e = self._entry(layer_idx, kind)
        if not isinstance(e, _SeqEntry):
            raise ValueError(f"layer {layer_idx} kind {kind!r} is fixed-size, not sequence-indexed")
        return e

    def _page_spans(self, e: _SeqEntry, layer_idx: int, kind: str, start: int, end: int):
        """(page, first row, end row) within pages of the rows [start, end), checked."""
        if not 0 <= start <= end <= e.num_tokens:
            raise IndexError(f"layer {layer_idx} kind {kind!r}: rows [{start}, {end}) outside the "
                             f"{e.num_tokens} written")
        P, spans, row = self.page_tokens, [], start
        while row < end:
            page, off = divmod(row, P)
            take = min(P - off, end - row)
            spans.append((page, off, off + take))
            row += take
        return spans

    def window(self, layer_idx: int, kind: str, start: int, end: int,
               device: torch.device | str | None = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows [start, end) of a sequence kind on `device` (default: the storage device; there,
        a view when they lie in one page of the storage dtype) in `dtype` (default: as stored;
        fp8 pages: dequantised, on `device`, to the dtype appended): one key window, never the
        whole layer."""
        device = self.storage_device if device is None else torch.device(device)
        self.synchronize()
        e = self._seq_entry(layer_idx, kind)
        spans = self._page_spans(e, layer_idx, kind, start, end)
        if e.fp8:
            parts = [self._decode(e, page, a, b, device, dtype or e.dtype) for page, a, b in spans]
        else:
            parts = [e.pages[page][a:b] for page, a, b in spans]
        if not parts:
            return torch.empty((0, *e.row_shape), dtype=dtype or e.dtype, device=device)
        rows = parts[0] if len(parts) == 1 else torch.cat(parts)
        rows = rows.to(device, non_blocking=self.pin_memory)
        return rows if dtype is None else rows.to(dtype)

    def window_fp8(self, layer_idx: int, kind: str, start: int, end: int,
                   device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [start, end) of an fp8 kind as stored: (values [n, d] float8_e4m3fn, scales [n]
        float32), d = prod(row_shape), x ~ values * scales[:, None]. Views of the page when the
        rows lie in one page and `device` is the storage device: the `(k, k_scale)` pair of
        DeepGEMM's `fp8_mqa_logits`, with no copy."""
        device = self.storage_device if device is None else torch.device(device)
        self.synchronize()
        e = self._seq_entry(layer_idx, kind)
        if not e.fp8:
            raise ValueError(f"layer {layer_idx} kind {kind!r} is not stored in the fp8 format")
        spans = self._page_spans(e, layer_idx, kind, start, end)
        views = [tuple(t[a:b] for t in e.fp8_views(page, self.page_tokens)) for page, a, b in spans]
        if not views:
            return (torch.empty((0, e.row_values), dtype=fp8.FP8_DTYPE, device=device),
                    torch.empty(0, dtype=torch.float32, device=device))
        values, scales = views[0] if len(views) == 1 else (torch.cat([v for v, _ in views]),
                                                            torch.cat([s for _, s in views]))
        nb = self.pin_memory
        return values.to(device, non_blocking=nb), scales.to(device, non_blocking=nb)

    def gather(self, layer_idx: int, kind: str, index: torch.Tensor,
               device: torch.device | str | None = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows `index` (1-D, any order, < the rows written) of a sequence kind on `device`
        (default: the storage device) in `dtype` (default: as stored; fp8 pages: dequantised, on
        `device`, to the dtype appended): a sparse selection's rows, never the whole layer."""
        device = self.storage_device if device is None else torch.device(device)
        self.synchronize()
        e = self._seq_entry(layer_idx, kind)
        index = index.to(self.storage_device, torch.long)
        if index.numel() and not 0 <= int(index.min()) <= int(index.max()) < e.num_tokens:
            raise IndexError(f"layer {layer_idx} kind {kind!r}: rows {int(index.min())}.."
                             f"{int(index.max())} outside the {e.num_tokens} written")
        shape = (index.numel(), e.row_values) if e.fp8 else (index.numel(), *e.row_shape)
        out = torch.empty(shape, dtype=fp8.FP8_DTYPE if e.fp8 else e.dtype,
                          device=self.storage_device)
        scales = (torch.empty(index.numel(), dtype=torch.float32, device=self.storage_device)
                  if e.fp8 else None)
        page_of = torch.div(index, self.page_tokens, rounding_mode="floor")
        for page in page_of.unique().tolist():
            here = (page_of == page).nonzero()[:, 0]
            rows = index[here] - page * self.page_tokens
            if e.fp8:
                values, page_scales = e.fp8_views(page, self.page_tokens)
                # as bytes: selecting and writing 8-bit rows needs no float8 kernels
                out.view(torch.uint8)[here] = values.view(torch.uint8).index_select(0, rows)
                scales[here] = page_scales.index_select(0, rows)
            else:
                out[here] = e.pages[page].index_select(0, rows)
        if e.fp8:
            out, scales = (t.to(device, non_blocking=self.pin_memory) for t in (out, scales))
            return fp8.dequantize_rows(out, scales, dtype or e.dtype).view(-1, *e.row_shape)
        out = out.to(device, non_blocking=self.pin_memory)
        return out if dtype is None else out.to(dtype)

    def prefetch(self, layer_idx: int, device: torch.device | str) -> None:
        """Start copying all kinds of a layer to ``device`` (CUDA: side stream + event; CPU: no-op)."""
        device = torch.device(device)
        if layer_idx not in self._order or (
                not self.device_copies and (device == self.storage_device or device.type == "cpu")):
            return
        pre = self._prefetched.get(layer_idx)
        if pre is not None and pre[0] == device:
            return
        if device.type != "cuda":  # other accelerators: plain synchronous copy
            tensors = {k: self._to_device(layer_idx, k, device) for k in self.kinds(layer_idx)}
            self._prefetched[layer_idx] = (device, tensors, None)
            return
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))  # see appends / earlier work
        with torch.cuda.stream(stream):
            tensors = {k: self._to_device(layer_idx, k, device) for k in self.kinds(layer_idx)}
            event = torch.cuda.Event()
            event.record(stream)
        self._prefetched[layer_idx] = (device, tensors, event)

    def release(self, layer_idx: int) -> None:
        """Drop the device copies of a layer made by :meth:`prefetch`."""
        self._prefetched.pop(layer_idx, None)

    def iter_layers(self, layer_indices: list[int], device: torch.device | str) -> Iterator[int]:
        """Yield layers in order, prefetching layer k+1 while the caller uses k, then releasing k."""
        order = list(layer_indices)
        if order:
            self.prefetch(order[0], device)
        for i, layer in enumerate(order):
            if i + 1 < len(order):
                self.prefetch(order[i + 1], device)
            try:
                yield layer
            finally:
                self.release(layer)

    # ------------------------------------------------------------------ gradients
    def keep_grads(self, kinds: list[str] | None = None) -> None:
        """The exact prompt gradient: a zero cotangent buffer beside each (layer, kind) of `kinds`
        (default: all), shaped like the logical tensor, on the storage device, in the page dtype
        promoted to at least float32 (sums over members and query blocks). Replay and the prompt
        backward add into them (:meth:`add_grad`, :meth:`differentiable`); allocating them here,
        once, keeps them out of every later phase's peak."""
        for layer, kind in self._keys(None, None):
            if kinds is not None and kind not in kinds:
                continue
            e = self._entry(layer, kind)
            shape = (e.num_tokens, *e.row_shape) if isinstance(e, _SeqEntry) else e.shape
            dtype = torch.promote_types(e.dtype, torch.float32)
            self._grads[(layer, kind)] = self._host_empty(shape, dtype).zero_()

    def has_grad(self, layer_idx: int, kind: str) -> bool:
        return (layer_idx, kind) in self._grads

    def add_grad(self, layer_idx: int, kind: str, grad: torch.Tensor, rows=None) -> None:
        """Add `grad` to the cotangent of (layer, kind): the whole tensor, or its `rows` (a slice,
        or a 1-D index tensor of distinct rows)."""
        buffer = self._grads[(layer_idx, kind)]
        grad = grad.to(buffer.device, buffer.dtype).reshape((-1, *buffer.shape[1:])
                                                            if rows is not None else buffer.shape)
        if rows is None:
            buffer.add_(grad)
        elif isinstance(rows, slice):
            buffer[rows].add_(grad)
        else:
            buffer.index_add_(0, rows.to(buffer.device), grad)

    def grad(self, layer_idx: int, kind: str) -> torch.Tensor | None:
        """The cotangent buffer of (layer, kind) (None when :meth:`keep_grads` did not keep one)."""
        return self._grads.get((layer_idx, kind))

    def pop_grad(self, layer_idx: int, kind: str) -> torch.Tensor | None:
        """:meth:`grad`, and the buffer is dropped (the prompt backward has used it)."""
        return self._grads.pop((layer_idx, kind), None)

    def zero_(self) -> None:
        """Set every stored row and fixed state to zero, in place (the online loop's control run:
        a policy that sees nothing of the captured prompt)."""
        self.synchronize()
        for layer in self._seq.values():
            for entry in layer.values():
                for page in entry.pages:
                    page.zero_()
        for layer in self._fixed.values():
            for tensor in layer.values():
                tensor.zero_()
        self._prefetched.clear()

    def truncate(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` rows of every sequence kind (and of their cotangent
        buffers); pages past them are freed. Blockwise replay's reverse walk drops a block's rows
        once its backward has taken their cotangents (replay.py)."""
        self.synchronize()
        for layer, kinds in self._seq.items():
            for kind, entry in kinds.items():
                if num_tokens > entry.num_tokens:
                    raise ValueError(f"layer {layer} kind {kind!r}: cannot keep {num_tokens} rows "
                                     f"of the {entry.num_tokens} written")
                del entry.pages[-(-num_tokens // self.page_tokens):]
                entry.num_tokens = num_tokens
                if (layer, kind) in self._grads:
                    self._grads[(layer, kind)] = self._grads[(layer, kind)][:num_tokens]
                self._prefetched.pop(layer, None)

    def drop_grads(self) -> None:
        """Free every cotangent buffer (the prompt backward has used them)."""
        self._grads.clear()

    def differentiable(self, value: torch.Tensor, layer_idx: int, kind: str, rows=None) -> torch.Tensor:
        """`value` (what :meth:`fetch` gave for (layer, kind), or its `rows`) as a differentiable
        input whose cotangent is added to the buffer (:meth:`add_grad`) when autograd reaches it:
        no leaf, no `.grad` of the page's size, one addition per backward that uses it."""
        anchor = torch.empty(0, device=value.device, requires_grad=True)
        return _IntoGradBuffer.apply(anchor, value.detach(),
                                     lambda grad: self.add_grad(layer_idx, kind, grad, rows))

    # ------------------------------------------------------------------ misc
    def clear(self) -> None:
        """Free all pages, fixed states, device copies and leaves."""
        self.synchronize()
        self._seq.clear()
        self._fixed.clear()
        self._order.clear()
        self._prefetched.clear()
        self._grads.clear()

    def __repr__(self) -> str:
        return (
            f"PageStore(page_tokens={self.page_tokens}, pinned={self.pin_memory}, "
            f"layers={len(self._order)}, bytes_by_kind={self.bytes_by_kind()}, "
            f"nbytes={self.nbytes()}, allocated={self.nbytes(allocated=True)})"
        )


@dataclass(frozen=True)
class LayerRows:
    """One layer's captured key rows, read by global position: a window or a selection at a time
    (streamed capture's key source). On one process the layer's pages themselves (row =
    position); under CP, `context_parallel.StreamedCapture` offers the same two reads over every
    rank's rows gathered in host memory."""

    store: PageStore
    layer_idx: int

    def window(self, kind: str, start: int, end: int, device=None, dtype=None) -> torch.Tensor:
        return self.store.window(self.layer_idx, kind, start, end, device, dtype)

    def gather(self, kind: str, index: torch.Tensor, device=None, dtype=None) -> torch.Tensor:
        return self.store.gather(self.layer_idx, kind, index, device, dtype)
