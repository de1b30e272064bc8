"""The attention of the fixed-shape decode step: each row's new K/V written in place in its own KV,
tails read over the slots in use under a mask built on the device or pages read in place by the
paged kernel (`StaticAttention`), and the same beside a waiting prompt's chunk carried in the step's
forward (`Chunk`, `MixedAttention`).

Why its own module: `step.py` decides which step runs (compiled, recorded, segmented, eager); this
is what every one of them computes in each layer, and what a compiled step is traced from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from branchwise.backends.hf import cpu_kernels
from branchwise.backends.hf.attention import (
    SharedSegment,
    Window,
    exact_attention,
    fused_cascade,
    merge_shared,
)
from branchwise.backends.hf.batch import BatchContext
from branchwise.backends.hf.kv_pages import Pages
from branchwise.backends.hf.step_inputs import StepKeys


def pages_copied(ctx: BatchContext, tap: str | None) -> str | None:
    """Why a step of this batch cannot read its rows' pages in place (None: it can, or the batch
    keeps tails): the paged kernel reads float32 and bfloat16 on a CPU, one query per row, nothing
    a tap needs as a rectangle of keys (`tap`: why one does), and once it is built: a step never
    waits for its build (`cpu_kernels.ready_now`)."""
    kv = ctx.kv
    if not isinstance(kv, Pages):
        return None
    like = kv.like()
    if like.device.type != "cpu":
        return f"no paged decode kernel wired for {like.device.type} (the reference path reads a copy)"
    if like.dtype not in (torch.float32, torch.bfloat16):
        return f"the paged decode kernel reads float32 and bfloat16, not {like.dtype}"
    if tap is not None:
        return tap
    return cpu_kernels.ready_now()


READERS_LEAST = 2
"""The fewest entries of a segment's readers as handed (padded with -1): a compiler specialises a
dimension of size 1, so a segment under one row would be a kind of batch of its own."""


def handed_count(segments: int) -> int:
    """How many segments a step hands the kernel for `segments` real ones: the next power of two
    (0 stays 0). Why: the count of the kernel's list arguments is a constant of a compiled step, so
    each count would compile anew as a tree search deepens; padded, depths 3-4 share one kind,
    5-8 another, and so on (a padding segment no row reads costs the kernel nothing)."""
    return 0 if segments <= 0 else 1 << (segments - 1).bit_length()


class KernelSegments:
    """Shared segments as the paged kernel reads them beside the rows' pages: each one's readers
    made once (int32, every row where a segment names none, a tensor of its own per segment, at
    least `READERS_LEAST` entries), each layer's keys and values handed with them (`at`), padded to
    `handed_count` segments by segments of two zero tokens that no row reads (-1 readers).

    Why the padding and the tensors of their own: a compiled step is specialised on the count of
    segments, on any size 1, and on which of its inputs are the same tensor; padded so, every batch
    whose real segments pad to the same count is one kind of batch (`step_compiler.kind_of`), the
    real segments' lengths and readers symbolic sizes."""

    def __init__(self, segments: Sequence[SharedSegment], batch: int, device: torch.device) -> None:
        real = list(segments)
        self.real = len(real)
        """How many of the handed segments are real (the rest pad)."""
        self.keys: list[list[torch.Tensor]] = [list(seg.keys) for seg in real]
        """Per handed segment, its keys per layer `[H_kv, T, D]`."""
        self.values: list[list[torch.Tensor]] = [list(seg.values) for seg in real]
        # what is made here is plain whatever mode the step is built in (a compiled step's guards
        # compare inference flags, and the worker builds its sample batch outside inference mode)
        with torch.inference_mode(False):
            self.rows = [self._readers(seg.rows, batch, device) for seg in real]
            for _ in range(handed_count(len(real)) - len(real)):
                self.keys.append(self._padding(real[0].keys))
                self.values.append(self._padding(real[0].values))
                self.rows.append(torch.full((READERS_LEAST,), -1, dtype=torch.int32, device=device))

    @staticmethod
    def _padding(like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per layer, two zero tokens shaped as `like`'s (heads, head size, dtype, device)."""
        return [t.new_zeros(t.shape[0], 2, t.shape[2]) for t in like]

    @staticmethod
    def _readers(rows: torch.Tensor | None, batch: int, device: torch.device) -> torch.Tensor:
        """A segment's readers as the kernel takes them (every row where `rows` is None)."""
        readers = torch.arange(batch, device=device) if rows is None else rows
        short = READERS_LEAST - readers.numel()
        if short > 0:
            readers = torch.cat([readers, readers.new_full((short,), -1)])
        return readers.to(torch.int32, copy=True)  # of its own, even where `rows` is int32

    def at(self, layer: int) -> cpu_kernels.Segments:
        """The segments' keys and values of `layer`, with their readers."""
        return cpu_kernels.Segments(
            [keys[layer] for keys in self.keys], [values[layer] for values in self.values], self.rows
        )


class StaticAttention:
    """The attention of one fixed-shape step (`attention.AttentionContext`): write each row's new
    K/V at its length, attend over the tail's first `span` slots under a mask from the lengths, plus
    the batch's shared segments (one product each for all their rows, merged by log-sum-exp)."""

    def __init__(self, ctx: BatchContext, lens: torch.Tensor, pos: torch.Tensor) -> None:
        self.ctx = ctx
        self.lens = lens
        self.pos = pos
        self.windowed = False
        """Whether a query of this step reaches past the model's sliding window (`Stepper.forward`
        decides it per step on the host: the window's layers then attend through
        `exact_attention`; a bool, so a compiled step is guarded on it, not on a position)."""
        self.slots = torch.arange(ctx.capacity, device=lens.device)
        """The tail slots read, `0 .. span - 1` (at least the longest row's length + 1; see
        `Stepper.span`): a tensor, so that a compiled step reads the span as a size, not a number
        it would be specialised on."""
        self.shared = ctx.read_segments()
        """What the rows read besides their tails: their ancestors, and the blocks they point at
        (ReasonCache's pool, read as one more segment masked per row: `batch.BlockPool`)."""
        self.merged = [seg for seg in self.shared if seg.mask is not None]
        self.taps = [tap for tap in ctx.taps if tap.in_step]
        """Taps the step feeds each layer's queries (`AttentionTap.in_step`), after it (`feed_taps`)."""
        self.feeds = bool(self.taps)
        """Whether each layer keeps what it read for the taps (`fed`). Why a flag and a list rather
        than calling the taps inside the step: a compiled step is traced without them (the worker
        has none), so it keeps their inputs as outputs of its own, and the taps' code runs after it
        (`feed_taps`, inside the step a recorder records, so a replay feeds them too)."""
        self.fed: list[tuple[int, torch.Tensor, float, bool, torch.Tensor | None, torch.Tensor | None]] = []
        """Per layer this step ran: the layer, its queries, the scaling, whether the paged kernel read
        the layer (and then the own slots' mass and the log-sum-exp, where a tap reads them)."""
        self.scored = any(tap.reads_mass for tap in self.taps)
        """Whether the paged kernel returns each own slot's attention mass too (a tap reads it)."""
        why = None
        if any(tap.reads_keys for tap in self.taps):
            why = "an acceleration's attention tap reads the keys as a rectangle"
        elif self.scored and self.merged:  # the kernel's mass is against its own log-sum-exp
            why = "an attention-mass tap under a masked pool of blocks merged after the paged kernel"
        self.copied = pages_copied(ctx, why)
        """Why this step reads a gathered copy of its rows' pages (None: tails, or pages in place)."""
        self.in_place = isinstance(ctx.kv, Pages) and self.copied is None
        """Whether each layer reads the rows' pages where they lie (`cpu_kernels.paged_decode`)."""
        handed = [seg for seg in self.shared if seg.mask is None] if self.in_place else []
        self.handed = KernelSegments(handed, ctx.batch, lens.device)
        """The segments the paged kernel reads with the rows' pages, in one softmax (read in place;
        none otherwise): every one but a masked pool of blocks, which `merge_shared` merges after."""
        self.grouped = ctx.n_groups > 1
        """Whether query heads share K/V heads (a bool here, outside any compilation, where sizes
        are symbolic and SDPA's `enable_gqa` takes no symbolic bool)."""
        self.bias: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        self.visible = self.slots[None, :0]
        """`[B, span]`: which tail slots each row sees this step (made in `prepare`)."""
        self.where = ctx.kv.locate(lens[:, None])
        """Where each row's new K/V goes, at its length (made in `prepare` from the lengths, read by
        every layer: the rows' indices a tensor of their own among a compiled step's inputs would
        be one more size to specialise on, and it was: each kind compiled twice)."""
        self.reach = self.lens.to(torch.int32)
        """`[B]` int32: the slots each row reads in place, its new one included (`prepare`)."""

    def prepare(self, dtype: torch.dtype) -> None:
        """The tail's mask, built on the device once per step: slot j is visible to a row's token iff
        j <= its length (the slot it is written to). Boolean `[B, 1, 1, span]` for one SDPA when no
        row reads a shared segment, else an additive bias `[B, 1, G, span]` for the cascade."""
        ctx = self.ctx
        self.fed = []
        self.where = ctx.kv.locate(self.lens[:, None])
        visible = self.visible = self.slots[None, :] <= self.lens[:, None]
        if self.in_place:  # the kernel masks by length itself (`visible`: a soft-capped or windowed layer's)
            self.reach = (self.lens + 1).to(torch.int32)
            return
        if not self.shared:  # one SDPA over the tails (its kernel picks the grouped heads itself)
            self.mask = visible[:, None, None, :]
            return
        bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
        bias.masked_fill_(~visible, float("-inf"))
        # materialised once per step: the CPU's flash kernel copies a broadcast mask in every layer
        self.bias = bias[:, None, None, :].expand(-1, 1, ctx.n_groups, -1).contiguous()

    @property
    def span(self) -> int:
        return int(self.slots.shape[0])

    @span.setter
    def span(self, span: int) -> None:
        if span != self.slots.shape[0]:
            self.slots = torch.arange(span, device=self.lens.device)

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
        ctx = self.ctx
        ctx.kv.write(layer, key, value, self.where)  # each row's new K/V at its length
        windowed = window is not None and self.windowed
        if self.in_place and softcap is None and not windowed:
            out, mass, lse = self._paged(layer, query, scaling)
            if self.feeds:  # no tap reads the keys (`pages_copied`); some may read their mass
                self.fed.append((layer, query, scaling, True, mass, lse))
            return out
        span = self.slots.shape[0]
        k_own, v_own = ctx.kv.read(layer, span)
        if self.feeds:
            self.fed.append((layer, query, scaling, False, None, None))
        if softcap is not None or windowed:  # what the fused kernels cannot do (`attention.exact_attention`)
            spec = None
            if windowed and window is not None:
                spec = Window.of(window, ctx.tail_start, self.pos[:, 0], self.lens, 1, span)
            # the step's own mask (`prepare`), not built again in every windowed or soft-capped layer
            visible = self.visible[:, None, :]
            return exact_attention(query, k_own, v_own, visible, self.shared, layer, scaling, softcap, spec)[
                0
            ]
        if not self.shared:  # what the layer loop runs for rows without shared ancestors
            out = F.scaled_dot_product_attention(
                query, k_own, v_own, attn_mask=self.mask, scale=scaling, enable_gqa=self.grouped
            )
            return out.transpose(1, 2)
        assert self.bias is not None, "attend() before prepare()"
        return fused_cascade(query, k_own, v_own, self.bias, self.shared, layer, scaling)

    def feed_taps(self) -> None:
        """Hand the taps what each layer of the step just run read (`fed`): its queries, and the
        keys as a `StepKeys` (over tails the rows' own keys, read again: the step wrote them before
        it attended; pages read in place hand the mass instead, None where no tap reads it)."""
        fed, self.fed = self.fed, []
        span = self.slots.shape[0]
        for layer, query, scaling, paged, mass, lse in fed:
            if paged:
                keys = None if mass is None else StepKeys(None, self.visible, self.shared, scaling, mass, lse)
            else:
                keys = StepKeys(self.ctx.kv.read(layer, span)[0], self.visible, self.shared, scaling)
            for tap in self.taps:
                tap.on_step(layer, query, keys)

    def _paged(
        self, layer: int, query: torch.Tensor, scaling: float
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Attention over the rows' pages read in place and the segments handed to the kernel with
        them (output and log-sum-exp per query), a masked pool merged after by log-sum-exp: `[B, 1, H, D]`,
        each own slot's attention mass `[B, slots]` where a tap reads it (`scored`, else None), and
        the merged log-sum-exp `[B, H_kv, G]` (the kernel's mass is against its own log-sum-exp:
        a batch merging a masked pool after it reads a copy where a tap reads the mass,
        `pages_copied`)."""
        kv = self.ctx.kv
        assert isinstance(kv, Pages)
        b, h, _, d = query.shape
        h_kv = kv.keys[layer].shape[1]
        g = h // h_kv
        args = (
            query[:, :, 0],
            kv.keys[layer],
            kv.values[layer],
            kv.table,
            self.reach,
            scaling,
            0,
            self.handed.at(layer),
        )
        mass = None
        if self.scored:
            out, lse, mass = cpu_kernels.paged_decode_mass(*args)
        else:
            out, lse = cpu_kernels.paged_decode(*args)
        total = lse.view(b, h_kv, g)
        if self.merged:
            merged, total = merge_shared(
                query.reshape(b, h_kv, g, d), out.view(b, h_kv, g, d), total, self.merged, layer, scaling
            )
            out = merged.reshape(b, h, d)
        return out[:, None], mass, total


@dataclass
class Chunk:
    """Prompt tokens a decode step carries beside its rows (chunked prefill in one forward): the
    next `ids` of one waiting prompt, in a batch of their own (`ctx`: the prompt's row, its KV so
    far in the tail, its ancestors shared)."""

    ctx: BatchContext
    ids: Sequence[int]
    logits: torch.Tensor | None = None
    """The logits after the chunk's last token, once a step has computed it `[V]`."""


class MixedAttention:
    """The attention of a decode step that carries a prefill chunk. The forward runs the rows' tokens
    and the chunk's as one sequence `[1, B + C]` (every linear layer reads its weights once for
    both), and attention splits it again: the first B positions are the decoding rows', attended
    as the fixed-shape step attends them, the last C the chunk's, causal over its own batch."""

    def __init__(self, rows: StaticAttention, chunk: BatchContext) -> None:
        self.rows = rows
        self.chunk = chunk
        self.b = rows.ctx.batch

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
        b = self.b

        def rows_of(t: torch.Tensor) -> torch.Tensor:  # [1, H, B + C, D] -> [B, H, 1, D]
            return t[0, :, :b].transpose(0, 1).unsqueeze(2)

        out = self.rows.attend(layer, rows_of(query), rows_of(key), rows_of(value), scaling, softcap, window)
        tail = self.chunk.attend(
            layer, query[:, :, b:], key[:, :, b:], value[:, :, b:], scaling, softcap, window
        )
        return torch.cat([out.transpose(0, 1), tail], dim=1)  # [1, B + C, H, D]
