"""Ordering many prompts into batches of similar length (the SkipKV paper, §4.3, Eq. 12).

Why its own module: it is batch planning for whoever sends many problems at once (the SkipKV
benchmark today), pure arithmetic on prompt lengths; it depends on no acceleration and no torch.
"""

from __future__ import annotations

from collections.abc import Sequence


def group_by_length(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """§4.3: batches of indices with similar prefill lengths, so left padding eats less KV budget.

    Indices are sorted by length (ascending, stable) and cut into batches of `batch_size`. When
    len % batch_size leaves one short batch, the paper puts it last; we put it wherever Eq. 12's
    total padding is smallest (last on ties). Why: with the short batch fixed at the end, sorting can
    pad *more* than the caller's order ([10, 10, 1, 1, 1] in twos: 0 tokens unsorted, 9 sorted);
    with the best position no ordering of the same batch sizes pads less, because for given sizes
    sorted contiguous batches are optimal.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    sizes = [batch_size] * (len(order) // batch_size)
    short = len(order) % batch_size
    if short:
        sizes.insert(_short_batch_slot([lengths[i] for i in order], batch_size, short), short)
    groups, start = [], 0
    for size in sizes:
        groups.append(order[start : start + size])
        start += size
    return groups


def _short_batch_slot(sorted_lengths: list[int], batch_size: int, short: int) -> int:
    """Where among the full batches the short one pads least: Σ size·max over batches, in O(n/bs)."""
    q = len(sorted_lengths) // batch_size
    # full batch g before the short one ends at (g+1)·bs − 1; after it, shifted by `short`
    before = [batch_size * sorted_lengths[(g + 1) * batch_size - 1] for g in range(q)]
    after = [batch_size * sorted_lengths[short + (g + 1) * batch_size - 1] for g in range(q)]
    suffix = [0] * (q + 1)
    for g in range(q - 1, -1, -1):
        suffix[g] = suffix[g + 1] + after[g]
    best, best_cost, prefix = q, None, 0
    for p in range(q + 1):
        cost = prefix + short * sorted_lengths[p * batch_size + short - 1] + suffix[p]
        if best_cost is None or cost <= best_cost:
            best, best_cost = p, cost
        if p < q:
            prefix += before[p]
    return best


def padding_tokens(groups: Sequence[Sequence[int]], lengths: Sequence[int]) -> int:
    """Eq. 12 summed: Σ over batches of Σ (longest prefill in the batch − each prefill)."""
    total = 0
    for group in groups:
        if group:
            longest = max(lengths[i] for i in group)
            total += sum(longest - lengths[i] for i in group)
    return total
