"""Batch state: the rows being computed together and the per-batch KV buffers attention reads.

Why a separate module: the tree (`tree.py`) holds KV per node for as long as the node lives; a
forward needs the same KV arranged per *row* — each row's own tokens in a padded tail buffer that
grows as it decodes, its ancestors as shared segments read once for every row under them. `Batch`
builds that arrangement from segments and copies each row's tail back into its segment when the
row is done (`capture`). Nothing here is specific to an acceleration: one that needs to see
attention (weights, queries) or move a row's slots registers an `AttentionTap`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
import torch.nn.functional as F

from branchwise.backends.base import FinishReason
from branchwise.backends.hf.arch import DecoderParts
from branchwise.backends.hf.attention import (
    SharedSegment,
    Weights,
    Window,
    bias_of,
    cascade,
    exact_attention,
    fused_cascade,
)
from branchwise.backends.hf.block_pool import BlockPool
from branchwise.backends.hf.kv_pages import Pages
from branchwise.backends.hf.own_kv import KVLayout, OwnKV, Tails, Where
from branchwise.backends.hf.segment import Block, Segment
from branchwise.backends.hf.step_inputs import Exits, Steer, StepKeys
from branchwise.backends.hf.tree import KVTree

Broadcast = Literal["cascade", "copy"]
"""How rows read shared ancestors: one batched product per segment, or per-row copies (baseline)."""


@dataclass
class Row:
    """One branch in a batch: its segment, where its KV sits in the tail, and what it decoded."""

    seg: Segment
    kv_len: int
    """Valid KV tokens of the row's own segment in the tail (physical; below `computed` after eviction)."""
    computed: int
    """Tokens of the segment whose KV was computed (logical)."""
    tail_start: int = 0
    """Where the row's own KV starts in the tail (after copied ancestors under broadcast='copy')."""
    out: list[int] = field(default_factory=list)
    top1: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish: FinishReason | None = None
    captured: bool = False
    preempted: bool = False
    """Dropped from the batch to stay within the KV budget: its KV is freed, not captured, and it is
    recomputed when it rejoins (its tokens so far are kept)."""


class AttentionTap:
    """An observer of a batch's attention, installed by an acceleration (every method optional).

    `wants_weights` makes attention take the explicit-softmax path (SDPA hides its weights) and call
    `on_weights`; `on_query` sees each layer's post-RoPE queries. The other methods keep per-slot
    state the tap holds aligned when rows leave the batch, the tail grows or a row's slots move.
    """

    wants_weights: bool = False
    in_step: bool = False
    """Whether the fixed-shape step can feed it (`on_step` per layer, writing in place, then
    `count_step` once per step on the host): such a tap keeps its batch on the fast step; any other
    keeps it on the layer loop."""
    reads_keys: bool = True
    """Whether `on_step` reads the keys (`StepKeys`): a batch in pages then reads a gathered copy
    of them at each step (`step_attention.pages_copied`); a tap that reads only the queries is
    given None there, and the pages are read in place."""
    reads_mass: bool = False
    """Whether what `on_step` needs of its rows' own keys is the attention each slot got
    (`StepKeys.mass`): a batch in pages then reads them in place, the paged kernel returning each
    slot's mass beside its output (`cpu_kernels.paged_decode_mass`), and such a tap says
    `reads_keys = False`."""

    def on_query(self, layer: int, query: torch.Tensor, q_len: int) -> None:
        """Post-RoPE queries `[B, H, q, D]` of layer `layer`, before attention."""

    def on_weights(self, layer: int, weights: Weights) -> None:
        """Softmax statistics of layer `layer` (only when `wants_weights`)."""

    def on_step(self, layer: int, query: torch.Tensor, keys: StepKeys | None) -> None:
        """A decode step's post-RoPE queries `[B, H, 1, D]` of layer `layer` and the keys they read
        (None where the tap does not read them, `reads_keys`, and the step reads pages in place;
        `in_step` taps): what it keeps is written in place into buffers that keep their address,
        so a captured step replays it."""

    def count_step(self) -> None:
        """A decode step ran (`in_step` taps): host-side bookkeeping, outside any captured step."""

    def select_rows(self, keep: torch.Tensor) -> None:
        """Rows not in `keep` (old indices, in order) left the batch."""

    def grow(self, capacity: int) -> None:
        """The tail buffers grew to `capacity` slots per row."""

    def move_slots(self, pos: int, start: int, index: torch.Tensor) -> None:
        """Row `pos` keeps tail slots `index` (absolute), now packed from `start` on."""


@dataclass
class BatchContext:
    """Per-batch KV state the attention function reads and writes, layer by layer.

    `kv` holds each row's own tokens (`own_kv.py`: rectangular tails or pages; "tail" below means
    a row's own slots in either); `lens[b]` is how many of them are valid before the current
    forward. `begin(q)` prepares the masks and write positions for a forward of `q` new tokens per
    row (padded rows feed dummies whose outputs are discarded and whose slots are later
    overwritten).
    """

    kv: OwnKV
    lens: torch.Tensor  # [B] long
    shared: list[SharedSegment] = field(default_factory=list)
    pos_next: torch.Tensor | None = None  # [B] logical position of each row's next token
    n_groups: int = 1
    taps: list[AttentionTap] = field(default_factory=list)
    last_hidden: torch.Tensor | None = None  # final-norm hidden state at each row's last fed token
    steer: Steer | None = None
    """Vectors the next forward adds to the residual stream (set by a plug-in before a decode step
    and cleared after it; the layer loop and the fixed-shape step both apply it)."""
    exits: Exits | None = None
    """An early exit for the fixed-shape step's decode steps (set by a plug-in for the batch; the
    layer loop ignores it: there the plug-in's own hooks exit)."""
    pool: BlockPool | None = None
    """Shared blocks the rows read (ReasonCache); None while no row reads one."""
    grow_min: int = 128
    """Fewest slots per row the tails grow by when a row reaches their end (`grow_by`): fewer where
    no row may hold more (an eviction policy's cap), since every row grows at once."""
    grow_limit: int | None = None
    """The most slots any row of the batch may need (None: unknown): growth stops there, however
    much `grow_by` would add (`next_capacity`)."""
    tail_start: torch.Tensor | None = None
    """Where each row's own KV starts in its tail `[B]`, the slots before it its copied ancestors:
    what a sliding window reads the tail slots' positions from (`attention.Window`). None once a
    slot was evicted or moved (positions no longer follow from slots)."""
    # set by begin():
    q_len: int = 0
    _own_mask: torch.Tensor | None = None  # [B,1,q,T] bool
    _own_mask_g: torch.Tensor | None = None  # [B,1,G*q,T] bool
    _write_idx: torch.Tensor | None = None
    _where: Where | None = None  # `kv.locate(_write_idx)`, made by the first layer of a forward
    _uniform: int | None = None
    _own_bias_g: torch.Tensor | None = None  # _own_mask_g as an additive bias, built on first use
    _reach: int | None = None  # one past the last position this forward's queries hold (read once, lazily)

    @property
    def batch(self) -> int:
        return int(self.lens.shape[0])

    @property
    def capacity(self) -> int:
        return self.kv.capacity

    @property
    def nbytes(self) -> int:
        """Bytes of the rows' own KV storage (transient: it lives as long as the batch)."""
        return self.kv.nbytes

    def begin(self, q_len: int) -> None:
        """Prepare masks and write positions for a forward of `q_len` tokens per row."""
        self.q_len = q_len
        self._own_bias_g = None
        device = self.lens.device
        total = self.make_room(q_len)
        j = torch.arange(total, device=device)
        i = torch.arange(q_len, device=device)
        # key j is visible to query i of row b iff j <= lens[b] + i (causal within the tail).
        limit = self.lens[:, None] + i[None, :]  # [B, q]
        mask = j[None, None, :] <= limit[:, :, None]  # [B, q, T]
        self._own_mask = mask[:, None]
        g = self.n_groups
        self._own_mask_g = (
            mask[:, None, None].expand(-1, 1, g, -1, -1).reshape(self.batch, 1, g * q_len, total)
        )
        lens_list = self.lens.tolist()
        self._uniform = lens_list[0] if all(x == lens_list[0] for x in lens_list) else None
        self._reach = None
        self._write_idx = None if self._uniform is not None else limit  # [B, q]
        self._where = None

    def make_room(self, q_len: int) -> int:
        """Grow the tails (amortised) so every row can take `q_len` more tokens (pages: give each
        row the pages that needs); returns the slots the longest row will then use."""
        lens = self.lens.tolist()
        total = max(lens) + q_len
        grown = total > self.capacity
        capacity = self.next_capacity(total) if grown else self.capacity
        self.kv.fit(lens, q_len, capacity)
        if grown:
            for tap in self.taps:  # what the storage holds now (pages round up to whole pages)
                tap.grow(self.capacity)
        return total

    def grow_by(self) -> int:
        """Slots per row the tails gain when a row reaches their end (amortised growth)."""
        return max(self.grow_min, self.capacity // 2)

    def next_capacity(self, needed: int) -> int:
        """The tails' capacity once grown to hold `needed` slots per row: amortised (`grow_by`), but
        never past what a row may need (`grow_limit`), and at least `needed`."""
        grown = self.capacity + self.grow_by()
        if self.grow_limit is not None:
            grown = min(grown, self.grow_limit)
        return max(needed, grown)

    def select_rows(self, keep: torch.Tensor, row_map: dict[int, int]) -> None:
        """Drop batch rows not in `keep` (a long tensor of old row indices, in order)."""
        self.kv.select_rows(keep)
        self.lens = self.lens.index_select(0, keep)
        # per-forward state too: rows can leave between layers (early exits)
        if self._own_mask is not None:
            assert self._own_mask_g is not None  # begin() sets both
            self._own_mask = self._own_mask.index_select(0, keep)
            self._own_mask_g = self._own_mask_g.index_select(0, keep)
        self._own_bias_g = None
        if self._write_idx is not None:
            self._write_idx = self._write_idx.index_select(0, keep)
        self._where = None
        if self.pos_next is not None:
            self.pos_next = self.pos_next.index_select(0, keep)
        if self.tail_start is not None:
            self.tail_start = self.tail_start.index_select(0, keep)
        if self.pool is not None:
            self.pool.select_rows(keep)
        for tap in self.taps:
            tap.select_rows(keep)
        new_shared = []
        for seg in self.shared:
            if seg.rows is None:
                new_shared.append(seg)
                continue
            rows = [row_map[r] for r in seg.rows.tolist() if r in row_map]
            if rows:
                new_shared.append(replace(seg, rows=torch.tensor(rows, device=self.lens.device)))
        self.shared = new_shared

    def move_slots(self, pos: int, start: int, index: torch.Tensor) -> None:
        """Keep only tail slots `index` (absolute, increasing) of row `pos`, packed from `start` on.

        The public way to evict part of a row's own KV mid-decode: buffers, the row's length and
        every tap move together, so nothing is left pointing at a slot that moved.
        """
        self._move(pos, start, index, int(index.numel()))
        for tap in self.taps:
            tap.move_slots(pos, start, index)

    def move_slots_per_head(self, pos: int, start: int, index: torch.Tensor) -> None:
        """`move_slots` with its own slots per (layer, KV head): `index` [L, H_kv, k] (absolute,
        increasing per head). Lengths and masks stay per row (every head keeps k). A tap that keeps
        per-slot state cannot follow different slots per head, so one refuses the move."""
        for tap in self.taps:
            if type(tap).move_slots is not AttentionTap.move_slots:
                raise ValueError(f"{type(tap).__name__} keeps per-slot state: no per-head eviction under it")
        self._move(pos, start, index, int(index.shape[-1]))

    def _move(self, pos: int, start: int, index: torch.Tensor, kept: int) -> None:
        """Row `pos` keeps slots `index` (`kept` of them per head) packed from `start` on."""
        self.tail_start = None  # slots no longer follow positions
        self.kv.move(pos, start, index, kept)
        lens = self.lens.clone()
        lens[pos] = start + kept
        self.lens = lens

    def read_segments(self) -> list[SharedSegment]:
        """The shared segments the rows read: their ancestors, and the block pool where rows point
        at blocks (one more segment, masked per row)."""
        pooled = None if self.pool is None else self.pool.segment()
        return self.shared if pooled is None else [*self.shared, pooled]

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
        softcap: float | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """Write this forward's K/V into the tail and attend over ancestors + tail.

        query `[B, H, q, D]`, key/value `[B, H_kv, q, D]` (post-RoPE). Returns `[B, q, H, D]`.
        A soft-capped layer, or a sliding window some query reaches past, attends through
        `exact_attention`.
        """
        q_len = self.q_len
        for tap in self.taps:
            tap.on_query(layer, query, q_len)
        if self._uniform is not None:
            self.kv.write_from(layer, key, value, self._uniform)
        else:
            assert self._write_idx is not None
            if self._where is None:
                self._where = self.kv.locate(self._write_idx)
            self.kv.write(layer, key, value, self._where)
        assert self._own_mask is not None and self._own_mask_g is not None, "attend() before begin()"
        total = self._own_mask.shape[-1]
        k_own, v_own = self.kv.read(layer, total)
        want_weights = any(tap.wants_weights for tap in self.taps)
        shared = self.read_segments()
        if window is not None and self._reach is None:  # a host read, only for a model with a window
            assert self.pos_next is not None
            self._reach = int(self.pos_next.max()) + q_len
        windowed = window is not None and self._reach is not None and self._reach > window
        if softcap is not None or windowed:  # what the fused kernels cannot do
            assert self.pos_next is not None
            spec = None  # `lens` and `pos_next` below are the rows' before this forward
            if windowed and window is not None:
                spec = Window.of(window, self.tail_start, self.pos_next, self.lens, q_len, total)
            mask = self._own_mask[:, 0]
            out, weights = exact_attention(
                query, k_own, v_own, mask, shared, layer, scaling, softcap, spec, want_weights
            )
            return self._observed(layer, out, weights)
        if not want_weights and (shared or self._uniform == 0):
            # fused kernels with log-sum-exp; a fresh tail (every row starts empty) is plain causal
            if self._uniform == 0:
                bias = None
            else:  # built once per forward, shared by the layers
                if self._own_bias_g is None or self._own_bias_g.dtype != query.dtype:
                    self._own_bias_g = bias_of(self._own_mask_g, query.dtype)
                bias = self._own_bias_g
            return fused_cascade(query, k_own, v_own, bias, shared, layer, scaling)
        if not want_weights:
            out = F.scaled_dot_product_attention(
                query, k_own, v_own, attn_mask=self._own_mask, scale=scaling, enable_gqa=self.n_groups > 1
            )
            return out.transpose(1, 2)
        out, weights = cascade(query, k_own, v_own, self._own_mask_g, shared, layer, scaling, want_weights)
        return self._observed(layer, out, weights)

    def _observed(self, layer: int, out: torch.Tensor, weights: Weights | None) -> torch.Tensor:
        """`out`, once the taps that read attention weights have seen `weights`."""
        if weights is not None:
            for tap in self.taps:
                if tap.wants_weights:
                    tap.on_weights(layer, weights)
        return out


@dataclass
class Batch:
    """Rows decoded together and their attention context."""

    rows: list[Row]
    ctx: BatchContext
    feeds: list[list[int]]
    """Each row's pending tokens when the batch was assembled (what its first forward feeds)."""
    broadcast: Broadcast = "cascade"
    caps: list[int] = field(default_factory=list)
    """A decode batch's: the most tokens each row may decode in it (empty for a prefill), set
    before the plug-ins see the batch (`on_batch`), so they know what it may come to."""

    @classmethod
    def assemble(
        cls,
        segs: Sequence[Segment],
        extra: int,
        parts: DecoderParts,
        dtype: torch.dtype,
        device: torch.device,
        broadcast: Broadcast = "cascade",
        copy_tokens: int = 0,
        limit: int | None = None,
        reserve: Callable[[int], None] | None = None,
        layout: KVLayout = "tails",
    ) -> Batch:
        """Rows for `segs`: each row's own KV in its tail (with `extra` free slots), ancestors shared.

        With `broadcast="copy"` (the RKSC notebook's `repeat_interleave(...).clone()`, kept as a
        baseline) every row gets its own copy of its ancestors' KV in front of its tail instead.
        Under "cascade", the top of a row's path is copied too while it holds at most
        `copy_tokens` tokens (an ancestor is copied when its whole path, root to its end, does): a
        shared segment costs one more attention call per layer, which for a few tokens costs more
        than reading them once per row (many requests with short prompts in one decode batch), and
        the bound on the path, not on each segment, keeps a prompt the prefix cache split into
        many short segments shared.

        `limit` feeds (and makes room for) at most that many pending tokens per row: one chunk of a
        long prompt (chunked prefill), the rest left pending. `reserve` is told the tails' bytes
        before they are allocated (the KV budget may refuse them). `layout` is how the rows' own
        KV is held (`own_kv.py`): in pages, the free slots ahead cost nothing until written.
        """
        rows = [Row(seg=s, kv_len=s.kv_tokens, computed=s.n_computed) for s in segs]
        b = len(rows)
        decided: dict[int, bool] = {}

        def copied(anc: Segment) -> bool:
            if broadcast == "copy":
                return True
            if anc.id not in decided:
                decided[anc.id] = anc.position <= copy_tokens
            return decided[anc.id]

        chains = [[a for a in reversed(r.seg.kv_ancestors()) if copied(a)] for r in rows]
        for r, chain in zip(rows, chains, strict=True):
            r.tail_start = sum(a.kv_tokens for a in chain)
        lens = [r.tail_start + r.kv_len for r in rows]
        feeds = [s.pending if limit is None else s.pending[:limit] for s in segs]
        # the first forward pads every row's feed to the longest (`BatchContext.begin`): room for
        # that, or it would grow every row's tail by `grow_by` slots before the budget is asked
        fed = max(len(f) for f in feeds)
        cap = max(max(lens) + fed + extra, 1)
        shape = (b, parts.n_kv_heads, cap, parts.head_dim)
        kv: OwnKV
        if layout == "tails":
            if reserve is not None:
                itemsize = torch.tensor([], dtype=dtype).element_size()
                reserve(2 * parts.n_layers * math.prod(shape) * itemsize)
            kv = Tails.zeros(shape, parts.n_layers, dtype, device)
        else:  # the pages each row holds now and its own `extra` free slots ahead, no rectangle
            kv = Pages(parts.n_layers, parts.n_kv_heads, parts.head_dim, b, dtype, device)
            if reserve is not None:
                reserve(kv.growth(lens, fed + extra, cap))
            kv.fit(lens, fed + extra, cap)
        for i, (r, chain) in enumerate(zip(rows, chains, strict=True)):
            at = 0
            for piece in [*chain, r.seg]:
                n = r.kv_len if piece is r.seg else piece.kv_tokens
                if n:
                    assert piece.keys is not None and piece.values is not None
                    kv.load(i, at, piece.keys, piece.values)
                at += n
        groups: dict[int, tuple[Segment, list[int]]] = {}
        for i, r in enumerate(rows):
            for anc in r.seg.kv_ancestors():
                if not copied(anc):
                    groups.setdefault(anc.id, (anc, []))[1].append(i)
        shared = [
            SharedSegment(
                anc.keys or [],
                anc.values or [],
                None if len(idx) == b else torch.tensor(idx, device=device),
                anc.id,
                start=anc.position - anc.n_computed if anc.kv_tokens == anc.n_computed else None,
            )
            for anc, idx in groups.values()
            if anc.kv_tokens  # a segment emptied by eviction has nothing left to attend to
        ]
        ctx = BatchContext(
            kv=kv,
            lens=torch.tensor(lens, device=device),
            shared=shared,
            n_groups=parts.n_heads // parts.n_kv_heads,
            pos_next=torch.tensor([s.position for s in segs], device=device),
            # a row's slots follow its positions while no slot of its path was evicted
            tail_start=torch.tensor([r.tail_start for r in rows], device=device)
            if all(a.kv_tokens == a.n_computed for s in segs for a in (s, *s.kv_ancestors()))
            else None,
        )
        batch = cls(rows=rows, ctx=ctx, feeds=feeds, broadcast=broadcast)
        for i, r in enumerate(rows):
            for seg in (r.seg, *r.seg.kv_ancestors()):
                for _, block in seg.blocks:
                    batch.pool().point(i, block)
        return batch

    def pool(self) -> BlockPool:
        """The batch's block pool (made on first use)."""
        if self.ctx.pool is None:
            kv = self.ctx.kv
            self.ctx.pool = BlockPool.empty(kv.like(), len(kv.tensors()) // 2, self.ctx.batch)
        return self.ctx.pool

    def own_kv(
        self, pos: int, row: Row, first: int = 0, last: int | None = None, owned: bool = False
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """`[H_kv, n, D]` per layer of the row's own KV slots `first .. last` (relative to its own
        KV; `last` None: all it holds), to read (views where the layout has them); with `owned`,
        tensors of their own, for what outlives the batch (copied once whatever the layout)."""
        end = row.kv_len if last is None else last
        return self.ctx.kv.row(pos, row.tail_start + first, row.tail_start + end, owned)

    def seal(self, tree: KVTree, pos: int, row: Row, slot: int, n: int) -> Block:
        """Copy `n` own KV slots of a row (from `slot`, relative to its own KV) into a new block.

        The block is owned by the row's run; nothing points at it yet (see `point_at`)."""
        keys, values = self.own_kv(pos, row, slot, slot + n, owned=True)
        return tree.blocks.seal(keys, values, row.seg.owner)

    def point_at(self, tree: KVTree, pos: int, row: Row, slot: int, logical: int, block: Block) -> None:
        """Replace the row's own KV slots `slot .. slot + block.tokens` by a reference to `block`.

        The slots leave the row's tail (`move_slots`: buffers, length and taps move together) and
        the row reads the block through the pool from the next forward on; `logical` is where the
        block sits in the node's own tokens, so positions stay logical."""
        n = block.tokens
        own = torch.arange(row.kv_len, device=self.ctx.lens.device)
        keep = own[(own < slot) | (own >= slot + n)]
        self.keep_own(pos, row, keep)
        tree.blocks.ref(row.seg, logical, block)
        self.pool().point(pos, block)

    def advance(self, present: Sequence[int], feeds: Sequence[Sequence[int]]) -> None:
        """Rows `present` (row indices, in batch order) just computed `feeds`."""
        for ri, f in zip(present, feeds, strict=True):
            self.rows[ri].kv_len += len(f)
            self.rows[ri].computed += len(f)

    def keep_own(self, pos: int, row: Row, keep: torch.Tensor) -> None:
        """Keep only the slots `keep` (relative to the row's own KV, increasing) of the row at batch
        position `pos`: an eviction mid-decode. Positions stay logical (`row.computed` is unchanged)."""
        self.ctx.move_slots(pos, row.tail_start, keep + row.tail_start)
        row.kv_len = int(keep.numel())

    def keep_own_per_head(self, pos: int, row: Row, keep: torch.Tensor) -> None:
        """`keep_own` with its own slots per (layer, KV head): `keep` [L, H_kv, k]."""
        self.ctx.move_slots_per_head(pos, row.tail_start, keep + row.tail_start)
        row.kv_len = int(keep.shape[-1])

    def reread(self, seg: Segment) -> None:
        """`seg`'s KV changed in the tree (slots evicted): the rows reading it as a shared segment
        read what it holds now from the next forward on, or nothing once it holds none."""
        shared = []
        for entry in self.ctx.shared:
            if entry.key == seg.id:
                if not seg.kv_tokens:
                    continue  # nothing left to attend to
                entry.keys, entry.values = seg.keys or [], seg.values or []
            shared.append(entry)
        self.ctx.shared = shared

    def hand_over(self, tree: KVTree, row: Row) -> bool:
        """Give a one-row batch's tail buffers to the row's node as its KV, without a copy, where
        they hold exactly its own KV (a prefill: no ancestors copied in front, no free slots
        ahead); the batch holds nothing after. False (nothing done) otherwise: `capture` it.

        Why: a capture copies the row's KV while the tails still hold it, so for a moment a prompt's
        whole KV is held twice, over a budget that priced it once (a long prompt's last chunk)."""
        ctx, kv = self.ctx, self.ctx.kv
        if not isinstance(kv, Tails) or ctx.batch != 1 or row.tail_start or ctx.pool is not None:
            return False
        if row.kv_len != ctx.capacity:
            return False
        keys, values = [t[0] for t in kv.keys], [t[0] for t in kv.values]
        kv.clear()
        tree.set_kv(row.seg, keys, values)
        row.seg.n_computed = row.computed
        row.captured = True
        return True

    def capture(self, tree: KVTree, pos: int, row: Row) -> None:
        """Copy a row's KV out of the batch buffers into its segment (independent tensors, so
        releasing the node frees exactly its memory)."""
        keys, values = self.own_kv(pos, row, owned=True)
        tree.set_kv(row.seg, keys, values)
        row.seg.n_computed = row.computed
        row.captured = True
