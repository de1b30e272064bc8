"""Where grammars compile: `Lane`, a queue served by daemon threads, and `CompileProcess`, a child
process that compiles one grammar at a time and can be killed mid-compile.

Why both, measured (xgrammar 0.2.9, SmolLM2's 49,152-token vocabulary, a 2-core machine):

* xgrammar releases the GIL while it compiles (a Python thread ticking every 10 ms went on ticking
  through a 2.4 s compile) but offers no way to stop a compile, and a thread cannot be killed. A
  compile past its deadline can only be abandoned, and it keeps a core until xgrammar returns: for
  ``{"pattern": "a{1,30000}"}``, minutes. Only a process can be stopped.
* A process costs a copy of the grammar: the compiled grammar crosses as xgrammar's JSON, 4-8 MB
  for a tool schema (its token-mask cache), 0.2-0.5 s to write and 0.06-0.2 s to read back, where
  the compile itself took 0.05-0.16 s; and the child imports xgrammar (and with it torch), 2-4 s
  before its first compile.

So `Grammars` compiles what `pattern_limits` sizes as small in threads of its own process (every
typical schema: fast, no copy), and the rest in `CompileProcess` children, killed at the deadline.
Both kinds of worker are daemon threads: the process never waits at exit for an abandoned compile,
and a child exits when its parent's end of the pipe closes, whatever it is doing (the parent died,
or exited). At exit a thread's compile within its deadline is given until `EXIT_WAIT_S` to end
(an abandoned one is not waited for): xgrammar
returning into an interpreter that is shutting down aborts the process ("terminate called without
an active exception", exit status 134, seen when a compile ended during the shutdown).

The child is this file run by path (`_BOOT`), not imported as ``branchwise.backends.hf...``: that
package's ``__init__`` loads the whole backend, which the child has no use for.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import IO, Any, TypeVar

__all__ = ["CompileFailed", "CompileProcess", "CompileTimedOut", "Lane", "both"]

T = TypeVar("T")

IDLE_EXIT_S = 60.0
"""A lane's thread that has had no job this long ends (the next job starts one): a backend that is
dropped leaves no threads behind for long."""

EXIT_WAIT_S = 10.0
"""Longest wait at exit for the compiles running in lanes' threads (see the module docstring); a
compile still running then is left, and ends with the process."""

READY_TIMEOUT_S = 120.0
"""Longest wait for a new child to import xgrammar and read the tokenizer (2-4 s measured): not part
of any compile's deadline, since it is not the grammar's cost."""

_BOOT = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__grammar_child__')"
_HEADER = struct.Struct("<Q")


def both(first: Future[T], second: Future[T]) -> Future[T]:
    """A future done when both are: the first one's error, else the second one's result."""
    if first.done() and second.done():
        return first if first.exception() is not None else second
    joined: Future[T] = Future()
    lock = threading.Lock()

    def settle(_: Future[T]) -> None:
        with lock:  # the two callbacks may run at once, in two workers
            if joined.done() or not (first.done() and second.done()):
                return
            error = first.exception() or second.exception()
            if error is not None:
                joined.set_exception(error)
            else:
                joined.set_result(second.result())

    first.add_done_callback(settle)
    second.add_done_callback(settle)
    return joined


class CompileTimedOut(Exception):
    """The child did not answer within the deadline: it was killed."""


class CompileFailed(Exception):
    """xgrammar refused the grammar in the child: ``kind`` is the exception's class name."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _send(stream: IO[bytes], payload: bytes) -> None:
    stream.write(_HEADER.pack(len(payload)))
    stream.write(payload)
    stream.flush()


def _receive(stream: IO[bytes]) -> bytes | None:
    """One frame, or None at the end of the stream."""
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(head)
    body = stream.read(size)
    return body if len(body) == size else None


class Lane:
    """A queue of jobs served by `size` daemon threads.

    `stuck` replaces a thread whose job has overrun (an abandoned compile): the lane starts another,
    so it keeps `size` threads that can take jobs, and the stuck one ends once its job returns.
    `stuck_now` counts those still running, which `Grammars` holds to a bound.
    """

    def __init__(self, name: str, size: int) -> None:
        self.name, self.size = name, size
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._busy: set[int] = set()
        self._stuck: set[int] = set()
        self._closed = False

    def submit(self, job: Callable[[], None]) -> None:
        _PENDING.change(+1)
        self._jobs.put(job)
        self._fill()

    @property
    def stuck_now(self) -> int:
        with self._lock:
            return len(self._stuck)

    def stuck(self, ident: int) -> None:
        """The thread `ident` runs a job that overran: start one in its place."""
        with self._lock:
            abandoned = ident in self._busy and ident not in self._stuck
            self._stuck.add(ident)
        if abandoned:  # exit no longer waits for it
            _PENDING.change(-1)
        self._fill()

    def _fill(self) -> None:
        with self._lock:
            while self._threads - len(self._stuck) < self.size:
                self._threads += 1
                threading.Thread(target=self._serve, name=f"branchwise-{self.name}", daemon=True).start()

    def close(self) -> None:
        """The lane's owner is gone: its idle threads end now, not after `IDLE_EXIT_S` (a backend
        built and dropped in a loop left two idle threads per load for a minute); a running job is
        not stopped (its thread ends after it).

        Why it takes no lock and waits for nothing: it runs from a garbage collector's finalizer
        (the engine's), on whatever thread the collection happened, which may be inside `_fill`
        holding this lane's lock (a load's background thread starting a worker was once stuck
        there for good, and the interpreter's exit with it). `SimpleQueue.put` is safe there; a
        thread started after (a job of another lane submitting here, such as the tables' build
        queueing the ``json_object`` compile) sees the lane closed once its job is done, and ends
        instead of idling for `IDLE_EXIT_S`."""
        self._closed = True  # first: a thread not counted below reads it
        for _ in range(self._threads):
            self._jobs.put(_STOP)

    def _serve(self) -> None:
        me = threading.get_ident()
        while True:
            try:
                job = self._jobs.get(timeout=0 if self._closed else IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:
                    self._threads -= 1
                if self._jobs.empty():
                    return
                self._fill()  # a job came in just now: a thread must stay for it
                return
            if job is _STOP:  # the lane is closed (its owner is gone): no thread takes its place
                with self._lock:
                    self._threads -= 1
                return
            with self._lock:
                self._busy.add(me)
            try:
                job()  # jobs settle their own futures and never raise (`Grammars` wraps them)
            finally:
                # what the job holds (its closure's tensors) goes now, before exit may stop waiting
                # for it: kept until the next `get`, it was freed on this daemon thread while the
                # interpreter finalised, and torch's tensor destructor, unable to take the
                # interpreter lock there, aborted the process ("terminate called without an
                # active exception")
                del job
                with self._lock:
                    self._busy.discard(me)
                    abandoned = me in self._stuck
                    if abandoned:  # its place was taken (`stuck`): this thread ends
                        self._stuck.discard(me)
                        self._threads -= 1
                if not abandoned:
                    _PENDING.change(-1)
            if abandoned:
                return

    @property
    def busy(self) -> int:
        """Jobs running now, overrun ones included."""
        with self._lock:
            return len(self._busy)


class _Pending:
    """Jobs submitted to any lane and not ended, abandoned ones (`Lane.stuck`) aside.

    Why one count for every lane and not a wait per lane: a job may submit to another lane before it
    ends (the tables' build queues the ``json_object`` compile), and lanes waited one after the
    other missed it when the second had been waited first; the compile then ran into the shutdown
    and aborted the process. One count never drops to zero between the two jobs."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._count = 0

    def change(self, by: int) -> None:
        with self._changed:
            self._count += by
            self._changed.notify_all()

    def wait_none(self, until: float) -> bool:
        """Wait until none is pending or `time.monotonic()` passes `until`; whether none is."""
        with self._changed:
            while self._count and (left := until - time.monotonic()) > 0:
                self._changed.wait(left)
            return not self._count


_PENDING = _Pending()


def _STOP() -> None:
    """The job `Lane.close` queues once per thread: the thread that takes it ends."""


@atexit.register
def _wait_for_lanes() -> None:
    _PENDING.wait_none(time.monotonic() + EXIT_WAIT_S)


class CompileProcess:
    """A child process with its own xgrammar compiler for one tokenizer; `compile` runs one of the
    compiler's methods there and returns the grammar as xgrammar's JSON, or kills the child when it
    takes longer than the deadline (the next `compile` starts a new one). One caller at a time."""

    def __init__(self, tokenizer_info_json: str, max_threads: int = 1) -> None:
        self._setup = json.dumps({"tokenizer_info": tokenizer_info_json, "max_threads": max_threads})
        self._proc: subprocess.Popen[bytes] | None = None
        self._replies: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.started = 0  # children started, the first included (tests read it)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def compile(self, method: str, args: list[Any], kwargs: dict[str, Any], timeout_s: float) -> str:
        """xgrammar's JSON of ``compiler.<method>(*args, **kwargs)`` run in the child (`ready` first);
        `CompileFailed` when xgrammar raised, `CompileTimedOut` (the child killed) past `timeout_s`."""
        self.ready()
        proc = self._proc
        assert proc is not None and proc.stdin is not None
        try:
            _send(proc.stdin, json.dumps({"method": method, "args": args, "kwargs": kwargs}).encode())
        except (BrokenPipeError, OSError):
            self.close()
            raise CompileFailed("RuntimeError", "the grammar compile process ended unexpectedly") from None
        try:
            head = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            self.close()
            raise CompileTimedOut from None
        reply = None if head is None else json.loads(head)
        if reply is None:
            self.close()
            raise CompileFailed("RuntimeError", "the grammar compile process ended unexpectedly")
        if not reply["ok"]:
            raise CompileFailed(reply["kind"], reply["message"])
        body = self._replies.get()
        if body is None:
            self.close()
            raise CompileFailed("RuntimeError", "the grammar compile process ended unexpectedly")
        return body.decode()

    def ready(self) -> None:
        """Start a child unless one is running, and wait until it can compile (not part of a
        compile's deadline: the child's start is not the grammar's cost)."""
        if self._proc is not None and self._proc.poll() is None:
            return
        self.close()
        proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._proc, self.started = proc, self.started + 1
        replies: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._replies = replies
        threading.Thread(
            target=_pump, args=(proc.stdout, replies), name="branchwise-grammar-reader", daemon=True
        ).start()
        assert proc.stdin is not None
        _send(proc.stdin, self._setup.encode())
        try:
            ready = replies.get(timeout=READY_TIMEOUT_S)
        except queue.Empty:
            ready = None
        if ready is None or not json.loads(ready).get("ready"):
            self.close()
            raise CompileFailed("RuntimeError", "the grammar compile process did not start")

    def close(self) -> None:
        """Kill the child, if any (a compile under way is lost)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()

    def __del__(self) -> None:
        # at interpreter exit what `close` needs may be gone already; the child exits on its own then
        with contextlib.suppress(Exception):
            self.close()


def _pump(stream: IO[bytes] | None, into: queue.SimpleQueue[bytes | None]) -> None:
    """Move the child's frames into `into` until its output ends (then a None)."""
    assert stream is not None
    while True:
        try:
            frame = _receive(stream)
        except (OSError, ValueError):
            frame = None
        into.put(frame)
        if frame is None:
            return


def _child() -> None:
    """The child's loop: read the setup, then compile job after job; exit when stdin closes."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # anything printed goes to the log, never into the frames
    setup = _receive(stdin)
    if setup is None:
        return
    import xgrammar as xgr

    spec = json.loads(setup)
    info = xgr.TokenizerInfo.deserialize_json(spec["tokenizer_info"])
    compiler = xgr.GrammarCompiler(info, max_threads=spec["max_threads"], cache_enabled=False)
    jobs: queue.SimpleQueue[bytes] = queue.SimpleQueue()

    def read() -> None:  # a thread of its own, so that a closed pipe ends even a running compile
        while (frame := _receive(stdin)) is not None:
            jobs.put(frame)
        os._exit(0)

    threading.Thread(target=read, daemon=True).start()
    _send(stdout, json.dumps({"ready": True, "at": time.time()}).encode())
    while True:
        job = json.loads(jobs.get())
        try:
            grammar = getattr(compiler, job["method"])(*job["args"], **job["kwargs"])
            body = grammar.serialize_json().encode()
        except Exception as err:  # sent back whole: the parent words it as a ConstraintError
            _send(stdout, json.dumps({"ok": False, "kind": type(err).__name__, "message": str(err)}).encode())
            continue
        _send(stdout, b'{"ok": true}')
        _send(stdout, body)


if __name__ == "__grammar_child__":
    _child()
