"""The KV memory pool and what acts on it: the budget's parsing and accounting, chunked prefill
(same tokens as a whole prefill, bounded per forward, interleaved with running rows), preemption
(same greedy tokens as without a budget, KV back to baseline) and the scheduler's admission."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from branchwise.backends.base import ContextTooLong, DecodeParams, KVBudgetExceeded
from branchwise.backends.hf import HFBackend, intake
from branchwise.backends.hf.pool import parse_budget
from branchwise.backends.scheduler import Job, Scheduler
from branchwise.backends.scheduler_router import PLAIN_ROW_TOKENS, prompt_share

CPU = torch.device("cpu")
TEXT = "Question: How many apples are left? Let's think step by step about the problem. "


def decode(backend: HFBackend, prompt: list[int], n: int, tokens: int) -> list[list[int]]:
    root = backend.prefill(prompt)
    kids = backend.fork(root, n) if n > 1 else [root]
    gens = backend.extend(kids, DecodeParams(max_tokens=tokens, min_tokens=tokens))
    backend.release(kids if n == 1 else [*kids, root])
    return [g.token_ids for g in gens]


def test_budget_forms_and_errors() -> None:
    assert parse_budget(None, CPU) is None and parse_budget("none", CPU) is None
    assert parse_budget(4096, CPU) == 4096
    assert parse_budget("4GiB", CPU) == 4 << 30 and parse_budget("512MB", CPU) == 512_000_000
    assert 0 < parse_budget(0.25, CPU) <= parse_budget("0.5", CPU)  # type: ignore[operator]
    assert parse_budget("auto", CPU) > 0  # type: ignore[operator]
    for bad in (0, -5, 1.5, "lots", "4 parsecs", True):
        with pytest.raises(ValueError, match="kv_budget"):
            parse_budget(bad, CPU)


def test_admission_prices_a_prompt_by_how_its_rows_hold_it(tiny_llama_dir: Path) -> None:
    """Rows that share a prompt read it once (or each copy a short one into its tail); a row that
    holds its prompt as its own KV holds it like its tokens, once (its node lends it to the batch's
    tail). The scheduler prices a job by the router's layout: a lone short prompt is a plain row."""
    pool = HFBackend(tiny_llama_dir, kv_layout="tails").engine.pool
    tb, row = pool.token_bytes, pool.row_tokens(16)
    long = pool.copy_tokens + 100
    assert pool.job_cost(long, 4, 16, shared=True) == (long + 4 * row) * tb
    assert pool.job_cost(long, 4, 16, shared=False) == 4 * (row + long) * tb
    assert pool.job_cost(long, 1, 16, shared=False) == (row + long) * tb
    assert row == 16 + 16  # its tokens once and its free slots
    # under pages, what the rows hold when they start and a page ahead, in whole pages; a job
    # that cannot finish unless one row alone reaches its max_tokens is refused by its floor
    paged = HFBackend(tiny_llama_dir, kv_layout="pages").engine.pool
    assert paged.row_tokens(100) == 16 and paged.job_cost(long, 4, 100, shared=True) == (long + 4 * 16) * tb
    assert paged.job_cost(long, 4, 100, shared=False) == 4 * (-(-(long + 16) // 16) * 16) * tb
    assert paged.job_floor(long, 4, 100, shared=True) == (long + 112) * tb
    params = DecodeParams(max_tokens=16)
    short_prompt, long_prompt = [1] * 8, [1] * (PLAIN_ROW_TOKENS + 1)
    assert prompt_share(Job(prompt=short_prompt, n=1, params=params)) == "none"  # its own node
    assert prompt_share(Job(prompt=long_prompt, n=1, params=params)) == "exact"  # a row reads it
    assert prompt_share(Job(prompt=short_prompt, n=4, params=params, share="none")) == "none"
    assert prompt_share(Job(prompt=short_prompt, n=4, params=params, share="exact")) == "exact"


def test_used_bytes_count_nodes_cache_and_tails(tiny_llama_dir: Path) -> None:
    backend = HFBackend(tiny_llama_dir, kv_budget=None)
    ids = backend.encode(TEXT * 2)
    root = backend.prefill(ids)
    kids = backend.fork(root, 4)
    seen: list[int] = []
    backend.extend(
        kids, DecodeParams(max_tokens=4), on_step=lambda _: seen.append(backend.kv_stats().used_bytes)
    )
    stats = backend.kv_stats()
    # while decoding, the batch's tails count beside the nodes
    assert max(seen) > stats.bytes_held > 0
    backend.release([*kids, root])
    after = backend.kv_stats()
    assert after.bytes_held == 0 and after.used_bytes == after.cache_bytes > 0
    assert after.budget_bytes is None


def test_chunked_prefill_gives_the_same_tokens(tiny_arch_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(intake, "ALONE_CHUNK", 16)  # a prompt alone is computed 16 tokens per forward
    whole = HFBackend(tiny_arch_dir, prefill_chunk=0, cache_bytes=0)
    chunked = HFBackend(tiny_arch_dir, prefill_chunk=16, cache_bytes=0)
    ids = whole.encode(TEXT * 3)
    assert len(ids) > 3 * 16
    assert decode(chunked, ids, 3, 8) == decode(whole, ids, 3, 8)
    assert chunked.kv_stats().extra["prefill_chunks"] >= len(ids) // 16
    assert "prefill_chunks" not in whole.kv_stats().extra
    assert chunked.kv_stats().bytes_held == 0


def test_a_prompt_alone_is_chunked_by_the_wait_it_imposes(
    tiny_arch_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call that newcomers may join (an `admit`) prefills a long prompt alone chunk by chunk,
    asking for newcomers between chunks. The chunks are sized by time (`PrefillPace.idle_size`):
    where a token costs next to nothing, as large as a prompt alone is computed (`ALONE_CHUNK`
    tokens); with fixed chunks (`prefill_share=0`), `prefill_chunk` tokens. Chunks run until at
    most one is left, which the decode's first forward computes. The tokens are a whole prefill's."""
    monkeypatch.setattr(intake, "ALONE_CHUNK", 32)
    whole = HFBackend(tiny_arch_dir, prefill_chunk=0, cache_bytes=0)
    ids = whole.encode(TEXT * 3)
    assert len(ids) > 3 * 16
    expected = decode(whole, ids, 3, 8)
    asked: list[int] = []

    def admit(alive: int) -> list[int]:
        asked.append(alive)
        return []

    for share in (1.0, 0.0):
        backend = HFBackend(tiny_arch_dir, prefill_chunk=16, cache_bytes=0)
        backend.prefill_share = share
        backend.engine.pace.token_s = 1e-9  # as if an earlier call had measured it
        asked.clear()
        root = backend.prefill(ids)
        kids = backend.fork(root, 3)
        gens = backend.extend(kids, DecodeParams(max_tokens=8, min_tokens=8), admit=admit)
        backend.release([*kids, root])
        chunks = backend.kv_stats().extra["prefill_chunks"]
        assert [g.token_ids for g in gens] == expected
        assert asked  # newcomers were asked for
        size = 32 if share else 16
        assert chunks == -(-len(ids) // size) - 1


@pytest.mark.parametrize("layout", ["tails", "pages"])
def test_rows_beyond_the_budget_wait_and_keep_greedy_tokens(tiny_arch_dir: Path, layout: str) -> None:
    """Eight rows that cannot all decode at once within the budget (a call without a scheduler):
    counted KV never passes the budget, and every row ends with the tokens an unbounded run gives.
    Under tails, priced at their worst case, the rows beyond it wait outside the batch and join as
    the first end, so none is preempted (all eight at once used to overshoot the budget and preempt
    the youngest a step later). Under pages, priced by what they hold, they start together and the
    youngest are preempted as the rows outgrow the budget, then come back."""
    free = HFBackend(tiny_arch_dir, kv_budget=None, cache_bytes=0)
    ids = free.encode(TEXT)
    want = decode(free, ids, 8, 48)
    tb = free.engine.pool.token_bytes
    budget = (len(ids) + 8 * 48) * tb
    tight = HFBackend(tiny_arch_dir, kv_budget=budget, cache_bytes=0, kv_layout=layout)
    seen: list[int] = []
    root = tight.prefill(ids)
    kids = tight.fork(root, 8)
    params = DecodeParams(max_tokens=48, min_tokens=48)
    gens = tight.extend(kids, params, on_step=lambda _: seen.append(tight.engine.pool.used()))
    tight.release([*kids, root])
    assert [g.token_ids for g in gens] == want
    stats = tight.kv_stats()
    if layout == "tails":
        assert stats.extra["deferred_rows"] > 0 and stats.preemptions == 0
    else:
        assert stats.preemptions > 0
    assert tight.engine.pool.overruns == 0 and max(seen) <= budget
    assert stats.bytes_held == 0 and stats.used_bytes == 0


def test_the_prefix_cache_yields_before_rows_are_preempted(tiny_llama_dir: Path) -> None:
    backend = HFBackend(tiny_llama_dir, kv_budget=None)
    tb = backend.engine.pool.token_bytes
    for i in range(6):  # fill the cache with other prompts
        decode(backend, backend.encode(f"{i} {TEXT}"), 1, 2)
    cached = backend.kv_stats().cache_bytes
    ids = backend.encode("Another question entirely, with its own words.")
    backend.kv_budget = cached // 2 + (len(ids) + 4 * 8) * tb * 2
    evicted = backend.tree.prefix.evictions
    decode(backend, ids, 4, 8)
    assert backend.tree.prefix.evictions > evicted and backend.kv_stats().preemptions == 0


def test_context_window_is_checked_before_any_work(tiny_llama_dir: Path) -> None:
    backend = HFBackend(tiny_llama_dir)
    assert backend.max_context == 2048
    with pytest.raises(ContextTooLong, match=r"2049 tokens.*2048"):
        backend.prefill([5] * 2049)
    root = backend.prefill([5] * 2000)
    with pytest.raises(ContextTooLong, match=r"2000 tokens\) \+ max_tokens \(100\)"):
        backend.extend([root], DecodeParams(max_tokens=100))
    backend.release([root])
    assert backend.kv_stats().bytes_held == 0


def test_scheduler_refuses_what_never_fits_and_queues_what_fits_later(tiny_llama_dir: Path) -> None:
    backend = HFBackend(tiny_llama_dir, cache_bytes=0)
    ids = backend.encode(TEXT)
    params = DecodeParams(max_tokens=16, min_tokens=16)
    one = backend.kv_cost(len(ids), 4, 16)
    backend.kv_budget = int(one * 2.5)  # two such requests fit at once, not three
    sched = Scheduler(backend, window_s=0.05)
    used: list[int] = []

    def job() -> Job:
        return Job(prompt=ids, n=4, params=params, on_step=lambda _: used.append(backend.engine.pool.used()))

    try:
        jobs = [sched.enqueue(job()) for _ in range(2)]
        with pytest.raises(KVBudgetExceeded, match=r"kv_budget=.* needs kv_budget >= "):  # at once
            sched.enqueue(Job(prompt=ids, n=64, params=params))
        jobs += [sched.enqueue(job()) for _ in range(2)]
        gens = [j.result() for j in jobs]
        assert all(len(g) == 4 and all(len(x.token_ids) == 16 for x in g) for g in gens)
    finally:
        sched.close(timeout=30)
    assert sched.stats.rejected == 1
    assert max(used) <= backend.kv_budget and backend.kv_stats().preemptions == 0
    assert backend.kv_stats().bytes_held == 0


def test_a_long_prompt_does_not_stall_a_running_decode(tiny_llama_dir: Path) -> None:
    """A request with a long prompt joins a running decode one chunk per step: the running rows
    keep stepping while it prefills (they take steps between its chunks)."""
    backend = HFBackend(tiny_llama_dir, prefill_chunk=16, cache_bytes=0)
    short = backend.encode("Count: 1 2 3")
    long = backend.encode(TEXT * 8)
    events: list[str] = []
    sched = Scheduler(backend, window_s=0.0)
    started = threading.Event()

    def on_short(step: object) -> None:
        events.append("short")
        started.set()

    def on_long(step: object) -> None:
        events.append("long")

    try:
        a = sched.enqueue(
            Job(prompt=short, n=1, params=DecodeParams(max_tokens=400, min_tokens=400), on_step=on_short)
        )
        started.wait(30)  # (reading the backend's stats now would wait for the decode's lock)
        b = sched.enqueue(
            Job(prompt=long, n=2, params=DecodeParams(max_tokens=60, min_tokens=60), on_step=on_long)
        )
        a.result(), b.result()
    finally:
        sched.close(timeout=30)
    assert backend.kv_stats().extra["prefill_chunks"] >= len(long) // 16 - 1
    first_long = events.index("long")
    # the short request decoded a step per chunk while the long prompt was prefilled
    assert events[:first_long].count("short") >= len(long) // 16 - 1
