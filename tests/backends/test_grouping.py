"""Batch grouping by prefill length (SkipKV §4.3, Eq. 12): never pads more than any other order."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from branchwise.backends.grouping import group_by_length, padding_tokens


def _chunks(order: Sequence[int], size: int) -> list[list[int]]:
    return [list(order[i : i + size]) for i in range(0, len(order), size)]


def test_grouping_sorts_by_prefill_length() -> None:
    lengths = [10, 10, 1, 1, 1]
    assert padding_tokens(_chunks(range(5), 2), lengths) == 0
    groups = group_by_length(lengths, 2)
    assert padding_tokens(groups, lengths) == 0  # the short batch goes where it pads least
    assert group_by_length([5, 1, 3, 2], 2) == [[1, 3], [2, 0]]
    assert padding_tokens([[1, 3], [2, 0]], [5, 1, 3, 2]) == 1 + 2
    with pytest.raises(ValueError, match="batch_size=0"):
        group_by_length([1], 0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 60), max_size=25),
    st.integers(1, 6),
    st.randoms(use_true_random=False),
)
def test_grouping_never_pads_more_than_any_order(lengths: list[int], batch_size: int, rng) -> None:
    groups = group_by_length(lengths, batch_size)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert sorted(len(g) for g in groups) == sorted(len(g) for g in _chunks(range(len(lengths)), batch_size))
    padding = padding_tokens(groups, lengths)
    assert padding <= padding_tokens(_chunks(range(len(lengths)), batch_size), lengths)
    shuffled = list(range(len(lengths)))
    rng.shuffle(shuffled)
    assert padding <= padding_tokens(_chunks(shuffled, batch_size), lengths)
