"""REBASE width allocation (Wu et al., 2024) as used by REBASE itself and by ETS.

REBASE does not prune: at every step it hands the *remaining width* W_rem (how many children are
still to be sampled this step) to the current leaves, best first, with a temperature softmax over
their rewards and a sequential ceiling::

    for leaves sorted from best to worst reward:
        n_i = ceil(W_rem * exp(R_i / T) / sum_{k not yet allocated} exp(R_k / T))
        W_rem -= n_i

Because the denominator only covers leaves not yet allocated, the last leaf reached is offered the
whole remainder, so the counts always add up to the width; because each count is a ceiling, the best
leaves round *up* and low-reward leaves can end with zero children when the width is small. ETS uses
the same counts, normalised to sum to one, as the value of keeping each leaf (ETS's public code: O_i
is the REBASE allocation, normalised, not the raw reward).

Everything here is pure Python/NumPy: no torch, no model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "DEFAULT_TEMPERATURE",
    "next_width",
    "rebase_allocation",
    "rebase_weights",
]

DEFAULT_TEMPERATURE = 0.2
"""REBASE's softmax temperature T_R; 0.2 is the default of the public REBASE code and ETS's setting."""

# Slack before the ceiling. exp/log in float64 turn an exact share such as 3 * (1/3) into
# 1.0000000000000002, and a bare ceil would then give that leaf 2 children instead of 1. The slack is
# far below any real fractional part (shares are at least ~1e-300 apart only when they are equal).
_CEIL_SLACK = 1e-9


def _check_width(width: int, name: str = "width") -> int:
    if isinstance(width, bool) or not isinstance(width, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(width).__name__}")
    if width < 0:
        raise ValueError(f"{name} must be >= 0, got {width}")
    return int(width)


def _check_temperature(temperature: float) -> float:
    t = float(temperature)
    if not math.isfinite(t) or t <= 0.0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return t


def _check_rewards(rewards: Sequence[float] | np.ndarray) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be a 1-D sequence, got shape {r.shape}")
    if not np.all(np.isfinite(r)):
        raise ValueError("rewards must be finite (no NaN or inf): a NaN reward has no place in the ranking")
    return r


def rebase_allocation(
    rewards: Sequence[float] | np.ndarray,
    width: int,
    temperature: float = DEFAULT_TEMPERATURE,
) -> list[int]:
    """Children per leaf under REBASE's sequential-ceil softmax, in the order the rewards were given.

    Contract (tested):

    * every count is an int in ``[0, width]``;
    * the counts sum to exactly ``width`` whenever there is at least one leaf (the last leaf reached
      is offered the whole remainder); with no leaves the result is ``[]`` and nothing is allocated;
    * counts never increase from a better leaf to a worse one; among *equal* rewards the leaf listed
      first is treated as better (a stable sort), so it takes the rounding-up: two tied leaves
      sharing a width of 3 get ``[2, 1]``;
    * when ``width`` is smaller than the number of leaves, the worst leaves get 0.

    The softmax is evaluated against a running log-sum-exp over the leaves not yet allocated, so
    rewards of any magnitude (say -1000) give the same counts as the same rewards shifted, instead of
    the 0/0 that a plain ``exp(R/T)`` underflows to.
    """
    r = _check_rewards(rewards)
    w = _check_width(width)
    t = _check_temperature(temperature)
    n = r.shape[0]
    counts = [0] * n
    if n == 0 or w == 0:
        return counts

    order = np.argsort(-r, kind="stable")  # best first; ties keep input order
    logits = r[order] / t
    # suffix_lse[p] = log(sum_{q >= p} exp(logits[q])): the denominator over leaves not yet allocated.
    suffix_lse = np.logaddexp.accumulate(logits[::-1])[::-1]

    remaining = w
    for p, idx in enumerate(order):
        if remaining == 0:
            break
        share = math.exp(float(logits[p] - suffix_lse[p]))  # in (0, 1]; exactly 1.0 for the last leaf
        k = math.ceil(remaining * share - _CEIL_SLACK)
        k = min(max(k, 0), remaining)
        if p == n - 1:
            k = remaining  # the last leaf's share is 1 in exact arithmetic; do not let rounding lose width
        counts[int(idx)] = k
        remaining -= k
    return counts


def rebase_weights(
    rewards: Sequence[float] | np.ndarray,
    temperature: float = DEFAULT_TEMPERATURE,
    width: int | None = None,
) -> list[float]:
    """ETS's value of keeping each leaf: the REBASE allocation divided by its sum (O_i, App. B).

    ``width`` is the remaining width of this step. It defaults to the number of leaves because that is
    REBASE's invariant after the first step: the live leaves are the children sampled last step
    (which summed to the width) minus the finished ones (each of which shrank the width by one).

    Leaves that REBASE would give no child get weight 0. Raises ``ValueError`` for an empty reward
    list or a zero width, where the weights are undefined (the search is over).
    """
    r = _check_rewards(rewards)
    w = r.shape[0] if width is None else _check_width(width)
    if r.shape[0] == 0:
        raise ValueError("rebase_weights needs at least one leaf")
    if w == 0:
        raise ValueError("rebase_weights needs width >= 1: with no width left there is nothing to weigh")
    counts = rebase_allocation(r, w, temperature)
    total = sum(counts)  # == w by rebase_allocation's contract
    return [c / total for c in counts]


def next_width(width: int, n_finished: int) -> int:
    """Remaining width for the next step: REBASE (and ETS) shrink the width by one per finished leaf.

    A finished trajectory (answer reached, or token budget spent) has used one of the ``width``
    samples for good, so one fewer child is sampled from then on. The result is clamped at 0, which
    ends the search.
    """
    w = _check_width(width)
    f = _check_width(n_finished, "n_finished")
    return max(0, w - f)
