"""The KV probe (RKSC §2.2): is sharing a prefix worth it on this machine, at this length?

Sharing is not free: a shared prefix is computed once, then every branch reads it through an extra
attention product per layer. For short prefixes or few branches a batched recompute can be faster.
The probe times (i) a batched full recompute of prefix + suffix for n branches against (ii) one
prefix forward plus (iii) a batched suffix forward of the n branches over the shared prefix (the
prefix already computed, outside the timed region: the prefix is counted exactly once), each the
minimum of `repeats` runs, per `bucket_tokens` prefix-length bucket and branch count, and caches
the verdict. The suffix is `suffix_tokens` long (the paper's s = 16): what sharing costs is the
extra read of the prefix by every suffix token, so a 1-token suffix would time a cheaper share
than any branch that then prefills its own text or decodes pays. It is separate from ASKS: it gates any exact fork, whether or not ASKS is on.

The probe only asks about prefixes not yet computed. A parent with computed KV (a decoded leaf, a
prompt already prefilled: every verify row of `score_next`, every tree child) is a sunk cost:
sharing it costs at most its pending tokens once, while recomputing would redo the whole path per
branch, so such forks always share and are never timed.

The verdicts are a property of the machine and the model, so the `KVProbe` lives in the backend's
build cache and every run shares it; the timing runs go through a plain session (no
accelerations, throwaway statistics), so they neither count in a run's numbers nor recurse.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from branchwise.backends.accel import ProbeConfig
from branchwise.backends.hf.hooks import Acceleration, Host, Setup
from branchwise.backends.hf.segment import Segment


class KVProbe:
    """Cached per-bucket verdicts of whether prefix sharing beats recompute on this machine."""

    def __init__(
        self,
        bucket_tokens: int = 64,
        repeats: int = 3,
        suffix_tokens: int = 16,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.bucket_tokens, self.repeats, self.suffix_tokens = bucket_tokens, repeats, suffix_tokens
        self.clock = clock  # injectable, so the decision logic is testable without wall-clock noise
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
            t0 = self.clock()
            fn()
            best = min(best, self.clock() - t0)
        return best


class Probe(Acceleration):
    """The probe as a fork hook: vetoes sharing where the cached (or fresh) timing says it loses.

    Statistics: `probe_share` / `probe_recompute` count the forks of this run the probe let share or
    made recompute; `probe_timed` the verdicts this run had to time (the rest came from the cache).
    """

    name = "probe"
    config = ProbeConfig

    def __init__(self, cfg: ProbeConfig, probe: KVProbe) -> None:
        self.cfg = cfg
        self.probe = probe

    @classmethod
    def build(cls, cfg: ProbeConfig, setup: Setup) -> Probe:
        """Verdicts are shared by every run of the backend with the same timing settings."""
        probe = setup.shared(
            ("probe", cfg.bucket_tokens, cfg.repeats, cfg.suffix_tokens),
            lambda: KVProbe(cfg.bucket_tokens, cfg.repeats, cfg.suffix_tokens),
        )
        return cls(cfg, probe)

    def on_fork(self, host: Host, path: list[int], n: int, parent: Segment) -> bool:
        cfg = self.cfg
        if cfg.override != "auto":
            return cfg.override == "share"
        if computed_tokens(parent):  # sunk cost: sharing computed KV is always right
            host.stats.bump("probe_sunk")
            return True
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
        s = self.probe.suffix_tokens
        if host.max_context is not None:  # a prompt near the context end: time the suffix that fits
            s = max(1, min(s, host.max_context - len(path)))
        suffix = (path * (s // len(path) + 1))[-s:]  # any tokens: only the amount of work matters
        ready: list[Segment] = []  # a computed prefix the suffix timing forks from

        def recompute() -> None:
            root = plain.tree.add(None, False, list(path), plain.ledger)
            kids = plain.fork(root.id, n, share="none")
            plain.append(kids, [suffix] * n)
            plain.compute([plain.tree.get(k) for k in kids])
            plain.release([*kids, root.id])

        def prefix() -> None:
            root = plain.tree.add(None, False, list(path), plain.ledger)
            plain.compute([root])
            for old in ready:
                plain.release([old.id])
            ready[:] = [root]

        def shared_suffix() -> None:
            kids = plain.fork(ready[0].id, n, share="exact")
            plain.append(kids, [suffix] * n)
            plain.compute([plain.tree.get(k) for k in kids])
            plain.release(kids)

        def synced(fn: Callable[[], None]) -> Callable[[], None]:
            """Wait for the device's queued kernels, so the clock times the work and not its launch."""
            if host.device.type != "cuda":
                return fn

            def run() -> None:
                fn()
                torch.cuda.synchronize(host.device)

            return run

        try:
            self.probe.decide(len(path), n, synced(recompute), synced(prefix), synced(shared_suffix))
        finally:
            plain.release([seg.id for seg in ready])


def computed_tokens(seg: Segment) -> int:
    """Tokens of `seg`'s path whose KV is already computed (its own and its KV ancestors')."""
    return seg.n_computed + sum(a.n_computed for a in seg.kv_ancestors())
