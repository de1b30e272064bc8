"""The backend-level request scheduler: batching, bounds, cancellation and per-request failures.

A fake backend records every call, so the tests assert what reached the backend, not timings.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from branchwise.backends.base import DecodeParams, Generation
from branchwise.backends.scheduler import Cancelled, InvalidPrompt, Job, QueueFull, Scheduler

GREEDY = DecodeParams(max_tokens=4)


class RecordingBackend:
    """Rejects prompts holding a negative id (as a backend rejects ids outside its vocabulary)."""

    name = "recording"

    def __init__(self) -> None:
        self.next = 0
        self.live: set[int] = set()
        self.prompts: dict[int, list[int]] = {}
        self.extends: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.in_extend = threading.Event()

    def prefill(self, ids: Sequence[int]) -> int:
        if any(i < 0 for i in ids):
            raise ValueError(f"token id {min(ids)} is outside the vocabulary")
        self.next += 1
        self.live.add(self.next)
        self.prompts[self.next] = list(ids)
        return self.next

    def fork(self, node: int, n: int, share: str | None = None) -> list[int]:
        return [self.prefill(self.prompts[node]) for _ in range(n)]

    def extend(self, nodes: Sequence[int], params: DecodeParams) -> list[Generation]:
        self.in_extend.set()
        assert self.gate.wait(30)
        self.extends.append(len(nodes))
        return [
            Generation(n, [len(self.prompts[n])], str(len(self.prompts[n])), [1.0], [0.0], "eos")
            for n in nodes
        ]

    def release(self, nodes: Sequence[int]) -> None:
        self.live.difference_update(nodes)


def test_a_bad_prompt_fails_alone_and_its_batch_mates_are_decoded() -> None:
    backend = RecordingBackend()
    backend.gate.clear()
    scheduler = Scheduler(backend, window_s=0.0)  # type: ignore[arg-type]
    blocker = scheduler.enqueue(Job([1], 1, GREEDY))  # holds the worker while the next three queue up
    assert backend.in_extend.wait(30)
    jobs = [scheduler.enqueue(Job(p, 2, GREEDY)) for p in ([1, 2], [-1], [1, 2, 3])]
    backend.gate.set()
    assert blocker.result()[0].text == "1"
    assert [g.text for g in jobs[0].result()] == ["2", "2"]
    with pytest.raises(InvalidPrompt, match="outside the vocabulary"):
        jobs[1].result()
    assert [g.text for g in jobs[2].result()] == ["3", "3"]
    assert backend.extends == [1, 4]  # the two good requests shared one decode
    assert backend.live == set()
    scheduler.close(timeout=10)


def test_bounded_queue_and_cancellation() -> None:
    backend = RecordingBackend()
    backend.gate.clear()
    scheduler = Scheduler(backend, window_s=0.0, max_queued_rows=4)  # type: ignore[arg-type]
    running = scheduler.enqueue(Job([1], 1, GREEDY))
    assert backend.in_extend.wait(30)
    waiting = scheduler.enqueue(Job([7, 7], 3, GREEDY))
    with pytest.raises(QueueFull, match="limit 4"):
        scheduler.enqueue(Job([5], 2, GREEDY))
    fits = scheduler.enqueue(Job([5], 1, GREEDY))  # 3 + 1 rows still fit
    scheduler.cancel(waiting)
    with pytest.raises(Cancelled):
        waiting.result()
    backend.gate.set()
    running.result()
    assert fits.result()[0].text == "1"
    scheduler.close(timeout=10)
    assert scheduler.stats.rejected == 1 and scheduler.stats.cancelled == 1
    assert [7, 7] not in backend.prompts.values()  # the cancelled request was never prefilled
    with pytest.raises(RuntimeError, match="closed"):
        scheduler.enqueue(Job([1], 1, GREEDY))
