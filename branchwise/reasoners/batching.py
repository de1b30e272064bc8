"""Request batching: concurrent callers' decode requests merged into one backend `extend`.

Why its own module: batching is not DSPy-specific. `BranchwiseLM` (the DSPy adapter) submits to a
`Batcher` today; a server or `Reasoner.batch` can submit to the same kind of queue, which is where a
backend-level request scheduler grows from.

One worker thread owns all backend calls of a `Batcher`: it drains what queued up while the previous
batch ran, groups requests with equal decoding parameters, and decodes each group's branches in ONE
`extend` (each request's prompt is prefilled once and forked `n` times).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from branchwise.backends.base import Backend, DecodeParams, Generation, ShareMode

__all__ = ["BatchStats", "Batcher", "Job"]

log = logging.getLogger(__name__)


@dataclass
class BatchStats:
    """How well concurrent calls were batched (shared by an LM and all its copies).

    ``extend_calls`` counts backend `extend` calls made for DSPy requests; ``requests`` the requests
    they served; ``rows`` the branches decoded (a request with ``n`` samples is ``n`` rows).
    """

    extend_calls: int = 0
    requests: int = 0
    rows: int = 0
    max_requests_per_call: int = 0
    max_rows_per_call: int = 0
    histogram: dict[int, int] = field(default_factory=dict)
    """requests per `extend` call -> how many calls had that many"""

    @property
    def mean_requests_per_call(self) -> float:
        return self.requests / self.extend_calls if self.extend_calls else 0.0

    @property
    def mean_rows_per_call(self) -> float:
        return self.rows / self.extend_calls if self.extend_calls else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "extend_calls": self.extend_calls,
            "requests": self.requests,
            "rows": self.rows,
            "mean_requests_per_call": round(self.mean_requests_per_call, 3),
            "mean_rows_per_call": round(self.mean_rows_per_call, 3),
            "max_requests_per_call": self.max_requests_per_call,
            "max_rows_per_call": self.max_rows_per_call,
            "histogram": dict(sorted(self.histogram.items())),
        }


@dataclass
class Job:
    """One `forward` call waiting for the worker."""

    prompt: list[int]
    n: int
    params: DecodeParams
    share: ShareMode
    done: threading.Event = field(default_factory=threading.Event)
    generations: list[Generation] | None = None
    error: BaseException | None = None
    batch_requests: int = 0
    batch_rows: int = 0

    def group_key(self, batch_seeded: bool) -> tuple[Any, ...]:
        """Jobs with equal keys are decoded in one `extend`; a seeded sampling job stays alone unless
        `batch_seeded`: two seeded requests in one batch would share one random stream (see the
        `branchwise.reasoners.dspy` module docstring)."""
        alone = self.params.seed is not None and self.params.temperature > 0 and not batch_seeded
        return (self.params, self.share, id(self) if alone else None)


class Batcher:
    """A request queue drained by one worker thread that owns all backend calls for DSPy requests.

    Why one worker rather than a lock: a lock would serialise the threads one request at a time;
    the worker instead takes everything that queued up while the previous batch ran (plus whatever
    arrives within `window_s`), so B threads cost one batched decode instead of B sequential ones.
    """

    def __init__(self, backend: Backend, *, max_rows: int, max_requests: int, window_s: float) -> None:
        self.backend = backend
        self.max_rows = max_rows
        self.max_requests = max_requests
        self.window_s = window_s
        self.batch_seeded = False
        self.stats = BatchStats()
        self._cv = threading.Condition()
        self._queue: deque[Job] = deque()
        self._worker: threading.Thread | None = None
        self._closed = False

    def submit(self, job: Job) -> list[Generation]:
        with self._cv:
            if self._closed:
                raise RuntimeError("this BranchwiseLM was closed")
            self._queue.append(job)
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(
                    target=self._loop, name="branchwise-dspy-batcher", daemon=True
                )
                self._worker.start()
            self._cv.notify_all()
        job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.generations is not None
        return job.generations

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def _take(self) -> list[Job] | None:
        """Wait for work; return a batch bounded by `max_rows`/`max_requests` (None once closed)."""
        with self._cv:
            while not self._queue and not self._closed:
                self._cv.wait()
            if not self._queue:
                return None
            # Threads woken by the previous batch resubmit within milliseconds of each other: keep
            # collecting while calls keep arriving (each arrival restarts a `window_s` gap, capped at
            # 10 windows), so they join this batch instead of trickling into the next ones. A lone
            # serial caller pays one window per call.
            start = time.monotonic()
            seen = len(self._queue)
            gap_end = start + self.window_s
            while self._rows_queued() < self.max_rows and len(self._queue) < self.max_requests:
                now = time.monotonic()
                left = min(gap_end, start + 10 * self.window_s) - now
                if left <= 0:
                    break
                self._cv.wait(left)
                if len(self._queue) != seen:
                    seen = len(self._queue)
                    gap_end = time.monotonic() + self.window_s
            batch: list[Job] = []
            rows = 0
            while self._queue and len(batch) < self.max_requests:
                job = self._queue[0]
                if batch and rows + job.n > self.max_rows:
                    break
                batch.append(self._queue.popleft())
                rows += job.n
            return batch

    def _rows_queued(self) -> int:
        return sum(job.n for job in self._queue)

    def _loop(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            groups: dict[tuple[Any, ...], list[Job]] = {}
            for job in batch:
                groups.setdefault(job.group_key(self.batch_seeded), []).append(job)
            for jobs in groups.values():
                self._run_group(jobs)

    def _run_group(self, jobs: list[Job]) -> None:
        """Prefill each prompt once, fork it n times and decode all branches in ONE `extend`."""
        backend = self.backend
        children: list[int] = []
        try:
            spans = []
            for job in jobs:
                root = backend.prefill(job.prompt)
                # one sample shares its prompt with nobody: a plain row batches better than a
                # one-row shared segment (each shared segment is one more attention product per layer)
                share = job.share if job.n > 1 else "none"
                try:
                    kids = backend.fork(root, job.n, share=share)
                finally:
                    # the children keep the root's KV alive; releasing it now frees it with them
                    backend.release([root])
                spans.append((len(children), len(children) + len(kids)))
                children.extend(kids)
            gens = backend.extend(children, jobs[0].params)
            rows = len(children)
            for job, (a, b) in zip(jobs, spans, strict=True):
                job.generations = gens[a:b]
                job.batch_requests, job.batch_rows = len(jobs), rows
            st = self.stats
            st.extend_calls += 1
            st.requests += len(jobs)
            st.rows += rows
            st.max_requests_per_call = max(st.max_requests_per_call, len(jobs))
            st.max_rows_per_call = max(st.max_rows_per_call, rows)
            st.histogram[len(jobs)] = st.histogram.get(len(jobs), 0) + 1
        except BaseException as exc:  # delivered to every waiting caller, never lost in the worker
            for job in jobs:
                job.error = exc
        finally:
            if children:
                try:
                    backend.release(children)
                except Exception:  # pragma: no cover - release of nodes the failure already freed
                    log.debug("release after a failed batch", exc_info=True)
            for job in jobs:
                job.done.set()
