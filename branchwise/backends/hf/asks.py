"""ASKS and the KV probe (RKSC §2.2, Eq. 2, Alg. 2).

ASKS generalises token-exact prefix reuse: a branch whose prompt differs from the root's may still
reuse the root's whole KV when its hidden states stay close to the root's. The gate compares, layer
by layer, the state at the last token of the branch's *divergent part* with the root's state at the
last token of *its* divergent part (both computed over the exact common prefix), weighted with
w_l ∝ exp(α·l/L) so later, more task-specific layers count more (Eq. 2). A branch that passes reads
the root's KV (and effectively sees the root's phrasing: lossy, so runs report agreement with
`share="none"`); one that fails keeps the exact KV its gate pass already computed — no work is lost.

The probe (§2.2) decides per 64-token prefix-length bucket whether sharing pays off at all by timing
(i) a batched full recompute against (ii) one prefix forward plus (iii) a batched suffix forward over
the shared cache, each the minimum of 3 runs, and caches the verdict.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch


def layer_weights(n_layers: int, alpha: float) -> torch.Tensor:
    """w_l = exp(α·l/L) / Σ_l' exp(α·l'/L), l = 1..L (Eq. 2)."""
    scores = torch.tensor([alpha * layer / n_layers for layer in range(1, n_layers + 1)], dtype=torch.float64)
    return torch.softmax(scores, dim=0)


def similarity(branch: torch.Tensor, root: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """σ_b of Eq. 2. `branch` [L, B, H], `root` [L, H] pre-normalised to unit length; returns [B]."""
    unit = torch.nn.functional.normalize(branch.double(), dim=-1)
    cos = (unit * root.double()[:, None, :]).sum(-1)  # [L, B]
    return (weights[:, None] * cos).sum(0)


class HiddenCapture:
    """Layer observer that keeps every layer's output at each row's last token (never exits)."""

    def __init__(self) -> None:
        self.states: list[torch.Tensor] = []

    def after_layer(self, layer: int, h_last: torch.Tensor, rows: torch.Tensor) -> None:
        self.states.append(h_last.detach().clone())

    def stacked(self) -> torch.Tensor:
        """[L, B, H]."""
        return torch.stack(self.states)


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
