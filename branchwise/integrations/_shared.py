"""What the integrations share in one process: one loaded model per (model, device, dtype), one request
scheduler per backend, and each front end's counted use of them.

Why: a front end given a model name (`ChatBranchwise(model=...)`, DSPy's `BranchwiseEngine` and
`BranchwiseLM`) gets the process's loaded backend of that name (`backends.hf.registry`), and every
front end on one backend submits to one scheduler, so their requests merge into shared decode passes
instead of contending for the model from separate worker threads.

Nothing here keeps a model alive: the registry holds backends weakly (but for the last used model,
kept warm for an idle period after its last use ends: a use of a registry model tells it when),
this module holds schedulers weakly, and the scheduler's worker holds its scheduler only while it
decodes. A front end's
`ModelUse` holds the backend and the scheduler; when the last use of a scheduler is closed its
worker thread stops at once, and when the front ends are freed, the scheduler, then the backend and
its weights are. A use closed while others remain leaves the scheduler running for them.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any

from branchwise.backends.base import Backend, Generation
from branchwise.backends.scheduler import BatchStats, Job, Scheduler

__all__ = ["ModelUse", "Released", "shared_scheduler", "use_model", "users"]

CLOSE_WAIT_S = 30.0
"""How long `ModelUse.close` waits for the worker thread to finish what is queued and end."""

_lock = threading.RLock()  # re-entrant: a use's finalizer may run in a thread that holds it (gc)
_by_backend: weakref.WeakValueDictionary[int, Scheduler] = weakref.WeakValueDictionary()
"""id(backend) -> its scheduler. By id and weakly: the scheduler holds its backend, so a backend
key or a strong value would keep both alive for ever (the id is never reused while it lives)."""
_users: weakref.WeakKeyDictionary[Scheduler, int] = weakref.WeakKeyDictionary()
"""Open `ModelUse`s of each shared scheduler."""


def shared_scheduler(backend: Backend) -> Scheduler:
    """The scheduler that every integration on `backend` submits to (created on first use, shared
    while anyone holds it).

    Why shared: two front ends on one model (a DSPy engine and a LangChain chat model, or several
    copies of either) would otherwise each own a worker thread and decode in separate passes that
    contend for the backend; one queue merges all their requests.
    """
    with _lock:
        sched = _by_backend.get(id(backend))
        if sched is None or sched.backend is not backend:
            sched = Scheduler(backend, name="branchwise-scheduler")
            _by_backend[id(backend)] = sched
        return sched


def users(scheduler: Scheduler) -> int:
    """How many open `ModelUse`s share `scheduler`."""
    with _lock:
        return _users.get(scheduler, 0)


class Released:
    """What a closed front end holds instead of its backend and scheduler: any use says so."""

    def __init__(self, owner: str) -> None:
        self._owner = owner

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and friends probe for optional hooks
            raise AttributeError(name)
        raise RuntimeError(f"{self._owner} was closed; build a new one (it shares the model if it is loaded)")

    def __repr__(self) -> str:
        return f"Released({self._owner!r})"


def _release(
    ref: weakref.ref[Scheduler], counted: bool, timeout: float | None, ended: Callable[[], None] | None
) -> None:
    """One use ends: `ended` is told (the registry restarts its model's idle period), and the last
    use of a shared scheduler parks its worker (and waits for it when `timeout` is set: an explicit
    close; a use freed by the garbage collector does not wait)."""
    if ended is not None:
        ended()
    sched = ref()
    if sched is None or not counted:
        return
    with _lock:
        left = _users.get(sched, 1) - 1
        if left > 0:
            _users[sched] = left
        else:
            _users.pop(sched, None)
    if left <= 0:
        sched.park(timeout)


class ModelUse:
    """One front end's hold on a backend and the scheduler its requests go through.

    `close()` (or the end of a ``with`` block) drops the hold at once: the front end's backend and
    scheduler references are released, and if it was the scheduler's last use, its worker thread
    stops (it restarts if someone still holding the scheduler sends a request). A use that is freed
    without being closed counts down the same way. A scheduler of the caller's own (`scheduler=`)
    is not counted: its owner parks or closes it.
    """

    def __init__(
        self,
        backend: Backend,
        scheduler: Scheduler | None = None,
        *,
        owner: str,
        ended: Callable[[], None] | None = None,
    ) -> None:
        counted = scheduler is None
        sched = shared_scheduler(backend) if scheduler is None else scheduler
        self.owner = owner
        self._backend: Backend | None = backend
        self._scheduler: Scheduler | None = sched
        self._stats = sched.stats
        if counted:
            with _lock:
                _users[sched] = _users.get(sched, 0) + 1
        self._finalizer = weakref.finalize(self, _release, weakref.ref(sched), counted, None, ended)

    @property
    def closed(self) -> bool:
        return self._scheduler is None

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise RuntimeError(f"{self.owner} was closed")
        return self._backend

    @property
    def scheduler(self) -> Scheduler:
        if self._scheduler is None:
            raise RuntimeError(f"{self.owner} was closed")
        return self._scheduler

    @property
    def stats(self) -> BatchStats:
        """The scheduler's batching statistics (the last ones seen, once closed)."""
        if self._scheduler is not None:
            self._stats = self._scheduler.stats
        return self._stats

    def submit(self, job: Job) -> list[Generation]:
        return self.scheduler.submit(job)

    async def submit_async(self, job: Job) -> list[Generation]:
        return await self.scheduler.submit_async(job)

    def enqueue(self, job: Job) -> Job:
        return self.scheduler.enqueue(job)

    def cancel(self, job: Job) -> None:
        """Cancel `job` (a no-op once closed: the job was already decoded or is decoding to its end)."""
        if self._scheduler is not None:
            self._scheduler.cancel(job)

    def close(self, timeout: float | None = CLOSE_WAIT_S) -> None:
        """Drop this hold now (idempotent); the last use of the scheduler waits up to `timeout`
        seconds for its worker thread to end."""
        detached = self._finalizer.detach()
        self._backend = self._scheduler = None
        if detached is not None:
            _, _, (ref, counted, _, ended), _ = detached
            _release(ref, counted, timeout, ended)

    def __enter__(self) -> ModelUse:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def use_model(
    model: str | os.PathLike[str] | None,
    backend: Backend | None,
    *,
    owner: str,
    device: str = "auto",
    dtype: str = "auto",
    scheduler: Scheduler | None = None,
) -> ModelUse:
    """A front end's use of `backend`, or, when it is None, of the process's loaded `model` (loaded
    now if nobody holds it: `backends.hf.registry.shared_backend`; the end of this use restarts its
    idle period there)."""
    if backend is not None:
        return ModelUse(backend, scheduler, owner=owner)
    from branchwise.backends.hf import registry

    key = registry.model_key(model, device=device, dtype=dtype)
    loaded = registry.shared_backend(model, device=device, dtype=dtype)
    return ModelUse(loaded, scheduler, owner=owner, ended=functools.partial(registry.touch, key))
