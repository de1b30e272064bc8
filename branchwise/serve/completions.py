"""Answering a completion (`translate.Completion`): a strategy run, a stream, or whole choices, each
shaped as OpenAI's reply (the shapes themselves: `replies.py`).

Why its own module: the three ways a completion is answered share the reply's head (id, created,
model) and nothing else; kept as three plain functions, each reads top to bottom (the routes in
`app.py` only pick the translation and call `answer`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from branchwise.serve.errors import ClientGone, RequestError
from branchwise.serve.field_format import FieldFormat
from branchwise.serve.progress import Progress
from branchwise.serve.protocol import ChatRequest
from branchwise.serve.replies import (
    FINISH,
    ChatChunks,
    TextChunks,
    chat_choice_message,
    chat_logprobs,
    details,
    reply_notes,
    strategy_message,
    strategy_reply,
    text_logprobs,
    tools_of,
    usage,
)
from branchwise.serve.server import CONTEXT_LENGTH_EXCEEDED, Server
from branchwise.serve.streaming import chunks, sse
from branchwise.serve.translate import Completion

__all__ = ["answer"]


async def answer(server: Server, c: Completion, request: Request) -> Response:
    """Answer a chat or text completion: a strategy run, a stream, or whole choices."""
    head = {
        "id": f"{c.kind.id_prefix}-{uuid.uuid4().hex[:24]}",
        "created": int(time.time()),
        "model": server.name,
    }
    if c.req.branchwise is not None and c.req.branchwise.strategy is not None:
        return await _strategy(server, c, request, head)
    max_tokens = server.fit(c.req, c.prompt, c.field)
    await server.check_constraint_fits(c.req, c.prompt, max_tokens)
    candidates = await _candidates(server, c)  # before a stream too: a bad list is a 400 either way
    if c.req.stream:
        return await _streamed(server, c, request, head, max_tokens)
    fields = await server.dspy_fields_of(c.req, c.messages, c.prompt, max_tokens)
    return await _whole(server, c, request, head, max_tokens, candidates, fields)


async def _candidates(server: Server, c: Completion) -> list[float] | None:
    """A text completion's ``branchwise.score_candidates``: each candidate token's log-probability."""
    opts = c.req.branchwise
    if isinstance(c.req, ChatRequest) or opts is None or opts.score_candidates is None:
        return None
    return await asyncio.to_thread(server.candidate_logprobs, c.prompt, opts.score_candidates)


async def _strategy(server: Server, c: Completion, request: Request, head: dict[str, Any]) -> Response:
    """A strategy run (the ``branchwise.strategy`` extension): one choice, its notes beside it."""
    context = getattr(server.backend, "max_context", None)
    if context is not None and len(c.prompt) >= context:
        raise RequestError(
            400,
            f"{c.field}: the prompt is {len(c.prompt)} tokens, the model's context {context}",
            c.field,
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    strategy = c.req.branchwise.strategy if c.req.branchwise is not None else None
    name = strategy if isinstance(strategy, str) else "given inline"
    progress = Progress(f"{request.url.path} {head['id']} (strategy {name})", len(c.prompt), None)
    try:
        result = await server.strategies.run(c.req, c.messages, request, server.drop, c.field)
    except ClientGone:
        progress.end("cancelled (the client went away)", 0)
        raise
    except RequestError as err:
        progress.end(f"answered {err.status} ({err.message[:120]})", 0)
        raise
    text, finish, extra, used = strategy_reply(result)
    progress.end(f"answered ({finish})", used)
    if isinstance(c.req, ChatRequest):
        message, finish = strategy_message(result, text, finish, c.req.constraint)
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    body = {
        "object": c.kind.object,
        "choices": [choice],
        "usage": usage(len(c.prompt), used),
        "branchwise": extra,
    }
    return JSONResponse({**head, **body})


async def _streamed(
    server: Server, c: Completion, request: Request, head: dict[str, Any], max_tokens: int
) -> Response:
    """Server-sent events as the tokens are decoded (`streaming.chunks`)."""
    req = c.req
    stream = await server.stream(req, c.prompt, max_tokens, request, head["id"])
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    tools = tools_of(req.constraint)
    chat = isinstance(req, ChatRequest)
    readers = [ChatChunks(tools) if chat else TextChunks(c.echo) for _ in range(req.n)]
    events = chunks(
        stream, server.backend, {**head, "object": c.kind.chunk_object}, readers, len(c.prompt), include_usage
    )
    return StreamingResponse(
        sse(events), media_type="text/event-stream", background=BackgroundTask(stream.close)
    )


async def _whole(
    server: Server,
    c: Completion,
    request: Request,
    head: dict[str, Any],
    max_tokens: int,
    candidates: list[float] | None,
    fields: FieldFormat | None,
) -> Response:
    """The ``n`` choices once decoded, with log-probabilities and candidate scores where asked
    (`fields`: DSPy's fields the reply was decoded as, written back in their adapter's format)."""
    req, backend, opts = c.req, server.backend, c.req.branchwise
    gens = await server.decode(req, c.prompt, max_tokens, request, head["id"])
    k = (req.top_logprobs or 0) if isinstance(req, ChatRequest) else (req.logprobs or 0)
    tops = [await asyncio.to_thread(server.top_logprobs, c.prompt, g, k) if k else None for g in gens]
    choices = []
    for i, (g, top) in enumerate(zip(gens, tops, strict=True)):
        choice: dict[str, Any] = {"index": i}
        if isinstance(req, ChatRequest):
            message, finish = chat_choice_message(g, req.constraint)
            if fields is not None:
                message["content"] = fields.render(g.text)
            choice.update(message=message, finish_reason=finish, logprobs=None)
            if req.logprobs:
                choice["logprobs"] = {"content": chat_logprobs(backend, g, top)}
        else:
            choice.update(text=c.echo + g.text, finish_reason=FINISH[g.finish_reason], logprobs=None)
            if req.logprobs is not None:
                choice["logprobs"] = text_logprobs(
                    backend, g, top, req.return_tokens_as_token_ids, len(c.echo)
                )
        if opts is not None and opts.details:
            choice["branchwise"] = details(g)
        choices.append(choice)
    counted = usage(len(c.prompt), sum(len(g.token_ids) for g in gens))
    out: dict[str, Any] = {**head, "object": c.kind.object, "choices": choices, "usage": counted}
    extra: dict[str, Any] = {}
    if candidates is not None:
        extra["candidate_logprobs"] = candidates
    notes = reply_notes(gens)  # decode steps that left the fast step: said to plain callers too
    if fields is not None:
        notes = [*notes, fields.note]
    if notes:
        extra["notes"] = notes
    if extra:
        out["branchwise"] = extra
    return JSONResponse(out)
