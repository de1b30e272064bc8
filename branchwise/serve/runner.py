"""Run the server in a background thread of this process (tests, notebooks, benchmarks' baselines).

Why not a subprocess: a notebook or a test already holds the loaded backend; serving it from a
thread shares it (and its prefix cache) with the in-process code, with no second model load.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["serve_in_thread"]


@contextmanager
def serve_in_thread(
    app: Any, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 30.0
) -> Iterator[str]:
    """Serve `app` with uvicorn on ``host:port`` (0: a free port) and yield its base URL.

    On exit the server shuts down gracefully (in-flight requests finish, then the app's lifespan
    closes its scheduler). Raises `RuntimeError` if it has not started within `start_timeout_s`.
    """
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=30))
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
        thread.join(start_timeout_s)
        sock.close()
