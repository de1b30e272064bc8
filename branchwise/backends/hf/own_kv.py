"""Where a batch keeps its rows' own KV while they decode: rectangular tails, or pages.

Why its own module: attention (`batch.BatchContext`, `step_attention.StaticAttention`) writes each
row's new K/V and reads what the row holds; how those slots are laid out in memory is a separate
decision with its own costs, and both layouts answer the same questions (`OwnKV`), so the rest of
the engine never asks which one it has.

- `Tails`: one `[B, H_kv, capacity, D]` buffer per layer, every row padded to the batch's
  capacity. A write is a slice; a read is a view. The tails grow by copying every layer, a row
  that leaves is an `index_select` of every layer, and a row holds `capacity` slots whatever its
  own length.
- `Pages` (`kv_pages.py`): the rows' KV in fixed-size pages (`[N, H_kv, block, D]` per layer, the layout of vLLM,
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
