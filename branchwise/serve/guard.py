"""The door checks of `branchwise serve`: one ASGI middleware in front of every route.

Why these checks, and why before FastAPI: a model server on a workstation is reachable by every web
page its user opens. A page cannot read the answers of a cross-site request, but it can *send*
one, and it can point a name it controls at 127.0.0.1 (DNS rebinding) to read them too. So:

* **Host** must name this server: the address the connection came in on (and ``localhost``,
  ``127.0.0.1``, ``[::1]`` on a loopback connection), with the port it came in on, or a name the
  operator allowed (``--allow-host``; ``*`` allows any). A rebinding page's requests carry its own
  name and are refused (400);
* **Content-Type** of a POST must be ``application/json``: a page can send ``text/plain``, a form or
  a typeless blob to another site without asking, but not JSON, which needs a CORS preflight the
  server never grants unless ``--cors-origin`` names the page's origin (415 otherwise);
* **Authorization: Bearer <key>** when the server has an API key (compared in constant time);
  ``/health`` stays open so load balancers need no key (401);
* **the body** is read here, whole, before any route sees it: larger than ``max_body_bytes`` is a
  413 (at once when ``Content-Length`` says so), slower than ``body_timeout_s`` is a 408 — a client
  that announces a big body and sends a few bytes cannot hold a connection and its buffer forever.

Every refusal is OpenAI's JSON error shape (`errors.error_body`) and closes the connection where
the request's body was not read to its end (its unread bytes must not be taken for a next request).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from fastapi.responses import JSONResponse

from branchwise.serve.errors import error_body

__all__ = ["LOOPBACK_NAMES", "Guard", "is_loopback"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
"""Names a loopback connection may carry in its Host header."""


def _unmapped(address: str) -> str:
    """An IPv4 client of a dual-stack socket shows as ``::ffff:a.b.c.d``: the IPv4 address it is."""
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return address
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped) if mapped is not None else address


def is_loopback(host: str) -> bool:
    """Whether `host` (an address, bracketed or not, or ``localhost``) is this machine only."""
    host = _unmapped(host.strip("[]").lower())
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _split_host(value: str) -> tuple[str, int | None]:
    """``name[:port]`` of a Host header, the name lowercased (IPv6 addresses keep their brackets)."""
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value.partition("]")
        name, port = name + "]", rest.removeprefix(":")
    elif value.count(":") == 1:
        name, port = value.split(":")
    else:
        name, port = value, ""
    if not port:
        return name, None
    return (name, int(port)) if port.isdigit() else (name, -1)


class Guard:
    """The checks of the module docstring around `app` (install with ``app.add_middleware``).

    Args:
        api_key: the key clients must send as ``Authorization: Bearer <key>``; None: no key.
        allowed_hosts: Host names accepted besides the connection's own address (``name`` for any
            port, ``name:port`` for one); ``*`` accepts every Host.
        max_body_bytes: a larger request body is a 413.
        body_timeout_s: a body not received in full within this many seconds is a 408.
        open_paths: paths served without the API key.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None = None,
        allowed_hosts: Iterable[str] = (),
        max_body_bytes: int = 8 * 2**20,
        body_timeout_s: float = 30.0,
        open_paths: Iterable[str] = ("/health",),
    ) -> None:
        self.app = app
        self.key = None if not api_key else b"bearer " + api_key.encode()
        hosts = {h.strip().lower() for h in allowed_hosts}
        self.any_host = "*" in hosts
        self.hosts = hosts - {"*"}
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.lower(), value)
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await self._refuse(scope, receive, send, *refusal)
            return
        if scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body = await self._body(scope, receive, send, headers)
        if body is None:  # answered (408, 413) or the client left
            return
        replayed = False

        async def replay() -> Message:
            """The body read above, then the connection's own messages (its disconnect)."""
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    # ------------------------------------------------------------------ the checks
    def _refusal(
        self, scope: Scope, headers: dict[bytes, bytes]
    ) -> tuple[int, str, str | None, str | None] | None:
        """(status, message, param, code) of the first check the request fails, or None."""
        host = headers.get(b"host", b"").decode("latin-1")
        if not self._host_ok(host, scope.get("server")):
            shown = repr(host) if host else "none"
            return (
                400,
                f"Host: this server does not answer for {shown} (allow it with --allow-host)",
                "Host",
                None,
            )
        if self.key is not None and scope["path"] not in self.open_paths and scope["method"] != "OPTIONS":
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if not hmac.compare_digest(scheme.lower() + b" " + token.strip(), self.key):
                return (
                    401,
                    "Authorization: missing or wrong API key (send 'Authorization: Bearer <key>')",
                    None,
                    "invalid_api_key",
                )
        if scope["method"] == "POST":
            kind = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
            if kind != "application/json":
                shown = repr(kind) if kind else "none"
                return 415, f"Content-Type: must be application/json (got {shown})", "Content-Type", None
        return None

    def _host_ok(self, host: str, server: tuple[str, int] | None) -> bool:
        if self.any_host:
            return True
        if not host:
            return False
        name, port = _split_host(host)
        if name in self.hosts or (port is not None and f"{name}:{port}" in self.hosts):
            return True
        if server is None:  # no socket address (an in-memory test client): only allowed names pass
            return False
        address, bound_port = _unmapped(server[0].lower()), server[1]
        if ":" in address:
            address = f"[{address}]"
        if port is not None and port != bound_port:
            return False
        return name == address or (is_loopback(address) and name in LOOPBACK_NAMES)

    async def _body(
        self, scope: Scope, receive: Receive, send: Send, headers: dict[bytes, bytes]
    ) -> bytes | None:
        """The whole body within the limits, or None once a refusal went out (or the client left)."""
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                await self._refuse(
                    scope, receive, send, 400, "Content-Length: not a number", "Content-Length"
                )
                return None
            if int(length) > self.max_body_bytes:
                await self._refuse(scope, receive, send, *self._too_big(int(length)))
                return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                text = f"body: not received in full within {self.body_timeout_s:g} s"
                await self._refuse(scope, receive, send, 408, text, "body")
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._refuse(scope, receive, send, *self._too_big(size, "at least "))
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_big(self, size: int, at_least: str = "") -> tuple[int, str, str, None]:
        return (
            413,
            f"body: {at_least}{size} bytes, over the limit of {self.max_body_bytes} bytes",
            "body",
            None,
        )

    async def _refuse(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        status: int,
        message: str,
        param: str | None,
        code: str | None = None,
    ) -> None:
        """Answer with OpenAI's error shape; close the connection (a body may be left unread)."""
        headers = {"Connection": "close"}
        if status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        response = JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)
        await response(scope, receive, send)
