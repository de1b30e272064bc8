"""Paired percentile-bootstrap confidence intervals: one implementation for the eval report and the
benchmarks.

Why paired: every comparison here is per problem (baseline and accelerated latency of the same
problem), so a resample must keep each problem's values together, or problem difficulty would
leak into the interval. Why a fixed seed: regenerating a report or re-summarising a benchmark on
the same data must not move its numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import ArrayLike
from scipy.stats import bootstrap

__all__ = ["MIN_PROBLEMS", "N_RESAMPLES", "bootstrap_ci"]

N_RESAMPLES = 2000

# Fewest problems (rows) a CI is given for. n problems have only C(2n - 1, n) distinct resamples
# (3 for two, 10 for three, 35 for four, 126 for five), so below five the percentiles are read off a
# handful of values and the interval does not describe the uncertainty (with two problems it is the
# span between the two problems' own values, whatever their spread says about a third). Five is a
# floor, not a guarantee: an interval over few problems is still rough.
MIN_PROBLEMS = 5


def bootstrap_ci(
    columns: Sequence[ArrayLike],
    statistic: Callable[..., float],
    *,
    n_resamples: int = N_RESAMPLES,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float]:
    """Percentile bootstrap CI of ``statistic(*columns)``, resampling problems (rows) with replacement.

    ``columns`` are equal-length per-problem samples (one for an accuracy, baseline and accelerated
    latency for a speedup); ``statistic`` gets the resampled columns as arrays. NaN when there are
    fewer than ``MIN_PROBLEMS`` problems (too few distinct resamples for the percentiles to mean
    anything, see ``MIN_PROBLEMS``) or the statistic is not finite on a resample.
    """
    data = tuple(np.asarray(c, dtype=float) for c in columns)
    if not data or len(data[0]) < MIN_PROBLEMS:
        return (math.nan, math.nan)
    result = bootstrap(
        data,
        statistic,
        n_resamples=n_resamples,
        paired=True,
        vectorized=False,
        confidence_level=level,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    low, high = result.confidence_interval
    return (float(low), float(high))
