"""The KV probe (RKSC §2.2): the decision logic with injected timings, the sunk-cost rule, the override."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from branchwise.backends import DecodeParams
from branchwise.backends.accel import Accel, ProbeConfig
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.probe import KVProbe, Probe

CONTEXT = " The farmer has 12 apples and buys 7 more in the morning market."


def _scripted(times: list[float]) -> Iterator[float]:
    """A clock that returns t0, t0 + d for each duration in `times` (one pair per timed call)."""
    now = 0.0
    for d in times:
        yield now
        now += d
        yield now


def test_decide_uses_min_times_and_caches_per_bucket() -> None:
    # repeats=2: recompute (9, 7), prefix (3, 2), suffix (5, 4) -> 2 + 4 < 7 -> share
    clock = _scripted([9, 7, 3, 2, 5, 4])
    probe = KVProbe(bucket_tokens=64, repeats=2, clock=lambda: next(clock))
    calls: list[str] = []
    assert probe.decide(100, 8, *(lambda n=n: calls.append(n) for n in "rps")) is True
    assert calls == ["r", "r", "p", "p", "s", "s"]
    assert probe.timings[(1, 8)] == {"recompute": 7, "prefix": 2, "suffix": 4}
    assert probe.decide(127, 8, lambda: 1 / 0, lambda: 1 / 0, lambda: 1 / 0) is True  # same bucket: cached
    clock = _scripted([6, 2, 4])  # 2 + 4 = 6, not below: recompute
    probe.clock, probe.repeats = (lambda: next(clock)), 1
    assert probe.decide(128, 8, lambda: None, lambda: None, lambda: None) is False


def _token_clock(backend: HFBackend) -> list[int]:
    """Make the 'time' of a path the number of tokens it pushes through the model, through the layer
    loop or the fixed-shape step (a one-token suffix is a decode-shaped step)."""
    fed = [0]
    engine = backend.engine
    for owner in (engine.runner, engine.stepper):
        forward = owner.forward

        def counting(ctx, feeds, *args, forward=forward, **kwargs):
            fed[0] += sum(len(f) for f in feeds)
            return forward(ctx, feeds, *args, **kwargs)

        owner.forward = counting  # type: ignore[method-assign]
    return fed


@pytest.mark.parametrize(("n", "s"), [(2, 16), (4, 16), (2, 1)])
def test_probe_counts_the_prefix_once(tiny_llama_dir, n: int, s: int) -> None:
    """Timed in tokens: prefix P once + n suffixes of s tokens (the paper's s = 16 by default) vs
    n·(P + s) recomputed -> sharing wins. Counting the prefix twice (2P + n·s vs n(P + s)) would make
    n=2 recompute."""
    backend = HFBackend(tiny_llama_dir)
    fed = _token_clock(backend)
    cfg = ProbeConfig(repeats=1) if s == 16 else ProbeConfig(repeats=1, suffix_tokens=s)
    assert cfg.suffix_tokens == s
    session = backend.session(share="exact", accel=Accel(probe=cfg))
    plugin = session.plugin(Probe)
    assert plugin is not None and plugin.probe.suffix_tokens == s  # the build follows the config
    plugin.probe = KVProbe(repeats=1, suffix_tokens=s, clock=lambda: float(fed[0]))
    prompt = backend.encode(CONTEXT)
    root = session.prefill(prompt)
    kids = session.fork(root, n)
    p = len(prompt)
    key = plugin.probe.key(p, n)
    assert plugin.probe.timings[key] == {"recompute": n * (p + s), "prefix": p, "suffix": n * s}
    assert plugin.probe.verdicts[key] is True
    stats = session.kv_stats()
    assert stats.extra["probe_share"] == 1 and stats.tokens_reused == n * p
    session.release([root, *kids])
    assert backend.kv_stats().live_nodes == 0


def test_probe_never_times_a_computed_parent(tiny_llama_dir) -> None:
    """n=1 forks of decoded leaves (verify rows, tree children) share their sunk KV, untimed."""
    backend = HFBackend(tiny_llama_dir)
    session = backend.session(share="exact", accel=Accel(probe=ProbeConfig(override="auto", repeats=1)))
    plugin = session.plugin(Probe)
    assert plugin is not None
    plugin.probe = KVProbe(repeats=1, clock=lambda: 0.0)  # ties: a timed fork would recompute
    root = session.prefill(backend.encode(CONTEXT))
    session.extend([root], DecodeParams(max_tokens=3, min_tokens=3))
    for _ in range(3):
        (child,) = session.fork(root, 1)
        session.release([child])
    session.score_next([root], backend.encode(" Is it right?"), backend.encode(" Yes No"))
    stats = session.kv_stats().extra
    assert "probe_timed" not in stats and "probe_recompute" not in stats
    assert stats["probe_sunk"] >= 3
    assert plugin.probe.verdicts == {}
    session.release([root])


def test_probe_override(tiny_llama_dir) -> None:
    backend = HFBackend(tiny_llama_dir)
    backend.accel = Accel(probe=ProbeConfig(override="recompute"))
    root = backend.prefill(backend.encode(CONTEXT))
    kids = backend.fork(root, 3)
    assert backend.kv_stats().tokens_reused == 0  # the override made the fork recompute
    backend.release([root, *kids])
    assert backend.kv_stats().live_nodes == 0
