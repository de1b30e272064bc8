"""The scheduler's worker thread, written so that it never keeps its scheduler (or the model) alive.

Why its own module: the thread's body must not be a bound method of `Scheduler` (a thread running
``scheduler._loop`` holds its scheduler, and through it the backend, a whole model, for as long as it
runs, that is forever: a chat model built per request used to leak one model and one thread each).
`work` holds the scheduler only by weak reference while it waits, on the queue's condition and a
`WorkerSignal` that hold nothing of the scheduler, and takes a strong reference only while it takes
and decodes a batch (`Scheduler._step`). The scheduler's finalizer (`stop_worker`) wakes it to exit.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import deque
from typing import Protocol

from branchwise.backends.scheduler_jobs import Job

__all__ = ["Steps", "WorkerSignal", "stop_worker", "work"]

log = logging.getLogger(__name__)


class Steps(Protocol):
    """What the worker needs of its scheduler (`scheduler.Scheduler`): one round of taking what is
    queued and decoding it. A protocol, so that this module never names the scheduler's class and
    the dependency points one way (scheduler -> worker)."""

    def _step(self) -> None: ...


class WorkerSignal:
    """What the worker and its scheduler tell each other under the scheduler's `_cv` (this object
    holds no reference to the scheduler, so the worker can wait on it while the scheduler is freed)."""

    __slots__ = ("gone", "running", "stop")

    def __init__(self) -> None:
        self.running = False
        """a worker thread is running (set by `enqueue`, cleared by the worker as it exits)"""
        self.stop = False
        """the worker exits once the queue is empty (`park`, `close`)"""
        self.gone = False
        """the scheduler was freed: the worker exits, failing what is still queued"""


def stop_worker(cv: threading.Condition, signal: WorkerSignal) -> None:
    """The scheduler's finalizer: wake its worker so that it exits (the condition is re-entrant,
    so this is safe from whatever thread frees the scheduler)."""
    with cv:
        signal.gone = True
        cv.notify_all()


def work(ref: weakref.ref[Steps], cv: threading.Condition, queue: deque[Job], signal: WorkerSignal) -> None:
    """The worker thread: wait for work holding only the queue, then decode it through the scheduler.

    Why not a bound method: a thread running ``scheduler._loop`` holds its scheduler (and through it
    the backend, a whole model) for as long as it runs, that is forever; this one holds it only while
    a batch is taken and decoded, and exits when the scheduler is freed, parked or closed.
    """
    try:
        while True:
            with cv:
                while not queue and not signal.stop and not signal.gone:
                    cv.wait()
                if signal.gone or not queue:
                    signal.running = False
                    orphans = list(queue) if signal.gone else []
                    queue.clear()
                    break
            scheduler = ref()
            if scheduler is None:  # freed between the wait and now (its finalizer says so too)
                with cv:
                    signal.gone = True
                continue
            try:
                scheduler._step()
            finally:
                del scheduler
    except BaseException:  # pragma: no cover - `_step` delivers errors to jobs; this is a last resort
        with cv:
            signal.running = False
        log.exception("the scheduler's worker stopped")
        raise
    for job in orphans:
        job._fail(RuntimeError("the scheduler was freed before this request was decoded"))
