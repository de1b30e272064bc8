"""The KV probe (RKSC §2.2): timed once per bucket, cached, and overridable."""

from __future__ import annotations

import torch

from branchwise.backends.accel import Accel, ProbeConfig
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.probe import KVProbe

CONTEXT = " The farmer has 12 apples and buys 7 more in the morning market."


def test_probe_decides_once_per_bucket(tiny_llama_dir) -> None:
    probe = KVProbe(bucket_tokens=64, repeats=3)
    calls: list[str] = []

    def timed(name: str, cost: float):
        def fn() -> None:
            calls.append(name)
            torch.randn(int(cost * 1e5)).sum()

        return fn

    assert probe.decide(100, 8, timed("r", 50), timed("p", 1), timed("s", 1)) is True
    assert probe.decide(120, 8, timed("r", 50), timed("p", 1), timed("s", 1)) is True  # same bucket: cached
    assert len(calls) == 9
    backend = HFBackend(tiny_llama_dir)
    backend.accel = Accel(probe=ProbeConfig(override="recompute"))
    root = backend.prefill(backend.encode(CONTEXT))
    kids = backend.fork(root, 3)
    assert backend.kv_stats().tokens_reused == 0  # the override made the fork recompute
    backend.release([root, *kids])
    backend.accel = Accel(probe=ProbeConfig(repeats=1))
    root = backend.prefill(backend.encode(CONTEXT))
    kids = backend.fork(root, 3)
    stats = backend.kv_stats().extra
    assert stats.get("probe_share", 0) + stats.get("probe_recompute", 0) == 1
    backend.release([root, *kids])
    assert backend.kv_stats().live_nodes == 0
