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
  `kv_budget`), a request is taken (into a new batch, or into a running one) only while its
  worst-case KV (`kv_cost`: its prompt and ``n`` rows of ``max_tokens``) fits the room the backend
  reports (`kv_room`: the budget less what is held and what running rows may still grow by), first
  come, first served; a request that could never fit fails with `KVBudgetExceeded`, one that does
  not fit yet waits for memory to be freed;
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
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from branchwise.backends.base import (
    Admitted,
    Backend,
    Cancelled,
    DecodeParams,
    DecodeStep,
    Generation,
    KVBudgetExceeded,
    KVStats,
    NodeId,
    ShareMode,
)

__all__ = ["BatchStats", "Cancelled", "InvalidPrompt", "Job", "QueueFull", "Scheduler"]

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The scheduler's queue holds ``max_queued_rows`` branches already; retry later."""


class InvalidPrompt(ValueError):
    """The backend refused one request's prompt (e.g. a token id outside the vocabulary).

    Only that request fails: the other requests of its batch are decoded as usual.
    """


@dataclass
class BatchStats:
    """How well concurrent requests were batched.

    ``extend_calls`` counts backend `extend` calls made for requests; ``requests`` the requests
    they served; ``rows`` the branches decoded (a request with ``n`` samples is ``n`` rows);
    ``rejected`` the requests refused because the queue was full; ``cancelled`` those their caller
    cancelled before they were answered (waiting, or mid-decode); ``admitted`` those that joined an
    `extend` already decoding (continuous batching; they count in that call's requests and rows).
    """

    extend_calls: int = 0
    requests: int = 0
    rows: int = 0
    max_requests_per_call: int = 0
    max_rows_per_call: int = 0
    rejected: int = 0
    admitted: int = 0
    cancelled: int = 0
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
            "rejected": self.rejected,
            "admitted": self.admitted,
            "cancelled": self.cancelled,
            "histogram": dict(sorted(self.histogram.items())),
        }


@dataclass(eq=False)
class Job:
    """One request: ``n`` samples of ``prompt`` decoded with ``params``.

    ``share=None`` leaves the KV sharing of the ``n`` samples to the backend's default.
    ``on_step`` (optional) is called from the worker thread after each decode step that concerns
    the job, with its branch indices (0..n-1) as rows; like any `extend` listener it must return at
    once. ``on_done`` (optional) is called from the worker thread once the job has a result or an
    error; the asyncio bridge of `Scheduler.submit_async` uses it to wake the event loop.
    """

    prompt: list[int]
    n: int
    params: DecodeParams
    share: ShareMode | None = None
    on_step: Callable[[DecodeStep], None] | None = None
    on_done: Callable[[Job], None] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    generations: list[Generation] | None = None
    error: BaseException | None = None
    cancelled: bool = False
    batch_requests: int = 0
    batch_rows: int = 0
    nodes: list[NodeId] | None = None
    """Decode these existing nodes (the caller's, never released here) instead of prefilling
    `prompt` and forking it: a strategy's generate step (`Job.decoding`)."""
    tokens_computed: float = 0.0
    forward_calls: float = 0.0
    """The job's share of its `extend` call's computed tokens (by the tokens its rows generated)
    and the forwards it rode in."""
    shared: bool = False
    """Whether its `extend` call decoded another job's rows too (set when the call ends)."""

    @classmethod
    def decoding(
        cls,
        nodes: Sequence[NodeId],
        params: DecodeParams,
        on_step: Callable[[DecodeStep], None] | None = None,
    ) -> Job:
        """A job that decodes the caller's `nodes` (see `nodes`)."""
        return cls(prompt=[], n=len(nodes), params=params, nodes=list(nodes), on_step=on_step)

    def group_key(self, batch_seeded: bool, mixed: bool = False) -> tuple[Any, ...]:
        """Jobs with equal keys are decoded in one `extend`: equal decoding parameters, or any where
        the backend decodes rows with their own (`mixed`); a seeded sampling job stays alone unless
        `batch_seeded` (see the module docstring)."""
        alone = self.params.seed is not None and self.params.temperature > 0 and not batch_seeded
        if mixed:
            return (id(self) if alone else None,)
        return (self.params, self.share, id(self) if alone else None)

    def result(self) -> list[Generation]:
        """Wait for the worker; the generations, or the error the batch raised."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.generations is not None
        return self.generations

    def _fail(self, error: BaseException) -> None:
        """Answer the job with `error` (a refused prompt, a cancellation)."""
        self.error = error
        self._finish()

    def _finish(self) -> None:
        if self.done.is_set():  # answered early (see `_Router`); the batch's end changes nothing
            return
        self.done.set()
        if self.on_done is not None:
            self.on_done(self)


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
        self._listens = _extend_takes(backend, "on_step")
        self._admits = continuous and self._listens and _extend_takes(backend, "admit")
        self._mixes = self._admits and _extend_takes(backend, "row_params")
        """Requests with different decoding parameters share a decode (the backend takes each
        row's own): a long prompt then prefills beside others' decoding, whatever they asked."""

    @property
    def admits(self) -> bool:
        """Whether requests join a running decode: `continuous` and the backend's `extend` takes
        ``admit`` (a remote backend does not; its batches run one at a time)."""
        return self._admits

    # ------------------------------------------------------------------ callers
    def enqueue(self, job: Job) -> Job:
        """Queue `job` without waiting; raises `QueueFull`, `KVBudgetExceeded` (the job alone could
        never fit the backend's KV budget) or, once closed, `RuntimeError`."""
        self._check_fits(job)
        with self._cv:
            if self._closed:
                raise RuntimeError("the scheduler was closed")
            if self.max_queued_rows is not None and self._rows_queued() + job.n > self.max_queued_rows:
                self.stats.rejected += 1
                raise QueueFull(
                    f"{self._rows_queued()} branches are queued (limit {self.max_queued_rows}); retry later"
                )
            self._queue.append(job)
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._worker.start()
            self._cv.notify_all()
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
                return  # taken by the worker: its router stops the job's branches
        job._fail(Cancelled("the request was cancelled before it was decoded"))

    def queued_rows(self) -> int:
        """Branches waiting in the queue now (not counting the batch being decoded)."""
        with self._cv:
            return self._rows_queued()

    def idle(self) -> bool:
        """Nothing queued and no batch being decoded."""
        with self._cv:
            return not self._queue and not self._running

    def close(self, timeout: float | None = None) -> None:
        """Refuse new requests; the queued ones still finish. With `timeout`, wait for the worker."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            worker = self._worker
        if timeout is not None and worker is not None:
            worker.join(timeout)

    # ------------------------------------------------------------------ worker
    def _rows_queued(self) -> int:
        return sum(job.n for job in self._queue)

    def _kv_room(self) -> int | None:
        """Bytes of KV the backend can still promise (None: no budget); never under `_cv` (it takes
        the backend's lock, which a strategy run in another thread may hold for long)."""
        room = getattr(self.backend, "kv_room", None)
        return None if room is None else room()

    def _check_fits(self, job: Job) -> None:
        """Refuse at once a job whose worst-case KV exceeds what the budget admits for one job:
        waiting would not help, and it must not hold up the queue behind it."""
        limit = getattr(self.backend, "kv_limit", None)
        if limit is None:
            return
        cost = self._kv_cost(job)
        if cost > limit:
            with self._cv:
                self.stats.rejected += 1
            raise KVBudgetExceeded(
                f"the request needs up to {cost} bytes of KV ({len(job.prompt)} prompt tokens, "
                f"n={job.n} x max_tokens={job.params.max_tokens}); the KV budget admits at most "
                f"{limit} bytes per request"
            )

    def _kv_cost(self, job: Job) -> int:
        """Worst-case KV of the job (a node job's prompt is held already)."""
        return self.backend.kv_cost(len(job.prompt), job.n, job.params.max_tokens, job.share)  # type: ignore[attr-defined]

    def view(self, backend: Backend) -> Backend:
        """`backend` (a run's session over the same tree as this scheduler's backend) with its
        `extend` decoded by this scheduler, batched with other runs' (see the module docstring)."""
        return cast(Backend, _Through(self, backend))

    def _take(self) -> list[Job] | None:
        """Wait for work; return a batch bounded by `max_rows`/`max_requests` and the KV room
        (None once closed; [] when the first job must wait for memory)."""
        with self._cv:
            while not self._queue and not self._closed:
                self._cv.wait()
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

    def _loop(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            if not batch:  # the next request waits for KV memory held elsewhere to be freed
                with self._cv:
                    self._running -= 1
                    self._cv.wait(MEMORY_POLL_S)
                continue
            try:
                groups: dict[tuple[Any, ...], list[Job]] = {}
                for job in batch:
                    groups.setdefault(job.group_key(self.batch_seeded, self._mixes), []).append(job)
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
        router = _Router(self, jobs[0].group_key(self.batch_seeded, self._mixes))
        read_stats = getattr(backend, "kv_stats", None)  # a minimal backend may keep no counters
        before = read_stats() if read_stats is not None else None
        try:
            for job in jobs:
                router.join(job)
            if not router.jobs:
                return
            self.stats.extend_calls += 1
            params = jobs[0].params  # the call's; with `_mixes` each row also brings its job's own
            # `Backend.extend` names neither `admit` nor `row_params`: `_extend_takes` checked this one's
            if self._mixes:
                own = [job.params for job, (a, b) in router.jobs.items() for _ in range(a, b)]
                gens = backend.extend(  # type: ignore[call-arg]
                    list(router.children), params, on_step=router, admit=router.admit, row_params=own
                )
            elif self._admits:
                gens = backend.extend(  # type: ignore[call-arg]
                    list(router.children), params, on_step=router, admit=router.admit
                )
            elif self._listens:
                gens = backend.extend(list(router.children), params, on_step=router)
            else:
                gens = backend.extend(list(router.children), params)
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
                self._account(router, before, read_stats())
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

    @staticmethod
    def _account(router: _Router, before: KVStats, after: KVStats) -> None:
        """Hand the call's computed tokens to its jobs by the tokens their rows generated; each
        rode every forward of the call."""
        made = {
            job: max(sum(len(g.token_ids) for g in gens if g is not None), 1)
            for job, gens in router.ended.items()
        }
        total = sum(made.values())
        tokens = after.tokens_computed - before.tokens_computed
        forwards = after.forward_calls - before.forward_calls
        for job, n in made.items():
            job.tokens_computed += tokens * n / total
            job.forward_calls += forwards
            job.shared = len(made) > 1

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
                if job.n > room or job.group_key(self.batch_seeded, self._mixes) != key:
                    break
                if kv is not None:
                    cost = self._kv_cost(job)
                    if cost > kv:
                        break  # it waits for the batch to free memory (or for its own batch)
                    kv -= cost
                taken.append(self._queue.popleft())
                room -= job.n
        return taken

    def _fork_prompt(self, job: Job) -> list[int]:
        """Prefill the job's whole prompt (a backend with a prefix cache reuses what it holds) and
        fork it into ``n`` branches."""
        backend = self.backend
        root = backend.prefill(job.prompt)
        if job.n == 1 and len(job.prompt) <= PLAIN_ROW_TOKENS:
            # One sample of a short prompt shares it with nobody: decode the prompt's own node. It
            # is a plain row (a one-row shared segment would cost one more attention product per
            # layer), and its KV is the exact prompt, so a backend with a prefix cache keeps it for
            # the next request that starts the same way (DSPy's candidates, an agent's next turn).
            return [root]
        try:
            # A long prompt stays a segment its rows read, out of the batch's tails: a row's tail
            # holds its own tokens, and every row of a batch gets room for the longest one's.
            share = job.share if job.n > 1 else "exact"
            return backend.fork(root, job.n, share=share)
        finally:
            # the children keep the root's KV alive; releasing it now frees it with them
            backend.release([root])


def _extend_takes(backend: Backend, name: str) -> bool:
    """Whether the backend's `extend` takes the argument `name`: ``on_step`` (older backends do not;
    ``**kwargs`` counts) or ``admit`` (named explicitly: only a backend that admits rows says so)."""
    try:
        params = inspect.signature(backend.extend).parameters
    except (TypeError, ValueError):
        return False
    if name in params:
        return True
    return name == "on_step" and any(p.kind is p.VAR_KEYWORD for p in params.values())


PLAIN_ROW_TOKENS = 256
"""A one-sample request with a prompt up to this long decodes its prompt's node as a plain row; a
longer one decodes a child that reads the prompt (`Scheduler._fork_prompt`)."""

MEMORY_POLL_S = 0.05
"""How often a request waiting for KV memory held outside the scheduler looks again."""

ADMIT_EVERY = 4
"""Steps a few waiting requests may wait to join a running decode together (`_Router.admit`)."""


class _Router:
    """One `extend`'s step listener: hands each job its branches' steps, answers a job once all its
    branches have ended while others still decode, stops the branches of jobs cancelled meanwhile,
    and (continuous batching) admits queued jobs into the running decode.

    Runs on the worker thread between decode steps. Per step it walks the step's rows once; a job
    without a listener costs a dictionary lookup per branch.
    """

    def __init__(self, scheduler: Scheduler, key: tuple[Any, ...]) -> None:
        self.scheduler = scheduler
        self.key = key
        self.jobs: dict[Job, tuple[int, int]] = {}
        """Each joined job's rows in the call (start, end), in joining order."""
        self.children: list[int] = []
        self.owner: list[tuple[Job, int]] = []
        self.ended: dict[Job, list[Generation | None]] = {}
        self.left: dict[Job, int] = {}
        self.rows_left = 0
        self.steps = 0
        self.admitted_at = 0
        self.finished: list[Job] = []
        """Jobs whose rows all ended (answered or cancelled), in order."""
        self.retiring = 0
        """`finished[:retiring]` had ended when the batch was last re-assembled: none of their rows
        is in the batch now, so their nodes can be released before the call ends."""
        self.released: set[int] = set()

    def join(self, job: Job) -> bool:
        """Prefill and fork `job`'s prompt; its branches become the call's next rows. A job cancelled
        meanwhile fails with `Cancelled`, a prompt the backend refuses fails that job alone
        (`InvalidPrompt`); the call goes on without it."""
        if job.cancelled:
            job._fail(Cancelled("the request was cancelled before it was decoded"))
            return False
        if job.nodes is not None:
            kids = list(job.nodes)
            self.released.update(kids)  # the caller's nodes: never released here
        else:
            try:
                kids = self.scheduler._fork_prompt(job)
            except ValueError as exc:
                job._fail(InvalidPrompt(str(exc)))
                return False
        a = len(self.children)
        self.children.extend(kids)
        self.jobs[job] = (a, a + len(kids))
        self.owner.extend((job, i) for i in range(len(kids)))
        self.ended[job] = [None] * job.n
        self.left[job] = job.n
        self.rows_left += job.n
        st = self.scheduler.stats
        st.requests += 1  # counted before decoding: a job answered mid-call finds itself counted
        st.rows += job.n
        job.batch_requests, job.batch_rows = len(self.jobs), len(self.children)
        return True

    def admit(self, alive: int) -> Sequence[Admitted]:
        """`extend`'s ``admit``: queued jobs of this group that fit beside the `alive` rows.

        Admitting re-assembles the batch (about one copy of its rows' own KV), so a few newcomers
        beside many decoding rows wait up to `ADMIT_EVERY` steps to come in together; a batch that
        has shrunk to four times the waiting rows or less takes them at once."""
        sched = self.scheduler
        self.steps += 1
        self._release_retired()
        room = sched.max_rows - alive
        if room < 1:
            return []
        waiting = sched.queued_rows()
        if not waiting or (waiting * 4 < alive and self.steps - self.admitted_at < ADMIT_EVERY):
            return []
        self.admitted_at = self.steps
        # the batch is re-assembled from the rows still decoding: the jobs that ended by now leave it
        self.retiring = len(self.finished)
        before = len(self.children)
        for job in sched._admit(self.key, room):
            if self.join(job):
                sched.stats.admitted += 1
        new = self.children[before:]
        if not sched._mixes:
            return new
        return [(node, job.params) for node, (job, _) in zip(new, self.owner[before:], strict=True)]

    def _release_retired(self) -> None:
        """Release the nodes of jobs that ended before the last re-assembly (continuous batching).

        Without this a call that keeps admitting would hold every answered request's KV until it
        ends, which under a steady load is never. A job's rows leave the batch only when it is
        re-assembled (before that, a finished row may still be copied back into its node), so its
        nodes are released at the first step boundary after that."""
        if not self.retiring:
            return
        nodes = [
            n
            for job in self.finished[: self.retiring]
            for n in self.children[slice(*self.jobs[job])]
            if n not in self.released
        ]
        del self.finished[: self.retiring]
        self.retiring = 0
        if nodes:
            self.scheduler.backend.release(nodes)
            self.released.update(nodes)

    def unreleased(self) -> list[int]:
        """The call's nodes not released yet (the rest go when the call ends)."""
        return [n for n in self.children if n not in self.released]

    def __call__(self, step: DecodeStep) -> list[int] | None:
        owner = self.owner
        steps: dict[Job, DecodeStep] = {}
        for row, tokens in step.tokens.items():
            job, i = owner[row]
            if job.on_step is not None and not job.done.is_set():
                steps.setdefault(job, DecodeStep({}, {})).tokens[i] = tokens
        answered = []
        for row, gen in step.finished.items():
            job, i = owner[row]
            self.ended[job][i] = gen
            self.left[job] -= 1
            self.rows_left -= 1
            if job.on_step is not None and not job.done.is_set():
                steps.setdefault(job, DecodeStep({}, {})).finished[i] = gen
            if not self.left[job]:
                answered.append(job)
                self.finished.append(job)
        for job, own in steps.items():
            listener = job.on_step
            if listener is None:
                continue
            try:
                listener(own)
            except Exception:  # a consumer's bug must not stop everyone's decoding
                log.exception("a job's step listener failed; it hears no more steps")
                job.on_step = None
        if not self.rows_left:  # the call ends now: answer with the others, once released
            answered = []
        for job in answered:
            if not job.done.is_set() and not job.cancelled:
                job.generations = [g for g in self.ended[job] if g is not None]
                job._finish()
        return self._drop()

    def _drop(self) -> list[int] | None:
        """The rows of jobs cancelled since the last step (those jobs fail with `Cancelled` now)."""
        drop: list[int] | None = None
        for job, (a, b) in self.jobs.items():
            if job.cancelled and not job.done.is_set():
                job._fail(Cancelled("the request was cancelled while it was decoded"))
                self.rows_left -= self.left[job]  # its rows stop now, unreported
                self.left[job] = 0
                self.finished.append(job)
                drop = [*(drop or []), *range(a, b)]
        return drop


class _Through:
    """A run's backend whose `extend` goes through a scheduler (`Scheduler.view`); everything else
    is the run's own. Its `kv_stats` adds the jobs' shares of the batched calls' work."""

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
