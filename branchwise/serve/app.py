"""The OpenAI-compatible HTTP server: `create_app(backend)` builds the FastAPI application.

Why a server at all: LangChain, LiteLLM, every DSPy version, lm-eval and inspect speak the OpenAI
HTTP API; serving it makes branchwise reachable from all of them without adapters, and lets a model
stay loaded between calls. Every plain completion goes through the backend-level `Scheduler`, so
concurrent HTTP requests become shared decode passes (the same batching DSPy gets in-process), the
``n`` samples of a request fork one prefill, and whole prompts are submitted via `prefill`/`fork` so
a backend with a prefix cache reuses prompts across requests without this module knowing.

Behaviour at the edges: a bad body is a 400 naming the field and the range (OpenAI's error shape,
`errors`); a request the door refuses — wrong Host, no API key, not JSON, a body too big or too
slow — never reaches a route (`guard`); a prompt that does not fit the model's context with its
``max_tokens`` is a 400 naming both numbers before anything is computed (a default ``max_tokens``
is clamped to what the context leaves instead); a full queue is a 429 with ``Retry-After`` (memory
stays bounded: the queue never grows past ``max_queued_rows`` branches); a client that disconnects
while its request waits frees it before it is prefilled (see `Scheduler.cancel`), one that leaves
mid-stream has its branches stopped at the next decode step.

Shutdown (`begin_drain`, called by the runner when SIGTERM arrives): new requests get a 503,
in-flight ones may finish until ``drain_timeout_s``; then whatever still runs is cancelled and its
client answered with a JSON 503 (`streaming.watch` sees the drain's deadline beside the client's
disconnect), so the process exits within the timeout, not after it plus the scheduler's own wait.

Streaming is server-sent events in OpenAI's chunk format, sent as the tokens are decoded
(`streaming`): the scheduler hands each decode step to the request on its own thread, the event
loop turns tokens into text (`TextStream`) and text into chunks. Why text is held back at times: a
stop string cuts itself and what follows out of the final text, so the last
``len(longest stop) - 1`` characters wait until no stop string can begin in them, and a character
split over several tokens waits for its last token. Hence the streamed deltas, concatenated, equal
the non-streamed text exactly. With ``n > 1`` the choices' chunks interleave (each names its
``index``); a choice's last chunk carries its ``finish_reason`` as soon as that branch ends. A
backend that cannot report steps streams each choice whole once its batch has decoded.

Tools and structured output: the request's ``tools`` / ``response_format`` become one `Constraint`
(`protocol`), carried to the backend in `DecodeParams.constraint` (requests with different
constraints never share a decode call: the scheduler groups by params); the tools are shown in the
prompt by `Backend.chat_prompt`. The reply's text is read back into OpenAI's ``tool_calls``, whole
or streamed, by one reader (`replies.ToolCallStream`), so both say the same. Strategy runs (the
``branchwise`` extension) are bounded and cancellable (`strategy`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from branchwise.backends.base import Backend, Generation, ShareMode
from branchwise.backends.scheduler import Job, Scheduler
from branchwise.serve.errors import ClientGone, RequestError, draining, json_object, parse
from branchwise.serve.guard import Guard
from branchwise.serve.protocol import BranchwiseOptions, ChatMessage, ChatRequest, CompletionRequest
from branchwise.serve.replies import (
    FINISH,
    ChatChunks,
    TextChunks,
    chat_choice_message,
    chat_logprobs,
    details,
    strategy_message,
    strategy_reply,
    text_logprobs,
    tools_of,
    usage,
)
from branchwise.serve.strategy import StrategyLimits, StrategyRunner
from branchwise.serve.streaming import StepFeed, Stream, chunks, outcome, sse, until

__all__ = ["create_app"]

log = logging.getLogger("branchwise.serve")

DRAIN_GRACE_S = 2.0
"""After the drain's deadline: how long dropped work may take to stop (one decode step) before
the process exits anyway."""


def _vocab_size(backend: Backend) -> int | None:
    """Tokens the tokenizer knows (None: the backend exposes no tokenizer)."""
    tokenizer = getattr(backend, "tokenizer", None)
    return None if tokenizer is None else len(tokenizer)


class _Server:
    """Request handling over one backend and its scheduler (kept apart from the routes for tests)."""

    def __init__(
        self, backend: Backend, scheduler: Scheduler, share: ShareMode, strategies: StrategyRunner
    ) -> None:
        self.backend = backend
        self.share = share
        self.scheduler = scheduler
        self.strategies = strategies
        self.draining = False
        self.drop = asyncio.Event()
        """Set at the drain's deadline: every request still waiting is cancelled and answered 503."""
        self.drain_end: float | None = None

    def begin_drain(self, timeout_s: float) -> None:
        """On the loop: refuse new requests; drop what still runs `timeout_s` from now."""
        if self.draining:
            return
        loop = asyncio.get_running_loop()
        self.draining = True
        self.drain_end = loop.time() + timeout_s
        loop.call_later(timeout_s, self.drop.set)

    # ------------------------------------------------------------------ checks at the door
    def fit(self, req: ChatRequest | CompletionRequest, prompt: list[int], field: str) -> int:
        """The request's ``max_tokens`` within the model's context: a 400 when the prompt, or the
        prompt and the ``max_tokens`` the client chose, do not fit; a default budget is clamped."""
        context = getattr(self.backend, "max_context", None)
        wanted = req.token_budget()
        if context is None:
            return wanted
        if len(prompt) >= context:
            raise RequestError(
                400,
                f"{field}: the prompt is {len(prompt)} tokens; the model's context of {context} tokens "
                "leaves no room for a reply",
                field,
            )
        if not req.budget_set():
            return min(wanted, context - len(prompt))
        if len(prompt) + wanted > context:
            name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
            raise RequestError(
                400,
                f"{name}: the prompt ({len(prompt)} tokens) + {name} ({wanted}) = {len(prompt) + wanted} "
                f"exceeds the model's context of {context} tokens",
                name,
            )
        return wanted

    def check_ids(self, ids: Sequence[int], field: str) -> None:
        """A 400 naming `field` and the range when an id is outside the vocabulary."""
        check = getattr(getattr(self.backend, "engine", None), "check_ids", None)
        if check is not None:
            try:
                check(ids, field)
            except ValueError as err:
                message = str(err)
                raise RequestError(
                    400, message if message.startswith(field) else f"{field}: {message}", field
                ) from None
            return
        vocab = _vocab_size(self.backend)
        bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise RequestError(400, f"{field} holds ids outside [0, {vocab}): {bad[:5]}", field)

    # ------------------------------------------------------------------ plain completions
    def _job(self, req: ChatRequest | CompletionRequest, prompt: list[int], max_tokens: int) -> Job:
        if self.draining:
            raise draining()
        opts = req.branchwise or BranchwiseOptions()
        share = opts.share or self.share
        return Job(prompt=prompt, n=req.n, params=req.decode_params(max_tokens), share=share)

    async def decode(
        self, req: ChatRequest | CompletionRequest, prompt: list[int], max_tokens: int, request: Request
    ) -> list[Generation]:
        """Queue the request's ``n`` samples and wait for them, or for the client to go away."""
        job = self._job(req, prompt, max_tokens)
        work = asyncio.ensure_future(self.scheduler.submit_async(job))
        await until(work, request, self.drop)
        return outcome(work, req.constraint_field)

    async def stream(
        self, req: ChatRequest | CompletionRequest, prompt: list[int], max_tokens: int, request: Request
    ) -> Stream:
        """Queue the request with a step listener; return once its first tokens (or its end) are in.

        Waiting for them before answering keeps errors found on the way (a full queue, a prompt the
        backend refuses) proper HTTP errors instead of failures inside a 200 stream.
        """
        job = self._job(req, prompt, max_tokens)
        feed = StepFeed(asyncio.get_running_loop())
        job.on_step = feed.push
        work = asyncio.ensure_future(self.scheduler.submit_async(job))
        work.add_done_callback(lambda _: feed.wake())
        ready = asyncio.ensure_future(feed.wait())
        try:
            await until(ready, request, self.drop, cancel=work)
        finally:
            ready.cancel()
        if work.done():
            outcome(work, req.constraint_field)  # raises the request's error, if any
        return Stream(job, work, feed, self.drop)

    def top_logprobs(self, prompt: list[int], gen: Generation, k: int) -> list[list[tuple[int, float]]]:
        """The k most likely tokens at each generated position (temperature 1, like the chosen ones).

        The backend's decode keeps only the chosen token's log-probability, so each position is
        re-scored: one `score_next` over the whole vocabulary per generated token, reading the
        prompt's KV from one shared prefill. Costly; only asked-for top logprobs pay it.
        """
        size = _vocab_size(self.backend)
        if size is None:
            raise RequestError(400, "top_logprobs: this backend exposes no tokenizer to rank tokens")
        vocab = list(range(size))
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

    # ------------------------------------------------------------------ health
    def kv(self) -> dict[str, Any] | None:
        """The backend's KV memory figures for `/health`, read without its lock (which a decode
        holds for as long as it runs), so a busy server still answers at once."""
        memory = getattr(self.backend, "kv_memory", None)
        return None if memory is None else dict(memory())


@dataclass(frozen=True)
class _Kind:
    """What differs between a chat and a text completion's reply: names and choice shapes."""

    object: str
    chunk_object: str
    id_prefix: str


CHAT = _Kind("chat.completion", "chat.completion.chunk", "chatcmpl")
TEXT = _Kind("text_completion", "text_completion", "cmpl")


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
    api_key: str | None = None,
    allowed_hosts: Sequence[str] = (),
    cors_origins: Sequence[str] = (),
    docs: bool = False,
    max_body_bytes: int = 8 * 2**20,
    body_timeout_s: float = 30.0,
    max_strategy_branches: int = 64,
    max_strategy_tokens: int = 64 * 2048,
    strategy_timeout_s: float = 600.0,
) -> FastAPI:
    """The OpenAI-compatible app over `backend` (see the module docstring).

    Args:
        model_name: the id `/v1/models` lists; default: the backend's model name.
        share: KV sharing of a request's ``n`` samples unless its ``branchwise.share`` says otherwise.
        max_batch_rows, max_batch_requests, window_s: the scheduler's batch bounds (`Scheduler`).
        continuous: requests join a running decode (`Scheduler`'s continuous batching).
        max_queued_rows: branches (sum of ``n``) that may wait; beyond, requests get 429.
        max_strategy_queue: strategy runs that may wait for the strategy slot; beyond, 429.
        drain_timeout_s: on shutdown, how long in-flight requests may take to finish.
        api_key, allowed_hosts, max_body_bytes, body_timeout_s: the door's checks (`guard.Guard`).
        cors_origins: origins whose pages may call the API (CORS); none by default.
        docs: serve FastAPI's ``/docs``, ``/redoc`` and ``/openapi.json``.
        max_strategy_branches, max_strategy_tokens, strategy_timeout_s: bounds of a strategy run
            (`strategy.StrategyLimits`).
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
    limits = StrategyLimits(max_strategy_branches, max_strategy_tokens, strategy_timeout_s)
    server = _Server(backend, scheduler, share, StrategyRunner(backend, share, max_strategy_queue, limits))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        server.begin_drain(drain_timeout_s)  # a no-op where the runner began it on SIGTERM
        assert server.drain_end is not None
        left = server.drain_end - asyncio.get_running_loop().time()
        await asyncio.to_thread(scheduler.close, max(0.0, left) + DRAIN_GRACE_S)

    urls = {"docs_url": "/docs", "redoc_url": "/redoc", "openapi_url": "/openapi.json"}
    app = FastAPI(title="branchwise", lifespan=lifespan, **(urls if docs else dict.fromkeys(urls)))
    opened = ["/health", *(urls.values() if docs else ()), "/docs/oauth2-redirect"]
    app.add_middleware(
        Guard,
        api_key=api_key,
        allowed_hosts=allowed_hosts,
        max_body_bytes=max_body_bytes,
        body_timeout_s=body_timeout_s,
        open_paths=opened,
    )
    if cors_origins:  # outermost, so that preflights are answered before the door's checks
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    app.state.server = server
    app.state.scheduler = scheduler
    app.state.begin_drain = lambda: server.begin_drain(drain_timeout_s)
    app.state.drain_timeout_s = drain_timeout_s

    async def handle(request: Request, fn: Any) -> Response:
        try:
            return await fn(await request.body(), request)
        except RequestError as err:
            if err.status == 503 and server.draining:
                log.info("%s %s: answered 503 (shutting down)", request.method, request.url.path)
            return err.response()
        except ClientGone:
            log.info("%s %s: the client went away; its work was cancelled", request.method, request.url.path)
            return Response(status_code=499)  # never sent: the connection is closed
        except Exception as err:  # a bug: logged once, answered in OpenAI's shape, never plain text
            log.exception("%s %s failed", request.method, request.url.path)
            return RequestError(500, f"internal error: {type(err).__name__}: {err}").response()

    # ------------------------------------------------------------------ the one reply builder
    async def reply(
        kind: _Kind,
        req: ChatRequest | CompletionRequest,
        prompt: list[int],
        field: str,
        request: Request,
        messages: list[dict[str, Any]],
        echo: str = "",
    ) -> Response:
        """Answer a chat or text completion: a strategy run, a stream, or whole choices."""
        head = {"id": f"{kind.id_prefix}-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": name}
        opts = req.branchwise
        chat = isinstance(req, ChatRequest)
        if opts is not None and opts.strategy is not None:
            context = getattr(backend, "max_context", None)
            if context is not None and len(prompt) >= context:
                raise RequestError(
                    400, f"{field}: the prompt is {len(prompt)} tokens, the model's context {context}", field
                )
            result = await server.strategies.run(req, messages, request, server.drop, field)
            text, finish, extra, used = strategy_reply(result)
            if chat:
                message, finish = strategy_message(result, text, finish, req.constraint)
                choice: dict[str, Any] = {
                    "index": 0,
                    "message": message,
                    "finish_reason": finish,
                    "logprobs": None,
                }
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            body = {
                "object": kind.object,
                "choices": [choice],
                "usage": usage(len(prompt), used),
                "branchwise": extra,
            }
            return JSONResponse({**head, **body})
        max_tokens = server.fit(req, prompt, field)
        candidates = None
        if not chat and opts is not None and opts.score_candidates is not None:
            candidates = await asyncio.to_thread(server.candidate_logprobs, prompt, opts.score_candidates)
        if req.stream:
            stream = await server.stream(req, prompt, max_tokens, request)
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            tools = tools_of(req.constraint)
            readers = [ChatChunks(tools) if chat else TextChunks(echo) for _ in range(req.n)]
            events = chunks(
                stream, backend, {**head, "object": kind.chunk_object}, readers, len(prompt), include_usage
            )
            return StreamingResponse(
                sse(events), media_type="text/event-stream", background=BackgroundTask(stream.close)
            )
        gens = await server.decode(req, prompt, max_tokens, request)
        k = (req.top_logprobs or 0) if isinstance(req, ChatRequest) else (req.logprobs or 0)
        tops = [await asyncio.to_thread(server.top_logprobs, prompt, g, k) if k else None for g in gens]
        choices = []
        for i, (g, top) in enumerate(zip(gens, tops, strict=True)):
            choice = {"index": i}
            if isinstance(req, ChatRequest):
                message, finish = chat_choice_message(g, req.constraint)
                choice.update(message=message, finish_reason=finish, logprobs=None)
                if req.logprobs:
                    choice["logprobs"] = {"content": chat_logprobs(backend, g, top)}
            else:
                choice.update(text=echo + g.text, finish_reason=FINISH[g.finish_reason], logprobs=None)
                if req.logprobs is not None:
                    choice["logprobs"] = text_logprobs(
                        backend, g, top, req.return_tokens_as_token_ids, len(echo)
                    )
            if opts is not None and opts.details:
                choice["branchwise"] = details(g)
            choices.append(choice)
        counted = usage(len(prompt), sum(len(g.token_ids) for g in gens))
        out: dict[str, Any] = {**head, "object": kind.object, "choices": choices, "usage": counted}
        if candidates is not None:
            out["branchwise"] = {"candidate_logprobs": candidates}
        return JSONResponse(out)

    async def chat(body: bytes, request: Request) -> Response:
        req: ChatRequest = parse(ChatRequest, body)
        if req.stream and req.logprobs:
            raise RequestError(400, "logprobs: not supported together with stream", "logprobs")
        messages = _messages(req.messages)
        prompt = _chat_prompt(backend, messages, req.shown_tools)
        return await reply(CHAT, req, prompt, "messages", request, messages)

    async def complete(body: bytes, request: Request) -> Response:
        req: CompletionRequest = parse(CompletionRequest, body)
        if req.stream and req.logprobs is not None:
            raise RequestError(400, "logprobs: not supported together with stream", "logprobs")
        if isinstance(req.prompt, str):
            prompt_text, prompt = req.prompt, backend.encode(req.prompt)
        else:
            # ids (`CompletionRequest` unwraps a list of one prompt); the text is decoded only if echo
            # or a strategy asks
            prompt, prompt_text = list(cast(list[int], req.prompt)), None
            server.check_ids(prompt, "prompt")
        wants_text = req.echo or (req.branchwise is not None and req.branchwise.strategy is not None)
        text = (prompt_text if prompt_text is not None else backend.decode(prompt)) if wants_text else ""
        messages = [{"role": "user", "content": text}]
        return await reply(TEXT, req, prompt, "prompt", request, messages, text if req.echo else "")

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
        runs = server.strategies.runs
        out = {
            "status": "draining" if server.draining else "ok",
            "model": name,
            "queued_rows": scheduler.queued_rows(),
            "busy": not scheduler.idle() or runs > 0,
            "strategy_runs": runs,
            "batching": {**scheduler.stats.as_dict(), "continuous": scheduler.admits},
        }
        kv = server.kv()
        return out if kv is None else {**out, "kv": kv}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """vLLM's tokenizer endpoint (text, or chat messages, and tools, with the generation prompt
        appended)."""

        async def run(body: bytes, _: Request) -> Response:
            data = json_object(body)
            if "messages" in data:
                fields = {k: data[k] for k in ("messages", "tools", "tool_choice") if k in data}
                req = parse(ChatRequest, json.dumps(fields).encode())
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
            tokens = json_object(body).get("tokens")
            if not isinstance(tokens, list):
                raise RequestError(400, "tokens: give a list of token ids (integers >= 0)", "tokens")
            for i, t in enumerate(tokens):  # `type`, not isinstance: JSON's true is no token id
                if type(t) is not int or t < 0:
                    raise RequestError(
                        400,
                        f"tokens[{i}]: a token id is an integer >= 0 (got {json.dumps(t)[:40]})",
                        "tokens",
                    )
            server.check_ids(tokens, "tokens")
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
