"""Where a batch keeps its rows' own KV while they decode: rectangular tails, or pages.

Why its own module: attention (`batch.BatchContext`, `step_attention.StaticAttention`) writes each
row's new K/V and reads what the row holds; how those slots are laid out in memory is a separate
decision with its own costs, and both layouts answer the same questions (`OwnKV`), so the rest of
the engine never asks which one it has.

- `Tails`: one `[B, H_kv, capacity, D]` buffer per layer, every row padded to the batch's
  capacity. A write is a slice; a read is a view. The tails grow by copying every layer, a row
  that leaves is an `index_select` of every layer, and a row holds `capacity` slots whatever its
  own length.
- `Pages`: the rows' KV in fixed-size pages (`[N, H_kv, block, D]` per layer, the layout of vLLM,
  SGLang and FlashInfer) and a block table per row (`table` `[B, M]` int32 on the device). A row
  holds the pages its own length needs; growing adds pages to a row (nothing copied), a row that
  ends or an eviction puts pages back on the free list at once, where any row of the batch takes
  them. The decode step reads the pages in place (`cpu_kernels.paged_decode`); what needs a
  rectangle (a prefill chunk's causal attention, a tap, a soft-capped or windowed layer) reads a
  gathered copy (`read`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import sys
from collections.abc import Sequence
from typing import Literal, Protocol

import torch

from branchwise.backends.hf import cpu_kernels

Where = tuple[torch.Tensor, torch.Tensor]
"""Where a forward's new K/V go (`OwnKV.locate`): two index tensors, the layout's own."""
KVLayout = Literal["tails", "pages"]
"""How a batch holds its rows' own KV (`Tails`, `Pages`)."""
KV_LAYOUTS: tuple[KVLayout, ...] = ("tails", "pages")
LAYOUT_ENV = "BRANCHWISE_KV_LAYOUT"
"""Environment variable naming the layout a backend gets when it is given none (`default_layout`)."""
GROW_SLOTS = 128
"""Fewest slots per row the storage grows by (`BatchContext.grow_min`'s default, as the tails grow)."""
BLOCK = 16
"""Tokens per page: the page size `cpu_kernels.paged_decode` was measured best at on a CPU
(`benchmarks/paged_attention.py`), and what a row wastes at most (one partly filled page)."""

LEAST = 2
"""The fewest pages a batch's storage holds and the narrowest block table: a compiler specialises
a dimension of size 1 (it would refuse the same kind of batch once a second page came), and a
batch assembled with exactly the pages its rows fill often starts with one."""


HUGE_PAGE = 2 << 20
"""Bytes of a transparent huge page on x86-64 and most arm64 Linux kernels."""
MADV_HUGEPAGE = 14
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None


def kv_buffer(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """A zeroed KV buffer of `like`'s dtype and device. On a Linux CPU its memory is advised to be
    backed by transparent huge pages before it is first touched.

    Why: a decode step reads every row's KV once per layer, scattered over the buffer for pages;
    with 4 KiB pages that costs a TLB miss every 4 KiB, which measured 0.87x against 1.03x on huge
    pages for 64 rows (`benchmarks/paged_attention.py`). Where the kernel's setting is `madvise`
    (the common default) memory gets huge pages only when asked; both layouts are asked alike, so
    comparing them stays fair (zeros, not empty: masked slots still enter the products)."""
    t = like.new_empty(tuple(shape))
    if _libc is not None and t.device.type == "cpu" and t.nbytes >= 2 * HUGE_PAGE:
        start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        end = (t.data_ptr() + t.nbytes) // HUGE_PAGE * HUGE_PAGE
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE)
    return t.zero_()


def check_layout(layout: str) -> KVLayout:
    """`layout` if it is one of `KV_LAYOUTS`, else a ValueError naming the field and the choices."""
    if layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout={layout!r} is not one of {', '.join(map(repr, KV_LAYOUTS))}")
    return layout


def default_layout(device: torch.device) -> KVLayout:
    """The layout of a backend given none: `$BRANCHWISE_KV_LAYOUT`, else pages on a CPU that can
    build the paged kernel, tails elsewhere. Why: on a CPU pages decode at the tails' speed or
    faster, admit 4x the rows under a budget and stay within it (`benchmarks/kv_admission.py`);
    without the kernel (`cpu_kernels.missing`) or on CUDA (no FlashInfer wiring yet) they would be
    read as a gathered copy, slower than the tails (each such step says so: `pages_copied`)."""
    chosen = os.environ.get(LAYOUT_ENV)
    if chosen:
        return check_layout(chosen)
    if device.type != "cpu":
        return "tails"
    return "tails" if cpu_kernels.missing() is not None else "pages"


class OwnKV(Protocol):
    """The storage of a batch's rows' own KV (see the module docstring). Slots are per row:
    slot j of row b is its j-th own token, whatever the layout puts it."""

    @property
    def capacity(self) -> int:
        """Slots every row may address (a row's writes stay below it)."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes of storage the layout holds now (what the KV budget counts while the batch lives)."""
        ...

    limit: int | None
    """Bytes the storage may grow to ahead of need (set from the KV budget at each step boundary,
    `intake.Intake`; None: unbounded). Pages grow amortised only up to it (past it, by what rows
    need now); the tails' growth is bounded by `BatchContext.next_capacity` instead."""

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor holding KV (the budget's storage check, a batch's end)."""
        ...

    def like(self) -> torch.Tensor:
        """A tensor of the KV's dtype and device, `[*, H_kv, *, D]` (what per-slot state is made like)."""
        ...

    def fit(self, lens: Sequence[int], q_len: int, capacity: int) -> None:
        """Make room for `q_len` more tokens after each row's `lens[b]`, the rows addressing up to
        `capacity` slots from now on (at least the current capacity)."""
        ...

    def locate(self, at: torch.Tensor) -> Where:
        """Where each row's slots `at` `[B, q]` lie (for `write`): made once per forward, read by
        every layer."""
        ...

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, where: Where) -> None:
        """Write `key`/`value` `[B, H_kv, q, D]` at the slots `where` locates (`locate`)."""
        ...

    def growth(self, lens: Sequence[int], q_len: int, capacity: int) -> int:
        """Bytes the storage would gain from `fit(lens, q_len, capacity)` (what a KV budget is asked
        for before the step that grows it)."""
        ...

    def slots_held(self, rows: int) -> int:
        """Token slots of storage the batch holds for its `rows` live rows (freed with the batch)."""
        ...

    def write_from(self, layer: int, key: torch.Tensor, value: torch.Tensor, start: int) -> None:
        """Write `key`/`value` `[B, H_kv, q, D]` at slots `start .. start + q` of every row."""
        ...

    def read(self, layer: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's slots `0 .. total - 1` of `layer` as `[B, H_kv, total, D]` (a view of the
        tails; a copy of the pages)."""
        ...

    def row(
        self, pos: int, first: int, last: int, owned: bool = False
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Row `pos`'s slots `first .. last - 1`, `[H_kv, n, D]` per layer: views where the layout
        can give them, else copies; with `owned`, tensors of their own (what outlives the batch)."""
        ...

    def load(self, pos: int, at: int, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Copy `[H_kv, n, D]` per layer into row `pos`'s slots `at .. at + n` (room made by `fit`)."""
        ...

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keep rows `keep` (old indices, in order); the others' storage is given up."""
        ...

    def move(self, pos: int, start: int, index: torch.Tensor, kept: int) -> None:
        """Row `pos` keeps slots `index` (absolute, increasing; `[k]`, or `[L, H_kv, k]` per layer
        and head), packed from `start` on; it holds `start + kept` slots after."""
        ...

    frees_rows: bool
    """Whether a row that ended can give its storage back before the batch compacts (`release`)."""

    def release(self, pos: int) -> None:
        """Row `pos` ended and its KV was captured: its storage goes back at once, for any other
        row (only where `frees_rows`); it stays in the batch until compaction, holding nothing."""
        ...

    def shrink(self) -> bool:
        """Give back now the storage no row holds (a KV budget would be exceeded otherwise); returns
        whether anything went. Tails hold none apart from their rows' own slots."""
        ...

    def signature(self) -> tuple[object, ...]:
        """What a recorded step bakes in: the storage's addresses and shapes."""
        ...

    def clear(self) -> None:
        """Give up every buffer now (a batch that ended abnormally)."""
        ...


def _per_layer_index(index: torch.Tensor, layer: int) -> torch.Tensor:
    """A `move` index for one layer: `[k]` is every head's, `[L, H_kv, k]` per head."""
    return index if index.dim() == 1 else index[layer]


class Tails:
    """Every row's own KV in a `[B, H_kv, capacity, D]` buffer per layer (the module docstring)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.keys = keys
        self.values = values
        self.limit: int | None = None

    @classmethod
    def zeros(
        cls, shape: tuple[int, int, int, int], n_layers: int, dtype: torch.dtype, device: torch.device
    ) -> Tails:
        like = torch.empty(0, dtype=dtype, device=device)
        return cls(
            [kv_buffer(shape, like) for _ in range(n_layers)],
            [kv_buffer(shape, like) for _ in range(n_layers)],
        )

    @property
    def capacity(self) -> int:
        return int(self.keys[0].shape[2])

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys) * 2

    def tensors(self) -> list[torch.Tensor]:
        return [*self.keys, *self.values]

    def like(self) -> torch.Tensor:
        return self.keys[0]

    def fit(self, lens: Sequence[int], q_len: int, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        # plain tensors, like the tails a batch is assembled with, though this runs inside a
        # forward: a compiled step checks which kind its inputs are, and recompiles for the other
        with torch.inference_mode(False):
            for buf in (self.keys, self.values):
                for layer, old in enumerate(buf):
                    new = kv_buffer((old.shape[0], old.shape[1], capacity, old.shape[3]), old)
                    new[:, :, : old.shape[2]] = old
                    buf[layer] = new

    def locate(self, at: torch.Tensor) -> Where:
        return torch.arange(at.shape[0], device=at.device)[:, None], at

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, where: Where) -> None:
        # an index_put, not a scatter: a compiled step's mutation of its inputs must be re-done in
        # place by inductor, which it does for index_put and not for scatter (it then copied every
        # layer's whole tails at every step, a cost that grew with rows x capacity)
        rows, at = where
        self.keys[layer][rows, :, at] = key.transpose(1, 2)
        self.values[layer][rows, :, at] = value.transpose(1, 2)

    def growth(self, lens: Sequence[int], q_len: int, capacity: int) -> int:
        if capacity <= self.capacity:
            return 0
        return (capacity - self.capacity) * self.nbytes // self.capacity

    def slots_held(self, rows: int) -> int:
        return rows * self.capacity

    def write_from(self, layer: int, key: torch.Tensor, value: torch.Tensor, start: int) -> None:
        q = key.shape[2]
        self.keys[layer][:, :, start : start + q] = key
        self.values[layer][:, :, start : start + q] = value

    def read(self, layer: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer][:, :, :total], self.values[layer][:, :, :total]

    def row(
        self, pos: int, first: int, last: int, owned: bool = False
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        keys = [t[pos, :, first:last] for t in self.keys]
        values = [t[pos, :, first:last] for t in self.values]
        if owned:
            return [k.clone() for k in keys], [v.clone() for v in values]
        return keys, values

    def load(self, pos: int, at: int, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            n = k.shape[1]
            self.keys[layer][pos, :, at : at + n] = k
            self.values[layer][pos, :, at : at + n] = v

    def select_rows(self, keep: torch.Tensor) -> None:
        def kept(t: torch.Tensor) -> torch.Tensor:
            return torch.index_select(t, 0, keep, out=kv_buffer((len(keep), *t.shape[1:]), t))

        self.keys = [kept(t) for t in self.keys]
        self.values = [kept(t) for t in self.values]

    def move(self, pos: int, start: int, index: torch.Tensor, kept: int) -> None:
        with torch.inference_mode():  # a write that needs no autograd record
            for buffers in (self.keys, self.values):
                for layer, t in enumerate(buffers):
                    idx = _per_layer_index(index, layer).to(t.device)
                    if idx.dim() == 1:
                        t[pos, :, start : start + kept] = t[pos, :, idx]
                    else:  # per head
                        t[pos, :, start : start + kept] = t[pos].gather(
                            1, idx[..., None].expand(-1, -1, t.shape[-1])
                        )

    frees_rows = False

    def shrink(self) -> bool:
        return False

    def release(self, pos: int) -> None:
        raise NotImplementedError("a row's tail slots go only when the batch compacts")

    def signature(self) -> tuple[object, ...]:
        return (self.capacity, self.keys[0].data_ptr(), self.values[0].data_ptr())

    def clear(self) -> None:
        self.keys[:], self.values[:] = [], []


class Pages:
    """The rows' own KV in fixed-size pages with a block table per row (the module docstring).

    `keys[l]`/`values[l]` `[N, H_kv, block, D]`; `table` `[B, M]` int32 on the device (entry i of
    row b: the page holding its slots `i * block .. (i + 1) * block - 1`; entries past what a row
    holds point at page 0, read only under a mask); `held[b]` the same pages on the host, in order;
    `free` the pages no row holds. Once a row gave its pages back (`release`), a `sink` page that
    no row holds takes what it still writes (its pad tokens' K/V) until it leaves. The storage
    grows when the free list runs dry (`_grown`) and packs when most of it is free and at
    compaction (`_pack`); it never moves otherwise. Every table is made outside inference mode, a
    plain tensor as the tails' buffers are: a step compiled over a plain table refuses an inference
    one (its guards compare dispatch keys; once every paged step after a compaction ran
    uncompiled), and a plain one takes the in-place edits made in and out of inference mode.
    """

    def __init__(
        self,
        n_layers: int,
        heads: int,
        dim: int,
        batch: int,
        dtype: torch.dtype,
        device: torch.device,
        block: int = BLOCK,
    ) -> None:
        self.block = block
        empty = torch.zeros(0, heads, block, dim, dtype=dtype, device=device)
        self.keys = [empty.clone() for _ in range(n_layers)]
        self.values = [empty.clone() for _ in range(n_layers)]
        self.sink: int | None = None
        with torch.inference_mode(False):  # plain, as every table is (the class docstring)
            self.table = torch.zeros(batch, 0, dtype=torch.int32, device=device)
        self.held: list[list[int]] = [[] for _ in range(batch)]
        self.free: list[int] = []
        self.released: set[int] = set()
        """Rows that gave their pages back (`release`): they get none again."""
        self.limit: int | None = None

    @classmethod
    def of(cls, keys: list[torch.Tensor], values: list[torch.Tensor], table: torch.Tensor) -> Pages:
        """Pages over given storage and table, no row holding any yet (a compiler's sample batch:
        `step.from_skeleton`)."""
        pages = cls.__new__(cls)
        pages.block = int(keys[0].shape[2])
        pages.keys, pages.values, pages.table = keys, values, table
        pages.held = [[] for _ in range(table.shape[0])]
        pages.free, pages.released, pages.sink = list(range(int(keys[0].shape[0]))), set(), None
        pages.limit = None
        return pages

    @property
    def capacity(self) -> int:
        return int(self.table.shape[1]) * self.block

    @property
    def pages(self) -> int:
        """Pages of storage (held and free)."""
        return int(self.keys[0].shape[0])

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every layer, keys and values."""
        k = self.keys[0]
        return 2 * len(self.keys) * math.prod(k.shape[1:]) * k.element_size()

    @property
    def nbytes(self) -> int:
        return self.pages * self.page_bytes if self.keys else 0

    def tensors(self) -> list[torch.Tensor]:
        return [*self.keys, *self.values]

    def like(self) -> torch.Tensor:
        return self.keys[0]

    def fit(self, lens: Sequence[int], q_len: int, capacity: int) -> None:
        width = max(-(-capacity // self.block), LEAST)
        if width > self.table.shape[1]:
            with torch.inference_mode(False):  # a plain table (the class docstring)
                table = self.table.new_zeros(self.table.shape[0], width)
            table[:, : self.table.shape[1]] = self.table
            self.table = table
        wanted = self._short(lens, q_len)
        short = sum(w for w in wanted if w > 0) - len(self.free)
        if short > 0:
            self._grow(short, capacity)
        for b, w in enumerate(wanted):
            if w <= 0:
                continue
            got, self.free = self.free[:w], self.free[w:]
            first = len(self.held[b])
            self.held[b].extend(got)
            self.table[b, first : first + w] = torch.tensor(got, dtype=torch.int32)

    def _grown(self, short: int, capacity: int) -> int:
        """Pages of storage once grown for `short` more, amortised as the tails grow: `short` and
        `GROW_SLOTS` more per row or half the storage, whichever is more, but never past what every
        row still decoding would hold at `capacity` slots (the tails' size, which bounds it), nor
        past `limit`. Empty storage (a batch being assembled) grows by exactly `short`: the pages
        its rows hold, their free slots ahead included (`Batch.assemble`), as admission priced."""
        old = self.pages
        if not old:
            return max(short, LEAST)
        live = [h for b, h in enumerate(self.held) if b not in self.released]
        ceiling = old - len(self.free) + sum(max(-(-capacity // self.block) - len(h), 0) for h in live)
        if self.limit is not None and self.keys:
            ceiling = min(ceiling, self.limit // self.page_bytes)
        amortised = old + short + max(len(live) * (-(-GROW_SLOTS // self.block)), old // 2)
        return max(old + short, min(amortised, ceiling))

    def _short(self, lens: Sequence[int], q_len: int) -> list[int]:
        """Pages each row still needs to take `q_len` more tokens after `lens`."""
        return [
            0 if b in self.released else -(-(n + q_len) // self.block) - len(held)
            for b, (n, held) in enumerate(zip(lens, self.held, strict=True))
        ]

    def growth(self, lens: Sequence[int], q_len: int, capacity: int) -> int:
        short = sum(w for w in self._short(lens, q_len) if w > 0) - len(self.free)
        return 0 if short <= 0 else (self._grown(short, capacity) - self.pages) * self.page_bytes

    def slots_held(self, rows: int) -> int:
        return self.pages * self.block

    def _grow(self, short: int, capacity: int) -> None:
        """Add at least `short` pages of storage (zeros: a masked slot still enters the products)."""
        old = self.pages
        new = self._grown(short, capacity)
        with torch.inference_mode(False):  # plain tensors, as `Tails.fit` keeps them
            for buf in (self.keys, self.values):
                for layer, t in enumerate(buf):
                    grown = kv_buffer((new, *t.shape[1:]), t)
                    grown[:old] = t
                    buf[layer] = grown
        self.free.extend(range(old, new))

    def locate(self, at: torch.Tensor) -> Where:
        """The pages and offsets of each row's slots `at` `[B, q]`."""
        rows = torch.arange(at.shape[0], device=at.device)[:, None]
        return self.table[rows, at // self.block].long(), at % self.block

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, where: Where) -> None:
        page, off = where
        self.keys[layer][page, :, off] = key.transpose(1, 2)
        self.values[layer][page, :, off] = value.transpose(1, 2)

    def write_from(self, layer: int, key: torch.Tensor, value: torch.Tensor, start: int) -> None:
        q = key.shape[2]
        at = torch.arange(start, start + q, device=key.device).expand(key.shape[0], q)
        self.write(layer, key, value, self.locate(at))

    def read(self, layer: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = -(-total // self.block)
        pages = self.table[:, :n].long()

        def gathered(pool: torch.Tensor) -> torch.Tensor:  # [B, n, H, block, D] -> [B, H, n*block, D]
            g = pool[pages].transpose(1, 2)
            return g.reshape(g.shape[0], g.shape[1], n * self.block, g.shape[-1])[:, :, :total]

        return gathered(self.keys[layer]), gathered(self.values[layer])

    def _row_slots(self, pos: int, first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        at = torch.arange(first, last)
        held = torch.tensor(self.held[pos], dtype=torch.long)
        device = self.keys[0].device
        return held[at // self.block].to(device), (at % self.block).to(device)

    def row(
        self, pos: int, first: int, last: int, owned: bool = False
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        page, off = self._row_slots(pos, first, last)
        # one gather per layer, straight into [H, n, D] (the heads first): each its own storage
        return (
            [t.transpose(0, 1)[:, page, off] for t in self.keys],
            [t.transpose(0, 1)[:, page, off] for t in self.values],
        )

    def load(self, pos: int, at: int, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        n = keys[0].shape[1]
        page, off = self._row_slots(pos, at, at + n)
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            self.keys[layer][page, :, off] = k.transpose(0, 1)
            self.values[layer][page, :, off] = v.transpose(0, 1)

    def select_rows(self, keep: torch.Tensor) -> None:
        """Rows leave when a quarter of the batch ended (`decode.py`'s compaction), the moment the
        tails give memory back: the storage is packed to the pages the staying rows hold (`_pack`)."""
        kept = keep.tolist()
        self.held = [self.held[b] for b in kept]
        self.released = {new for new, old in enumerate(kept) if old in self.released}
        with torch.inference_mode(False):  # a plain table (the class docstring)
            self.table = self.table.index_select(0, keep.to(self.table.device))
        self._pack()

    def _pack(self) -> None:
        """Storage of exactly the pages the rows hold (and the sink), their pages renumbered: one
        copy of what stays, as the tails' `index_select` is. Freed pages wait on the free list
        for the batch's rows until then; a KV budget counts the storage, so it shrinks when they
        are many (`release`) and at compaction."""
        sink = [self.sink] if self.sink is not None and self.released else []
        order = [*sink, *(p for held in self.held for p in held)]
        n = max(len(order), LEAST)
        with torch.inference_mode(False):  # plain tensors, as `Tails.fit` keeps them
            index = torch.tensor(order, dtype=torch.long, device=self.table.device)
            for buf in (self.keys, self.values):
                for layer, t in enumerate(buf):
                    packed = kv_buffer((n, *t.shape[1:]), t)
                    torch.index_select(t, 0, index, out=packed[: len(order)])
                    buf[layer] = packed
        self.sink = 0 if sink else None
        renamed, at = [], len(sink)
        with torch.inference_mode(False):  # a plain table (the class docstring)
            table = torch.zeros(len(self.held), self.table.shape[1], dtype=torch.int32)
        for b, held in enumerate(self.held):
            renamed.append(list(range(at, at + len(held))))
            table[b, : len(held)] = torch.tensor(renamed[-1], dtype=torch.int32)
            at += len(held)
        self.held, self.free = renamed, list(range(len(order), n))
        self.table = table.to(self.table.device)  # a plain tensor's copy is plain

    def move(self, pos: int, start: int, index: torch.Tensor, kept: int) -> None:
        total = start + kept
        span = int(index.max()) + 1 if index.numel() else total
        dst_page, dst_off = self._row_slots(pos, start, total)
        page, off = self._row_slots(pos, 0, span)  # where the row's slots lie, for every layer alike
        if index.dim() == 1:
            index = index.to(page.device)
            page, off = page[index], off[index]
        with torch.inference_mode():
            for buffers in (self.keys, self.values):
                for layer, t in enumerate(buffers):
                    if index.dim() == 1:  # the kept slots, [k, H, D]
                        moved = t[page, :, off]
                    else:  # per head: the row's slots as [H, span, D], gathered per head
                        idx = index[layer].to(t.device)
                        whole = t[page, :, off].transpose(0, 1)
                        moved = whole.gather(1, idx[..., None].expand(-1, -1, t.shape[-1])).transpose(0, 1)
                    t[dst_page, :, dst_off] = moved
        keep_pages = -(-total // self.block)
        freed = self.held[pos][keep_pages:]
        if freed:  # whole pages past what the row keeps go back at once, for any row
            self.held[pos] = self.held[pos][:keep_pages]
            self.free.extend(freed)
            self.table[pos, keep_pages : keep_pages + len(freed)] = 0

    frees_rows = True

    def release(self, pos: int) -> None:
        if self.sink is None:
            if not self.free:
                self._grow(1, self.capacity)
            self.sink = self.free.pop()
        self.free.extend(self.held[pos])
        self.held[pos] = []
        self.table[pos] = self.sink
        self.released.add(pos)
        if 2 * len(self.free) > self.pages:
            self._pack()

    def shrink(self) -> bool:
        if max(self.pages - len(self.free), LEAST) >= self.pages:
            return False  # nothing to give back (the free pages a pack keeps do not count)
        self._pack()
        return True

    def signature(self) -> tuple[object, ...]:
        return (
            self.capacity,
            self.pages,
            self.keys[0].data_ptr(),
            self.values[0].data_ptr(),
            self.table.data_ptr(),
        )

    def clear(self) -> None:
        self.keys[:], self.values[:] = [], []
        self.held, self.free = [], []
