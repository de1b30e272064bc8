"""The backend-level request scheduler: batching, bounds, cancellation and per-request failures.

A fake backend records every call, so the tests assert what reached the backend, not timings.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest
from testkit import FakeBackend

from branchwise.backends.base import DecodeParams, DecodeStep, Generation, SupportsAdmission
from branchwise.backends.scheduler import Cancelled, InvalidPrompt, Job, QueueFull, Scheduler

GREEDY = DecodeParams(max_tokens=4)


class RecordingBackend(FakeBackend):
    """Answers each row with its prompt's length; rejects prompts holding a negative id (as a backend
    rejects ids outside its vocabulary); `extend` waits while the test holds `gate` closed."""

    name = "recording"

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.in_extend = threading.Event()

    def prefill(self, ids: Sequence[int]) -> int:
        if any(i < 0 for i in ids):
            raise ValueError(f"token id {min(ids)} is outside the vocabulary")
        return super().prefill(ids)

    def reply(self, prompt: list[int]) -> str:
        return str(len(prompt))

    def extend(self, nodes: Sequence[int], params: DecodeParams, on_step: Any = None) -> list[Generation]:
        self.in_extend.set()
        assert self.gate.wait(30)
        return super().extend(nodes, params)


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
    assert [7, 7] not in backend.prefilled  # the cancelled request was never prefilled
    with pytest.raises(RuntimeError, match="closed"):
        scheduler.enqueue(Job([1], 1, GREEDY))


class SteppingBackend(RecordingBackend):
    """Decodes ``len(prompt)`` tokens per branch, one per step, telling `on_step` after each step
    and stopping the rows it gives back (as the local backend's decode loop does)."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled_at: dict[int, int] = {}  # node -> tokens it had when it was stopped

    def extend(self, nodes: Sequence[int], params: DecodeParams, on_step=None) -> list[Generation]:
        self.in_extend.set()
        assert self.gate.wait(30)
        self.extends.append(len(nodes))
        outs: list[list[int]] = [[] for _ in nodes]
        gens: list[Generation | None] = [None] * len(nodes)
        alive = set(range(len(nodes)))

        def gen(i: int, reason: str) -> Generation:
            return Generation(nodes[i], outs[i], str(len(outs[i])), [1.0] * len(outs[i]), [0.0], reason)

        while alive:
            tokens, finished = {}, {}
            for i in sorted(alive):
                outs[i].append(len(outs[i]) + 1)
                tokens[i] = outs[i][-1:]
                if len(outs[i]) == len(self.prompts[nodes[i]]):
                    gens[i] = finished[i] = gen(i, "eos")
            alive -= set(finished)
            for i in (on_step(DecodeStep(tokens, finished)) if on_step else None) or []:
                if i in alive:
                    alive.discard(i)
                    gens[i] = gen(i, "cancelled")
                    self.cancelled_at[nodes[i]] = len(outs[i])
        return [g for g in gens if g is not None]


def test_steps_reach_their_job_and_a_job_is_answered_when_its_branches_end() -> None:
    backend = SteppingBackend()
    backend.gate.clear()
    scheduler = Scheduler(backend, window_s=0.0)  # type: ignore[arg-type]
    blocker = scheduler.enqueue(Job([9], 1, GREEDY))  # the next jobs queue up and share one batch
    assert backend.in_extend.wait(30)
    heard: dict[str, list[tuple[dict[int, list[int]], list[int]]]] = {"short": [], "long": []}
    short_done_at: list[bool] = []

    def listen(name: str):
        def on_step(step: DecodeStep) -> None:
            heard[name].append((step.tokens, sorted(step.finished)))
            if name == "long":
                short_done_at.append(short.done.is_set())

        return on_step

    short = scheduler.enqueue(Job([1, 2], 2, GREEDY, on_step=listen("short")))
    long = scheduler.enqueue(Job([1, 2, 3, 4], 1, GREEDY, on_step=listen("long")))
    backend.gate.set()
    blocker.result()
    assert [g.token_ids for g in short.result()] == [[1, 2], [1, 2]]
    assert long.result()[0].token_ids == [1, 2, 3, 4]
    assert backend.extends == [1, 3]  # one decode for both jobs
    # each job hears its own branches, by its own indices, step by step
    assert heard["short"] == [({0: [1], 1: [1]}, []), ({0: [2], 1: [2]}, [0, 1])]
    assert heard["long"] == [({0: [t]}, [0] if t == 4 else []) for t in (1, 2, 3, 4)]
    # the short job was answered at its last step (after that step's listeners), while the long
    # one still decoded
    assert short_done_at == [False, False, True, True]
    assert backend.live == set()
    scheduler.close(timeout=10)


def test_a_job_cancelled_mid_batch_stops_its_branches_at_the_next_step() -> None:
    backend = SteppingBackend()
    scheduler = Scheduler(backend, window_s=0.0)  # type: ignore[arg-type]

    def leave_after_two(step: DecodeStep) -> None:
        if step.tokens.get(0) == [2]:
            scheduler.cancel(quitter)  # as the server does when its client disconnects

    quitter = Job([5] * 10, 2, GREEDY, on_step=leave_after_two)
    scheduler.enqueue(quitter)
    with pytest.raises(Cancelled, match="while it was decoded"):
        quitter.result()
    stayer = scheduler.submit(Job([5] * 3, 1, GREEDY))
    assert stayer[0].token_ids == [1, 2, 3]
    assert sorted(backend.cancelled_at.values()) == [2, 2]  # 2 of 10 tokens, then stopped
    assert scheduler.stats.cancelled == 1
    assert backend.live == set()
    scheduler.close(timeout=10)


def test_a_failing_step_listener_does_not_stop_the_batch() -> None:
    backend = SteppingBackend()
    scheduler = Scheduler(backend, window_s=0.0)  # type: ignore[arg-type]

    def broken(step: DecodeStep) -> None:
        raise RuntimeError("consumer bug")

    assert [g.token_ids for g in scheduler.submit(Job([1, 2, 3], 2, GREEDY, on_step=broken))] == [
        [1, 2, 3]
    ] * 2
    scheduler.close(timeout=10)


def test_a_request_queued_mid_decode_joins_it_and_decodes_as_it_would_alone(tiny_backend) -> None:
    """Continuous batching on the local backend: requests that arrive while a batch decodes are
    admitted into that `extend` (one call for all), even with other decoding parameters (each row
    decodes with its own), and their greedy tokens equal a serial run's."""
    backend = tiny_backend
    params = DecodeParams(max_tokens=8, min_tokens=8)
    other = DecodeParams(max_tokens=3, stop=("\n",))
    prompts = [backend.encode("What is 12 + 7?"), backend.encode("Name a prime number.")]
    serial = Scheduler(backend, window_s=0.0)
    alone = [[g.token_ids for g in serial.submit(Job(p, 2, params))] for p in prompts]
    alone_other = [g.token_ids for g in serial.submit(Job(prompts[0], 1, other))]
    serial.close(5)

    sched = Scheduler(backend, window_s=0.0)
    late: list[Job] = []

    def arrive(step: DecodeStep) -> None:  # requests arriving while the first one decodes
        if not late:
            late.append(sched.enqueue(Job(prompts[1], 2, params)))
            late.append(sched.enqueue(Job(prompts[0], 1, other)))

    first = sched.enqueue(Job(prompts[0], 2, params, on_step=arrive)).result()
    got = [[g.token_ids for g in gens] for gens in (first, late[0].result())]
    got_other = [g.token_ids for g in late[1].result()]
    sched.close(5)
    assert got == alone and got_other == alone_other and len(got_other[0]) <= 3
    assert sched.stats.admitted == 2 and sched.stats.extend_calls == 1 and sched.stats.requests == 3
    assert sched.stats.histogram == {3: 1} and sched.stats.max_rows_per_call == 5
    assert late[0].batch_requests == 2 and late[0].batch_rows == 4


def test_continuous_batching_is_declared_not_read_from_a_signature(tiny_backend) -> None:
    """A backend says whether its decode takes rows in (`SupportsAdmission.admits_rows`): the
    local backend does, a backend that never says does not whatever its `extend` takes, and a run's
    view through another scheduler (which forwards every other attribute, the declaration
    included, but not `admit`) says it does not, so a scheduler over it decodes without `admit`."""
    assert isinstance(tiny_backend, SupportsAdmission) and tiny_backend.admits_rows
    assert not isinstance(RecordingBackend(), SupportsAdmission)
    outer = Scheduler(tiny_backend, window_s=0.0)
    view = outer.view(tiny_backend)
    inner = Scheduler(view, window_s=0.0)
    assert outer.admits and not inner.admits
    gens = inner.enqueue(Job(tiny_backend.encode("What is 12 + 7?"), 2, DecodeParams(max_tokens=3))).result()
    assert len(gens) == 2 and all(g.token_ids for g in gens)
    inner.close(5)
    outer.close(5)


def test_continuous_false_waits_for_the_batch_to_end(tiny_backend) -> None:
    assert Scheduler(tiny_backend).admits and not Scheduler(RecordingBackend()).admits  # no `admit`
    sched = Scheduler(tiny_backend, window_s=0.0, continuous=False)
    assert not sched.admits
    params = DecodeParams(max_tokens=4, min_tokens=4)
    prompt = tiny_backend.encode("What is 12 + 7?")
    late: list[Job] = []

    def arrive(step: DecodeStep) -> None:
        if not late:
            late.append(sched.enqueue(Job(prompt, 1, params)))

    sched.enqueue(Job(prompt, 1, params, on_step=arrive)).result()
    late[0].result()
    sched.close(5)
    assert sched.stats.admitted == 0 and sched.stats.extend_calls == 2


class ReleaseLog:
    """The tiny local backend, recording each `release` and whether an `extend` was running."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.calls: list[tuple[list[int], bool]] = []
        self.decoding = False
        self.first: list[int] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def extend(
        self,
        nodes: Sequence[int],
        params: DecodeParams,
        on_step: object = None,
        admit: object = None,
        row_params: object = None,
    ) -> list[Generation]:
        self.first = self.first or list(nodes)
        self.decoding = True
        try:
            return self.inner.extend(nodes, params, on_step, admit, row_params=row_params)
        finally:
            self.decoding = False

    def release(self, nodes: Sequence[int]) -> None:
        self.calls.append((list(nodes), self.decoding))
        self.inner.release(nodes)


def test_an_answered_request_frees_its_kv_while_the_call_goes_on(tiny_backend) -> None:
    """Under continuous batching one `extend` can run as long as requests keep coming: a request's
    nodes are released at the first step after the batch was re-assembled without its rows, not when
    the call ends (else the KV of every answered request piles up), and never twice."""
    backend = ReleaseLog(tiny_backend)
    sched = Scheduler(backend, window_s=0.0)
    params = DecodeParams(max_tokens=6, min_tokens=6)
    prompt = tiny_backend.encode("What is 12 + 7?")
    late: list[Job] = []

    def first_steps(step: DecodeStep) -> None:
        # B joins at the first step; when A ends, C joins and the batch is re-assembled without A
        if not late or step.finished:
            late.append(sched.enqueue(Job(prompt, 1, params)))

    sched.enqueue(Job(prompt, 1, params, on_step=first_steps)).result()
    for job in late:
        job.result()
    sched.close(5)
    a = backend.first[0]
    during = [nodes for nodes, decoding in backend.calls if decoding and a in nodes]
    assert during == [[a]]  # released mid-call, alone
    released = [n for nodes, _ in backend.calls for n in nodes]
    assert len(released) == len(set(released)) and sched.stats.admitted == 2
