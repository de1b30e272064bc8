"""ReasonCache's shared blocks as one batch reads them: laid out once per batch, each row's block
table a mask over them, read by the step as one more shared segment (`BlockPool.segment`).

Why its own module: the batch (`batch.py`) only holds a pool and hands it to attention; what a
pool is made of, and how a row's table becomes the segment's mask, is ReasonCache's business."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from branchwise.backends.hf.attention import SharedSegment
from branchwise.backends.hf.segment import Block

POOL_KEY = -2
"""`SharedSegment.key` of a batch's block pool (segment ids are never negative)."""


@dataclass
class BlockPool:
    """The shared blocks the rows of one batch read, laid out once, and each row's block table.

    Blocks live in the tree (ref-counted, one copy each); a batch that reads them lays each out once
    in `keys`/`values` (per layer `[H_kv, cap, D]`), however many rows point at it, and `table`
    `[B, cap]` says which pool slots each row reads. Attention reads the pool as one more shared
    segment: one product of all its rows' queries against the pool, masked by the table, so pointing
    a row at a block copies nothing.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    table: torch.Tensor  # [B, cap] bool
    slots: dict[int, int] = field(default_factory=dict)
    """Block id → first pool slot."""
    used: int = 0
    _segment: SharedSegment | None = None

    @classmethod
    def empty(cls, like: torch.Tensor, n_layers: int, batch: int) -> BlockPool:
        h, d = like.shape[1], like.shape[3]
        return cls(
            keys=[like.new_zeros(h, 0, d) for _ in range(n_layers)],
            values=[like.new_zeros(h, 0, d) for _ in range(n_layers)],
            table=torch.zeros(batch, 0, dtype=torch.bool, device=like.device),
        )

    def point(self, row: int, block: Block) -> None:
        """Let batch row `row` read `block` (laid out on first use)."""
        at = self.slots.get(block.id)
        n = block.tokens
        if at is None:
            at = self.used
            if at + n > self.table.shape[1]:
                self._grow(at + n)
            with torch.inference_mode():  # the pool may have grown during a forward
                for layer, (k, v) in enumerate(zip(block.keys, block.values, strict=True)):
                    self.keys[layer][:, at : at + n] = k
                    self.values[layer][:, at : at + n] = v
            self.slots[block.id] = at
            self.used = at + n
        with torch.inference_mode():
            self.table[row, at : at + n] = True
        self._segment = None

    def _grow(self, needed: int) -> None:
        cap = max(needed, 2 * self.table.shape[1])
        for buf in (self.keys, self.values):
            for layer, old in enumerate(buf):
                new = old.new_zeros(old.shape[0], cap, old.shape[2])
                new[:, : old.shape[1]] = old
                buf[layer] = new
        table = self.table.new_zeros(self.table.shape[0], cap)
        table[:, : self.table.shape[1]] = self.table
        self.table = table

    def select_rows(self, keep: torch.Tensor) -> None:
        self.table = self.table.index_select(0, keep)
        self._segment = None

    def segment(self) -> SharedSegment | None:
        """The pool as a shared segment of the rows that read any block (None: no row does)."""
        if self._segment is None and self.used:
            table = self.table[:, : self.used]
            rows = table.any(dim=1).nonzero().flatten()
            if rows.numel():
                self._segment = SharedSegment(
                    [k[:, : self.used] for k in self.keys],
                    [v[:, : self.used] for v in self.values],
                    rows,
                    POOL_KEY,
                    mask=table.index_select(0, rows),
                )
        return self._segment
