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
(`streaming`): the scheduler hands each decode step to the request on its own thread, a worker
thread turns tokens into text (`TextStream`) and the event loop text into chunks. Translations
(chat templates, tokenization) run off the loop too: a remote backend's tokenizer is an HTTP
call. Why text is held back at times: a stop string cuts itself and what follows out of the final
text, so the last ``len(longest stop) - 1`` characters wait until no stop string can begin in
them, and a character split over several tokens waits for its last token. Hence the streamed
deltas, concatenated, equal the non-streamed text exactly. With ``n > 1`` the choices' chunks
interleave (each names its ``index``); a choice's last chunk carries its ``finish_reason`` as soon
as that branch ends. A backend that cannot report steps streams each choice whole once its batch
has decoded.

Tools and structured output: the request's ``tools`` / ``response_format`` become one `Constraint`
(`protocol`), carried to the backend in `DecodeParams.constraint` (requests with different
constraints never share a decode call: the scheduler groups by params); the tools are shown in the
prompt by `Backend.chat_prompt`. The reply's text is read back into OpenAI's ``tool_calls``, whole
or streamed, by one reader (`replies.ToolCallStream`), so both say the same. Strategy runs (the
``branchwise`` extension) are bounded and cancellable (`strategy`).

Where things live: this module builds the app (scheduler, middleware, lifespan) and wires each
route to plain functions: a request is translated (`translate`), answered (`completions`) and its
reply shaped (`replies`) over one `server.Server`, whose `handle` turns every error into OpenAI's
error shape.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from branchwise.backends.base import Backend, ShareMode
from branchwise.backends.scheduler import Scheduler
from branchwise.serve.completions import answer
from branchwise.serve.guard import Guard
from branchwise.serve.server import Server, handle
from branchwise.serve.strategy import StrategyLimits, StrategyRunner
from branchwise.serve.translate import chat_completion, detokenized, text_completion, tokenized

__all__ = ["create_app"]

DRAIN_GRACE_S = 2.0
"""After the drain's deadline: how long dropped work may take to stop (one decode step) before
the process exits anyway."""


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
    dspy_fields: bool = True,
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
        dspy_fields: decode a request that asks for DSPy's fields in DSPy's words under a JSON
            Schema of them (`field_format.FieldFormat`).
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
    strategies = StrategyRunner(backend, share, max_strategy_queue, limits)
    server = Server(backend, scheduler, share, strategies, name)
    server.dspy_fields = dspy_fields

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
    _routes(app, server)
    return app


def _routes(app: FastAPI, server: Server) -> None:
    """The HTTP routes: each one a translation, an answer, and `handle`'s error rule."""

    @app.post("/v1/chat/completions")
    async def chat_route(request: Request) -> Response:
        async def run(body: bytes, request: Request) -> Response:
            return await answer(server, await asyncio.to_thread(chat_completion, server, body), request)

        return await handle(server, request, run)

    @app.post("/v1/completions")
    async def completions_route(request: Request) -> Response:
        async def run(body: bytes, request: Request) -> Response:
            return await answer(server, await asyncio.to_thread(text_completion, server, body), request)

        return await handle(server, request, run)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": server.name, "object": "model", "created": 0, "owned_by": "branchwise"}],
        }

    @app.get("/health")
    async def health() -> dict[str, Any]:
        scheduler, runs = server.scheduler, server.strategies.runs
        out = {
            "status": "draining" if server.draining else "ok",
            "model": server.name,
            "queued_rows": scheduler.queued_rows(),
            "busy": not scheduler.idle() or runs > 0,
            "strategy_runs": runs,
            "batching": {**scheduler.stats.as_dict(), "continuous": scheduler.admits},
        }
        compiling = getattr(server.backend, "decode_compile", None)
        if compiling is not None:  # the compiled decode step's progress (a local backend's)
            out["decode_compile"] = compiling
        kv = server.kv()
        return out if kv is None else {**out, "kv": kv}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """vLLM's tokenizer endpoint (text, or chat messages, and tools, with the generation prompt
        appended)."""

        async def run(body: bytes, _: Request) -> Response:
            tokens = await asyncio.to_thread(tokenized, server.backend, body)
            return JSONResponse({"tokens": tokens, "count": len(tokens)})

        return await handle(server, request, run)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        async def run(body: bytes, _: Request) -> Response:
            return JSONResponse({"prompt": await asyncio.to_thread(detokenized, server, body)})

        return await handle(server, request, run)
