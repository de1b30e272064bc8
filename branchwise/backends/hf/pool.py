"""The KV memory pool: one budget over every byte of KV the engine holds.

Why its own module (the split SGLang makes between its radix tree and its memory pool): the tree
(`tree.py`) knows which tokens each node holds and who reads them; the pool knows how many bytes
all of that costs and whether more fits. Every byte of KV is counted here, in one place:

- live nodes' KV (prompts shared by many branches, each branch's own tokens) and the shared blocks
  of ReasonCache: the tree's `total` ledger;
- the prefix cache across requests: the tree's `cache` ledger;
- the batch tails a decode writes into while it runs (`BatchContext` buffers, which hold each row's
  own tokens: its node lends them to the batch, `KVTree.lend`): tracked while their batch is alive.

With a budget (`HFBackend(kv_budget=...)`), three things act on it: admission (a scheduler takes a
queued request only while the worst-case KV of the running rows and of the request fits under the
budget less a small watermark: `room`), the prefix cache, which yields first when memory runs short
(`yield_cache`) and never keeps more than the budget leaves free (`cache_ceiling`, obeyed by every
trim, so a burst's released nodes cannot leave it over the budget), and preemption (`intake.py`):
when a decode still outgrows the budget, the youngest rows leave the batch and their KV leaves the
budget until they rejoin. Counted bytes stay within the budget at every step boundary and after
every release; `allocated_bytes` measures the storage they stand for, to check that they track it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import os
import re
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from branchwise.backends.base import KVBudgetExceeded
from branchwise.backends.hf.batch import BatchContext
from branchwise.backends.hf.tree import KVTree

__all__ = [
    "AUTO_FRACTION",
    "BatchRefused",
    "KVPool",
    "free_memory",
    "parse_budget",
    "return_freed_memory",
]

AUTO_FRACTION = 0.5
"""``kv_budget="auto"``: this fraction of the memory free when the budget is set (after the weights
loaded), leaving the rest to activations, the allocator's slack and the rest of the process."""

TAIL_SLACK = 128
"""Free slots per row a decode batch's tails are assembled with, at most (`Computation.assemble`)."""

log = logging.getLogger("branchwise.kv")

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12}
_UNITS |= {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


class BatchRefused(KVBudgetExceeded):
    """A batch's storage does not fit the budget where the caller can do with less
    (`KVPool.reserve_tails`'s `refusable`): tails with free slots ahead are assembled again without
    them, a paged batch that rows join lets its youngest joining row wait (`Intake.hold_back`);
    never reaches a caller."""


def _batch_bytes(ctx: BatchContext) -> int:
    """Bytes a live batch holds beside the tree: its tail buffers and its laid-out blocks."""
    pool = ctx.pool
    blocks = 0 if pool is None else sum(t.nbytes for t in (*pool.keys, *pool.values))
    return ctx.nbytes + blocks


def free_memory(device: torch.device) -> int:
    """Bytes free for new tensors on `device`: CUDA's free memory, or the OS's available memory."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def return_freed_memory(device: torch.device) -> None:
    """Hand memory freed by released KV back to the system.

    Why: the budget bounds what the KV holds, but freed CPU tensors go back to glibc's heap, which
    keeps the pages (its mmap threshold grows after the first large frees), so a process's resident
    size stays at the high-water mark of its biggest burst. `malloc_trim` returns the free pages;
    on CUDA, the caching allocator's unused blocks are released instead. Costs milliseconds for a
    heap of a few hundred MB, so schedulers call it when they go idle, not per request.
    """
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc: its allocator returns memory its own way
        return
    trim(0)


def parse_budget(value: int | float | str | None, device: torch.device) -> int | None:
    """Bytes of a ``kv_budget`` setting; None = unbounded.

    Accepted: None or "none" (unbounded), "auto" (`AUTO_FRACTION` of free memory), an int of bytes,
    a float in (0, 1] (that fraction of free memory), or a string of either ("0.5", "4GiB", "512MB").
    """
    allowed = (
        "None, 'auto', bytes (an int >= 1 or a size like '4GiB'), or a fraction of free memory in (0, 1]"
    )
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "off", "unbounded")):
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return int(AUTO_FRACTION * free_memory(device))
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)", text)
        if m is None or m.group(2) not in _UNITS:
            raise ValueError(f"kv_budget={value!r} is not one of: {allowed}")
        number = float(m.group(1))
        if m.group(2) or ("." not in m.group(1) and "e" not in m.group(1)):
            value = int(number * _UNITS[m.group(2)])
        else:
            value = number
    if isinstance(value, bool):
        raise ValueError(f"kv_budget={value!r} is not one of: {allowed}")
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"kv_budget={value!r}: a fraction must be in (0, 1]; or give {allowed}")
        return int(value * free_memory(device))
    if value < 1:
        raise ValueError(f"kv_budget={value!r} must be >= 1 byte; or give {allowed}")
    return int(value)


@dataclass
class KVPool:
    """Byte accounting of all KV and the budget it must stay under (see the module docstring).

    Not thread-safe on its own: the engine's lock serialises every use.
    """

    tree: KVTree
    token_bytes: int
    """KV bytes of one token over all layers (the unit of every estimate)."""
    budget: int | None = None
    watermark: float = 0.02
    """Fraction of the budget admission leaves free (growth the estimates miss: tails' padding)."""
    reserved: int = 0
    """Bytes the running decode's rows may still need: growth, and the copy of their KV into their
    nodes not yet made (worst case; set at each step boundary by `Intake.pressure`)."""
    copy_tokens: int = 0
    """Prompts up to this many tokens may be copied into each row's tail (`Computation.assemble`)."""
    page: int | None = None
    """How rows are priced (`row_slots`): None for rectangular tails (the worst case), else the
    pages' size in tokens (what a row holds and a page ahead; set with the KV layout)."""
    preemptions: int = 0
    overruns: int = 0
    """Decode steps that ran above the budget because nothing could yield (the oldest row alone:
    it is never preempted, so a decode always progresses)."""
    overrun_bytes: int = 0
    """The most bytes any overrun went above the budget (`overrun`: each new peak is logged)."""
    _batches: weakref.WeakValueDictionary[int, BatchContext] = field(
        default_factory=weakref.WeakValueDictionary
    )

    def __post_init__(self) -> None:
        self.tree.ceiling = self.cache_ceiling

    def overrun(self, over: int, what: str) -> None:
        """Count a step that must run `over` bytes above the budget (`what` says why); a new peak
        is logged with its size, and `stats` reports the count and the peak (a server's `/health`)."""
        self.overruns += 1
        if over > self.overrun_bytes:
            self.overrun_bytes = over
            log.warning(
                "KV over its budget: %s holds %d bytes above kv_budget=%d bytes (overrun %d)",
                what,
                over,
                self.budget,
                self.overruns,
            )

    def track(self, ctx: BatchContext) -> None:
        """Count a batch's tail buffers while the batch lives. Under a budget their storage grows
        amortised only into the room the budget leaves (`OwnKV.limit`, updated by the intake at
        every step boundary): set here, before the batch's first forward, which once grew a new
        batch's pages by half their size, 1.12x the budget, before any boundary had set it."""
        if self.budget is not None:
            ctx.kv.limit = self.budget - self.used()
        self._batches[id(ctx)] = ctx

    def end(self, ctx: BatchContext) -> None:
        """A batch ended abnormally (its call raised): free its tails now. The exception's traceback
        keeps the decode's frames, and so the batch, alive for as long as a caller keeps the error;
        its buffers must not stay allocated and counted that long."""
        ctx.kv.clear()
        if ctx.pool is not None:
            ctx.pool.keys[:], ctx.pool.values[:] = [], []
        self._batches.pop(id(ctx), None)

    def _contexts(self) -> list[BatchContext]:
        while True:
            try:  # read without the engine's lock by `stats`: a batch may come or go meanwhile
                return list(self._batches.values())
            except RuntimeError:
                continue

    @property
    def tails(self) -> int:
        """Bytes of the live batches' tail buffers and of their laid-out shared blocks (a
        ReasonCache batch copies each block it reads once into its `BlockPool`)."""
        return sum(_batch_bytes(ctx) for ctx in self._contexts())

    def used(self) -> int:
        """Every byte of KV held now: live nodes and blocks, the prefix cache, batch tails."""
        return self.tree.accounts.total.held + self.tree.accounts.cache.held + self.tails

    def room(self) -> int | None:
        """Bytes admission may still promise (None: unbounded): the budget less the watermark, what
        is held and what running rows may still need (`reserved`); the prefix cache counts as free (it
        yields)."""
        if self.budget is None:
            return None
        limit = int(self.budget * (1.0 - self.watermark))
        return limit - self.used() - self.reserved + self.tree.accounts.cache.held

    def cache_ceiling(self) -> int | None:
        """The most bytes the prefix cache may hold now (None: unbounded): what the budget leaves
        free of live KV and batch tails (`KVTree.ceiling`; every trim of the cache obeys it)."""
        if self.budget is None:
            return None
        return max(0, self.budget - self.tree.accounts.total.held - self.tails)

    def over(self, extra: int = 0) -> int:
        """Bytes above the budget once `extra` more are held (<= 0: it fits)."""
        return 0 if self.budget is None else self.used() + extra - self.budget

    def yield_cache(self, need: int) -> int:
        """Evict prefix-cache nodes (least recently used first) until `need` more bytes fit the
        budget or the cache is empty of unpinned nodes; returns how many nodes went."""
        over = self.over(need)
        if over <= 0 or not self.tree.accounts.cache.held:
            return 0
        return self.tree.trim(max(0, self.tree.accounts.cache.held - over))

    def reserve_tails(self, nbytes: int, refusable: bool = False, moving: int = 0) -> None:
        """A batch is about to allocate `nbytes` of tails: let the prefix cache yield. `moving` is
        what the batch's rows' nodes hold now and lend to the tails once copied (`KVTree.lend`):
        those bytes move, they are not added (for the copy's moment they are held twice).

        Storage that still does not fit is refused with `BatchRefused` where the caller can do with
        less (`refusable`: tails with free slots ahead, assembled again without them, or a paged
        batch that rows join, `Computation.assemble`): a fresh batch's free slots cost up to
        `TAIL_SLACK` tokens per row at once, and letting them through is how a burst of
        re-assembled batches once held twice the budget. Tails larger than the
        whole budget are refused with `KVBudgetExceeded` (an error, not the process killed for
        memory: one long row makes every row's tail as long, `job_cost`). A smaller overshoot of
        tails without slack (what the rows already hold, copied) is let through and counted
        (`overruns`): the decode's next step preempts rows to make up for it
        (`intake.Intake.pressure`), which failing every request of the batch would not."""
        need = max(nbytes - moving, 0)
        if self.budget is None or self.over(need) <= 0:
            return
        self.yield_cache(need)
        if self.over(need) <= 0:
            return
        if refusable:
            raise BatchRefused(
                f"a decode batch's storage needs {nbytes} bytes; the KV budget of "
                f"{self.budget} bytes has {self.budget - self.used()} free"
            )
        if nbytes <= self.budget:
            self.overrun(self.over(need), "a decode batch's tails (copied from its rows' own KV)")
            return
        raise KVBudgetExceeded(
            f"a decode batch needs {nbytes} bytes of tails, more than the whole kv_budget of "
            f"{self.budget} bytes; kv_budget must be at least {nbytes} bytes for it"
        )

    def row_tokens(self, max_tokens: int) -> int:
        """KV slots one decoding row is priced at besides its prompt (see `job_cost`)."""
        return self.row_slots(0, max_tokens, max_tokens)

    def row_slots(self, now: int, left: int, cap: int) -> int:
        """KV slots a decoding row is priced at when it holds `now` own tokens and may add `left`
        more (`cap` being the most it may generate).

        Rectangular tails (`page` None) price the worst case: that KV once grown (in its tail while
        it decodes: its node lends it, and in its node once captured) and its tail's free slots.
        Pages price what the row holds now and one page ahead, rounded to whole pages, as vLLM's
        admission does: a row that outgrows the budget is preempted (`intake.Intake.pressure`), and
        rows that stop early (most samples of a self-consistency request stop well before their
        `max_tokens`) never tie up the room their worst case would have."""
        if self.page is None:
            return now + left + min(cap, TAIL_SLACK)
        return self.in_pages(now + min(left, self.page))

    def in_pages(self, tokens: int) -> int:
        """The slots of the whole pages `tokens` fill (under pages: `page` set)."""
        assert self.page is not None, "only pages round to pages"
        return -(-tokens // self.page) * self.page

    def slack(self, caps: Sequence[int]) -> int:
        """Free slots per row a decode batch is assembled with ahead of its rows' growth
        (`Computation._batch`): under tails, up to `TAIL_SLACK` (their growth copies every row);
        under pages none, each row holding the pages its first step fills (within `row_slots`'s
        page ahead) and taking one more when it starts it."""
        return min(max(caps), TAIL_SLACK) if self.page is None else 0

    def job_cost(self, prompt_tokens: int, n: int, max_tokens: int, shared: bool) -> int:
        """Bytes admission prices ``n`` rows decoding up to ``max_tokens`` each from one prompt at
        (held once when `shared` by ``n > 1`` rows, by each row otherwise: a lone row, or rows that
        do not share, hold the prompt as their own KV); cached prompt tokens are not subtracted.

        Under tails that is the worst case, counting what a decode really holds, not only the
        tokens: a row's own KV once (its node lends it to the batch's tail while the row decodes,
        `KVTree.lend`, and takes it back when the row ends or the batch is re-assembled for a
        newcomer), the free slots a batch's tails are assembled with (`Computation.assemble`'s
        ``extra``: up to 128 per row), and, when many short prompts decode together, its own copy
        of its prompt in its tail (`copy_tokens`). Counting the tokens alone made admission
        promise room that decoding then took back by preemption; counting a row's own KV twice, as
        the node kept a copy of what its tail held, admitted two thirds of the rows a budget holds.
        Under pages, what the rows hold when they start and a page ahead each (`row_slots`)."""
        if shared and n > 1:  # one prompt node the rows read (or copy into their tails, if short)
            prompt = prompt_tokens
            copied = prompt_tokens if prompt_tokens <= self.copy_tokens else 0
            row = self.row_slots(copied, max_tokens, max_tokens)
        else:  # each row's prompt is its own KV, held like its tokens
            prompt = 0
            row = self.row_slots(prompt_tokens, max_tokens, max_tokens)
        return (prompt + n * row) * self.token_bytes

    def job_floor(self, prompt_tokens: int, n: int, max_tokens: int, shared: bool) -> int:
        """The least budget share under which such a job can finish at all: its admission price,
        and under pages also one of its rows grown to ``max_tokens`` (rows beside it are preempted
        until it ends, but it cannot be: `intake.Intake.pressure`)."""
        cost = self.job_cost(prompt_tokens, n, max_tokens, shared)
        if self.page is None:
            return cost
        alone = (prompt_tokens + self.in_pages(max_tokens)) * self.token_bytes
        return max(cost, alone)

    def minimum_budget(self, prompt_tokens: int = 1, max_tokens: int = 1) -> int:
        """The smallest ``kv_budget`` under which one row of `prompt_tokens` decoding `max_tokens`
        can finish at all (its `job_floor` within the budget less the watermark)."""
        cost = self.job_floor(prompt_tokens, 1, max_tokens, True)
        return math.ceil(cost / (1.0 - self.watermark))

    def set_budget(self, budget: int | None) -> None:
        """Set the budget (bytes; None: unbounded), refusing one that cannot hold a single row of
        one prompt token and one new token (every request would be refused: better said now)."""
        least = self.minimum_budget()
        if budget is not None and budget < least:
            raise ValueError(
                f"kv_budget={budget} bytes is below the minimum of {least} bytes: one row of one "
                f"token needs {self.job_floor(1, 1, 1, True)} bytes of KV ({self.token_bytes} bytes "
                f"per token) and admission keeps {self.watermark:.0%} of the budget free"
            )
        self.budget = budget
        self.tree.trim()

    def price_by(self, page: int | None) -> None:
        """Price rows for the KV layout (`page`: see its field), refusing the change where the
        budget is below the least one row then needs (`set_budget`'s error, nothing changed)."""
        old, self.page = self.page, page
        try:
            self.set_budget(self.budget)
        except ValueError:
            self.page = old
            raise

    def settle(self) -> int:
        """After nodes were released: trim the prefix cache to its own budget and to what the KV
        budget leaves free (`cache_ceiling`); returns how many cached nodes went."""
        return self.tree.trim()

    def allocated_bytes(self) -> int:
        """Bytes of the storage really allocated for what `used` counts: every distinct tensor
        storage the tree's nodes, their shared blocks and the live batches' tails hold.

        Why by storage, not by tensor: a view keeps its whole base alive (a node holding a slice of
        a batch's buffers would pin all of it), so counted bytes (`Tensor.nbytes`) track the real
        memory only while every tensor owns its storage; this measures that on any device (on CUDA
        the allocator's own figure, `torch.cuda.memory_allocated`, adds the weights and the
        activations, and rounds each block up)."""
        seen: dict[tuple[str, int], int] = {}

        def add(tensors: Iterable[torch.Tensor]) -> None:
            for t in tensors:
                storage = t.untyped_storage()
                if storage.nbytes():
                    seen[(str(t.device), storage.data_ptr())] = storage.nbytes()

        for seg in self.tree.segments():
            add(seg.keys or ())
            add(seg.values or ())
            for _, block in seg.blocks:
                add(block.keys)
                add(block.values)
        for ctx in self._contexts():
            add(ctx.kv.tensors())
            if ctx.pool is not None:
                add(ctx.pool.keys)
                add(ctx.pool.values)
        return sum(seen.values())

    def stats(self) -> dict[str, int | None]:
        """The budget's figures; safe to read without the engine's lock (a monitor's snapshot)."""
        return {
            "budget_bytes": self.budget,
            "used_bytes": self.used(),
            "bytes_held": self.tree.accounts.total.held,
            "cache_bytes": self.tree.accounts.cache.held,
            "preemptions": self.preemptions,
            "overruns": self.overruns,
            "overrun_bytes": self.overrun_bytes,
        }
