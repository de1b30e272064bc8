"""One request scheduler per backend, shared by every integration that runs on it."""

from __future__ import annotations

import threading
import weakref
from typing import Any

from branchwise.backends.base import Backend
from branchwise.backends.scheduler import Scheduler

__all__ = ["shared_scheduler"]

_lock = threading.Lock()
_by_backend: weakref.WeakKeyDictionary[Any, Scheduler] = weakref.WeakKeyDictionary()


def shared_scheduler(backend: Backend) -> Scheduler:
    """The scheduler that every integration on `backend` submits to (created on first use).

    Why shared: two front ends on one model (a DSPy engine and a LangChain chat model, or several
    copies of either) would otherwise each own a worker thread and decode in separate passes that
    contend for the backend; one queue merges all their requests. A backend that cannot be weakly
    referenced gets a fresh scheduler per call.
    """
    with _lock:
        try:
            sched = _by_backend.get(backend)
        except TypeError:  # not weak-referenceable / hashable: nothing to share by
            return Scheduler(backend, name="branchwise-scheduler")
        if sched is None:
            sched = Scheduler(backend, name="branchwise-scheduler")
            _by_backend[backend] = sched
        return sched
