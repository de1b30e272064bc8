"""Running the server: uvicorn with a drain that fits its timeout, from the CLI or in a thread.

Why not plain `uvicorn.run`: on SIGTERM uvicorn waits up to its graceful timeout for connections,
then cancels what still runs — which the ASGI server turns into a plain-text 500 and a traceback
per request — then runs the app's shutdown (the scheduler's own wait, a second timeout), then
re-raises the signal, so a clean drain still exits with status 143. `DrainingServer` tells the app
that the drain began (`app.state.begin_drain`: the app answers new requests 503 and, at the drain's
deadline, cancels what still runs and answers it with a JSON 503 itself), keeps uvicorn's own
cancellation as a backstop a little after that deadline, and does not re-raise the signal: after
a drain the process exits 0.

Why `serve_in_thread` (not a subprocess) for tests and notebooks: they already hold the loaded
backend; serving it from a thread shares it (and its prefix cache) with the in-process code, with
no second model load.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from uvicorn.server import HANDLED_SIGNALS

from branchwise.serve.starting import Starting, load_in_background

__all__ = ["DrainingServer", "bind", "serve", "serve_in_thread"]

BACKSTOP_S = 5.0
"""How long after the app's own drain deadline uvicorn cancels what still runs (it never should)."""


class DrainingServer(uvicorn.Server):
    """A `uvicorn.Server` that calls `on_drain` when its shutdown begins and exits 0 after a signal
    (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, on_drain: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.on_drain = on_drain

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.on_drain is not None:
            self.on_drain()  # before uvicorn waits for connections: the app starts its clock
        await super().shutdown(sockets=sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """uvicorn's signal capture, minus re-raising the signal once drained (exit 0, not 143)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not listening yet): a busy port fails here, at once, before
    a model is loaded. Raises `OSError`."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _config(app: Any, drain_timeout_s: float, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=drain_timeout_s + BACKSTOP_S)  # type: ignore[arg-type]


def _drain_hook(app: Any) -> Callable[[], None] | None:
    return getattr(getattr(app, "state", None), "begin_drain", None)


def serve(
    app: Any,
    sock: socket.socket,
    drain_timeout_s: float,
    log_level: str = "info",
    build: Callable[[Starting], Any] | None = None,
) -> None:
    """Serve `app` on the bound `sock` until SIGTERM / SIGINT, then drain (module docstring), and end
    the process with status 0; returns only if the server never started.

    With `build`, `app` is a `starting.Starting` that answers 503 while `build` prepares the real
    app on a thread of its own (loading the model): the port is open from the first second. A
    `build` that fails stops the server, and its error is raised here.

    Why end it here: once the drain is over nothing is left to do, but the interpreter's own
    teardown would still run a full garbage collection over every object of the model, the KV tree
    and the libraries (measured: 6 to 9 s on a loaded 2-core CPU after a burst), so the process
    would outlive the drain by seconds instead of the one decode step the documentation promises.
    Logs and standard streams are flushed first."""
    server = DrainingServer(_config(app, drain_timeout_s, log_level), _drain_hook(app))
    failed: list[BaseException] = []

    def stop(err: BaseException) -> None:
        failed.append(err)
        server.should_exit = True

    if build is not None:
        load_in_background(app, build, stop)
    server.run(sockets=[sock])
    if failed:
        raise failed[0]
    if server.started:
        _exit_now()


def _exit_now() -> None:
    """Flush what the process wrote, then exit 0 without the interpreter's teardown."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


@contextmanager
def serve_in_thread(
    app: Any, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 30.0
) -> Iterator[str]:
    """Serve `app` with uvicorn on ``host:port`` (0: a free port) and yield its base URL.

    On exit the server shuts down gracefully (in-flight requests finish, then the app's lifespan
    closes its scheduler). Raises `RuntimeError` if it has not started within `start_timeout_s`.
    """
    sock = bind(host, port)
    drain = float(getattr(getattr(app, "state", None), "drain_timeout_s", 30.0))
    server = DrainingServer(_config(app, drain, "warning"), _drain_hook(app))
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="branchwise-serve", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the server did not start on {host}:{sock.getsockname()[1]}")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(start_timeout_s + drain + BACKSTOP_S)
        sock.close()
