"""One request's log lines: its progress in tokens and branches while it decodes, and how it ended.

Why: a request of many branches and long answers may decode for minutes, and an operator watching
the log of a busy server saw nothing between uvicorn's access line (written when the reply went out)
and silence. `Progress` rides on the request's scheduler job: its step listener counts the tokens
and ended branches on the decoding thread (a counter, then at most one log line per `every_s`), and
the end of the job's future writes the last line on the event loop, whether the request was
answered, failed, or cancelled by its client or the drain. Logging is thread-safe, and nothing here
waits, so the batch never waits for a log line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from branchwise.backends.base import DecodeStep, Generation

__all__ = ["PROGRESS_EVERY_S", "Progress"]

log = logging.getLogger("branchwise.serve")

PROGRESS_EVERY_S = 10.0
"""Seconds between a decoding request's progress lines (the default of `Server.progress_every_s`)."""


class Progress:
    """The log lines of one request (see the module docstring): `on_step` wraps the job's own
    listener (None: the request is not streamed), `ended` is the job future's done callback."""

    def __init__(
        self,
        label: str,
        prompt_tokens: int,
        branches: int | None,
        every_s: float = PROGRESS_EVERY_S,
        listener: Callable[[DecodeStep], None] | None = None,
    ) -> None:
        self.label = label
        self.prompt_tokens = prompt_tokens
        self.branches = branches
        self.every_s = every_s
        self.listener = listener
        self.started = time.monotonic()
        self.first_token: float | None = None
        """Seconds from arrival to the first decoded token (None: none yet)."""
        self.tokens = 0
        self.finished = 0
        self._said = self.started

    def on_step(self, step: DecodeStep) -> None:
        """On the decoding thread: count, and say where the request stands every `every_s`."""
        new = sum(len(tokens) for tokens in step.tokens.values())
        now = time.monotonic()
        if new and self.first_token is None:
            self.first_token = now - self.started
        self.tokens += new
        self.finished += len(step.finished)
        if now - self._said >= self.every_s:
            self._said = now
            log.info(
                "%s: %d tokens decoded, %d of %s branches ended (%.1f s, %.1f tokens/s)",
                self.label,
                self.tokens,
                self.finished,
                self.branches,
                now - self.started,
                self.tokens / max(now - self.started, 1e-9),
            )
        if self.listener is not None:
            self.listener(step)

    def ended(self, work: asyncio.Future[Any]) -> None:
        """The job's future is done: one line with its outcome, tokens, seconds and rates."""
        if work.cancelled():
            self.end("cancelled", self.tokens)
            return
        error = work.exception()
        if error is not None:
            self.end(f"failed ({type(error).__name__}: {error})", self.tokens)
            return
        gens: list[Generation] = work.result()
        reasons = Counter(g.finish_reason for g in gens)
        why = ", ".join(f"{count} {reason}" for reason, count in sorted(reasons.items()))
        self.end(f"answered ({why})", sum(len(g.token_ids) for g in gens))

    def end(self, outcome: str, tokens: int) -> None:
        """The request's last line: `outcome`, its seconds since arrival and `tokens` decoded."""
        seconds = time.monotonic() - self.started
        over = "" if self.branches is None else f" over {self.branches} branches"
        first = "" if self.first_token is None else f", first token after {self.first_token:.2f} s"
        log.info(
            "%s: %s after %.2f s: %d prompt tokens, %d completion tokens%s (%.1f tokens/s%s)",
            self.label,
            outcome,
            seconds,
            self.prompt_tokens,
            tokens,
            over,
            tokens / max(seconds, 1e-9),
            first,
        )
