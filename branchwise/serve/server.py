"""One server's request handling, apart from the HTTP routes (`app.py`) and from how requests and
replies are shaped (`translate.py`, `completions.py`, `replies.py`).

Why its own module: what a request meets on the way in (the context check, ids inside the
vocabulary, a refusal while draining), how it reaches the scheduler (whole or streamed, cancelled
with its client or at the drain's deadline), and the error-to-response rule every route shares
(`handle`) are the server's state and policy; the routes only wire URLs to them.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from branchwise.backends.base import Backend, DecodeStep, Generation, ShareMode
from branchwise.backends.scheduler import Job, Scheduler
from branchwise.schema_budget import OutputFloor
from branchwise.serve.errors import ClientGone, RequestError, draining
from branchwise.serve.field_format import FieldFormat
from branchwise.serve.progress import PROGRESS_EVERY_S, Progress
from branchwise.serve.protocol import BranchwiseOptions, ChatRequest, CompletionRequest
from branchwise.serve.strategy import StrategyRunner
from branchwise.serve.streaming import StepFeed, Stream, outcome, until

__all__ = ["Server", "handle", "vocab_size"]

log = logging.getLogger("branchwise.serve")


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""OpenAI's error code for a request over the model's context. Clients act on the code, not the
words: DSPy maps it to `ContextWindowExceededError`, on which `dspy.ReAct` drops its oldest steps and
goes on (with a code-less 400 the agent stopped at its context's end)."""


def _tokens(out: OutputFloor) -> str:
    return f"{out.tokens} tokens" if out.exact else f"at least {out.tokens} tokens"


def _path(field: str, where: str) -> str:
    """Where in the request an output of the constraint from `field` is: a tool's call of the
    ``tools`` field is ``tools[i].function.parameters``, of ``branchwise.constraint`` that after a dot."""
    if not where:
        return field
    return where if field == "tools" else f"{field}.{where}"


def vocab_size(backend: Backend) -> int | None:
    """Tokens the tokenizer knows (None: the backend exposes no tokenizer)."""
    tokenizer = getattr(backend, "tokenizer", None)
    return None if tokenizer is None else len(tokenizer)


class Server:
    """Request handling over one backend and its scheduler: the checks a request meets before any
    work, its decode (whole or streamed), re-scored log-probabilities, the drain."""

    def __init__(
        self, backend: Backend, scheduler: Scheduler, share: ShareMode, strategies: StrategyRunner, name: str
    ) -> None:
        self.backend = backend
        self.name = name
        """The model id replies and `/v1/models` name."""
        self.share = share
        self.scheduler = scheduler
        self.strategies = strategies
        self.draining = False
        self.drop = asyncio.Event()
        """Set at the drain's deadline: every request still waiting is cancelled and answered 503."""
        self.drain_end: float | None = None
        self.progress_every_s = PROGRESS_EVERY_S
        """Seconds between the progress lines a decoding request logs (`progress.Progress`)."""
        self.dspy_fields = True
        """Whether a request asking for DSPy's fields is decoded under their schema (`field_format`)."""

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
                code=CONTEXT_LENGTH_EXCEEDED,
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
                code=CONTEXT_LENGTH_EXCEEDED,
            )
        return wanted

    async def check_constraint_fits(
        self, req: ChatRequest | CompletionRequest, prompt: Sequence[int], max_tokens: int
    ) -> None:
        """A 400 when an output the request's constraint allows cannot fit: its shortest form (a
        schema's shortest JSON, a call of any tool that may be called) beyond what the model's
        context leaves after the prompt (naming the constraint's field, or the tool's: no
        ``max_tokens`` helps), or the shortest reply beyond ``max_tokens`` (naming that field).
        Each message gives both numbers.

        Why before queueing: such a reply can only be cut, never completed, and a client is better
        told at once than handed unparseable JSON. Why in a thread: the count reads the whole
        schema and tokenizes its shortest output (bounded, `Grammars.fit`), work that grows with the
        request; the event loop answers others meanwhile. The count is cached, so the decode's own
        fit finds it done. A backend with no such count (a remote one) is not checked.
        """
        constraint = req.constraint
        fit_of = getattr(self.backend, "fit_constraint", None)
        if constraint is None or fit_of is None:
            return
        fit = await asyncio.to_thread(fit_of, constraint, max_tokens)
        field = req.constraint_field
        context = getattr(self.backend, "max_context", None)
        if context is not None:
            room = context - len(prompt)
            for out in fit.outputs:
                if out.tokens > room:
                    what = "call of this tool" if out.where else "output this constraint allows"
                    raise RequestError(
                        400,
                        f"{_path(field, out.where)}: the shortest {what} takes {_tokens(out)}, more "
                        f"than the {room} tokens the model's context of {context} leaves after the "
                        f"prompt ({len(prompt)} tokens; max_tokens is {max_tokens})",
                        field.split(".")[0],  # the top-level field, as every 400's param
                    )
        if fit.floor_tokens is None or fit.floor_tokens <= max_tokens:
            return
        name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
        chosen = "" if req.budget_set() else " (the default)"
        size = _tokens(OutputFloor("", fit.floor_tokens, fit.floor_exact))
        raise RequestError(
            400,
            f"{name}: {max_tokens}{chosen} is below the {size} of the shortest output the {field} "
            "constraint allows; the reply could only be cut",
            name,
        )

    async def dspy_fields_of(
        self,
        req: ChatRequest | CompletionRequest,
        messages: list[dict[str, Any]],
        prompt: list[int],
        max_tokens: int,
    ) -> FieldFormat | None:
        """The DSPy fields a plain chat request asks for in DSPy's words (`field_format`), now its
        constraint; None (the request as it came) when off, when it has a constraint of its own, is
        streamed or a strategy run, or when their shortest JSON cannot fit ``max_tokens`` or the
        context (the client asked for no grammar, so it gets no 400 for one)."""
        plain = req.constraint is None and not req.stream
        if not self.dspy_fields or not plain or not isinstance(req, ChatRequest):
            return None
        fields = FieldFormat.of(messages)
        fit_of = getattr(self.backend, "fit_constraint", None)
        if fields is None or fit_of is None:
            return None
        constraint = fields.constraint()
        fit = await asyncio.to_thread(fit_of, constraint, max_tokens)
        context = getattr(self.backend, "max_context", None)
        room = max_tokens if context is None else min(max_tokens, context - len(prompt))
        if fit.floor_tokens is None or fit.floor_tokens > room:
            return None
        req.constrain(constraint, "messages")
        return fields

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
        vocab = vocab_size(self.backend)
        bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise RequestError(400, f"{field} holds ids outside [0, {vocab}): {bad[:5]}", field)

    # ------------------------------------------------------------------ plain completions
    def _submit(
        self,
        req: ChatRequest | CompletionRequest,
        prompt: list[int],
        max_tokens: int,
        label: str,
        listener: Callable[[DecodeStep], None] | None = None,
    ) -> tuple[Job, asyncio.Future[list[Generation]]]:
        """Queue the request's job, its steps counted and its end logged under `label` (`Progress`,
        which hands each step on to `listener`); the job and the future of its generations."""
        if self.draining:
            raise draining()
        opts = req.branchwise or BranchwiseOptions()
        share = opts.share or self.share
        progress = Progress(label, len(prompt), req.n, self.progress_every_s, listener)
        job = Job(prompt=prompt, n=req.n, params=req.decode_params(max_tokens), share=share)
        job.on_step = progress.on_step
        work = asyncio.ensure_future(self.scheduler.submit_async(job))
        work.add_done_callback(progress.ended)
        return job, work

    async def decode(
        self,
        req: ChatRequest | CompletionRequest,
        prompt: list[int],
        max_tokens: int,
        request: Request,
        rid: str,
    ) -> list[Generation]:
        """Queue the request's ``n`` samples and wait for them, or for the client to go away
        (`rid`: the reply's id, which its log lines name)."""
        _, work = self._submit(req, prompt, max_tokens, f"{request.url.path} {rid}")
        await until(work, request, self.drop)
        return outcome(work, req.constraint_field)

    async def stream(
        self,
        req: ChatRequest | CompletionRequest,
        prompt: list[int],
        max_tokens: int,
        request: Request,
        rid: str,
    ) -> Stream:
        """Queue the request with a step listener; return once its first tokens (or its end) are in.

        Waiting for them before answering keeps errors found on the way (a full queue, a prompt the
        backend refuses) proper HTTP errors instead of failures inside a 200 stream.
        """
        feed = StepFeed(asyncio.get_running_loop())
        job, work = self._submit(req, prompt, max_tokens, f"{request.url.path} {rid} (streamed)", feed.push)
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
        size = vocab_size(self.backend)
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


async def handle(
    server: Server, request: Request, fn: Callable[[bytes, Request], Awaitable[Response]]
) -> Response:
    """Run a route's work on the request's body; every error becomes a response in OpenAI's shape
    (a bug is logged once and answered 500), and a client that left is logged at INFO."""
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
