"""Shared helpers of the benchmark scripts: timing medians, fixed-length prompts, JSON output.

Why: every benchmark prints one JSON object as its last line, with medians over repeats after a
warm-up and ratios measured in the same run (these machines are noisy: compare ratios).
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

PASSAGE = (
    "A farmer keeps careful records of every field, every harvest and every sale. In the first "
    "season the north field yielded 124 bushels of wheat and the south field 87 bushels of barley; "
    "a third of the barley was sold at the market in town while the rest was stored for winter. "
    "The farmer's neighbour borrowed 15 bushels of wheat and promised to return twice as much after "
    "the next harvest. In the second season the yields rose by a fifth, prices fell by a tenth, and "
    "the stored barley lost 6 bushels to damp. "
)


def exact_tokens(backend: Any, text: str, n: int) -> list[int]:
    """Exactly `n` token ids of `text` repeated as often as needed."""
    ids: list[int] = []
    while len(ids) < n:
        ids += backend.encode(text)
    return ids[:n]


def branch_suffixes(backend: Any, b: int, length: int) -> list[list[int]]:
    """`b` distinct branch hints of exactly `length` tokens each (RKSC's branch-specific suffix)."""
    return [
        exact_tokens(backend, f" Hint {i}: reason about part {i} of the records, then answer. ", length)
        for i in range(b)
    ]


def median_time(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> tuple[float, Any]:
    """Median wall time of `fn` over `repeats` runs after `warmup` runs; returns (median, last output)."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def machine() -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
    }


def emit(obj: dict[str, Any]) -> None:
    """Print the benchmark's JSON object as the last line of output."""
    print(json.dumps(obj, sort_keys=False))
