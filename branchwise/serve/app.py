"""The OpenAI-compatible HTTP server: `create_app(backend)` builds the FastAPI application.

Why a server at all: LangChain, LiteLLM, every DSPy version, lm-eval and inspect speak the OpenAI
HTTP API; serving it makes branchwise reachable from all of them without adapters, and lets a model
stay loaded between calls. Every plain completion goes through the backend-level `Scheduler`, so
concurrent HTTP requests become shared decode passes (the same batching DSPy gets in-process), the
``n`` samples of a request fork one prefill, and whole prompts are submitted via `prefill`/`fork` so
a backend with a prefix cache reuses prompts across requests without this module knowing.

Behaviour at the edges: a bad body is a 400 naming the field and the range (OpenAI's error shape);
a full queue is a 429 with ``Retry-After`` (memory stays bounded: the queue never grows past
``max_queued_rows`` branches); a client that disconnects while its request waits frees it before it
is prefilled (see `Scheduler.cancel`); on shutdown (SIGTERM, via uvicorn) in-flight requests finish
before the process exits.

Streaming is server-sent events in OpenAI's chunk format, sent as the tokens are decoded: the
scheduler hands each decode step of a request's branches to the request (`Job.on_step`, on the
decoding thread), which only queues it for the event loop (`_StepFeed`), so a slow client never
holds up the batch; the loop turns tokens into text (`TextStream`) and sends the chunks. Why text
is held back at times: a stop string cuts itself and what follows out of the final text, so the
last ``len(longest stop) - 1`` characters wait until no stop string can begin in them, and a
character split over several tokens waits for its last token. Hence the streamed deltas,
concatenated, equal the non-streamed text exactly. With ``n > 1`` the choices' chunks interleave
(each names its ``index``); a choice's last chunk carries its ``finish_reason`` as soon as that
branch ends, and the response ends (optionally with a usage chunk, then ``[DONE]``) once all of its
branches have, even while other requests of its batch still decode. A backend that cannot report
steps (its `extend` takes no ``on_step``) streams each choice whole once its batch has decoded.

A client that disconnects mid-stream cancels its request: its branches stop at the next decode step
(they no longer take rows of the batch) and their KV is released when the batch ends.

Tools and structured output: the request's ``tools`` / ``response_format`` become one `Constraint`
(`protocol`), carried to the backend in `DecodeParams.constraint` (requests with different
constraints never share a decode call: the scheduler groups by params); the tools are shown in the
prompt by `Backend.chat_prompt`. The reply's text is read back into OpenAI's ``tool_calls``, whole
or streamed, by one reader (`replies.ToolCallStream`), so both say the same; a constraint the
backend's grammar engine cannot compile is a 400 naming the request field it came from.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import re
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask

from branchwise.backends.base import Backend, DecodeStep, Generation, ShareMode
from branchwise.backends.scheduler import Cancelled, InvalidPrompt, Job, QueueFull, Scheduler
from branchwise.backends.text import TextStream
from branchwise.constraints import ConstraintError
from branchwise.serve.protocol import BranchwiseOptions, ChatMessage, ChatRequest, CompletionRequest
from branchwise.serve.replies import (
    FINISH,
    ChatDeltas,
    chat_choice_message,
    chat_logprobs,
    details,
    strategy_message,
    strategy_reply,
    text_logprobs,
    tools_of,
    usage,
)

__all__ = ["create_app"]

log = logging.getLogger(__name__)


class RequestError(Exception):
    """A request the server refuses: becomes an OpenAI-shaped error response."""

    def __init__(
        self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def response(self) -> JSONResponse:
        kind = {400: "invalid_request_error", 429: "rate_limit_error", 503: "server_unavailable"}
        body = {
            "error": {
                "message": self.message,
                "type": kind.get(self.status, "server_error"),
                "param": self.param,
                "code": None,
            }
        }
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _validation_error(err: ValidationError) -> RequestError:
    """One 400 naming each bad field, what is allowed and the value sent."""
    parts, params = [], []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "json_invalid":
            loc, msg = "body", f"malformed JSON ({e['ctx'].get('error', 'invalid')})"
        elif not loc and ": " in msg:  # a model-level check names its field itself: "n: ..."
            loc, msg = msg.split(": ", 1)
        shown = loc and not isinstance(e.get("input"), dict | list) and e["type"] != "missing"
        parts.append(f"{loc or 'body'}: {msg}" + (f" (got {e['input']!r})" if shown else ""))
        params.append(re.split(r"[.\[]", loc)[0] if loc else "body")
    return RequestError(400, "; ".join(parts), param=params[0] if params else None)


def _parse(model: type[BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as err:
        raise _validation_error(err) from None


async def _disconnected(request: Request) -> None:
    """Return once the client has gone away (the body is read already, so `receive` waits for it)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _vocab_size(backend: Backend) -> int:
    """Candidates for top-logprobs: every token the tokenizer knows."""
    tokenizer = getattr(backend, "tokenizer", None)
    if tokenizer is None:
        raise RequestError(400, "top_logprobs: this backend exposes no tokenizer to rank tokens")
    return len(tokenizer)


async def _until(
    task: asyncio.Future[Any], request: Request, cancel: asyncio.Future[Any] | None = None
) -> None:
    """Wait for `task`, or for the client to go away: then cancel `cancel` (default `task`; the
    scheduler drops its job or stops its branches) and raise `CancelledError`."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        (cancel or task).cancel()
        raise asyncio.CancelledError


def _outcome(work: asyncio.Future[list[Generation]], source: str = "constraint") -> list[Generation]:
    """A finished job's generations, or its error as the HTTP error it becomes (`source`: the
    request field its constraint came from)."""
    try:
        return work.result()
    except QueueFull as err:
        raise RequestError(429, str(err), headers={"Retry-After": "1"}) from None
    except InvalidPrompt as err:
        raise RequestError(400, f"prompt: {err}", param="prompt") from None
    except Cancelled as err:  # pragma: no cover - only a disconnected client's job is cancelled
        raise RequestError(503, str(err)) from None
    except ConstraintError as err:  # the grammar engine refused the request's constraint
        raise RequestError(400, f"{source}: {err}", source.split(".")[0]) from None


class _StepFeed:
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


class _Stream:
    """A request being streamed: its job, the task awaiting it, and the steps it produces."""

    def __init__(self, job: Job, work: asyncio.Future[list[Generation]], feed: _StepFeed) -> None:
        self.job, self.work, self.feed = job, work, feed

    async def choices(self, backend: Backend) -> AsyncIterator[tuple[int, str, Generation | None]]:
        """(choice index, text delta, the choice's `Generation` once it has ended), as decoded.

        The deltas of a choice, concatenated, are its final text. Leaving early (the client went
        away) cancels the job, which stops its branches.
        """
        n = self.job.n
        texts = [TextStream(backend.decode, self.job.params) for _ in range(n)]
        ended = [False] * n
        try:
            while True:
                last = self.work.done()  # every step was queued before the job ended
                for step in self.feed.drain():
                    for i, tokens in step.tokens.items():
                        if not ended[i] and (delta := texts[i].push(tokens)):
                            yield i, delta, None
                    for i, gen in step.finished.items():
                        if not ended[i]:
                            ended[i] = True
                            yield i, texts[i].finish(gen.text), gen
                if last:
                    break
                await self.feed.wait()
            for i, gen in enumerate(_outcome(self.work)):  # choices no step reported as ended
                if not ended[i]:
                    ended[i] = True
                    yield i, texts[i].finish(gen.text), gen
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Cancel the job unless it has ended (the client left): the scheduler stops its branches."""
        if not self.work.done():
            self.work.cancel()

    async def close(self) -> None:
        """Run after the response: a response task cancelled by a disconnect may leave the
        generators above suspended rather than closed, so their `finally` cannot be relied on."""
        self.cancel()


class _Server:
    """Request handling over one backend and its scheduler (kept apart from the routes for tests)."""

    def __init__(
        self,
        backend: Backend,
        scheduler: Scheduler,
        model_name: str,
        share: ShareMode,
        max_strategy_queue: int,
    ) -> None:
        self.backend = backend
        self.share = share
        self.scheduler = scheduler
        self.model_name = model_name
        self.max_strategy_queue = max_strategy_queue
        self.strategy_waiting = 0
        self.strategy_slot = asyncio.Lock()
        """One strategy at a time: `Reasoner.run` resets and reads backend-wide KV counters."""
        self.draining = False

    # ------------------------------------------------------------------ plain completions
    def _job(self, req: ChatRequest | CompletionRequest, prompt: list[int]) -> Job:
        if self.draining:
            raise RequestError(503, "the server is shutting down")
        opts = req.branchwise or BranchwiseOptions()
        share = opts.share or self.share
        return Job(prompt=prompt, n=req.n, params=req.decode_params(req.token_budget()), share=share)

    async def decode(
        self, req: ChatRequest | CompletionRequest, prompt: list[int], request: Request
    ) -> list[Generation]:
        """Queue the request's ``n`` samples and wait for them, or for the client to go away."""
        job = self._job(req, prompt)
        work = asyncio.ensure_future(self.scheduler.submit_async(job))
        await _until(work, request)
        return _outcome(work, req.constraint_field)

    async def stream(
        self, req: ChatRequest | CompletionRequest, prompt: list[int], request: Request
    ) -> _Stream:
        """Queue the request with a step listener; return once its first tokens (or its end) are in.

        Waiting for them before answering keeps errors found on the way (a full queue, a prompt the
        backend refuses) proper HTTP errors instead of failures inside a 200 stream.
        """
        job = self._job(req, prompt)
        feed = _StepFeed(asyncio.get_running_loop())
        job.on_step = feed.push
        work = asyncio.ensure_future(self.scheduler.submit_async(job))
        work.add_done_callback(lambda _: feed.wake())
        ready = asyncio.ensure_future(feed.wait())
        try:
            await _until(ready, request, cancel=work)
        finally:
            ready.cancel()
        if work.done():
            _outcome(work, req.constraint_field)  # raises the request's error, if any
        return _Stream(job, work, feed)

    def top_logprobs(self, prompt: list[int], gen: Generation, k: int) -> list[list[tuple[int, float]]]:
        """The k most likely tokens at each generated position (temperature 1, like the chosen ones).

        The backend's decode keeps only the chosen token's log-probability, so each position is
        re-scored: one `score_next` over the whole vocabulary per generated token, reading the
        prompt's KV from one shared prefill. Costly; only asked-for top logprobs pay it.
        """
        vocab = list(range(_vocab_size(self.backend)))
        root = self._stem(prompt, "top_logprobs")
        try:
            out = []
            for i in range(len(gen.token_ids)):
                probs = self.backend.score_next([root], [prompt[-1], *gen.token_ids[:i]], vocab)[0]
                best = sorted(range(len(probs)), key=probs.__getitem__, reverse=True)[:k]
                out.append([(t, math.log(max(probs[t], 1e-45))) for t in best])
            return out
        finally:
            self.backend.release([root])

    def candidate_logprobs(self, prompt: list[int], candidates: Sequence[int]) -> list[float]:
        """Log-probability of each candidate token right after the prompt (one forward)."""
        root = self._stem(prompt, "branchwise.score_candidates")
        try:
            probs = self.backend.score_next([root], [prompt[-1]], candidates)[0]
        except ValueError as err:
            raise RequestError(400, f"branchwise.score_candidates: {err}", "branchwise") from None
        finally:
            self.backend.release([root])
        return [math.log(p) if p > 0 else -math.inf for p in probs]

    def _stem(self, prompt: list[int], field: str) -> int:
        """The prompt minus its last token, prefilled: `score_next` needs a suffix of >= 1 token."""
        if len(prompt) < 2:
            raise RequestError(400, f"{field}: needs a prompt of at least 2 tokens", field.split(".")[0])
        return self.backend.prefill(prompt[:-1])

    # ------------------------------------------------------------------ strategies
    async def run_strategy(self, req: ChatRequest | CompletionRequest, messages: list[dict[str, Any]]) -> Any:
        """Run a whole strategy on the last user turn (system turns become its system prompt). With
        tools or a response format every branch decodes under the constraint and the branches vote
        on their calls or values (`Reasoner`'s typed answers)."""
        from branchwise.reasoners import Reasoner

        opts = req.branchwise
        assert opts is not None and opts.strategy is not None
        strategy = _strategy(opts, req)
        if any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            raise RequestError(
                400,
                "messages: tool calls and results in a strategy request's history are not supported yet",
                "messages",
            )
        system = "\n\n".join(m["content"] for m in messages if m["role"] in ("system", "developer")) or None
        turns = [m for m in messages if m["role"] not in ("system", "developer")]
        if not turns:
            raise RequestError(400, "messages: a strategy needs a user message to answer", "messages")
        c = req.constraint
        typed: dict[str, Any] = {}
        if c is not None and c.kind == "tool_calls":
            typed = {
                "tools": list(c.tools),
                "tool_choice": c.tool_choice,
                "parallel_tool_calls": c.parallel_tool_calls,
            }
        elif c is not None:
            typed = {"response_format": c}
        try:
            reasoner = Reasoner(
                strategy, backend=self.backend, share=opts.share or self.share, system_prompt=system, **typed
            )
        except ValueError as err:
            raise RequestError(
                400, f"{req.constraint_field}: {err}", req.constraint_field.split(".")[0]
            ) from None
        if self.strategy_waiting >= self.max_strategy_queue:
            raise RequestError(
                429,
                f"{self.strategy_waiting} strategy runs are queued; retry later",
                headers={"Retry-After": "1"},
            )
        self.strategy_waiting += 1
        try:
            async with self.strategy_slot:
                return await asyncio.to_thread(reasoner.run, turns[-1]["content"])
        finally:
            self.strategy_waiting -= 1


def _strategy(opts: BranchwiseOptions, req: ChatRequest | CompletionRequest) -> Any:
    """The strategy the extension names: a prebuilt (knobs from the extension and the request) or a spec."""
    from branchwise.reasoners.registry import check_names
    from branchwise.strategies import PREBUILT, Strategy

    spec = opts.strategy
    try:
        if isinstance(spec, str):
            if spec not in PREBUILT:
                raise ValueError(f"{spec!r} is not a prebuilt strategy; allowed: {', '.join(PREBUILT)}")
            tokens = opts.tokens or (req.max_tokens if isinstance(req, ChatRequest) else None)
            strategy = PREBUILT[spec](
                branches=opts.branches,
                temperature=req.temperature,
                tokens=tokens,
                seed=req.seed,
                verifier=opts.verifier,
            )
        else:
            strategy = Strategy.model_validate(spec)
            strategy.compile()
        check_names(strategy)
    except ValidationError as err:
        from branchwise.cli_params import one_line

        raise RequestError(400, f"branchwise.strategy: {one_line(err)}", "branchwise") from None
    except ValueError as err:
        raise RequestError(400, f"branchwise.strategy: {err}", "branchwise") from None
    return strategy


# ---------------------------------------------------------------------- response shapes


async def _sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
    except Exception as err:  # the status line has gone out: say it in the stream (as vLLM does)
        log.exception("a streamed request failed")
        message = err.message if isinstance(err, RequestError) else f"{type(err).__name__}: {err}"
        error = {"message": message, "type": "server_error", "param": None, "code": None}
        yield f"data: {json.dumps({'error': error})}\n\n"
    yield "data: [DONE]\n\n"


def create_app(
    backend: Backend,
    *,
    model_name: str | None = None,
    share: ShareMode = "exact",
    max_batch_rows: int = 64,
    max_batch_requests: int = 64,
    max_queued_rows: int = 1024,
    window_s: float = 0.01,
    continuous: bool = True,
    max_strategy_queue: int = 16,
    drain_timeout_s: float = 30.0,
) -> FastAPI:
    """The OpenAI-compatible app over `backend` (see the module docstring).

    Args:
        model_name: the id `/v1/models` lists; default: the backend's model name.
        share: KV sharing of a request's ``n`` samples unless its ``branchwise.share`` says otherwise.
        max_batch_rows, max_batch_requests, window_s: the scheduler's batch bounds (`Scheduler`).
        continuous: requests join a running decode (`Scheduler`'s continuous batching).
        max_queued_rows: branches (sum of ``n``) that may wait; beyond, requests get 429.
        max_strategy_queue: strategy runs that may wait for the strategy slot; beyond, 429.
        drain_timeout_s: on shutdown, how long queued requests may take to finish.
    """
    scheduler = Scheduler(
        backend,
        max_rows=max_batch_rows,
        max_requests=max_batch_requests,
        window_s=window_s,
        max_queued_rows=max_queued_rows,
        continuous=continuous,
        name="branchwise-serve-scheduler",
    )
    name = model_name or str(getattr(backend, "model_name", backend.name))
    server = _Server(backend, scheduler, name, share, max_strategy_queue)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        server.draining = True  # uvicorn has let in-flight requests finish; refuse stragglers
        await asyncio.to_thread(scheduler.close, drain_timeout_s)

    app = FastAPI(title="branchwise", lifespan=lifespan)
    app.state.server = server
    app.state.scheduler = scheduler

    def meta(kind: str) -> dict[str, Any]:
        return {"id": f"{kind}-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": name}

    async def handle(request: Request, fn: Any) -> Response:
        try:
            return await fn(await request.body(), request)
        except RequestError as err:
            return err.response()

    # ------------------------------------------------------------------ chat
    async def chat(body: bytes, request: Request) -> Response:
        req: ChatRequest = _parse(ChatRequest, body)
        if req.stream and req.logprobs:
            raise RequestError(400, "logprobs: not supported together with stream", "logprobs")
        messages = _messages(req.messages)
        prompt = _chat_prompt(backend, messages, req.shown_tools)
        head = meta("chatcmpl")
        if req.branchwise is not None and req.branchwise.strategy is not None:
            result = await server.run_strategy(req, messages)
            text, finish, extra, used = strategy_reply(result)
            message, finish = strategy_message(result, text, finish, req.constraint)
            choice = {"index": 0, "message": message, "finish_reason": finish}
            return JSONResponse(
                {
                    **head,
                    "object": "chat.completion",
                    "choices": [{**choice, "logprobs": None}],
                    "usage": usage(len(prompt), used),
                    "branchwise": extra,
                }
            )
        tools = tools_of(req.constraint)
        if req.stream:
            stream = await server.stream(req, prompt, request)
            include_usage = req.stream_options is not None and req.stream_options.include_usage

            async def chunks() -> AsyncIterator[dict[str, Any]]:
                base = {**head, "object": "chat.completion.chunk"}

                def chunk(i: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
                    return {**base, "choices": [{"index": i, "delta": delta, "finish_reason": finish}]}

                for i in range(req.n):
                    yield chunk(i, {"role": "assistant", "content": ""})
                readers = [ChatDeltas(tools) for _ in range(req.n)]
                used = 0
                async for i, text, g in stream.choices(backend):
                    for delta in readers[i].push(text, end=g is not None):
                        yield chunk(i, delta)
                    if g is not None:
                        used += len(g.token_ids)
                        yield chunk(i, {}, readers[i].finish_reason(g))
                if include_usage:
                    yield {**base, "choices": [], "usage": usage(len(prompt), used)}

            return StreamingResponse(
                _sse(chunks()), media_type="text/event-stream", background=BackgroundTask(stream.close)
            )
        gens = await server.decode(req, prompt, request)
        counted = usage(len(prompt), sum(len(g.token_ids) for g in gens))
        k = req.top_logprobs or 0
        tops = [await asyncio.to_thread(server.top_logprobs, prompt, g, k) if k else None for g in gens]
        choices = []
        for i, (g, top) in enumerate(zip(gens, tops, strict=True)):
            message, finish = chat_choice_message(g, req.constraint)
            choice: dict[str, Any] = {
                "index": i,
                "message": message,
                "finish_reason": finish,
                "logprobs": None,
            }
            if req.logprobs:
                choice["logprobs"] = {"content": chat_logprobs(backend, g, top)}
            if req.branchwise is not None and req.branchwise.details:
                choice["branchwise"] = details(g)
            choices.append(choice)
        return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": counted})

    # ------------------------------------------------------------------ text completions
    async def complete(body: bytes, request: Request) -> Response:
        req: CompletionRequest = _parse(CompletionRequest, body)
        if req.stream and req.logprobs is not None:
            raise RequestError(400, "logprobs: not supported together with stream", "logprobs")
        if isinstance(req.prompt, str):
            prompt_text, prompt = req.prompt, backend.encode(req.prompt)
        else:
            prompt, prompt_text = list(req.prompt), None  # decoded only if echo asks for it
        head = meta("cmpl")
        opts = req.branchwise
        if opts is not None and opts.strategy is not None:
            question = prompt_text if prompt_text is not None else backend.decode(prompt)
            result = await server.run_strategy(req, [{"role": "user", "content": question}])
            text, finish, extra, used = strategy_reply(result)
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            return JSONResponse(
                {
                    **head,
                    "object": "text_completion",
                    "choices": [choice],
                    "usage": usage(len(prompt), used),
                    "branchwise": extra,
                }
            )
        candidates = None
        if opts is not None and opts.score_candidates is not None:
            candidates = await asyncio.to_thread(server.candidate_logprobs, prompt, opts.score_candidates)
        echo = (prompt_text if prompt_text is not None else backend.decode(prompt)) if req.echo else ""
        if req.stream:
            stream = await server.stream(req, prompt, request)
            include_usage = req.stream_options is not None and req.stream_options.include_usage

            async def chunks() -> AsyncIterator[dict[str, Any]]:
                base = {**head, "object": "text_completion"}

                def chunk(i: int, text: str, finish: str | None = None) -> dict[str, Any]:
                    return {**base, "choices": [{"index": i, "text": text, "finish_reason": finish}]}

                echoed: set[int] = set()
                used = 0
                async for i, text, g in stream.choices(backend):
                    if i not in echoed:  # the echoed prompt leads each choice's first chunk
                        echoed.add(i)
                        text = echo + text
                    if text:
                        yield chunk(i, text)
                    if g is not None:
                        used += len(g.token_ids)
                        yield chunk(i, "", FINISH[g.finish_reason])
                if include_usage:
                    yield {**base, "choices": [], "usage": usage(len(prompt), used)}

            return StreamingResponse(
                _sse(chunks()), media_type="text/event-stream", background=BackgroundTask(stream.close)
            )
        gens = await server.decode(req, prompt, request)
        counted = usage(len(prompt), sum(len(g.token_ids) for g in gens))
        k = req.logprobs or 0
        tops = [await asyncio.to_thread(server.top_logprobs, prompt, g, k) if k else None for g in gens]
        choices = []
        for i, (g, top) in enumerate(zip(gens, tops, strict=True)):
            choice = {
                "index": i,
                "text": echo + g.text,
                "finish_reason": FINISH[g.finish_reason],
                "logprobs": None,
            }
            if req.logprobs is not None:
                choice["logprobs"] = text_logprobs(backend, g, top, req.return_tokens_as_token_ids, len(echo))
            if opts is not None and opts.details:
                choice["branchwise"] = details(g)
            choices.append(choice)
        reply: dict[str, Any] = {**head, "object": "text_completion", "choices": choices, "usage": counted}
        if candidates is not None:
            reply["branchwise"] = {"candidate_logprobs": candidates}
        return JSONResponse(reply)

    # ------------------------------------------------------------------ routes
    @app.post("/v1/chat/completions")
    async def chat_route(request: Request) -> Response:
        return await handle(request, chat)

    @app.post("/v1/completions")
    async def completions_route(request: Request) -> Response:
        return await handle(request, complete)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": 0, "owned_by": "branchwise"}],
        }

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "draining" if server.draining else "ok",
            "model": name,
            "queued_rows": scheduler.queued_rows(),
            "busy": not scheduler.idle(),
            "batching": {**scheduler.stats.as_dict(), "continuous": scheduler.admits},
        }

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """vLLM's tokenizer endpoint (text, or chat messages, and tools, with the generation prompt
        appended)."""

        async def run(body: bytes, _: Request) -> Response:
            data = _json_object(body)
            if "messages" in data:
                fields = {k: data[k] for k in ("messages", "tools", "tool_choice") if k in data}
                req = _parse(ChatRequest, json.dumps(fields).encode())
                tokens = _chat_prompt(backend, _messages(req.messages), req.shown_tools)
            elif isinstance(data.get("prompt"), str):
                tokens = backend.encode(data["prompt"])
            else:
                raise RequestError(400, "prompt: give a string prompt or messages", "prompt")
            return JSONResponse({"tokens": tokens, "count": len(tokens)})

        return await handle(request, run)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        async def run(body: bytes, _: Request) -> Response:
            tokens = _json_object(body).get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
                raise RequestError(400, "tokens: give a list of token ids (integers >= 0)", "tokens")
            return JSONResponse({"prompt": backend.decode(tokens)})

        return await handle(request, run)

    return app


def _messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The request's messages as `Backend.chat_prompt` takes them (OpenAI-shaped dicts)."""
    try:
        return [m.as_dict() for m in messages]
    except ValueError as err:
        raise RequestError(400, str(err), "messages") from None


def _chat_prompt(
    backend: Backend, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[int]:
    """The prompt's token ids; the tools shown in the model's template or the fallback prompt."""
    if not tools:
        return backend.chat_prompt(messages)
    if "tools" not in inspect.signature(backend.chat_prompt).parameters:  # e.g. RemoteBackend's
        raise RequestError(400, f"tools: the {backend.name} backend cannot show tools to its model", "tools")
    return backend.chat_prompt(messages, tools)


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body or b"{}")
    except ValueError as err:
        raise RequestError(400, f"body: malformed JSON ({err})", "body") from None
    if not isinstance(data, dict):
        raise RequestError(400, "body: must be a JSON object", "body")
    return data
