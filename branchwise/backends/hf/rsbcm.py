"""RSBCM (RKSC §2.4, Alg. 4, App. H): block-level KV eviction by ω = mass · score / (depth + 1).

Each live segment's physical KV is cut into blocks of `block_tokens`. A block's importance is the
attention mass its keys received (accumulated by the shared-prefix attention while tracking is on,
not the constant 1.0 of the public notebook) times its branch's score, divided by its depth in the
branch tree + 1, so deep, low-scoring, rarely attended blocks go first. Above `capacity_blocks`,
the lowest-ω blocks are evicted and their tensors really dropped; positions stay correct because
keys are stored post-RoPE and the tree tracks logical positions separately from the KV length.
The prompt (depth 0) is pinned by default: it is shared by every branch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from branchwise.backends.accel import RSBCMConfig
from branchwise.backends.hf.attention import Weights
from branchwise.backends.hf.batch import AttentionTap, Batch, Row
from branchwise.backends.hf.hooks import Acceleration, Host, Setup
from branchwise.backends.hf.segment import Segment
from branchwise.backends.hf.step_inputs import StepKeys


@dataclass(frozen=True)
class Block:
    """One evictable block: physical token range [start, end) of a segment."""

    segment: int
    start: int
    end: int
    mass: float
    score: float
    depth: int

    @property
    def omega(self) -> float:
        return self.mass * self.score / (self.depth + 1)


def blocks_of(
    segment: int, mass: torch.Tensor | None, length: int, block_tokens: int, score: float, depth: int
) -> list[Block]:
    """Cut a segment of `length` physical tokens into blocks (the last one may be partial)."""
    out = []
    for start in range(0, length, block_tokens):
        end = min(start + block_tokens, length)
        block_mass = float(mass[start:end].sum()) if mass is not None else 0.0
        out.append(Block(segment, start, end, block_mass, score, depth))
    return out


def plan_evictions(blocks: Sequence[Block], capacity: int) -> list[Block]:
    """Alg. 4: while more than `capacity` blocks remain, evict the one with the smallest ω.

    Ties keep the earliest-listed block (deterministic).
    """
    excess = len(blocks) - capacity
    if excess <= 0:
        return []
    order = sorted(range(len(blocks)), key=lambda i: (blocks[i].omega, -i))
    return [blocks[i] for i in order[:excess]]


def keep_mask(length: int, evicted: Sequence[Block], device: torch.device) -> torch.Tensor:
    """Boolean mask of physical positions that survive the evictions of one segment."""
    keep = torch.ones(length, dtype=torch.bool, device=device)
    for block in evicted:
        keep[block.start : block.end] = False
    return keep


class MassTap(AttentionTap):
    """Accumulates, per batch, the attention mass every key received: each row's own tail
    (`own`, [B, cap]) and each tracked shared segment (`segments`, key → [T]).

    On the layer loop it reads the explicit softmax's statistics (`on_weights`). On the fixed-shape
    step (`on_step`), each key's mass is `exp(score − lse_total)`, added in place to buffers that
    keep their address, so the step stays fused (its attention never materialises weights) and
    captured. Where the step reads pages in place the paged kernel hands over each own slot's mass
    itself and the total log-sum-exp (its cascade's merge), so the tap adds one small tensor per
    layer and scores only the shared segments it tracks; over tails it scores the tail's keys and
    every shared segment's in a small pass of its own and merges their log-sum-exps into the
    total."""

    wants_weights = True
    in_step = True
    reads_keys = False  # the own slots' mass is enough (`reads_mass`); tails give keys anyway
    reads_mass = True

    def __init__(self, own: torch.Tensor, tracked: set[int]) -> None:
        self.own = own
        self.tracked = tracked
        self.segments: dict[int, torch.Tensor] = {}

    def on_weights(self, layer: int, weights: Weights) -> None:
        """Add the normalised attention weight each key got (summed over heads and queries)."""
        m, s = weights.m, weights.s
        m_own, p_own = weights.own
        weight = (p_own * torch.exp(m_own - m) / s).sum(dim=(1, 2))  # [B, T]
        self.own[:, : weight.shape[-1]] += weight.float()
        for seg, ms, ps in weights.segments:
            if seg.key not in self.tracked:
                continue
            m_r = m if seg.rows is None else m[seg.rows]
            s_r = s if seg.rows is None else s[seg.rows]
            factor = torch.exp(ms - m_r) / s_r  # [R, H_kv, G*q, 1]
            h_kv = factor.shape[1]
            factor = factor.permute(1, 0, 2, 3).reshape(h_kv, -1, 1)
            total = (ps * factor).sum(dim=(0, 1)).float()  # [T_seg]
            if seg.key in self.segments:
                self.segments[seg.key] += total
            else:
                self.segments[seg.key] = total

    def on_step(self, layer: int, query: torch.Tensor, keys: StepKeys | None) -> None:
        assert keys is not None, "the attention mass is the queries against the keys (`reads_mass`)"
        b, h, _, d = query.shape
        # the log-sum-exp of all a query read [B, H_kv, G]: pages read in place hand it over with
        # each own slot's mass (the step's merged total); over tails both are computed here
        known = keys.own is None
        if keys.own is None:
            assert keys.mass is not None and keys.lse is not None, "pages in place hand over the mass"
            lse, h_kv = keys.lse, int(keys.lse.shape[1])
            self.own[:, : keys.mass.shape[-1]] += keys.mass
        else:
            h_kv = int(keys.own.shape[1])
        qg = query.reshape(b, h_kv, h // h_kv, d).float()  # query head j*G.. reads KV head j

        def scores(q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
            sc = torch.matmul(q, k.float().transpose(-1, -2)) * keys.scaling
            return sc if visible is None else sc.masked_fill(~visible[:, None, None, :], float("-inf"))

        own = None if keys.own is None else scores(qg, keys.own, keys.visible)
        if own is not None:
            lse = torch.logsumexp(own, -1)
        parts = []
        for seg in keys.shared:
            if known and seg.key not in self.tracked:
                continue  # the total is known: an untracked segment needs no scores
            q_rows = qg if seg.rows is None else qg.index_select(0, seg.rows)
            sc = scores(q_rows, seg.keys[layer][None], seg.mask)  # [r, H_kv, G, T]
            parts.append((seg, sc))
            if known:
                continue
            part = torch.logsumexp(sc, -1)
            if seg.rows is None:
                lse = torch.logaddexp(lse, part)
            else:
                lse = lse.index_copy(0, seg.rows, torch.logaddexp(lse.index_select(0, seg.rows), part))
        if own is not None:
            self.own[:, : own.shape[-1]] += torch.exp(own - lse[..., None]).sum(dim=(1, 2))
        for seg, sc in parts:
            if seg.key not in self.tracked:
                continue
            lse_r = lse if seg.rows is None else lse.index_select(0, seg.rows)
            total = torch.exp(sc - lse_r[..., None]).sum(dim=(0, 1, 2))  # [T]
            if seg.key in self.segments:
                self.segments[seg.key] += total
            else:  # the first step (never a recorded one: a layout's first step runs eagerly)
                self.segments[seg.key] = total

    def select_rows(self, keep: torch.Tensor) -> None:
        self.own = self.own.index_select(0, keep)

    def grow(self, capacity: int) -> None:
        grown = self.own.new_zeros(self.own.shape[0], capacity)
        grown[:, : self.own.shape[1]] = self.own
        self.own = grown

    def move_slots(self, pos: int, start: int, index: torch.Tensor) -> None:
        self.own[pos, start : start + int(index.numel())] = self.own[pos, index]


class RSBCM(Acceleration):
    """Block eviction as a plug-in: tracks attention mass while a batch runs, folds it into each
    segment's running total, and after each decode batch evicts the lowest-ω blocks above capacity.

    State (per run): the attention mass and score of each of the run's segments. A branch's score is
    its generation confidence after decoding, or a verifier's score (`on_scores`). Statistics:
    `rsbcm_evictions`, `rsbcm_evicted_tokens`.
    """

    name = "rsbcm"
    config = RSBCMConfig
    needs_cascade = True  # block masses are kept per shared segment

    def __init__(self, cfg: RSBCMConfig, host: Host) -> None:
        self.cfg = cfg
        self.host = host
        self.mass: dict[int, torch.Tensor] = {}
        self.score: dict[int, float] = {}
        self._taps: dict[int, MassTap] = {}
        self.tracking = False
        """Whether attention mass is tracked (from the first batch near capacity on: `on_batch`)."""

    @classmethod
    def build(cls, cfg: RSBCMConfig, setup: Setup) -> RSBCM:
        return cls(cfg, setup.host)

    def _evictable(self, seg: Segment) -> bool:
        return not (self.cfg.pin_prompt and seg.is_prompt)

    def on_batch(self, batch: Batch) -> None:
        if batch.broadcast == "copy":
            # a backstop: `engine.check_broadcast` refuses this when the session is built
            raise ValueError("RSBCM needs broadcast='cascade' (block masses are kept per shared segment)")
        ancestors = {a.id: a for r in batch.rows for a in r.seg.kv_ancestors()}
        tracked = {s.key for s in batch.ctx.shared if self._evictable(ancestors[s.key])}
        self.tracking = self.tracking or self._near_capacity(batch)
        # only when something here can be evicted, and once capacity comes near: the tap costs
        # small products at every layer of every step (0.99x the plain step over pages read in
        # place, 0.85x over tails, where it scores every key itself: the embedded model on a CPU)
        if not self.tracking or not (tracked or any(self._evictable(r.seg) for r in batch.rows)):
            return
        self.host.stats.bump("rsbcm_tracked_batches")
        ctx = batch.ctx
        own = torch.zeros(ctx.batch, ctx.capacity, device=ctx.lens.device)
        for i, r in enumerate(batch.rows):
            mass = self.mass.get(r.seg.id)
            if r.kv_len and mass is not None:
                own[i, r.tail_start : r.tail_start + r.kv_len] = mass
        tap = MassTap(own, tracked)
        ctx.taps.append(tap)
        self._taps[id(batch)] = tap

    def _near_capacity(self, batch: Batch) -> bool:
        """Whether the run's evictable blocks, with all this batch's rows may come to (what they
        hold, their pending tokens and `Batch.caps`), reach `track_from` of the capacity: mass is
        tracked from that batch on. Below it no eviction can follow this batch, and RSBCM's paper
        calls it dormant there; a block's mass is the attention it got since tracking began (a
        block nothing read since weighs 0: evidence, over that window, that nothing attends to
        it)."""
        cfg, per = self.cfg, self.cfg.block_tokens
        rows = {r.seg.id for r in batch.rows}
        held = sum(
            -(-seg.kv_tokens // per)
            for seg in self.host.tree.segments(self.host.ledger)
            if seg.kv_tokens and seg.id not in rows and self._evictable(seg)
        )
        caps = [*batch.caps, *[0] * (len(batch.rows) - len(batch.caps))]  # (a prefill's: none)
        growth = sum(
            -(-(r.kv_len + len(fed) + cap) // per)
            for r, fed, cap in zip(batch.rows, batch.feeds, caps, strict=True)
            if self._evictable(r.seg)
        )
        return held + growth >= cfg.track_from * cfg.capacity_blocks

    def on_capture(self, batch: Batch, pos: int, row: Row) -> None:
        tap = self._taps.get(id(batch))
        if tap is not None:
            self.mass[row.seg.id] = tap.own[pos, row.tail_start : row.tail_start + row.kv_len].clone()

    def after_batch(self, batch: Batch, decoded: bool) -> None:
        if decoded:
            for r in batch.rows:
                if r.top1:
                    self.score[r.seg.id] = sum(r.top1) / len(r.top1)
        tap = self._taps.pop(id(batch), None)
        if tap is None:
            return
        for key, mass in tap.segments.items():  # fold this batch's mass into the running totals
            seg = self.host.tree.find(key)
            if seg is not None and seg.kv_tokens == mass.shape[0]:
                self.mass[key] = mass if key not in self.mass else self.mass[key] + mass
        # capacity is checked once per decode, as in RKSC's solve: when every row of the batch has
        # ended, not when the batch is cut for a newcomer or a row rejoining after a preemption
        # (evicting there would make a row's KV depend on when others joined or left)
        if decoded and all(r.finish is not None for r in batch.rows):
            self._enforce_capacity()

    def _enforce_capacity(self) -> None:
        """Evict the lowest-ω blocks above capacity, freeing their tensors (Alg. 4)."""
        cfg, tree = self.cfg, self.host.tree
        table = []
        for seg in tree.segments(self.host.ledger):
            depth = len(seg.kv_ancestors())
            if seg.kv_tokens and self._evictable(seg):
                mass, score = self.mass.get(seg.id), self.score.get(seg.id, 1.0)
                table += blocks_of(seg.id, mass, seg.kv_tokens, cfg.block_tokens, score, depth)
        evictions = plan_evictions(table, cfg.capacity_blocks)
        by_segment: dict[int, list[Block]] = {}
        for block in evictions:
            by_segment.setdefault(block.segment, []).append(block)
        for key, blocks in by_segment.items():
            found = tree.find(key)
            assert found is not None
            seg = found
            keep = keep_mask(seg.kv_tokens, blocks, self.host.device)
            self.host.kv.keep(seg, keep.nonzero().flatten())
            if key in self.mass:
                self.mass[key] = self.mass[key][keep]
            self.host.stats.bump("rsbcm_evicted_tokens", int((~keep).sum()))
        self.host.stats.bump("rsbcm_evictions", len(evictions))

    def on_split(self, head: Segment, rest: Segment, k: int) -> None:
        mass = self.mass.get(rest.id)
        if mass is not None:
            self.mass[head.id], self.mass[rest.id] = mass[:k].clone(), mass[k:].clone()

    def on_release(self, seg: Segment) -> None:
        self.mass.pop(seg.id, None)
        self.score.pop(seg.id, None)

    def on_scores(self, segs: Sequence[Segment], scores: Sequence[float]) -> None:
        for seg, score in zip(segs, scores, strict=True):
            self.score[seg.id] = score
