"""What joins a running decode at a step boundary, within the KV budget: preempted rows coming
back, long prompts prefilled one chunk per step, and the scheduler's new requests.

Why here and not in the scheduler: the scheduler (`backends/scheduler.py`) is generic over any
`Backend` and decides *which* requests may join (first come, first served, equal decoding
parameters, a row bound and the worst-case KV the backend says they need). Only the local backend
can decide *how* they join without stalling the batch, so the decode loop (`Computation.run`) asks this
object at each step boundary (`DecodeRun.admit` and `DecodeRun.pressure`):

- **Chunked prefill.** A newcomer whose prompt has more than `chunk` tokens to compute does not
  join at once (its whole prefill would run before the next decode step, stalling every row of the
  batch for as long). It waits in `prefilling`, and each step boundary computes one chunk of its
  prompt; it joins once at most one chunk is left. The running rows so wait at most one chunk's
  forward per step (measured on a 2-core CPU with an 8k-token prompt amid 16 clients: 512-token
  chunks left the short requests' p99 at 6.5x their p99 without the long prompt, 128-token chunks
  at 2.3x, for a long request 23 % slower than whole). When nothing decodes, chunks run back to
  back, and newcomers are asked for between them, so a short request that arrives meanwhile starts
  decoding after at most one chunk (larger chunks there left waves of short requests that all
  ended together waiting for one: p99 9.2x). Without a scheduler nobody can arrive, and a prompt
  is computed in `ALONE_CHUNK`s.
- **Preemption.** When the engine's KV would exceed its budget at the next step, the prefix cache
  yields first (`KVPool.yield_cache`); if that is not enough, the youngest rows (the last to join
  the call) leave the batch, their KV is dropped, and they wait in `preempted` with their tokens
  so far. They come back, before any newcomer, once their recompute and growth fit again: their
  tokens become pending and are recomputed like a prompt, so decoding resumes where it stopped.
  The oldest row is never preempted (progress); a run with accelerations is never preempted (their
  per-row state follows the KV), and a step over the budget is counted in `KVPool.overruns`.

Rows are numbered (`DecodeRun.join`) when they enter the call, not when they enter the batch, so
a request's rows keep the indices the scheduler expects whatever they wait for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from branchwise.backends.base import Admit, Admitted, KVStats, NodeId
from branchwise.backends.hf.batch import Batch, Row
from branchwise.backends.hf.decode import DecodeRun
from branchwise.backends.hf.pool import KVPool
from branchwise.backends.hf.segment import Segment
from branchwise.backends.hf.tree import KVTree

__all__ = ["Intake", "IntakeHost", "pending_work"]


class IntakeHost(Protocol):
    """What an `Intake` asks of the run that decodes (`compute.Computation`): its tree and
    statistics, a row's worst-case KV, and one bounded prefill of a waiting prompt.

    Why a protocol: the computation builds and drives the intake, so the intake must not know the
    computation's class; naming only these four keeps the dependency one way (compute -> intake)."""

    tree: KVTree
    stats: KVStats

    def row_kv_tokens(self, max_tokens: int) -> int: ...

    def compute_part(self, seg: Segment, limit: int) -> None: ...


ALONE_CHUNK = 512
"""Prompt tokens per forward where no newcomer can arrive (an `extend` without a scheduler): a
forward this long runs near a whole prompt's throughput and bounds the attention's memory."""


def alone_chunk(chunk: int) -> int:
    """Tokens per prefill forward when no other row decodes (0: whole prompts)."""
    return max(chunk, ALONE_CHUNK) if chunk else 0


def pending_work(seg: Segment) -> int:
    """Tokens still to compute before `seg` can decode: its own pending and its ancestors'."""
    return len(seg.pending) + sum(len(a.pending) for a in seg.kv_ancestors())


class Intake:
    """The step-boundary policy of one `extend` call (see the module docstring)."""

    def __init__(
        self,
        host: IntakeHost,
        run: DecodeRun,
        admit: Admit | None,
        pool: KVPool,
        chunk: int,
        preemptible: bool,
    ) -> None:
        self.host = host
        self.run = run
        self.outer = admit
        self.pool = pool
        self.chunk = chunk
        """Prompt tokens computed per step while other rows decode (0: chunked prefill off)."""
        self.preemptible = preemptible
        self.prefilling: list[Segment] = []
        self.preempted: list[Segment] = []
        self.ready: list[Segment] = []
        self.batch: Batch | None = None
        """The batch being decoded (set by `Computation.run` before each `decode`)."""

    # ------------------------------------------------------------------ the decode loop's calls
    def start(self, segs: Sequence[Segment]) -> list[Segment]:
        """The call's first rows: those with a long prompt wait in `prefilling` when newcomers may
        join meanwhile (without a scheduler there is nobody to let through: prompts are computed
        at once, still chunk by chunk to bound the attention's memory)."""
        if not self.chunk or self.outer is None:
            return list(segs)
        now = [s for s in segs if pending_work(s) <= self.chunk]
        self.prefilling += [s for s in segs if pending_work(s) > self.chunk]
        return now

    def waiting(self) -> bool:
        return bool(self.prefilling or self.preempted or self.ready)

    def next_ready(self) -> list[Segment]:
        """Rows to decode when the batch has emptied (or never started): preempted rows first,
        else prompts prefilled chunk by chunk with newcomers let in between; [] when none wait."""
        if self.preempted:
            return self._rejoin(force=True)
        while self.prefilling and not self.ready:
            self._prefill_step(self.chunk)
            if self.outer is not None and not self.ready:
                self._take(self.outer(self._held()))
        return self._pop_ready()

    def dropped(self, rows: Sequence[Row]) -> None:
        """Rows the decode loop preempted: free their KV; their tokens become pending."""
        for r in rows:
            seg = r.seg
            self.host.tree.set_kv(seg, None, None)
            seg.n_computed = 0
            seg.last_logits = None
            self.preempted.append(seg)
            self.pool.preemptions += 1
        if rows:
            self.host.stats.bump("preempted_rows", len(rows))

    def finish(self) -> None:
        """The call ended: nothing is reserved any more, and the batch's tails are let go at once
        (the run and this object refer to each other, so they would otherwise wait for the cyclic
        garbage collector, and the pool would go on counting the tails)."""
        self.pool.reserved = 0
        self.batch = None
        self.run.admit = self.run.pressure = None

    # ------------------------------------------------------------------ decode-loop callbacks
    def pressure(self, alive: list[Row]) -> list[Row]:
        """`DecodeRun.pressure`: record what the call may still need (running rows' worst-case growth,
        waiting rows' prompts and growth), and name the rows to preempt if the next step would not
        fit the budget."""
        pool, tb = self.pool, self.pool.token_bytes
        growth = 0
        for r in alive:
            cap = self._cap(r.seg)
            growth += max(cap - min(len(r.out), cap), 0)
        waiting = sum(
            pending_work(s) + self._cap(s) for s in (*self.prefilling, *self.preempted, *self.ready)
        )
        pool.reserved = (growth + waiting) * tb
        if pool.budget is None:
            return []
        need = len(alive) * tb + self._growth(alive)
        if pool.over(need) <= 0:
            return []
        pool.yield_cache(need)
        over = pool.over(need)
        if over <= 0:
            return []
        if not self.preemptible or len(alive) < 2:
            pool.overruns += 1
            return []
        rows = self.run.rows
        youngest = sorted(alive, key=lambda r: rows[r.seg.id], reverse=True)[:-1]
        victims = []
        capacity = self._tail_capacity(alive)
        for r in youngest:
            victims.append(r)
            over -= r.seg.kv_bytes + capacity * tb
            if over <= 0:
                break
        return victims

    def admit(self, alive: int) -> list[NodeId]:
        """`DecodeRun.admit`: one chunk of prefill, then rows that may join now (preempted rows
        first; the scheduler's newcomers only once none of those wait)."""
        if self.prefilling:
            self._prefill_step(self.chunk)
        if self.preempted:
            self.ready += self._rejoin(force=False)
        elif self.outer is not None:
            self._take(self.outer(alive + self._held()))
        return [s.id for s in self._pop_ready()]

    # ------------------------------------------------------------------ internals
    def _held(self) -> int:
        """Rows of the call that wait here (they count against the scheduler's row bound)."""
        return len(self.prefilling) + len(self.preempted) + len(self.ready)

    def _cap(self, seg: Segment) -> int:
        """Own KV tokens the row of `seg` may hold at most (its max_tokens, or an eviction's cap)."""
        return self.host.row_kv_tokens(self.run.params_of(seg).max_tokens)

    def _take(self, admitted: Sequence[Admitted]) -> None:
        """Number the scheduler's new rows (with their own parameters where given) and sort them
        into ready and prefilling."""
        if not admitted:
            return
        nodes = [a if isinstance(a, int) else a[0] for a in admitted]
        own = [None if isinstance(a, int) else a[1] for a in admitted]
        segs = [self.host.tree.growable(n) for n in nodes]
        self.run.join(segs, params=own if any(p is not None for p in own) else None)
        self.host.stats.bump("admitted_rows", len(segs))
        for seg in segs:
            long = self.chunk and pending_work(seg) > self.chunk
            (self.prefilling if long else self.ready).append(seg)

    def _prefill_step(self, size: int) -> None:
        """Compute `size` tokens of the first waiting prompt; rows left with at most a chunk are
        ready."""
        seg = self.prefilling[0]
        top = next(s for s in [*reversed(seg.kv_ancestors()), seg] if s.pending)
        self.host.compute_part(top, size)
        still: list[Segment] = []
        for s in self.prefilling:
            (still if pending_work(s) > self.chunk else self.ready).append(s)
        self.prefilling = still

    def _rejoin(self, force: bool) -> list[Segment]:
        """Preempted rows whose recompute and growth fit the budget now, oldest first (with
        `force`, at least one: the batch is empty, so it must make progress)."""
        tb = self.pool.token_bytes
        rows = self.run.rows
        self.preempted.sort(key=lambda s: rows[s.id])
        back: list[Segment] = []
        room = self.pool.room()
        for seg in list(self.preempted):
            cap = self._cap(seg)
            cost = (pending_work(seg) + self.pool.row_tokens(cap)) * tb
            if room is not None and cost > room and not (force and not back):
                break
            back.append(seg)
            self.preempted.remove(seg)
            if room is not None:
                room -= cost
        return back

    def _pop_ready(self) -> list[Segment]:
        out, self.ready = self.ready, []
        return out

    def _growth(self, alive: list[Row]) -> int:
        """Bytes the batch's tail buffers grow by at the next step (when a row reaches their end,
        they grow for every row at once: `BatchContext._grow`)."""
        ctx = None if self.batch is None else self.batch.ctx
        if ctx is None or not alive:
            return 0
        if max(r.tail_start + r.kv_len for r in alive) < ctx.capacity:
            return 0
        return ctx.batch * ctx.grow_by() * self.pool.token_bytes

    @staticmethod
    def _tail_capacity(alive: list[Row]) -> int:
        """Slots each row holds in the batch's tail buffers (freed with its row)."""
        return max((r.kv_len + r.tail_start for r in alive), default=0)
