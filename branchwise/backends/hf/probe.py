"""The KV probe (RKSC §2.2): is sharing a prefix worth it on this machine, at this length?

Sharing is not free: a shared prefix is computed once, then every branch reads it through an extra
attention product per layer. For short prefixes or few branches a batched recompute can be faster.
The probe times (i) a batched full recompute against (ii) one prefix forward plus (iii) a batched
suffix forward over the shared cache, each the minimum of `repeats` runs, per `bucket_tokens`
prefix-length bucket and branch count, and caches the verdict. It is separate from ASKS: it gates
any exact fork, whether or not ASKS is on.

The verdicts are a property of the machine and the model, so the `KVProbe` lives in the backend's
build cache and every run shares it; the timing runs go through a plain session (no
accelerations, throwaway statistics), so they neither count in a run's numbers nor recurse.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from branchwise.backends.accel import ProbeConfig
from branchwise.backends.base import ShareMode
from branchwise.backends.hf.hooks import Acceleration, Host


class KVProbe:
    """Cached per-bucket verdicts of whether prefix sharing beats recompute on this machine."""

    def __init__(self, bucket_tokens: int = 64, repeats: int = 3) -> None:
        self.bucket_tokens, self.repeats = bucket_tokens, repeats
        self.verdicts: dict[tuple[int, int], bool] = {}
        self.timings: dict[tuple[int, int], dict[str, float]] = {}

    def key(self, prefix_len: int, branches: int) -> tuple[int, int]:
        return prefix_len // self.bucket_tokens, branches

    def decide(
        self,
        prefix_len: int,
        branches: int,
        recompute: Callable[[], object],
        prefix: Callable[[], object],
        suffix: Callable[[], object],
    ) -> bool:
        """Share iff min-time(prefix) + min-time(suffix) < min-time(recompute); cached per bucket."""
        key = self.key(prefix_len, branches)
        if key not in self.verdicts:
            t = {
                name: self._min_time(fn)
                for name, fn in (("recompute", recompute), ("prefix", prefix), ("suffix", suffix))
            }
            self.timings[key] = t
            self.verdicts[key] = t["prefix"] + t["suffix"] < t["recompute"]
        return self.verdicts[key]

    def _min_time(self, fn: Callable[[], object]) -> float:
        best = math.inf
        for _ in range(self.repeats):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best


class Probe(Acceleration):
    """The probe as a fork hook: vetoes sharing where the cached (or fresh) timing says it loses.

    Statistics: `probe_share` / `probe_recompute` count the forks of this run the probe let share or
    made recompute; `probe_timed` the verdicts this run had to time (the rest came from the cache).
    """

    name = "probe"

    def __init__(self, cfg: ProbeConfig, probe: KVProbe) -> None:
        self.cfg = cfg
        self.probe = probe

    def on_fork(self, host: Host, path: list[int], n: int) -> bool:
        cfg = self.cfg
        if cfg.override != "auto":
            return cfg.override == "share"
        key = self.probe.key(len(path), n)
        if key not in self.probe.verdicts:
            self._time(host, path, n)
            host.stats.bump("probe_timed")
        verdict = self.probe.verdicts[key]
        host.stats.bump("probe_share" if verdict else "probe_recompute")
        return verdict

    def _time(self, host: Host, path: list[int], n: int) -> None:
        """Time the three paths in a plain session and cache the verdict."""
        plain = host.plain()
        suffix = path[-1:]

        def paths(share: ShareMode, prefix_only: bool = False) -> None:
            root = plain.tree.add(None, False, list(path), plain.ledger)
            if prefix_only or share == "exact":
                plain.compute([root])
            if not prefix_only:
                kids = plain.fork(root.id, n, share=share)
                plain.append(kids, [suffix] * n)
                plain.compute([plain.tree.get(k) for k in kids])
                plain.release(kids)
            plain.release([root.id])

        self.probe.decide(
            len(path),
            n,
            lambda: paths("none"),
            lambda: paths("exact", prefix_only=True),
            lambda: paths("exact"),
        )
