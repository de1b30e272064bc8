"""`Pages`: a batch's rows' own KV in fixed-size pages with a block table per row (`own_kv.OwnKV`).

Why a module of its own: the tails are a rectangle per layer and their edits are slices; pages are
a free list, a block table and the copies an eviction or a compaction makes between pages, which is
most of what there is to read here (the layouts compared: `own_kv`'s module docstring).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from branchwise.backends.hf import cpu_kernels
from branchwise.backends.hf.own_kv import BLOCK, GROW_SLOTS, LEAST, Where, kv_buffer


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
        if self._in_one_call():  # every layer in one call: [L, H, n, D], its own storage
            return (
                list(cpu_kernels.pages_gather(self.keys, page, off).unbind(0)),
                list(cpu_kernels.pages_gather(self.values, page, off).unbind(0)),
            )
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
        if self._in_one_call():  # every layer (and head) in one call, keys and values
            index = index.to(torch.long)
            for pools in [self.keys, self.values] if index.dim() == 3 else [[*self.keys, *self.values]]:
                cpu_kernels.pages_move(pools, page, off, index, dst_page, dst_off)
        else:
            self._move_each_layer((page, off), index, (dst_page, dst_off))
        keep_pages = -(-total // self.block)
        freed = self.held[pos][keep_pages:]
        if freed:  # whole pages past what the row keeps go back at once, for any row
            self.held[pos] = self.held[pos][:keep_pages]
            self.free.extend(freed)
            self.table[pos, keep_pages : keep_pages + len(freed)] = 0

    def _move_each_layer(self, src: Where, index: torch.Tensor, dst: Where) -> None:
        """`move`'s copies in torch, a few operations per layer (`cpu_kernels.pages_move` does them
        in one call where it is built)."""
        (page, off), (dst_page, dst_off) = src, dst
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

    def _in_one_call(self) -> bool:
        """Whether `row`/`move` copy every layer in one call: a CPU pool of the layout the kernels
        take, and the kernels built (`cpu_kernels.pages_ready`, never waited for)."""
        k = self.keys[0]
        return k.device.type == "cpu" and k.is_contiguous() and cpu_kernels.pages_ready()

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
