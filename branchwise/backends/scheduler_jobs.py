"""The scheduler's records: a request (`Job`) and the future its caller waits on, the two ways the
scheduler refuses one (`QueueFull`, `InvalidPrompt`), and the batching counters (`BatchStats`).

Why a module of its own: these are what the front ends hold (the server, the DSPy and LangChain
plug-ins build a `Job`, wait on it and read `BatchStats`) and what the scheduler's parts hand each
other (the queue takes jobs, a decode pass's router answers them). They hold no thread and call no
backend, so both parts import them without importing each other; `branchwise.backends.scheduler`
says how they are used.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from branchwise.backends.base import DecodeParams, DecodeStep, Generation, NodeId, ShareMode

__all__ = ["BatchStats", "InvalidPrompt", "Job", "QueueFull"]


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
        `batch_seeded` (see `branchwise.backends.scheduler`'s docstring)."""
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
        if self.done.is_set():  # answered early (see `Router`); the batch's end changes nothing
            return
        self.done.set()
        if self.on_done is not None:
            self.on_done(self)
