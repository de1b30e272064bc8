"""What joins a running decode at a step boundary, within the KV budget: preempted rows coming
back, long prompts prefilled one chunk per step, and the scheduler's new requests.

Why here and not in the scheduler: the scheduler (`backends/scheduler.py`) is generic over any
`Backend` and decides *which* requests may join (first come, first served, equal decoding
parameters, a row bound and the worst-case KV the backend says they need). Only the local backend
can decide *how* they join without stalling the batch, so the decode loop (`Computation.run`) asks this
object at each step boundary (it is the call's `decode.Boundary`):

- **Chunked prefill.** A newcomer whose prompt has more than `chunk` tokens to compute does not
  join at once (its whole prefill would run before the next decode step, stalling every row of the
  batch for as long). It waits in `prefilling`, and each step boundary computes one chunk of its
  prompt; it joins once at most one chunk is left. The running rows so wait at most one chunk's
  forward per step (measured on a 2-core CPU with an 8k-token prompt amid 16 clients: 512-token
  chunks left the short requests' p99 at 6.5x their p99 without the long prompt, 128-token chunks
  at 2.3x, for a long request 23 % slower than whole). When nothing decodes, chunks run back to
  back, and newcomers are asked for between them, so a short request that arrives meanwhile starts
  decoding after at most one chunk (larger chunks there left waves of short requests that all
  ended together waiting for one: p99 9.2x); those chunks are sized by that wait
  (`PrefillPace.idle_size`: about a quarter of a second, from `chunk` to `ALONE_CHUNK` tokens).
  Without a scheduler nobody can arrive, and a prompt is computed in `ALONE_CHUNK`s.
- **Preemption.** When the engine's KV would exceed its budget at the next step, the prefix cache
  yields first (`KVPool.yield_cache`), then the KV of the call's ended rows (`_free_ended`: freed,
  or swapped out under the swap policy below); if
  that is not enough, the youngest rows (the last to join the call) leave the batch at once
  (`preempt`) and wait in `preempted` with their tokens so far.
  They come back, before any newcomer, once their KV and growth fit again, so decoding resumes where
  it stopped. The oldest row is never preempted (progress: a step it alone makes over the budget is
  counted in `KVPool.overruns` and in the run's `kv_overruns`). A preempted row's KV is either

  - *recomputed* (`RECOMPUTE`): dropped, its tokens made pending and computed again like a prompt
    when it rejoins (its request's prompt with it, once no row reads it: `KVTree.drop_row`). The
    policy of runs whose KV is a function of the tokens (no acceleration, or only ones that leave
    KV exact: `Acceleration.kv_from_tokens`): nothing is copied, and a recompute runs at prefill
    speed, many tokens per forward; or
  - *swapped* (`SWAP`): copied into its node as at any batch boundary, then moved out of the
    budget (`KVSwap`: to host memory from an accelerator, to a file from a CPU) and moved back
    when it rejoins. The policy of runs with an acceleration that changes KV (SkipKV's evictions,
    River's exited tokens written by quantized layers, ReasonCache's block references, RSBCM's
    evicted blocks): their KV is not what a recompute from the tokens gives, so a recompute would
    change what the row attends to, and so its tokens, and would leave their per-row state (the
    slots SkipKV's tracker holds, the blocks a ReasonCache branch reads, RSBCM's per-slot attention
    mass) describing KV the row no longer has. A swap keeps both exactly: the resumed row continues
    as it would have without the preemption, at the cost of copying its KV twice.

A call without a scheduler (a strategy run's step) had nobody price its rows before it started: the
rows its budget does not hold wait in `preempted` from the start (`start`) and join as rows end.

Rows are numbered (`DecodeRun.join`) when they enter the call, not when they enter the batch, so
a request's rows keep the indices the scheduler expects whatever they wait for.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Literal, Protocol

import torch

from branchwise.backends.base import Admit, Admitted, KVStats, NodeId
from branchwise.backends.hf.batch import Batch, Row
from branchwise.backends.hf.decode import DecodeRun
from branchwise.backends.hf.hooks import Acceleration
from branchwise.backends.hf.kv_swap import KVSwap
from branchwise.backends.hf.pace import PrefillPace
from branchwise.backends.hf.pool import KVPool
from branchwise.backends.hf.segment import Segment
from branchwise.backends.hf.tree import KVTree

__all__ = ["RECOMPUTE", "SWAP", "Intake", "IntakeHost", "Policy", "pending_work", "policy_of"]

Policy = Literal["recompute", "swap"]
RECOMPUTE: Policy = "recompute"
SWAP: Policy = "swap"


def policy_of(plugins: Sequence[Acceleration]) -> Policy:
    """How a run's preempted rows keep their KV (see the module docstring): recompute where every
    acceleration leaves KV that the tokens determine, else swap."""
    return RECOMPUTE if all(p.kv_from_tokens for p in plugins) else SWAP


class IntakeHost(Protocol):
    """What an `Intake` asks of the run that decodes (`compute.Computation`): its tree and
    statistics, its device, a row's worst-case KV, and one bounded prefill of a waiting prompt,
    computed now (`compute_part`) or carried by the next decode step (`carry_part`: False where
    steps cannot carry one; `flush_part` computes a carried chunk no step took).

    Why a protocol: the computation builds and drives the intake, so the intake must not know the
    computation's class; naming only these keeps the dependency one way (compute -> intake)."""

    tree: KVTree
    stats: KVStats
    device: torch.device

    def row_kv_tokens(self, max_tokens: int) -> int: ...

    def compute_part(self, seg: Segment, limit: int) -> None: ...

    def carry_part(self, seg: Segment, limit: int) -> bool: ...

    def flush_part(self) -> None: ...


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
        policy: Policy = RECOMPUTE,
        pace: PrefillPace | None = None,
    ) -> None:
        self.host = host
        self.run = run
        self.outer = admit
        self.pool = pool
        self.chunk = chunk
        """The most prompt tokens computed per step while other rows decode (0: chunked prefill
        off); `pace` sizes each chunk within it by time."""
        self.pace = pace or PrefillPace()
        self.pace.idle()
        self.policy = policy
        """How preempted rows keep their KV (see the module docstring)."""
        self.swap = KVSwap(host.device)
        self.capture: Callable[[int, Row], None] | None = None
        """Copy a row of `batch` back into its node, with the plug-ins' `on_capture` (set with `batch`)."""
        self.prefilling: list[Segment] = []
        self.preempted: list[Segment] = []
        """Rows out of the batch until their KV fits: preempted, or held back at the start of a
        call without a scheduler (`start`)."""
        self._just: set[int] = set()
        """Rows preempted at this step boundary (they rejoin from the next one on)."""
        self.ready: list[Segment] = []
        self._carried = 0
        """Prompt tokens handed to the next decode step (`_prefill_step`), until it computed them."""
        self._size = chunk
        """The size of the last chunk: rows with at most this much left to compute are ready."""
        self._waiting_reserved = 0
        """Bytes of `pool.reserved` the waiting rows' own joining stands for (`_reserve`)."""
        self._running_reserved = 0
        """Bytes of `pool.reserved` the decoding rows may still need (`pressure`; 0 while none decode)."""
        self.batch: Batch | None = None
        """The batch being decoded (set by `Computation.run` before each `decode`)."""
        self._joining: set[int] = set()
        """Rows handed to the decode at the last boundary (`joins`)."""

    # ------------------------------------------------------------------ the decode loop's calls
    def start(self, segs: Sequence[Segment]) -> list[Segment]:
        """The call's first rows: those with a long prompt wait in `prefilling` when newcomers may
        join meanwhile (without a scheduler there is nobody to let through: prompts are computed
        at once, still chunk by chunk to bound the attention's memory).

        Without a scheduler nobody priced the call's rows before it started: under a budget, the
        rows that do not fit it (beyond the first, which always starts) wait in `preempted` as if
        preempted before their first step, and join as the rows ahead of them end (`_rejoin`). All
        of them at once used to fail (a beam search's 16 dense rows asked for 3.4x the budget in
        one batch's tails) or overshoot the budget and preempt a third of its rows a step later."""
        if self.outer is None:
            segs = self._fitting(segs)
        self._joining = {s.id for s in segs}
        if not self.chunk or self.outer is None:
            return list(segs)
        now = [s for s in segs if pending_work(s) <= self.chunk]
        self.prefilling += [s for s in segs if pending_work(s) > self.chunk]
        return now

    def _fitting(self, segs: Sequence[Segment]) -> list[Segment]:
        """The first of `segs` (at least one) whose worst-case KV fits the budget's room now; the
        others wait in `preempted` (nothing to drop: they hold no KV of this call yet)."""
        room = self.pool.room()
        if room is None or len(segs) < 2:
            return list(segs)
        counted: set[int] = set()
        now: list[Segment] = []
        for seg in segs:
            cost = self._join_cost(seg, counted)
            if now and cost > room:
                self.preempted.append(seg)
                self.run.hold(seg)
                continue
            now.append(seg)
            room -= cost
        if self.preempted:
            self.host.stats.bump("deferred_rows", len(self.preempted))
        return now

    def hold_back(self, segs: Sequence[Segment]) -> list[Segment]:
        """The batch of `segs` did not fit the budget (pages: rows are admitted by what they hold,
        `KVPool.row_slots`, and a batch re-assembled around newcomers may still come out larger
        than priced, e.g. where the prefix cache it counted as free is read by live rows): the
        youngest row new to the call waits in `preempted`, as rows that do not fit at the start do
        (`_fitting`), and joins once there is room (`_rejoin`). Returns the rows that stay."""
        joining = [s for s in segs[1:] if s.id in self._joining]
        assert joining, "only a batch that rows join is refused (`joins`)"
        victim = max(joining, key=lambda s: self.run.rows[s.id])
        self.preempted.append(victim)
        if victim.id not in self.run.carried:  # a preempted row rejoining keeps its carried row
            self.run.hold(victim)
        self._joining.discard(victim.id)
        self.host.stats.bump("deferred_rows")
        return [s for s in segs if s is not victim]

    def joins(self, segs: Sequence[Segment]) -> bool:
        """Whether rows join the batch of `segs` at this boundary, besides its first (the rows that
        `hold_back` may let wait: newcomers, and preempted rows coming back)."""
        return any(s.id in self._joining for s in segs[1:])

    def _join_cost(self, seg: Segment, counted: set[int]) -> int:
        """Bytes a row may still add to what is held once it joins the batch, priced as admission
        prices a row (`KVPool.row_slots`: its own KV as it will be, and its free slots): its
        ancestors' pending tokens (once for rows that share them: `counted` collects their ids), its
        own KV computed or swapped back in, its growth to its cap; less what its node holds now."""
        ancestors = 0
        for anc in seg.kv_ancestors():  # to compute, or to swap back in
            coming = len(anc.pending) + self.swap.tokens.get(anc.id, 0)
            if coming and anc.id not in counted:
                counted.add(anc.id)
                ancestors += coming
        cap = self._cap(seg)
        now = seg.kv_tokens + self.swap.tokens.get(seg.id, 0) + len(seg.pending) + self._copies(seg, 0)
        return (ancestors + self.pool.row_slots(now, cap, cap) - seg.kv_tokens) * self.pool.token_bytes

    def waiting(self) -> bool:
        return bool(self.prefilling or self.preempted or self.ready)

    def next_ready(self) -> list[Segment]:
        """Rows to decode when the batch has emptied (or never started): preempted rows first,
        else prompts prefilled chunk by chunk with newcomers let in between; [] when none wait."""
        self._running_reserved = 0  # nothing decodes now
        self._let_go_stopped()
        if self.preempted:
            return self._rejoin(force=True)
        self._carried_done()
        while self.prefilling and not self.ready:  # nothing decodes: chunks sized by the wait they impose
            started = time.perf_counter()
            done, _ = self._prefill_step(self.pace.idle_size(self.chunk, alone_chunk(self.chunk)))
            self.pace.timed_chunk(done, started, self.host.device)
            if self.outer is not None:  # no decode step tells the listener's cancellations: ask
                self.run.poll()
                self._let_go_stopped()
                if not self.ready:
                    self._ask(0)
        self.pace.idle()  # the first decode step is timed from neither an old step nor the last chunk
        return self._pop_ready()

    def preempt(self, pos: int, row: Row) -> None:
        """`Boundary.preempt`: row `row` (at batch position `pos`) leaves the batch now. Its KV
        leaves the budget at once, before the rows that stay take their next step: swapped out
        (copied into its node first, `capture`), or dropped and its tokens made pending. It waits
        in `preempted`, and may rejoin from the next step boundary on (not at this one: the room
        it left is what the rows that stay need now)."""
        seg = row.seg
        if self.policy == SWAP:
            assert self.capture is not None, "Intake.capture is set with its batch"
            self.capture(pos, row)
            self._swap_out(seg, self.host.tree.readers())
            self.host.stats.bump("swapped_rows")
        elif prompts := self.host.tree.drop_row(seg):  # and its prompt, once no row reads it
            self.host.stats.bump("preempted_prompts", prompts)
        seg.last_logits = None
        self.preempted.append(seg)
        self._just.add(seg.id)
        self.pool.preemptions += 1
        self.host.stats.bump("preempted_rows")

    def finish(self) -> None:
        """The call ended: nothing is reserved any more, and the batch's tails are let go at once
        (the run and this object refer to each other, so they would otherwise wait for the cyclic
        garbage collector, and the pool would go on counting the tails). A call cut short (an error,
        a cancelled request) may leave rows swapped out: their KV goes back into their nodes, so
        each node is whole and its bytes are counted until it is released."""
        self._forget_released()
        for seg in list(self.swap.segs.values()):
            self.swap.back(seg, self.host.tree)
        self.swap.close()
        self.pool.reserved = 0
        self.batch = self.capture = None
        self.run.boundary = None

    # ------------------------------------------------------------------ decode-loop callbacks
    def pressure(self, alive: list[Row]) -> list[Row]:
        """`Boundary.pressure`: record what the call may still need (`pool.reserved`, what admission
        may not promise to newcomers), and name the rows to preempt if the next step would not fit
        the budget.

        Running rows may still need what admission priced them at (`KVPool.job_cost`) less what
        they hold now: each row's own KV grown to its cap, its copied prompt and free slots.
        Reserving growth alone let a newcomer's admission double the running rows' KV unpriced
        (the dense arm of `benchmarks/kv_budget.py` was preempted 80 times a run). Waiting rows
        need what they will cost when they join (`_join_cost`): newcomers may not take it, but
        they themselves may (`_rejoin` adds it back to the room). Past the budget, the call's
        ended rows' KV goes before any running row (`_free_ended`)."""
        self._just.clear()
        self._forget_released()
        pool, tb = self.pool, self.pool.token_bytes
        worst = held = 0
        for r in alive:
            cap = self._cap(r.seg)
            now = r.kv_len + self._copies(r.seg, r.tail_start)
            worst += pool.row_slots(now, max(cap - min(len(r.out), cap), 0), cap)
            held += r.seg.kv_tokens
        if alive and self.batch is not None:
            held += self.batch.ctx.kv.slots_held(len(alive))
        self._running_reserved = max(worst - held, 0) * tb
        self._reserve()
        if pool.budget is None:
            return []
        need = len(alive) * tb + self._growth(alive)
        if pool.over(need) <= 0:
            return []
        pool.yield_cache(need)
        over = pool.over(need)
        if over > 0 and self.batch is not None and self.batch.ctx.kv.shrink():  # free pages go first
            need = len(alive) * tb + self._growth(alive)
            over = pool.over(need)
        if over > 0:  # ended rows' KV goes before any running row
            over -= self._free_ended(over)
        if over <= 0:
            return []
        if len(alive) < 2:  # the oldest row alone: it goes on over the budget, and the run says so
            pool.overrun(over, "the oldest decoding row alone")
            self.host.stats.bump("kv_overruns")
            return []
        rows = self.run.rows
        youngest = sorted(alive, key=lambda r: rows[r.seg.id], reverse=True)[:-1]
        victims = []
        capacity = self._tail_capacity(alive)
        tree = self.host.tree
        readers, leaving, swapped = tree.readers(), set[int](), set(self.swap.segs)
        for r in youngest:  # a request's rows are admitted together: its prompt goes with the last
            victims.append(r)
            over -= r.seg.kv_bytes + self._freed(r, capacity) * tb
            if self.policy == RECOMPUTE:
                over -= sum(a.kv_bytes for a in tree.unread_ancestors(r.seg, readers, leaving))
            else:
                over -= sum(a.kv_bytes for a in tree.idle_ancestors(r.seg, readers, swapped))
            if over <= 0:
                break
        return victims

    def _swap_out(self, seg: Segment, readers: dict[int, list[Segment]]) -> int:
        """Swap `seg`'s KV out of the budget, with the ancestors no row outside the swap reads then
        (`KVTree.idle_ancestors` over the tree's `readers`, which a swap leaves as they are: a
        request's prompt goes with its last row); the bytes moved."""
        tree = self.host.tree
        nbytes = self.swap.out(seg, tree)
        for anc in tree.idle_ancestors(seg, readers, set(self.swap.segs)):
            nbytes += self.swap.out(anc, tree)
            self.host.stats.bump("swapped_prompts")
        self.host.stats.bump("swapped_bytes", nbytes)
        return nbytes

    def _free_ended(self, over: int) -> int:
        """Bytes taken out of the budget, up to `over`, from the call's ended rows' KV: freed, to be
        computed again if ever extended (`RECOMPUTE`, `KVTree.free_idle`), or swapped out with the
        prompts no running row reads then (`SWAP`: such KV is not what a recompute gives).

        Why swapped too: under the swap policy an ended row's KV stayed in memory while its
        request's other rows decoded, and its request's prompt with it; at a budget that binds the
        last row left decoding ran past it (187-260 steps at 1.076x the budget in
        `benchmarks/kv_budget.py`'s SkipKV, ReasonCache and RSBCM arms). A swapped ended row comes
        back when the call ends, unless its node was released first (`_forget_released`)."""
        ended = [sid for sid, index in self.run.rows.items() if index in self.run.results]
        tree = self.host.tree
        if self.policy == RECOMPUTE:
            if freed := tree.free_idle(ended, over):  # a run that freed none says nothing
                self.host.stats.bump("freed_ended_kv_nodes", len(freed))
            return sum(freed)
        moved = 0
        readers = tree.readers()
        for sid in ended:
            if moved >= over:
                break
            seg = tree.find(sid)  # a swapped node holds no KV: not `idle`
            if seg is None or not tree.idle(seg, readers, set(self.swap.segs)):
                continue
            if nbytes := self._swap_out(seg, readers):
                moved += nbytes
                self.host.stats.bump("swapped_ended_rows")
        return moved

    def _forget_released(self) -> None:
        """Drop the swapped KV of nodes released since they were swapped out (a server's request
        releases its nodes once its last row ends): nothing will read it, and its file goes now."""
        tree = self.host.tree
        for sid in [sid for sid in self.swap.segs if sid not in tree]:
            self.swap.forget(sid)

    def _reserve(self) -> None:
        """Set `pool.reserved` to what the decoding rows and the rows waiting here may still need.

        Why before every question to the scheduler, not only at a step boundary: the rows taken at
        one question wait here (prefilling) and hold nothing yet; priced only at the next boundary,
        the questions between prefill chunks of an idle batch each saw the room they had left as
        free, and a burst of long prompts was taken many times over the budget."""
        counted: set[int] = set()
        self._waiting_reserved = sum(
            self._join_cost(s, counted) for s in (*self.prefilling, *self.preempted, *self.ready)
        )
        self.pool.reserved = self._running_reserved + self._waiting_reserved

    def _ask(self, alive: int) -> None:
        """Take the scheduler's newcomers that fit beside `alive` decoding rows and the rows waiting
        here, priced as they stand now (`_reserve`)."""
        assert self.outer is not None
        self._reserve()
        self._take(self.outer(alive + self._held()))
        self._reserve()

    def admit(self, alive: int) -> list[NodeId]:
        """`Boundary.admit`: one chunk of prefill, then rows that may join now (preempted rows
        first; the scheduler's newcomers only once none of those wait)."""
        self._let_go_stopped()
        self.pace.boundary()
        self._carried_done()
        if self.prefilling:  # sized so the rows decoding wait about a share of their own step
            started = time.perf_counter()
            done, carried = self._prefill_step(self.pace.size(self.chunk), carry=True)
            if carried:
                self.pace.carries(done)
            else:
                self.pace.timed_chunk(done, started, self.host.device)
        if self.preempted:
            self.ready += self._rejoin(force=False)
        elif self.outer is not None:
            self._ask(alive)
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

    def _prefill_step(self, size: int, carry: bool = False) -> tuple[int, bool]:
        """The next `size` tokens of the first waiting prompt: with `carry`, handed to the next
        decode step, which computes them in its own forward (the rows they leave ready are sorted
        at the next boundary, `_carried_done`), else computed now. Returns how many tokens, and
        whether the step carries them."""
        seg = self.prefilling[0]
        top = next(s for s in [*reversed(seg.kv_ancestors()), seg] if s.pending)
        done = min(size, len(top.pending))
        self._size = size
        if carry and self.host.carry_part(top, size):
            self._carried = done
            return done, True
        self.host.compute_part(top, size)
        self._sort_prefilling()
        return done, False

    def _carried_done(self) -> None:
        """The chunk handed to the last step is computed (a step that did not come computes it now):
        the rows it left with at most one chunk to go are ready."""
        self.host.flush_part()
        if self._carried:
            self._carried = 0
            self._sort_prefilling()

    def _sort_prefilling(self) -> None:
        """Rows left with at most one chunk (`_size` tokens) to compute are ready; the rest wait."""
        still: list[Segment] = []
        for s in self.prefilling:
            (still if pending_work(s) > self._size else self.ready).append(s)
        self.prefilling = still

    def _let_go_stopped(self) -> None:
        """Rows stopped while they waited (a cancelled request) do not come back and compute no
        more: preempted ones (`DecodeRun.stopped`; a swapped one's KV returns into its node,
        released with its request), and rows prefilling or ready to join, which end with no token
        (`DecodeRun.dropped`: the listener releases their nodes at once, `Router.admit`)."""
        run = self.run
        for seg in [s for s in self.preempted if s.id in run.stopped]:
            self._swap_back(seg)
            self.preempted.remove(seg)
        if not run.dropped:
            return
        for waiting in (self.prefilling, self.ready):
            for seg in [s for s in waiting if run.rows[s.id] in run.dropped]:
                waiting.remove(seg)
                run.end_waiting(seg)
                self.host.stats.bump("cancelled_waiting_rows")

    def _rejoin(self, force: bool) -> list[Segment]:
        """Preempted rows whose recompute and growth fit the budget now, oldest first (with
        `force`, at least one: the batch is empty, so it must make progress)."""
        rows = self.run.rows
        self.preempted.sort(key=lambda s: rows[s.id])
        back: list[Segment] = []
        room = self.pool.room()
        if room is not None:  # `reserved` holds the waiting rows' own needs: not theirs to compete with
            room += self._waiting_reserved
        counted: set[int] = set()
        for seg in list(self.preempted):
            if seg.id in self._just and not force:
                continue
            cost = self._join_cost(seg, counted)
            if room is not None and cost > room:  # ended rows' KV first
                room += self._free_ended(cost - room)
            if room is not None and cost > room and not (force and not back):
                break
            self._swap_back(seg)
            back.append(seg)
            self.preempted.remove(seg)
            if room is not None:
                room -= cost
        return back

    def _swap_back(self, seg: Segment) -> None:
        """A swapped row's KV back into its node, its swapped ancestors' first (no-ops for any that
        were not swapped)."""
        for node in [*reversed(seg.kv_ancestors()), seg]:
            self.swap.back(node, self.host.tree)

    def _pop_ready(self) -> list[Segment]:
        out, self.ready = self.ready, []
        self._joining = {s.id for s in out}
        return out

    def _copies(self, seg: Segment, copied: int) -> int:
        """Ancestor tokens the row of `seg` holds in its own KV: `copied` now, and under pages as
        many as a batch re-assembled with many prompts may copy into it (`Batch.assemble`: the
        ancestors whose path holds at most `copy_tokens`). Under tails the worst case's free slots
        cover that copy; under pages, priced by what rows hold, it must be priced itself (a burst
        of short prompts once asked 1.2x the budget for one batch)."""
        if self.pool.page is None:
            return copied
        copyable = sum(a.kv_tokens for a in seg.kv_ancestors() if a.position <= self.pool.copy_tokens)
        return max(copied, copyable)

    def _freed(self, row: Row, capacity: int) -> int:
        """Slots of the batch's own KV a preempted `row` gives back: a tail's `capacity` (every row
        holds as many), or the pages its own tokens fill."""
        return capacity if self.pool.page is None else self.pool.in_pages(row.kv_len + row.tail_start)

    def _growth(self, alive: list[Row]) -> int:
        """Bytes the batch's own KV storage grows by at the next step (tails: when a row reaches
        their end, for every row at once, ended ones not yet compacted too; pages: when the free
        pages do not cover the rows that start a page: `BatchContext.make_room`). Under a budget,
        the storage is told first how far it may grow (`OwnKV.limit`): its amortised growth stops
        there, so growing never preempts a row for room no row needs yet."""
        ctx = None if self.batch is None else self.batch.ctx
        if ctx is None or not alive:
            return 0
        pool = self.pool
        if pool.budget is not None:
            ctx.kv.limit = pool.budget - pool.used() + ctx.kv.nbytes
        lens = ctx.lens.tolist()
        needed = max(lens) + 1
        capacity = ctx.next_capacity(needed) if needed > ctx.capacity else ctx.capacity
        return ctx.kv.growth(lens, 1, capacity)

    @staticmethod
    def _tail_capacity(alive: list[Row]) -> int:
        """Slots each row holds in the batch's tail buffers (freed with its row)."""
        return max((r.kv_len + r.tail_start for r in alive), default=0)
