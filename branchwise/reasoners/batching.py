"""Several questions run together (`Reasoner.batch`): the threads they run in, and the progress a
person watching sees.

Why progress in tokens: a question's run is one long unit of work (a strategy's decodes, minutes on
a small machine), so a bar over questions sat at 0/1 until the end and said nothing. Every decode
step of every run is shown to `DecodeProgress` (`extend`'s ``on_step`` listener), which counts the
tokens decoded and the branches decoding now, so the bar moves with each step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Sequence
from types import TracebackType
from typing import Any

from tqdm.auto import tqdm

from branchwise.backends.base import DecodeStep

__all__ = ["BATCH_ROWS", "DecodeProgress", "run_threads"]

BATCH_ROWS = 64
"""Rows `Reasoner.batch` decodes together at most (the scheduler's row bound)."""


class DecodeProgress:
    """A progress bar in tokens decoded, with the branches decoding now and the questions answered.

    It is the runs' ``on_step`` listener: called on the decoding thread after each step, it only
    counts (under a lock: runs in threads of their own each report their steps) and returns at once.
    """

    def __init__(self, questions: int, *, disable: bool = False) -> None:
        self.questions = questions
        self.answered = 0
        self.tokens = 0
        self.branches = 0
        self._lock = threading.Lock()
        self._bar = tqdm(desc="reasoning", unit="tok", disable=disable, dynamic_ncols=True)
        self._show()

    def __call__(self, step: DecodeStep) -> Collection[int] | None:
        new = sum(len(tokens) for tokens in step.tokens.values())
        with self._lock:
            self.tokens += new
            self.branches = len(step.tokens)
            self._bar.update(new)
            self._show()
        return None  # it stops no row

    def answered_one(self) -> None:
        with self._lock:
            self.answered += 1
            self.branches = 0
            self._show()

    def _show(self) -> None:
        self._bar.set_postfix_str(
            f"{self.branches} branches decoding, {self.answered}/{self.questions} questions", refresh=False
        )

    def __enter__(self) -> DecodeProgress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._bar.refresh()
        self._bar.close()


def run_threads(fns: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run each function in its own thread; results in order, the first error re-raised."""
    out: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out
