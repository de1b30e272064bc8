"""The one thread of a process on which branchwise runs torch: the local backend's loading,
prefill and decode, and the models a reasoner runs beside it (a PRM verifier, the sentence embedder
of ETS's clustering).

Why: torch's CPU kernels parallelise with OpenMP, and GNU OpenMP (what torch's CPU wheels use)
keeps a pool of worker threads for every thread that ever ran a parallel region. Once a process
has more OpenMP threads than cores, OpenMP stops letting idle workers spin between parallel regions
and puts them to sleep at once, so each of the thousands of small regions of a decode step waits
for its workers to wake. A second thread that computes is enough: a model loaded on the main
thread and decoded on a scheduler's thread decoded at 14-16 tokens/s on a 2-core machine, against
22-24 with both on one thread (whichever). Serving computes on several threads by nature (the
scheduler's worker, the threads that score log-probabilities or run strategies for requests, the
thread that loaded the model), and a strategy run embeds or scores with other models on its own
thread while the backend decodes; so every such computation is handed to this one thread instead
(`on_compute_thread`, `COMPUTE.run`); a call made on it (a callback of a decode calling back into
the backend) runs at once.

The thread starts on first use and is a daemon. A caller interrupted while it waits (Ctrl-C) gets
its `KeyboardInterrupt` at once: a computation of its still queued is dropped, and the one running
for it stops at its next check (`COMPUTE.check()`, which the decode loop calls every step and a
chunked prefill every chunk) with a `KeyboardInterrupt` of its own, so its cleanup runs there and
the caller's cleanup (releasing its nodes) runs right after, not once a long decode has ended. The caller's torch
thread count goes with each call (OpenMP's count is per thread), so `torch.set_num_threads` in the
caller still decides how many cores a computation uses.

Who else computes in the process watches this thread (`watch`): it says when computing starts after
an idle spell and when it has been idle for `IDLE_AFTER_S`, so that work that may wait (the step
compiler's worker process) yields the cores while a request computes, on a machine too small to
give it cores of its own.

At exit the thread is stopped and joined before the interpreter finalises (`stop`, registered with
`atexit`): the computation running stops at its next check, queued ones fail with `ProcessExiting`,
and later calls from other threads are refused. Why: a daemon thread still inside a torch call when
the interpreter finalises is ended by Python as it returns, through C++ frames that cannot be
unwound, and the process aborts ("terminate called without an active exception", exit status 134:
seen with a decode still running on this thread as a script ended).
"""

from __future__ import annotations

import atexit
import functools
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, ParamSpec, TypeVar

import torch

__all__ = ["EXIT_WAIT_S", "ComputeThread", "ProcessExiting", "on_compute_thread"]

EXIT_WAIT_S = 30.0
"""Longest wait at exit for the computation running then to reach its next check (a decode step or
a prefill chunk: well under a second on a loaded model) and end."""


class ProcessExiting(RuntimeError):
    """The process is exiting: the compute thread runs nothing more (see the module docstring)."""


IDLE_AFTER_S = 0.5
"""Seconds with nothing to compute before the thread counts as idle: longer than the gap between
a decode's steps and between a scheduler's passes, so that watchers are not told at every step."""

P = ParamSpec("P")
R = TypeVar("R")

Task = tuple[Future[Any], Callable[[], Any], int] | None
"""A computation, or None: the signal to end (`stop`)."""


class ComputeThread:
    """A thread that runs the callables handed to it (`run`), one at a time, in order."""

    def __init__(self, name: str = "branchwise-compute") -> None:
        self.name = name
        self._thread: threading.Thread | None = None
        self._tasks: queue.SimpleQueue[Task] = queue.SimpleQueue()
        self._starting = threading.Lock()
        self._running: Future[Any] | None = None
        self._interrupted: Future[Any] | None = None
        self._watchers: list[Callable[[bool], None]] = []
        self._state = threading.Lock()
        self._busy = False
        self._last_active = 0.0
        self._idle_timer: threading.Timer | None = None
        self._stopping = False

    def watch(self, watcher: Callable[[bool], None]) -> Callable[[], None]:
        """Call `watcher(True)` when computing starts after an idle spell and `watcher(False)` once
        nothing has been computed for `IDLE_AFTER_S`; at once with the current state. Returns the
        function that stops watching. A watcher must be quick and must not call back into this
        thread: watchers run under the lock that orders the announcements (so a late "idle" never
        lands after the "busy" that overtook it), on the compute thread before the computation it
        announces or on the idle timer's thread."""
        with self._state:
            self._watchers.append(watcher)
            watcher(self._busy)

        def unwatch() -> None:
            with self._state:
                if watcher in self._watchers:
                    self._watchers.remove(watcher)

        return unwatch

    def _announce(self, busy: bool) -> None:
        """Under `_state`: a change of state, told to every watcher."""
        if self._busy != busy:
            self._busy = busy
            for watcher in self._watchers:
                watcher(busy)

    def _rest(self) -> None:
        """After a computation with nothing queued: announce idle once `IDLE_AFTER_S` pass without
        another (one timer at a time, re-armed while computations keep coming)."""
        with self._state:
            self._last_active = time.monotonic()
            if not self._watchers:  # nobody to tell: no timer thread either
                self._busy = False
                return
            if not self._busy or self._idle_timer is not None:
                return
            self._idle_timer = timer = threading.Timer(IDLE_AFTER_S, self._idle_check)
        timer.daemon = True
        timer.start()

    def _idle_check(self) -> None:
        with self._state:
            self._idle_timer = None
            wait = self._last_active + IDLE_AFTER_S - time.monotonic()
            active = self._running is not None or not self._tasks.empty()
            if not (active or wait > 0):
                self._announce(False)
                return
            # busy again, or recently: look again later
            self._idle_timer = timer = threading.Timer(max(wait, IDLE_AFTER_S / 2), self._idle_check)
        timer.daemon = True
        timer.start()

    def run(self, fn: Callable[[], R]) -> R:
        """`fn()` on this thread, its result or exception returned or raised here; at once when
        called on this thread. Once stopped (at exit): at once on the main thread, which finalises
        the interpreter itself; refused (`ProcessExiting`) on any other."""
        if threading.current_thread() is self._thread:
            return fn()
        if self._stopping:
            if threading.current_thread() is threading.main_thread():
                return fn()
            raise ProcessExiting("the process is exiting: no more computations run")
        self._start()
        done: Future[R] = Future()
        self._tasks.put((done, fn, torch.get_num_threads()))
        try:
            return done.result()
        except BaseException:
            if not done.cancel() and not done.done():  # running: it stops at its next check
                self._interrupted = done
            raise

    def check(self) -> None:
        """Raise `KeyboardInterrupt` on this thread when the caller of the computation running here
        was interrupted while it waited (see the module docstring), `ProcessExiting` once the
        process exits; nothing elsewhere."""
        if self._stopping and threading.current_thread() is self._thread:
            raise ProcessExiting("the process is exiting: the computation was stopped")
        task = self._interrupted
        if task is not None and task is self._running and threading.current_thread() is self._thread:
            raise KeyboardInterrupt("the caller waiting for this computation was interrupted")

    def _start(self) -> None:
        with self._starting:
            if self._stopping:
                raise ProcessExiting("the process is exiting: no more computations run")
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._thread.start()

    def stop(self, timeout: float = EXIT_WAIT_S) -> bool:
        """Stop the thread (at exit; see the module docstring): the running computation stops at its
        next check, queued ones fail, and this waits at most `timeout` seconds for the thread to
        end. Returns whether it ended (or never ran)."""
        with self._starting:
            self._stopping = True
            thread = self._thread
        if thread is None or not thread.is_alive():
            return True
        self._tasks.put(None)
        thread.join(timeout)
        return not thread.is_alive()

    def _serve(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            self._run_one(*task)
            # (the task's tuple holds the caller's callable and its arguments, a whole backend
            # while one is built: it must not live on in this frame until the next task comes)
            del task
            if self._tasks.empty():
                self._rest()

    def _run_one(self, done: Future[Any], fn: Callable[[], Any], threads: int) -> None:
        """One task; its callable, result and traceback go with this frame, not kept by the loop."""
        if not done.set_running_or_notify_cancel():
            return
        if self._stopping:
            done.set_exception(ProcessExiting("the process is exiting: the computation was not run"))
            return
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        with self._state:
            self._running = done
            self._announce(True)
        try:
            result = fn()
        except BaseException as exc:  # handed back to the caller, whatever it is
            done.set_exception(exc)
        else:
            done.set_result(result)
        finally:
            self._running = self._interrupted = None

    def _forget(self) -> None:
        """In a forked child the thread does not exist: the next call starts a new one."""
        self._thread = None
        self._tasks = queue.SimpleQueue()
        self._starting = threading.Lock()
        self._running = self._interrupted = None
        self._stopping = False
        self._state = threading.Lock()
        self._busy, self._idle_timer = False, None


COMPUTE = ComputeThread()
"""The process's compute thread."""
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=COMPUTE._forget)
atexit.register(COMPUTE.stop)


def on_compute_thread(method: Callable[P, R]) -> Callable[P, R]:
    """Run `method` on the process's compute thread (see the module docstring)."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        return COMPUTE.run(functools.partial(method, *args, **kwargs))

    return wrapper
