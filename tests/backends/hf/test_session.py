"""Per-run state is per run: sessions keep their own settings and KV statistics, concurrent runs
report exactly what they would alone, and expensive acceleration builds are made once per backend."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from branchwise.backends.accel import Accel, CGEEConfig, RiverConfig
from branchwise.backends.base import Accelerated, Backend, SupportsSessions
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.river import River
from branchwise.reasoners import Reasoner
from branchwise.strategies import self_consistency

QUESTIONS = ["What is 12 + 7?", "Count to five:", "Name three colours.", "The quick brown fox"]
COUNTERS = ("tokens_computed", "tokens_reused", "forward_calls", "peak_bytes")


@pytest.fixture
def backend(tiny_llama_dir) -> HFBackend:
    return HFBackend(tiny_llama_dir)


def test_sessions_are_backends_with_their_own_settings(backend: HFBackend) -> None:
    assert isinstance(backend, SupportsSessions)
    run = backend.session(share="none", accel=Accel(cgee=CGEEConfig()))
    assert isinstance(run, Backend) and isinstance(run, Accelerated)
    assert run.share == "none" and run.accel.cgee is not None
    assert backend.share == "exact" and backend.accel == Accel()  # the backend is untouched
    root = run.prefill(run.encode("Hello there"))
    kids = run.fork(root, 2)
    assert run.kv_stats().tokens_reused == 0  # share="none" recomputes
    assert run.kv_stats().live_nodes == 3 == backend.kv_stats().live_nodes  # the tree is shared
    run.release([root, *kids])
    assert backend.kv_stats().live_nodes == 0


def test_concurrent_runs_report_their_own_stats(backend: HFBackend) -> None:
    """4 threads on one backend: each run decodes and reports exactly what it does alone (without
    the prefix cache, whose hits depend on which run came first; see test_prefix_cache.py)."""
    backend.cache_bytes = 0
    strategy = self_consistency(n=3, temperature=0.0, max_tokens=8)

    def solve(question: str) -> tuple[list[str], dict[str, float]]:
        result = Reasoner(strategy, backend=backend).run(question)
        return [b.text for b in result.branches], {k: result.kv_stats[k] for k in COUNTERS}

    serial = [solve(q) for q in QUESTIONS]
    with ThreadPoolExecutor(max_workers=4) as pool:
        concurrent = list(pool.map(solve, QUESTIONS))
    assert concurrent == serial
    assert len({tuple(stats.values()) for _, stats in serial}) > 1  # the runs really differ
    assert backend.kv_stats().live_nodes == 0


def test_builds_are_cached_per_backend_and_reported(backend: HFBackend) -> None:
    strategy = self_consistency(n=2, max_tokens=4, seed=0)
    cfg = RiverConfig(threshold=-1.0, entry_layer=0)
    first = Reasoner(strategy, backend=backend, accel=Accel(river=cfg)).run("1 + 2?")
    again = Reasoner(strategy, backend=backend, accel=Accel(river=cfg)).run("1 + 2?")
    # a threshold change needs no rebuild: the river's weights are the same
    looser = Reasoner(
        strategy, backend=backend, accel=Accel(river=cfg.model_copy(update={"threshold": 1.0}))
    ).run("1 + 2?")
    assert first.kv_stats["accel_builds"] == 1
    assert again.kv_stats["accel_builds"] == 0 and looser.kv_stats["accel_builds"] == 0
    assert first.kv_stats["river_build_s"] == again.kv_stats["river_build_s"] > 0
    assert looser.kv_stats.get("river_exits", 0) == 0 and again.kv_stats["river_exits"] > 0
    backend.accel = Accel(river=cfg)
    river = backend.acceleration(River)
    assert isinstance(river, River)
    backend.accel = Accel(river=cfg.model_copy(update={"audit": True}))
    audited = backend.acceleration(River)
    assert isinstance(audited, River) and audited.path is river.path  # one build, two configs


def test_reasoner_leaves_the_backend_settings_alone(backend: HFBackend) -> None:
    backend.accel = Accel(cgee=CGEEConfig(level1=False))
    Reasoner(self_consistency(n=2, max_tokens=3), backend=backend, accel=Accel()).run("x")
    assert backend.accel == Accel(cgee=CGEEConfig(level1=False))


def test_short_ancestors_are_copied_into_tails_and_long_ones_stay_shared(
    backend: HFBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without accelerations, in a batch of many segments, an ancestor whose path holds at most
    `COPY_TOKENS` tokens is read from each row's tail (no shared segment, one attention call fewer
    per layer), a longer one stays shared; with an acceleration every ancestor stays shared, and so
    it does in a batch of few segments. Greedy tokens are the same either way."""
    from branchwise.backends.base import DecodeParams
    from branchwise.backends.hf import compute as compute_module
    from branchwise.backends.hf.engine import COPY_TOKENS

    few = backend.session()
    root = few.prefill(backend.encode("Count to five:"))
    kids = few.fork(root, 3)
    few.release([root])
    segs = [few.tree.get(k) for k in kids]
    few.computation.materialize_ancestors(segs)
    assert len(few.computation.assemble(segs, 0).ctx.shared) == 1  # one segment: shared, as always
    few.release(kids)
    monkeypatch.setattr(compute_module, "COPY_MIN_SEGMENTS", 0)  # a one-prompt batch counts as many

    session = backend.session()
    short = backend.encode("What is 12 + 7?")
    long = (short * (COPY_TOKENS // len(short) + 2))[: COPY_TOKENS + 8]
    layouts = {}
    for name, prompt in (("short", short), ("long", long)):
        root = session.prefill(prompt)
        kids = session.fork(root, 3)
        session.release([root])
        segs = [session.tree.get(k) for k in kids]
        session.computation.materialize_ancestors(segs)
        batch = session.computation.assemble(segs, 0)
        layouts[name] = ([s.key for s in batch.ctx.shared], [r.tail_start for r in batch.rows])
        session.release(kids)
    assert layouts["short"] == ([], [len(short)] * 3)
    # the prefix cache split the long prompt after the cached short one: that head is copied, the
    # segment whose path exceeds the bound is shared
    assert len(layouts["long"][0]) == 1 and layouts["long"][1] == [len(short)] * 3
    params = DecodeParams(max_tokens=6)
    tokens = {}
    for name, accel in (("copied", Accel()), ("shared", Accel(cgee=CGEEConfig()))):
        run = backend.session(accel=accel)
        root = run.prefill(short)
        kids = run.fork(root, 2)
        run.release([root])
        if name == "shared":
            segs = [run.tree.get(k) for k in kids]
            run.computation.materialize_ancestors(segs)
            assert len(run.computation.assemble(segs, 0).ctx.shared) == 1
        tokens[name] = [g.token_ids for g in run.extend(kids, params)]
        run.release(kids)
    assert tokens["copied"] == tokens["shared"]
