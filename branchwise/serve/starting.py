"""What `branchwise serve` answers while it starts: `/health` 503 ``{"status": "starting", ...}``
with the stage it is at, every other route 503 with ``Retry-After``, until the app is ready.

Why: loading a model takes seconds to minutes, and preparing compiled decode steps longer; a
server whose port stays closed meanwhile looks dead to a client or an orchestrator (a health check
cannot tell "starting" from "down", and a port that refuses connections reads as a crash). So the
command listens at once with this app in front, loads on a thread of its own (`load_in_background`),
and hands every request to the real app (`app.create_app`) once it is built. Each stage is printed
as it begins, and `/health` names it with the seconds since the start.

The real app's lifespan (its drain at shutdown) runs at shutdown if it was built by then; a drain
that begins while the model still loads has nothing to drain.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from types import SimpleNamespace
from typing import Any

__all__ = ["RETRY_AFTER_S", "Starting", "load_in_background"]

log = logging.getLogger("branchwise.serve")

RETRY_AFTER_S = 5
"""The ``Retry-After`` seconds a request gets while the server starts."""

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class Starting:
    """An ASGI app that answers 503 while the real one is prepared, then passes everything to it."""

    def __init__(self, drain_timeout_s: float) -> None:
        self.app: Any = None
        self.started = time.monotonic()
        self.stage = "starting"
        self.stages: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self.state = SimpleNamespace(begin_drain=self._begin_drain, drain_timeout_s=drain_timeout_s)
        """What the runner reads of an app (`runner._drain_hook`, its drain timeout)."""

    # ------------------------------------------------------------------ the loader's calls
    def begin(self, stage: str) -> None:
        """A stage of the start begins: printed, and named by `/health` until the next one."""
        now = round(time.monotonic() - self.started, 1)
        self.stage = stage
        self.stages.append({"stage": stage, "at_s": now})
        log.info("starting: %s (%.1f s)", stage, now)

    def ready(self, app: Any) -> None:
        """Every request from now on goes to `app`."""
        self.app = app
        log.info("ready after %.1f s", time.monotonic() - self.started)

    def progress(self) -> dict[str, Any]:
        """What `/health` says while starting: the stage, the stages so far, the seconds since the start."""
        return {
            "status": "starting",
            "stage": self.stage,
            "stages": list(self.stages),
            "elapsed_s": round(time.monotonic() - self.started, 1),
        }

    # ------------------------------------------------------------------ ASGI
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        app = self.app
        if app is not None:
            await app(scope, receive, send)
            return
        if scope["type"] != "http":  # a websocket: refused while starting
            await send({"type": "websocket.close", "code": 1013})
            return
        if scope.get("path") == "/health":
            await _json(send, 503, self.progress(), {})
            return
        message = f"the server is starting ({self.stage}); retry in {RETRY_AFTER_S} s"
        body = {"error": {"message": message, "type": "unavailable", "param": None, "code": 503}}
        await _json(send, 503, body, {"retry-after": str(RETRY_AFTER_S)})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        """Started at once; at shutdown, the real app's own lifespan (its drain) where it exists."""
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                app = self.app
                if app is not None:
                    async with app.router.lifespan_context(app):
                        pass
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _begin_drain(self) -> None:
        app = self.app
        if app is not None:
            app.state.begin_drain()


async def _json(send: Send, status: int, body: dict[str, Any], headers: dict[str, str]) -> None:
    data = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})


def load_in_background(
    starting: Starting, build: Callable[[Starting], Any], on_error: Callable[[BaseException], None]
) -> threading.Thread:
    """Run `build` (it calls `starting.begin` at each stage and returns the real app) on a thread
    of its own; its app is served once built. A failure is handed to `on_error` (the command stops
    the server and reports it)."""

    def run() -> None:
        try:
            starting.ready(build(starting))
        except BaseException as err:  # reported by the command, which stops the server
            starting.error = err
            on_error(err)

    thread = threading.Thread(target=run, name="branchwise-serve-load", daemon=True)
    thread.start()
    return thread
