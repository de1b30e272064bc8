"""Server-side strategy runs (the ``branchwise.strategy`` extension): bounded, one at a time,
cancelled when nobody waits for them any more.

Why bounds at the door: one strategy request can ask for thousands of branches of thousands of
tokens each, minutes of compute and gigabytes of KV, in a body of a few bytes. The server therefore
refuses (400) a run whose branches or whose branches × tokens exceed its limits before anything is
prefilled.

Why cancellation: a run takes seconds to minutes on its own thread (`Reasoner.run` is synchronous).
Its client may leave, the run may exceed its deadline, or the server may be draining for shutdown;
in each case the run is told to stop (`Reasoner.run(..., cancel=event)`: it stops within one decode
step and releases its KV), the handler waits for it to stop (so the next run never overlaps it:
`Reasoner.run` resets and reads backend-wide KV counters) and answers: nothing (the client left),
504 (the deadline) or 503 (the drain).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from branchwise.backends.base import Backend, Cancelled, ContextTooLong, KVBudgetExceeded, ShareMode
from branchwise.serve.errors import ClientGone, RequestError, draining
from branchwise.serve.protocol import BranchwiseOptions, ChatRequest, CompletionRequest
from branchwise.serve.streaming import Why, watch

__all__ = ["StrategyLimits", "StrategyRunner"]

log = logging.getLogger("branchwise.serve")


@dataclass(frozen=True)
class StrategyLimits:
    """What one strategy request may ask for.

    ``max_branches`` bounds the largest ``n`` of a generate node or ``width`` of a select node (for
    a prebuilt: ``branchwise.branches``); ``max_tokens`` bounds branches × the largest
    ``max_tokens`` of a generate node (``branchwise.tokens``); ``timeout_s`` is the run's deadline,
    counted from its arrival (waiting for the strategy slot included).
    """

    max_branches: int = 64
    max_tokens: int = 64 * 2048
    timeout_s: float = 600.0


def build(opts: BranchwiseOptions, req: ChatRequest | CompletionRequest) -> Any:
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


def size(strategy: Any) -> tuple[int, int]:
    """(branches, tokens per generate) of a strategy: its largest generate ``n`` or select
    ``width``, and its largest generate ``max_tokens``."""
    branches, tokens = 1, 1
    for node in strategy.nodes:
        if node.kind == "generate":
            branches, tokens = max(branches, node.n), max(tokens, node.max_tokens)
        elif node.kind == "select" and getattr(node, "width", None):
            branches = max(branches, node.width)
    return branches, tokens


def check_bounds(strategy: Any, limits: StrategyLimits) -> None:
    """A 400 naming the knob when the run asks for more than the server's limits."""
    branches, tokens = size(strategy)
    if branches > limits.max_branches:
        raise RequestError(
            400,
            f"branchwise.branches: {branches} branches is over this server's limit of "
            f"{limits.max_branches} (--max-strategy-branches)",
            "branchwise",
        )
    if branches * tokens > limits.max_tokens:
        raise RequestError(
            400,
            f"branchwise.tokens: {branches} branches x {tokens} tokens = {branches * tokens} is over this "
            f"server's limit of {limits.max_tokens} tokens per run (--max-strategy-tokens)",
            "branchwise",
        )


class StrategyRunner:
    """Runs strategy requests one at a time (a queue of at most `max_queue` waiting ones)."""

    def __init__(self, backend: Backend, share: ShareMode, max_queue: int, limits: StrategyLimits) -> None:
        self.backend = backend
        self.share = share
        self.max_queue = max_queue
        self.limits = limits
        self.runs = 0
        """Strategy requests running or waiting for the slot (what `/health` reports)."""
        self.slot = asyncio.Lock()

    def reasoner(
        self, req: ChatRequest | CompletionRequest, messages: list[dict[str, Any]]
    ) -> tuple[Any, str]:
        """The `Reasoner` for the request and the question it answers: the last user turn (system
        turns become its system prompt); with tools or a response format every branch decodes under
        the constraint and the branches vote on their calls or values."""
        from branchwise.reasoners import Reasoner

        opts = req.branchwise
        assert opts is not None and opts.strategy is not None
        strategy = build(opts, req)
        check_bounds(strategy, self.limits)
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
            field = req.constraint_field
            raise RequestError(400, f"{field}: {err}", field.split(".")[0]) from None
        return reasoner, turns[-1]["content"]

    async def run(
        self,
        req: ChatRequest | CompletionRequest,
        messages: list[dict[str, Any]],
        request: Request,
        drop: asyncio.Event,
        field: str = "messages",
    ) -> Any:
        """The run's `ReasoningResult`; raises `ClientGone`, or the 429 / 503 / 504 it becomes
        (`field`: the request's prompt field, named when the prompt does not fit the context)."""
        reasoner, question = self.reasoner(req, messages)
        if self.runs >= self.max_queue + 1:
            raise RequestError(
                429, f"{self.runs - 1} strategy runs are queued; retry later", headers={"Retry-After": "1"}
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.timeout_s
        self.runs += 1
        try:
            slot = asyncio.ensure_future(self.slot.acquire())
            why = await watch(slot, request, drop, self.limits.timeout_s)
            if why != "done":
                slot.cancel()
                self._refuse(why)
            try:
                cancel = threading.Event()
                work = asyncio.ensure_future(asyncio.to_thread(_run, reasoner, question, cancel))
                why = await watch(work, request, drop, max(0.0, deadline - loop.time()))
                if why != "done":
                    cancel.set()  # the run stops within one decode step
                    await asyncio.wait({work})
                    if work.exception() is not None or why == "gone":
                        self._refuse(why)
                return self._result(work, field)
            finally:
                self.slot.release()
        finally:
            self.runs -= 1

    def _refuse(self, why: Why) -> None:
        if why == "gone":
            raise ClientGone
        if why == "dropped":
            raise draining()
        raise RequestError(
            504,
            f"branchwise.strategy: the strategy run exceeded {self.limits.timeout_s:g} s (--strategy-timeout)",
            "branchwise",
        )

    @staticmethod
    def _result(work: asyncio.Future[Any], field: str) -> Any:
        try:
            return work.result()
        except ContextTooLong as err:
            raise RequestError(400, f"{field}: {err}", field) from None
        except KVBudgetExceeded as err:
            raise RequestError(
                400, f"branchwise: the run cannot fit the server's KV budget ({err})", "branchwise"
            ) from None
        except Cancelled:  # pragma: no cover - only a cancel set above stops a run
            raise draining() from None


def _run(reasoner: Any, question: str, cancel: threading.Event) -> Any:
    """`reasoner.run`, told to stop (within a decode step) when `cancel` is set."""
    return reasoner.run(question, cancel=cancel)
