"""Waiting for the scheduler without blocking the event loop, and streaming its steps as chunks.

Why a watch on every wait: a request's work runs on the scheduler's thread (or a strategy's), while
its handler waits on the event loop. Three things end that wait early, and each must reach the work
and the client in a defined way: the client going away (the work is cancelled, nothing is sent, one
log line — not an exception escaping into the ASGI server, which would log a traceback), the
shutdown drain's deadline (the work is cancelled, the client gets a JSON 503) and, for strategies,
the run's own deadline (a 504). `watch` waits for whichever comes first.

Streaming: the scheduler hands each decode step of a request's branches to the request
(`Job.on_step`, on the decoding thread), which only queues it for the event loop (`StepFeed`), so
a slow client never holds up the batch; a worker thread turns the queued tokens into text
(`TextStream`: a remote backend detokenizes over HTTP, which must not stall the loop and every
other request with it) and the reply's readers (`replies.ChatChunks`, `replies.TextChunks`) turn
text into OpenAI's chunks.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

from fastapi import Request

from branchwise.backends.base import Backend, DecodeStep, Generation, KVBudgetExceeded
from branchwise.backends.scheduler import Cancelled, InvalidPrompt, Job, QueueFull
from branchwise.backends.text import TextStream
from branchwise.constraints import ConstraintError
from branchwise.serve.errors import ClientGone, RequestError, draining
from branchwise.serve.replies import Chunks, reply_notes, usage

__all__ = ["StepFeed", "Stream", "chunks", "outcome", "sse", "until", "watch"]

log = logging.getLogger("branchwise.serve")

Why = Literal["done", "gone", "dropped", "timeout"]


async def _disconnected(request: Request) -> None:
    """Return once the client has gone away (the body is read already, so `receive` waits for it)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def watch(
    work: asyncio.Future[Any], request: Request, drop: asyncio.Event, timeout_s: float | None = None
) -> Why:
    """Wait for `work` (a future: it is not cancelled here), or for the client to leave, the drain to
    drop in-flight work, or `timeout_s`; say which came first."""
    gone = asyncio.ensure_future(_disconnected(request))
    dropped = asyncio.ensure_future(drop.wait())
    try:
        await asyncio.wait({work, gone, dropped}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return "done"
        return "gone" if gone.done() else "dropped" if dropped.done() else "timeout"
    finally:
        gone.cancel()
        dropped.cancel()


async def until(
    task: asyncio.Future[Any],
    request: Request,
    drop: asyncio.Event,
    cancel: asyncio.Future[Any] | None = None,
) -> None:
    """Wait for `task`; if the client leaves or the drain drops the request first, cancel `cancel`
    (default `task`; the scheduler drops its job or stops its branches) and raise `ClientGone` or
    the drain's 503."""
    why = await watch(task, request, drop)
    if why == "done":
        return
    (cancel or task).cancel()
    if why == "gone":
        raise ClientGone
    raise draining()


def outcome(work: asyncio.Future[list[Generation]], source: str = "constraint") -> list[Generation]:
    """A finished job's generations, or its error as the HTTP error it becomes (`source`: the
    request field its constraint came from)."""
    try:
        return work.result()
    except QueueFull as err:
        raise RequestError(429, str(err), headers={"Retry-After": "1"}) from None
    except InvalidPrompt as err:
        raise RequestError(400, f"prompt: {err}", param="prompt") from None
    except Cancelled:  # the drain cancelled it (a client that left gets no answer at all)
        raise draining() from None
    except ConstraintError as err:  # the grammar engine refused the request's constraint
        raise RequestError(400, f"{source}: {err}", source.split(".")[0]) from None
    except KVBudgetExceeded as err:  # retrying cannot help: the request alone is too big
        raise RequestError(
            400, f"n, max_tokens: the request cannot fit the server's KV budget ({err})"
        ) from None


class StepFeed:
    """One streamed request's decode steps, handed from the scheduler's worker to the event loop.

    The worker only appends to a deque and, unless a wake-up is pending already, schedules one
    (`call_soon_threadsafe`): it never waits for the client, and a consumer that falls behind finds
    several steps at once (at most the request's own tokens: memory stays bounded by max_tokens).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._steps: deque[DecodeStep] = deque()
        self._ready = asyncio.Event()
        self._wake_pending = False

    def push(self, step: DecodeStep) -> None:
        """On the worker thread: queue `step` and make sure the loop will look."""
        self._steps.append(step)
        if not self._wake_pending:
            self._wake_pending = True
            self._loop.call_soon_threadsafe(self._ready.set)

    def wake(self) -> None:
        """On the loop: look again (the job has ended)."""
        self._ready.set()

    async def wait(self) -> None:
        await self._ready.wait()

    def drain(self) -> list[DecodeStep]:
        """On the loop: every step queued so far (a push after this schedules a new wake-up)."""
        self._wake_pending = False
        self._ready.clear()
        steps = []
        while self._steps:
            steps.append(self._steps.popleft())
        return steps


def _deltas(
    steps: Sequence[DecodeStep], texts: Sequence[TextStream], ended: list[bool]
) -> list[tuple[int, str, Generation | None]]:
    """The text deltas of queued steps, in order (`Stream.choices`' items); marks ended choices.

    Each choice's tokens of all the steps are detokenized together (two decodes a choice, however
    far the consumer fell behind), so a slow detokenizer lets the stream catch up instead of
    falling further behind; a choice's deltas still come out in the order of its steps."""
    out: list[tuple[int, str, Generation | None]] = []
    pending: dict[int, list[int]] = {}

    def flush(i: int) -> None:
        if (tokens := pending.pop(i, None)) and (delta := texts[i].push(tokens)):
            out.append((i, delta, None))

    for step in steps:
        for i, tokens in step.tokens.items():
            if not ended[i]:
                pending.setdefault(i, []).extend(tokens)
        for i, gen in step.finished.items():
            if not ended[i]:
                flush(i)
                ended[i] = True
                out.append((i, texts[i].finish(gen.text), gen))
    for i in list(pending):
        flush(i)
    return out


class Stream:
    """A request being streamed: its job, the task awaiting it, and the steps it produces."""

    def __init__(
        self, job: Job, work: asyncio.Future[list[Generation]], feed: StepFeed, drop: asyncio.Event
    ) -> None:
        self.job, self.work, self.feed, self.drop = job, work, feed, drop

    async def choices(self, backend: Backend) -> AsyncIterator[tuple[int, str, Generation | None]]:
        """(choice index, text delta, the choice's `Generation` once it has ended), as decoded.

        The deltas of a choice, concatenated, are its final text. Leaving early (the client went
        away) cancels the job, which stops its branches; the drain's deadline raises its 503.
        """
        n = self.job.n
        texts = [TextStream(backend.decode, self.job.params) for _ in range(n)]
        ended = [False] * n
        try:
            while True:
                last = self.work.done()  # every step was queued before the job ended
                steps = self.feed.drain()
                if steps:  # detokenizing may block (a remote backend's is an HTTP call): not on the loop
                    for item in await asyncio.to_thread(_deltas, steps, texts, ended):
                        yield item
                if last:
                    break
                await self._next()
            for i, gen in enumerate(outcome(self.work)):  # choices no step reported as ended
                if not ended[i]:
                    ended[i] = True
                    yield i, texts[i].finish(gen.text), gen
        finally:
            self.cancel()

    async def _next(self) -> None:
        """Wait for the next steps; the drain's deadline stops the stream with its 503."""
        if self.drop.is_set():
            raise draining()
        ready = asyncio.ensure_future(self.feed.wait())
        dropped = asyncio.ensure_future(self.drop.wait())
        try:
            await asyncio.wait({ready, dropped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            dropped.cancel()
        if self.drop.is_set() and not self.work.done():
            raise draining()

    def cancel(self) -> None:
        """Cancel the job unless it has ended (the client left): the scheduler stops its branches.
        A client that left mid-stream is one INFO line, as one that left a waiting request is
        (`app.handle`); the drain's drop is said by `sse` instead."""
        if not self.work.done():
            self.work.cancel()
            if not self.drop.is_set():
                log.info("a streamed request's client went away; its branches were stopped")

    async def close(self) -> None:
        """Run after the response: a response task cancelled by a disconnect may leave the
        generators above suspended rather than closed, so their `finally` cannot be relied on."""
        self.cancel()


async def chunks(
    stream: Stream,
    backend: Backend,
    base: dict[str, Any],
    readers: Sequence[Chunks],
    prompt_tokens: int,
    include_usage: bool,
) -> AsyncIterator[dict[str, Any]]:
    """OpenAI's chunks of a streamed reply (chat or text: `readers` say which), then the usage.

    The chunk that ends the last choice carries the reply's notes (``branchwise.notes``, as a whole
    reply does: decode steps that left the fast step), so a streaming caller is told too."""

    def chunk(i: int, payload: dict[str, Any]) -> dict[str, Any]:
        return {**base, "choices": [{"index": i, **payload}]}

    for i, reader in enumerate(readers):
        for payload in reader.start():
            yield chunk(i, payload)
    ended: list[Generation] = []
    async for i, text, g in stream.choices(backend):
        cut = g is not None and g.finish_reason == "length"
        for payload in readers[i].push(text, end=g is not None, cut=cut):
            yield chunk(i, payload)
        if g is not None:
            ended.append(g)
            last = chunk(i, readers[i].finish(g))
            if len(ended) == len(readers) and (notes := reply_notes(ended)):
                last["branchwise"] = {"notes": notes}
            yield last
    used = sum(len(g.token_ids) for g in ended)
    if include_usage:
        yield {**base, "choices": [], "usage": usage(prompt_tokens, used)}


async def sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Server-sent events; an error after the status line went out is said in the stream (as vLLM
    does), in OpenAI's error shape."""
    try:
        async for event in events:
            yield f"data: {json.dumps(event)}\n\n"
    except RequestError as err:  # a refusal (the drain's 503): expected, one line
        log.info("a streamed request ended early: %s", err.message)
        yield f"data: {json.dumps(err.body())}\n\n"
    except Exception as err:
        log.exception("a streamed request failed")
        error = {
            "message": f"{type(err).__name__}: {err}",
            "type": "server_error",
            "param": None,
            "code": None,
        }
        yield f"data: {json.dumps({'error': error})}\n\n"
    yield "data: [DONE]\n\n"
