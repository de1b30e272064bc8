"""The KV budget is a bound and its books balance: counted bytes (live nodes, the prefix cache and
batch tails, `KVPool.used`) stay within `kv_budget` at every decode step boundary and after every
request, under a burst through one scheduler; they track the storage really allocated; a budget too
small for one row is refused naming the minimum; and a request cancelled while its rows wait
preempted, or one that raises, leaves nothing held."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from testkit import fail_forward

from branchwise.backends.accel import Accel, ReasonCacheConfig, SkipKVConfig
from branchwise.backends.base import DecodeParams, DecodeStep, KVBudgetExceeded
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.reasoncache import ReasonCache, StepBoundaries
from branchwise.backends.scheduler import Job, Scheduler

TEXT = "Question: How many apples are left? Let's think step by step about the problem. "
MARGIN = 0.01
"""Counted bytes against the storage really allocated (docs/SERVING.md states it)."""


def burst(backend: HFBackend, jobs: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """`jobs` requests of a few shared prefixes with varied n and lengths, all queued at once through
    one scheduler; returns `pool.used()` at every decode step boundary (each job's step listener,
    called between two forwards) and after every request ended (its nodes released)."""
    pool = backend.engine.pool
    steps: list[int] = []
    ends: list[int] = []
    sched = Scheduler(backend, window_s=0.01, max_rows=16)
    rng = random.Random(seed)
    try:
        queued = [
            sched.enqueue(
                Job(
                    prompt=backend.encode(f"{i % 5} {TEXT}" + " more" * rng.randrange(8)),
                    n=rng.choice([1, 2, 4]),
                    params=DecodeParams(max_tokens=rng.randrange(4, 30)),
                    on_step=lambda _: steps.append(pool.used()),
                    on_done=lambda _: ends.append(pool.used()),
                )
            )
            for i in range(jobs)
        ]
        for job in queued:
            job.result()
    finally:
        sched.close(timeout=60)
    return steps, ends


def test_a_burst_stays_within_the_budget_cache_included(tiny_llama_dir: Path) -> None:
    backend = HFBackend(tiny_llama_dir)  # the prefix cache's own budget (1 GiB) is far above the KV budget
    pool = backend.engine.pool
    budget = 600 * pool.token_bytes
    backend.kv_budget = budget
    assert backend.cache_bytes > 100 * budget
    steps, ends = burst(backend, 24)
    assert len(steps) > 100 and len(ends) == 24
    assert max(steps) <= budget, f"{max(steps) / budget:.3f} of the budget at a step boundary"
    assert max(ends) <= budget, f"{max(ends) / budget:.3f} of the budget after a request ended"
    assert pool.used() <= budget and pool.overruns == 0
    stats = backend.kv_stats()
    assert stats.bytes_held == 0 and 0 < stats.cache_bytes == pool.used()  # the cache kept what fits


def test_a_release_never_keeps_more_cache_than_the_budget_leaves(tiny_llama_dir: Path) -> None:
    """Finished nodes go to the cache (their bytes move, nothing is added), and every trim after a
    release obeys the budget: here the budget is lowered under what the cache holds, and the cache
    shrinks to it at once, then stays under it as more requests end."""
    backend = HFBackend(tiny_llama_dir, kv_budget=None)
    pool = backend.engine.pool
    for i in range(6):
        root = backend.prefill(backend.encode(f"{i} {TEXT}"))
        kids = backend.fork(root, 2)
        backend.extend(kids, DecodeParams(max_tokens=6, min_tokens=6))
        backend.release([*kids, root])
    cached = pool.tree.accounts.cache.held
    backend.kv_budget = cached // 2
    assert 0 < pool.tree.accounts.cache.held <= cached // 2 and pool.tree.prefix.evictions > 0
    live = backend.prefill(backend.encode("A live prompt."))
    backend.extend([live], DecodeParams(max_tokens=1))  # computed: its KV is live, not cached
    for i in range(3):
        root = backend.prefill(backend.encode(f"{i} again {TEXT}"))
        backend.extend([root], DecodeParams(max_tokens=8, min_tokens=8))
        backend.release([root])
        assert pool.used() <= backend.kv_budget
    assert pool.tree.accounts.total.held > 0 and pool.tree.accounts.cache.held > 0
    backend.release([live])


def test_counted_bytes_track_the_real_storage(tiny_llama_dir: Path) -> None:
    """`KVPool.used` (tensor bytes the ledgers and tails count) against `allocated_bytes` (distinct
    storages those tensors hold), while decoding, with the cache holding finished requests, and
    after a split of a cached node: within `MARGIN`."""
    backend = HFBackend(tiny_llama_dir, kv_budget=None)
    pool = backend.engine.pool
    pairs: list[tuple[int, int]] = []

    def look(_: object) -> None:
        pairs.append((pool.used(), pool.allocated_bytes()))

    ids = backend.encode(TEXT * 2)
    root = backend.prefill(ids)
    kids = backend.fork(root, 4)
    backend.extend(kids, DecodeParams(max_tokens=40, min_tokens=40), on_step=look)
    backend.release([*kids, root])
    look(None)
    again = backend.prefill(ids[: len(ids) // 2] + backend.encode(" a different ending"))  # splits
    backend.extend([again], DecodeParams(max_tokens=8), on_step=look)
    look(None)
    backend.release([again])
    look(None)
    assert len(pairs) > 40 and all(used > 0 for used, _ in pairs)
    worst = max(abs(real - used) / used for used, real in pairs)
    assert worst <= MARGIN, f"counted bytes are {worst:.2%} off the real storage"


@pytest.mark.parametrize("kind", ["reasoncache", "skipkv"])
def test_counted_bytes_track_the_real_storage_under_kv_changing_accelerations(
    tiny_llama_dir: Path, kind: str
) -> None:
    """ReasonCache's blocks (sealed copies in the tree, laid out once more in each batch's block
    pool) and SkipKV's evictions (slots moved within the tails, nodes' KV indexed into new tensors)
    are counted as what they allocate: within `MARGIN` at every step and after the release."""
    backend = HFBackend(tiny_llama_dir, kv_budget=None, cache_bytes=0)
    pool = backend.engine.pool
    if kind == "reasoncache":
        cfg = ReasonCacheConfig(block_tokens=2, mode="random", random_rate=1.0)
        session = backend.session(share="exact", accel=Accel(reasoncache=cfg))
        plugin = session.plugin(ReasonCache)
        assert plugin is not None
        every = frozenset(range(len(backend.tokenizer)))  # every token ends a step: blocks seal early
        plugin.boundaries = StepBoundaries(closes=every, sentence_end=frozenset(), space_start=frozenset())
    else:
        session = backend.session(
            share="exact", accel=Accel(skipkv=SkipKVConfig(budget=6, interval=4, window=2, query_window=4))
        )
    pairs: list[tuple[int, int]] = []

    def look(_: object) -> None:
        pairs.append((pool.used(), pool.allocated_bytes()))

    root = session.prefill(backend.encode(TEXT))
    kids = session.fork(root, 3)
    session.extend(kids, DecodeParams(max_tokens=40, min_tokens=40, temperature=1.0, seed=0), on_step=look)
    look(None)
    extra = session.kv_stats().extra
    assert extra.get("reasoncache_blocks_reused", 0) > 0 or extra.get("skipkv_evicted_tokens", 0) > 0, extra
    worst = max(abs(real - used) / used for used, real in pairs)
    assert worst <= MARGIN, f"counted bytes are {worst:.2%} off the real storage under {kind}"
    session.release([*kids, root])
    assert pool.used() == pool.allocated_bytes() == 0


def test_a_budget_below_one_row_is_refused_naming_the_minimum(tiny_llama_dir: Path) -> None:
    backend = HFBackend(tiny_llama_dir, kv_budget=None)
    pool = backend.engine.pool
    least = pool.minimum_budget()
    with pytest.raises(ValueError, match=rf"kv_budget={least - 1} bytes is below the minimum of {least}"):
        backend.kv_budget = least - 1
    assert backend.kv_budget is None  # unchanged
    backend.kv_budget = least  # the minimum itself is accepted
    with pytest.raises(ValueError, match=rf"kv_budget=64 bytes is below the minimum of {least} bytes"):
        HFBackend(tiny_llama_dir, kv_budget=64)  # at construction too
    # a request one row of which cannot fit: refused at admission, naming kv_budget and its minimum
    ids = backend.encode(TEXT)
    need = backend.kv_cost(len(ids), 1, 32)
    backend.kv_budget = need  # the budget less its watermark is under the request's need
    sched = Scheduler(backend)
    try:
        with pytest.raises(
            KVBudgetExceeded, match=rf"kv_budget={need} bytes.*kv_budget >= (\d+) bytes"
        ) as err:
            sched.enqueue(Job(prompt=ids, n=1, params=DecodeParams(max_tokens=32)))
        minimum = int(err.value.args[0].rsplit("kv_budget >= ", 1)[1].split()[0])
        backend.kv_budget = minimum  # the minimum it names admits the request
        gens = sched.submit(Job(prompt=ids, n=1, params=DecodeParams(max_tokens=32, min_tokens=32)))
        assert len(gens[0].token_ids) == 32
    finally:
        sched.close(timeout=30)


@pytest.mark.parametrize("layout", ["tails", "pages"])
def test_rows_cancelled_while_waiting_leave_the_books_balanced(tiny_llama_dir: Path, layout: str) -> None:
    """Eight rows under a budget that holds about two at once: the others wait outside the batch
    (tails price each row at its worst case, so they wait before their first step; pages start
    them all and preempt the youngest as they grow) and, while they wait, the step listener cancels
    the younger half (what a scheduler does for a cancelled request). The older rows end with all
    their tokens, the cancelled ones end as cancelled, and once the nodes are released nothing
    stays held."""
    backend = HFBackend(tiny_llama_dir, kv_budget=None, cache_bytes=0, kv_layout=layout)
    pool = backend.engine.pool
    ids = backend.encode(TEXT)
    backend.kv_budget = (len(ids) + 8 * 48) * pool.token_bytes
    at_cancel: list[int] = []

    def listener(step: DecodeStep) -> list[int] | None:
        if not at_cancel and len(step.tokens) < 8:  # rows outside the batch produced nothing
            at_cancel.append(len(step.tokens))
            return [4, 5, 6, 7]
        return None

    root = backend.prefill(ids)
    kids = backend.fork(root, 8)
    gens = backend.extend(kids, DecodeParams(max_tokens=48, min_tokens=48), on_step=listener)
    assert at_cancel and (layout == "pages" or at_cancel[0] <= 4)  # cancelled while rows 4-7 waited
    assert [len(g.token_ids) for g in gens[:4]] == [48] * 4
    assert all(g.finish_reason == "cancelled" and len(g.token_ids) < 48 for g in gens[4:])
    backend.release([*kids, root])
    assert pool.tree.accounts.total.held == 0 and pool.used() == 0 and pool.tails == 0
    assert len(pool.tree) == 0 and backend.kv_stats().bytes_held == 0


def test_a_request_that_raises_leaves_the_books_balanced(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward that fails mid-decode: the error reaches every request of the batch, and the
    batch's tails and nodes are all let go (the error's traceback does not keep the tails)."""
    backend = HFBackend(tiny_llama_dir, kv_budget=None, cache_bytes=0)
    pool = backend.engine.pool
    fail_forward(monkeypatch, at=6)
    sched = Scheduler(backend, window_s=0.2)
    try:
        jobs = [
            sched.enqueue(Job(prompt=backend.encode(f"{i} {TEXT}"), n=2, params=DecodeParams(max_tokens=20)))
            for i in range(2)
        ]
        errors = []
        for job in jobs:
            with pytest.raises(RuntimeError, match="device lost") as err:
                job.result()
            errors.append(err.value)  # held, with its traceback, while the books are read
        assert pool.tails == 0 and pool.allocated_bytes() == 0
        assert pool.tree.accounts.total.held == 0 and pool.used() == 0 and len(pool.tree) == 0
    finally:
        sched.close(timeout=60)


@pytest.mark.slow
def test_a_burst_on_the_embedded_model_stays_within_the_budget(embedded_dir: Path) -> None:
    backend = HFBackend(embedded_dir, dtype="float32")
    pool = backend.engine.pool
    budget = 800 * pool.token_bytes  # one request of the burst at most needs ~500 tokens
    backend.kv_budget = budget
    steps, ends = burst(backend, 12, seed=1)
    assert max(steps) <= budget and max(ends) <= budget and pool.overruns == 0
    assert backend.kv_stats().cache_bytes > 0
    used, real = pool.used(), pool.allocated_bytes()
    assert abs(real - used) <= MARGIN * used
