"""A request scheduler over any `Backend`: concurrent callers' requests become shared decode passes.

Why here (not in a front end): DSPy's `BranchwiseLM`, the OpenAI-compatible server and any other
front end (LangChain through the server, a notebook with threads) face the same problem: B callers
each want ``n`` samples of their own prompt, and B sequential `extend` calls cost B times one batched
call. The scheduler owns that problem once, generic over the `Backend` protocol:

* **n samples fork one prefill**: a request's prompt is submitted whole via `prefill` and `fork(n)`,
  so whatever prompt sharing the backend does (shared KV for the ``n`` children, and a prefix cache
  across requests where the backend keeps one) applies without the scheduler knowing about it;
* **concurrent requests share one `extend`**: one worker thread drains the queue and decodes every
  queued request with equal decoding parameters in ONE `extend` over all their branches. With
  greedy decoding the batched tokens equal the serial ones (the backend's batched decode is exact);
* **bounded memory**: with ``max_queued_rows`` set, `enqueue` raises `QueueFull` instead of letting
  the queue (and, later, the KV of its branches) grow without limit; a server turns that into 429;
* **streaming and early answers**: where the backend's `extend` takes an ``on_step`` listener, the
  worker routes each decode step to the jobs it belongs to: a job's own ``on_step`` sees its
  branches' tokens as they are produced (the server's streaming), and a job whose branches have
  all ended is answered then, not when the longest branch of its batch ends;
* **continuous batching**: where the backend's `extend` takes ``admit`` (the local backend), a
  request that queues while a batch decodes joins it at the next step boundary (same decoding
  parameters, within `max_rows`) instead of waiting for the batch's longest branch: its prompt is
  prefilled and its rows decode beside the others from then on. Rows that end leave room for the
  next ones, so the decode batch stays full under a steady load;
* **a KV memory budget**: where the backend has one (`SupportsKVBudget`: the local backend's
  `kv_budget`), a request is taken (into a new batch, or into a running one) only while the KV the
  backend prices it at (`kv_cost`: its prompt and ``n`` rows of ``max_tokens`` at worst, or, where
  the backend preempts rows that outgrow its budget, what they start with) fits the room the
  backend reports (`kv_room`: the budget less what is held and what running rows may still need),
  first come, first served; a request that could never finish within it (`kv_floor`) fails with
  `KVBudgetExceeded`, one that does not fit yet waits for memory to be freed;
* **cancellation**: a request cancelled while it waits is dropped before it is prefilled (a client
  that went away costs nothing); one cancelled mid-batch has its branches stopped at the next
  decode step (they stop taking batch rows and compute) and released with the batch. A backend
  whose `extend` takes no listener decodes them to the end of the batch instead.

Whole strategy runs share it too (`Reasoner.batch`): a run's session seen through `Scheduler.view`
sends each `extend` of its own nodes as a job (`Job.decoding`), so the generate steps of several
questions decode as one batch, joining a running decode where they arrive mid-way, within the KV
budget; each job is told its share of the call's computed tokens and forwards (by the tokens its
rows generated), so every run still reports its own cost.

Seeded sampling and batching: the backend seeds one generator per `extend` call, so two seeded
requests decoded in one batch would share a random stream and differ from their serial results. A
request that samples (temperature > 0) with a seed is therefore decoded in its own batch unless
``batch_seeded=True`` (faster, but the streams then depend on the batch).

Lifetime: the worker thread never holds its scheduler between batches (it keeps a weak reference,
and waits on the queue's condition alone), so a scheduler nobody uses any more is freed with its
backend, and its worker exits then; `park` stops an idle worker at once and `close` refuses new
requests. A front end that keeps a chat model per request therefore keeps no thread or model alive
after the request.

This module holds the queue and its drainer: what callers call, what is taken into a batch or a
running decode and within which limits (rows, requests, KV memory), and the worker thread. The
records they pass around (`Job`, `BatchStats`, the errors) are `scheduler_jobs`; what happens
inside one shared decode pass (rows made, steps routed, jobs admitted and answered) is
`scheduler_router`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, cast

from branchwise.backends.base import (
    Backend,
    Cancelled,
    DecodeParams,
    DecodeStep,
    Generation,
    KVBudgetExceeded,
    KVStats,
    NodeId,
    SupportsAdmission,
)
from branchwise.backends.scheduler_jobs import BatchStats, InvalidPrompt, Job, QueueFull
from branchwise.backends.scheduler_router import Router, prompt_share
from branchwise.backends.scheduler_worker import WorkerSignal, stop_worker, work

__all__ = ["BatchStats", "Cancelled", "InvalidPrompt", "Job", "QueueFull", "Scheduler"]

log = logging.getLogger(__name__)


class Scheduler:
    """A request queue drained by one worker thread that owns all backend calls for its requests.

    Why one worker rather than a lock: a lock would serialise the callers one request at a time;
    the worker instead takes everything that queued up while the previous batch ran (plus whatever
    arrives within `window_s`), so B callers cost one batched decode instead of B sequential ones.

    Args:
        backend: any `Backend`.
        max_rows: at most this many branches (sum of ``n``) are decoded in one `extend`.
        max_requests: at most this many requests per batch; 1 turns cross-request batching off.
        window_s: how long the worker waits for more requests before starting a batch.
        max_queued_rows: `enqueue` raises `QueueFull` when the waiting branches would exceed this
            (None: unbounded, for in-process callers that block anyway).
        batch_seeded: co-batch seeded sampling requests (see the module docstring).
        continuous: let queued requests join a running decode at a step boundary where the backend's
            `extend` takes ``admit`` (the local backend does); False waits for the batch to end.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        max_rows: int = 64,
        max_requests: int = 64,
        window_s: float = 0.01,
        max_queued_rows: int | None = None,
        batch_seeded: bool = False,
        continuous: bool = True,
        name: str = "branchwise-scheduler",
    ) -> None:
        if max_rows < 1 or max_requests < 1:
            raise ValueError("max_rows and max_requests must be >= 1")
        if max_queued_rows is not None and max_queued_rows < 1:
            raise ValueError(f"max_queued_rows={max_queued_rows} must be >= 1 (or None)")
        self.backend = backend
        self.max_rows = max_rows
        self.max_requests = max_requests
        self.window_s = window_s
        self.max_queued_rows = max_queued_rows
        self.batch_seeded = batch_seeded or getattr(backend, "seeds_per_request", False)
        """Seeded sampling jobs share decodes: asked for, or the backend seeds each request on its
        own (a remote server), so batching cannot change their tokens."""
        self.continuous = continuous
        self.name = name
        self.stats = BatchStats()
        self._cv = threading.Condition()
        self._queue: deque[Job] = deque()
        self._running = 0
        self._worker: threading.Thread | None = None
        self._closed = False
        self._compiling: set[Job] = set()  # jobs queued once their grammar is compiled (`_grammar`)
        self._signal = WorkerSignal()
        # the worker is told when this scheduler is freed (it holds no strong reference to it)
        weakref.finalize(self, stop_worker, self._cv, self._signal)
        self._admitting = (
            backend if continuous and isinstance(backend, SupportsAdmission) and backend.admits_rows else None
        )
        """The backend, where its decode takes rows in while it runs (it says so: `SupportsAdmission`);
        requests with different decoding parameters then share a decode too (the backend takes
        each row's own): a long prompt prefills beside others' decoding, whatever they asked."""

    @property
    def admits(self) -> bool:
        """Whether requests join a running decode: `continuous` and the backend's `extend` takes
        ``admit`` (a remote backend does not; its batches run one at a time)."""
        return self._admitting is not None

    # ------------------------------------------------------------------ callers
    def enqueue(self, job: Job) -> Job:
        """Queue `job` without waiting (a constrained one once its grammar is compiled, `_grammar`);
        raises `QueueFull`, `KVBudgetExceeded` (the job alone could never fit the backend's KV budget),
        the backend's error for a grammar it refused already or, once closed, `RuntimeError`."""
        self._check_fits(job)
        grammar = self._grammar(job)
        with self._cv:
            if self._closed:
                raise RuntimeError("the scheduler was closed")
            waiting = self._rows_queued() + sum(j.n for j in self._compiling)
            if self.max_queued_rows is not None and waiting + job.n > self.max_queued_rows:
                self.stats.rejected += 1
                raise QueueFull(f"{waiting} branches are queued (limit {self.max_queued_rows}); retry later")
            if grammar is None:
                self._queue.append(job)
            else:  # queued once its grammar is compiled (`_compiled`)
                self._compiling.add(job)
            self._signal.stop = False  # a parked worker serves again
            if not self._signal.running:
                self._signal.running = True  # set here, cleared by the worker under `_cv`: no lost job
                self._worker = threading.Thread(
                    target=work,
                    args=(weakref.ref(self), self._cv, self._queue, self._signal),
                    name=self.name,
                    daemon=True,
                )
                self._worker.start()
            self._cv.notify_all()
        if grammar is not None:
            grammar.add_done_callback(lambda done: self._compiled(job, done))
        return job

    def submit(self, job: Job) -> list[Generation]:
        """Queue `job` and wait for its generations (a blocking caller: a DSPy thread)."""
        return self.enqueue(job).result()

    async def submit_async(self, job: Job) -> list[Generation]:
        """Queue `job` and await its generations without blocking the event loop.

        If the awaiting task is cancelled (an HTTP client disconnected), the job is cancelled too:
        dropped if it still waits, its branches released with its batch otherwise.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()

        def settle() -> None:
            if not future.done():
                future.set_result(None)

        def wake(_: Job) -> None:
            loop.call_soon_threadsafe(settle)

        job.on_done = wake
        self.enqueue(job)
        try:
            await future
        except asyncio.CancelledError:
            self.cancel(job)
            raise
        return job.result()

    def cancel(self, job: Job) -> None:
        """Cancel `job`: a waiting job is removed from the queue and fails with `Cancelled`; one
        being decoded has its branches stopped at the next step (see the module docstring)."""
        with self._cv:
            if job.cancelled or job.done.is_set():
                return
            job.cancelled = True
            self.stats.cancelled += 1
            try:
                self._queue.remove(job)
            except ValueError:
                if job not in self._compiling:
                    return  # taken by the worker: its router stops the job's branches
                self._compiling.discard(job)
        job._fail(Cancelled("the request was cancelled before it was decoded"))

    def queued_rows(self) -> int:
        """Branches waiting in the queue now (not counting the batch being decoded)."""
        with self._cv:
            return self._rows_queued()

    def idle(self) -> bool:
        """Nothing queued and no batch being decoded."""
        with self._cv:
            return not self._queue and not self._running and not self._compiling

    def close(self, timeout: float | None = None) -> None:
        """Refuse new requests; the queued ones still finish. With `timeout`, wait for the worker."""
        with self._cv:
            self._closed = True
        self.park(timeout)

    def park(self, timeout: float | None = None) -> bool:
        """Let the worker thread exit once the queue is empty; the next request starts a new one.

        Why: a front end whose last user closed it releases the thread at once, without refusing
        requests that anyone still holding this scheduler sends later. With `timeout`, wait (at
        most that long) for the thread to end; returns whether no worker is left running.
        """
        with self._cv:
            self._signal.stop = True
            self._cv.notify_all()
            worker = self._worker
        if worker is None or worker is threading.current_thread():
            return worker is None
        if timeout is not None:
            worker.join(timeout)
        return not worker.is_alive()

    @property
    def worker_alive(self) -> bool:
        """Whether a worker thread is running now (it exits when parked, closed or freed)."""
        worker = self._worker
        return worker is not None and worker.is_alive()

    def _grammar(self, job: Job) -> Future[Any] | None:
        """The job's grammar compiling off this thread (the backend's ``prepare_grammar``; None: none
        to wait for; a compile error is raised). Why: a big grammar compiles for seconds, and the worker
        decodes everyone's requests; the job joins the queue once its grammar is ready."""
        prepare = getattr(self.backend, "prepare_grammar", None)
        future: Future[Any] | None = None if prepare is None else prepare(job.params)
        if future is None:
            return None
        if future.done():
            future.result()  # a grammar the engine refuses fails here, before anything is queued
        return None if future.done() else future

    def _compiled(self, job: Job, grammar: Future[Any]) -> None:
        """Queue `job` now that its grammar is compiled; fail it alone if it could not be (or if the
        scheduler was closed meanwhile); one cancelled meanwhile was answered by `cancel`."""
        with self._cv:
            if job not in self._compiling:
                return
            self._compiling.discard(job)
        try:
            grammar.result()
            self.enqueue(job)
        except Exception as err:
            job._fail(err)

    # ------------------------------------------------------------------ worker
    def _rows_queued(self) -> int:
        return sum(job.n for job in self._queue)

    def _kv_room(self) -> int | None:
        """Bytes of KV the backend can still promise (None: no budget); never under `_cv` (it takes
        the backend's lock, which a strategy run in another thread may hold for long)."""
        room = getattr(self.backend, "kv_room", None)
        return None if room is None else room()

    def _check_fits(self, job: Job) -> None:
        """Refuse at once a job that cannot finish within what the budget admits for one job
        (`kv_floor`: its worst case where the backend prices that, one row's worst case where it
        preempts rows): waiting would not help, and it must not hold up the queue behind it."""
        limit = getattr(self.backend, "kv_limit", None)
        if limit is None:
            return
        cost = self.backend.kv_floor(len(job.prompt), job.n, job.params.max_tokens, prompt_share(job))  # type: ignore[attr-defined]
        if cost > limit:
            with self._cv:
                self.stats.rejected += 1
            budget = getattr(self.backend, "kv_budget", None) or limit
            least = -(-cost * budget // max(limit, 1))  # the budget whose admitted share holds it
            raise KVBudgetExceeded(
                f"the request needs up to {cost} bytes of KV ({len(job.prompt)} prompt tokens, "
                f"n={job.n} x max_tokens={job.params.max_tokens}); kv_budget={budget} bytes admits "
                f"at most {limit} bytes per request: it needs kv_budget >= {least} bytes, or a "
                f"smaller n or max_tokens"
            )

    def _kv_cost(self, job: Job) -> int:
        """The KV the backend prices the job at (`kv_cost`), by how its rows will hold its prompt
        (`prompt_share`; a node job's prompt is held already: it has none)."""
        return self.backend.kv_cost(len(job.prompt), job.n, job.params.max_tokens, prompt_share(job))  # type: ignore[attr-defined]

    def view(self, backend: Backend) -> Backend:
        """`backend` (a run's session over the same tree as this scheduler's backend) with its
        `extend` decoded by this scheduler, batched with other runs' (see the module docstring)."""
        return cast(Backend, _Through(self, backend))

    def _take(self) -> list[Job] | None:
        """Wait for work; return a batch bounded by `max_rows`/`max_requests` and the KV room
        (None when nothing is queued: the worker then waits without holding the scheduler;
        [] when the first job must wait for memory)."""
        with self._cv:
            if not self._queue:
                return None
            # Callers woken by the previous batch resubmit within milliseconds of each other: keep
            # collecting while requests keep arriving (each arrival restarts a `window_s` gap, capped
            # at 10 windows), so they join this batch instead of trickling into the next ones. A lone
            # serial caller pays one window per call.
            start = time.monotonic()
            seen = len(self._queue)
            gap_end = start + self.window_s
            while (
                self._queue and self._rows_queued() < self.max_rows and len(self._queue) < self.max_requests
            ):
                left = min(gap_end, start + 10 * self.window_s) - time.monotonic()
                if left <= 0 or self._closed:
                    break
                self._cv.wait(left)
                if len(self._queue) != seen:
                    seen = len(self._queue)
                    gap_end = time.monotonic() + self.window_s
        room = self._kv_room()
        with self._cv:
            batch: list[Job] = []
            rows = 0
            while self._queue and len(batch) < self.max_requests:
                job = self._queue[0]
                if batch and rows + job.n > self.max_rows:
                    break
                if room is not None:
                    cost = self._kv_cost(job)
                    if cost > room:
                        break  # it waits for memory (first come, first served; it fits alone)
                    room -= cost
                batch.append(self._queue.popleft())
                rows += job.n
            self._running += 1
        return batch

    def _step(self) -> None:
        """One round of the worker: take what is queued and decode it (`scheduler_worker.work` waits
        for work without holding the scheduler)."""
        batch = self._take()
        if batch is None:
            return
        if not batch:  # the next request waits for KV memory held elsewhere to be freed
            with self._cv:
                self._running -= 1
                self._cv.wait(MEMORY_POLL_S)
            return
        try:
            groups: dict[tuple[Any, ...], list[Job]] = {}
            for job in batch:
                groups.setdefault(job.group_key(self.batch_seeded, self.admits), []).append(job)
            for jobs in groups.values():
                self._run_group(jobs)
        finally:
            with self._cv:
                self._running -= 1
                self._cv.notify_all()
                drained = not self._queue
        if drained:  # idle now: the backend may hand the batch's freed memory back
            trim = getattr(self.backend, "trim_memory", None)
            if trim is not None:
                trim()

    def _run_group(self, jobs: list[Job]) -> None:
        """Prefill each prompt once, fork it n times and decode all branches in ONE `extend`; with
        continuous batching, compatible requests that queue meanwhile join that `extend`."""
        backend = self.backend
        router = Router(
            backend,
            self.stats,
            jobs[0].group_key(self.batch_seeded, self.admits),
            max_rows=self.max_rows,
            mixes=self.admits,
            queued_rows=self.queued_rows,
            take=self._admit,
        )
        read_stats = getattr(backend, "kv_stats", None)  # a minimal backend may keep no counters
        before = read_stats() if read_stats is not None else None
        try:
            for job in jobs:
                router.join(job)
            if not router.jobs:
                return
            self.stats.extend_calls += 1
            params = jobs[0].params  # the call's; admitting, each row also brings its job's own
            if self._admitting is not None:
                own = [job.params for job, (a, b) in router.jobs.items() for _ in range(a, b)]
                gens = self._admitting.extend(
                    list(router.children), params, on_step=router, admit=router.admit, row_params=own
                )
            else:
                gens = backend.extend(list(router.children), params, on_step=router)
            for job, (a, b) in router.jobs.items():
                if not job.done.is_set():
                    job.generations = gens[a:b]
        except BaseException as exc:  # delivered to every waiting caller, never lost in the worker
            for job in router.jobs:
                if not job.done.is_set():
                    job.error = exc
        finally:
            st = self.stats
            if read_stats is not None and before is not None:
                router.account(before, read_stats())
            if router.jobs:  # the call's final size, admitted requests included
                st.max_requests_per_call = max(st.max_requests_per_call, len(router.jobs))
                st.max_rows_per_call = max(st.max_rows_per_call, len(router.children))
                st.histogram[len(router.jobs)] = st.histogram.get(len(router.jobs), 0) + 1
            if router.children:
                try:
                    backend.release(router.unreleased())
                except Exception:  # pragma: no cover - release of nodes the failure already freed
                    log.debug("release after a failed batch", exc_info=True)
            for job in router.jobs:
                job._finish()

    def _admit(self, key: tuple[Any, ...], room: int) -> list[Job]:
        """Take queued jobs that may join a running decode of group `key`, at most `room` rows.

        Strictly first come, first served: taking stops at the first job that does not fit or has
        other decoding parameters, so the running decode then drains and that job is served next
        (a steady stream of compatible requests never starves an incompatible one)."""
        taken: list[Job] = []
        kv = self._kv_room() if self._queue else None
        with self._cv:
            while self._queue and len(taken) < self.max_requests:
                job = self._queue[0]
                if job.n > room or job.group_key(self.batch_seeded, self.admits) != key:
                    break
                if kv is not None:
                    cost = self._kv_cost(job)
                    if cost > kv:
                        break  # it waits for the batch to free memory (or for its own batch)
                    kv -= cost
                taken.append(self._queue.popleft())
                room -= job.n
        return taken


MEMORY_POLL_S = 0.05
"""How often a request waiting for KV memory held outside the scheduler looks again."""


class _Through:
    """A run's backend whose `extend` goes through a scheduler (`Scheduler.view`); everything else
    is the run's own. Its `kv_stats` adds the jobs' shares of the batched calls' work."""

    admits_rows = False  # its `extend` takes no `admit` (the run's own backend's may)

    def __init__(self, scheduler: Scheduler, backend: Backend) -> None:
        self._scheduler = scheduler
        self._backend = backend
        self._tokens = self._forwards = 0.0
        self._extends = self._shared = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def extend(
        self,
        nodes: Sequence[NodeId],
        params: DecodeParams,
        on_step: Callable[[DecodeStep], Any] | None = None,
    ) -> list[Generation]:
        if not nodes:
            return []
        job = Job.decoding(nodes, params, on_step)
        try:
            return self._scheduler.submit(job)
        finally:
            self._tokens += job.tokens_computed
            self._forwards += job.forward_calls
            self._extends += 1
            self._shared += job.shared

    def kv_stats(self) -> KVStats:
        stats = self._backend.kv_stats()
        stats.tokens_computed += round(self._tokens)
        stats.forward_calls += round(self._forwards)
        stats.extra["batch_extends"] = float(self._extends)
        stats.extra["batch_shared_extends"] = float(self._shared)
        return stats
