"""`branchwise serve`'s door (`branchwise.serve.guard`): API key, Host, content type, CORS, docs,
body limits, and what a client that leaves leaves in the log.

Every server here listens on 127.0.0.1 on a free port (`serve_in_thread`). Each bad request is its
own test; none needs the model to decode (the door answers first), except the key's happy path.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from testkit import GatedBackend, Lines  # noqa: E402

from branchwise.serve import create_app  # noqa: E402
from branchwise.serve.runner import serve_in_thread  # noqa: E402

KEY = "s3cret-key"
CHAT = {"messages": [{"role": "user", "content": "What is 12 + 7?"}], "max_tokens": 2, "temperature": 0}
BODY_TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def guarded(tiny_backend: Any) -> Iterator[str]:
    """A server with an API key, one extra allowed host, one CORS origin, the docs on and small
    body limits."""
    app = create_app(
        tiny_backend,
        model_name="tiny",
        api_key=KEY,
        allowed_hosts=["models.internal"],
        cors_origins=["https://app.example"],
        docs=True,
        max_body_bytes=4096,
        body_timeout_s=BODY_TIMEOUT_S,
    )
    with serve_in_thread(app) as url:
        yield url


def auth(**headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}", **headers}


def error(r: Any, status: int) -> dict[str, Any]:
    """The response's OpenAI-shaped error, after checking its status."""
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(body)
    return body


# ------------------------------------------------------------------ API key


def test_a_missing_api_key_is_401(guarded: str) -> None:
    err = error(httpx.post(f"{guarded}/v1/chat/completions", json=CHAT), 401)
    assert err["code"] == "invalid_api_key" and "Authorization" in err["message"]


def test_a_wrong_api_key_is_401(guarded: str) -> None:
    r = httpx.post(f"{guarded}/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer nope"})
    assert error(r, 401)["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"


def test_a_key_in_another_scheme_is_401(guarded: str) -> None:
    r = httpx.get(f"{guarded}/v1/models", headers={"Authorization": f"Basic {KEY}"})
    error(r, 401)


def test_the_right_api_key_is_served_and_health_stays_open(guarded: str) -> None:
    r = httpx.post(f"{guarded}/v1/chat/completions", json=CHAT, headers=auth(), timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{guarded}/health").json()["status"] == "ok"


# ------------------------------------------------------------------ Host


def test_a_foreign_host_is_400(guarded: str) -> None:
    r = httpx.get(f"{guarded}/v1/models", headers=auth(Host="evil.example:8000"))
    err = error(r, 400)
    assert err["param"] == "Host" and "evil.example" in err["message"]


def test_a_foreign_host_is_refused_on_health_too(guarded: str) -> None:
    error(httpx.get(f"{guarded}/health", headers={"Host": "rebound.example"}), 400)


def test_a_loopback_name_on_another_port_is_400(guarded: str) -> None:
    error(httpx.get(f"{guarded}/v1/models", headers=auth(Host="localhost:1")), 400)


def test_loopback_names_and_allowed_hosts_pass(guarded: str) -> None:
    port = guarded.rsplit(":", 1)[1]
    for host in (f"localhost:{port}", "localhost", f"[::1]:{port}", "models.internal", "models.internal:1"):
        r = httpx.get(f"{guarded}/v1/models", headers=auth(Host=host))
        assert r.status_code == 200, (host, r.text)


def test_allow_host_star_accepts_any(tiny_backend: Any) -> None:
    with serve_in_thread(create_app(tiny_backend, allowed_hosts=["*"])) as url:
        assert httpx.get(f"{url}/v1/models", headers={"Host": "anything.example"}).status_code == 200


# ------------------------------------------------------------------ content type


def test_a_text_plain_post_is_415(guarded: str) -> None:
    r = httpx.post(
        f"{guarded}/v1/chat/completions",
        content=httpx.Request("POST", "/", json=CHAT).content,
        headers=auth(**{"Content-Type": "text/plain;charset=UTF-8"}),
    )
    err = error(r, 415)
    assert err["param"] == "Content-Type" and "application/json" in err["message"]


def test_a_post_without_content_type_is_415(guarded: str) -> None:
    r = httpx.post(f"{guarded}/tokenize", content=b'{"prompt": "hi"}', headers=auth())
    assert "none" in error(r, 415)["message"]


def test_a_form_post_is_415(guarded: str) -> None:
    r = httpx.post(f"{guarded}/detokenize", data={"tokens": "1"}, headers=auth())
    error(r, 415)


def test_json_with_a_charset_is_accepted(guarded: str) -> None:
    r = httpx.post(
        f"{guarded}/tokenize",
        content=b'{"prompt": "hi"}',
        headers=auth(**{"Content-Type": "application/json; charset=utf-8"}),
    )
    assert r.status_code == 200 and r.json()["count"] > 0


# ------------------------------------------------------------------ CORS and docs


def test_no_cors_headers_unless_an_origin_is_configured(served: str) -> None:
    r = httpx.options(
        f"{served}/v1/chat/completions",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in r.headers


def test_a_configured_origin_gets_its_preflight(guarded: str) -> None:
    headers = {
        "Origin": "https://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    r = httpx.options(f"{guarded}/v1/chat/completions", headers=headers)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.options(
        f"{guarded}/v1/chat/completions", headers={**headers, "Origin": "https://evil.example"}
    )
    assert other.headers.get("access-control-allow-origin") != "https://evil.example"


def test_docs_are_off_by_default(served: str) -> None:
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{served}{path}").status_code == 404


def test_docs_on_when_asked(guarded: str) -> None:
    assert httpx.get(f"{guarded}/openapi.json").json()["info"]["title"] == "branchwise"


# ------------------------------------------------------------------ body limits


def _raw(url: str, request: bytes, read_timeout_s: float) -> bytes:
    """Send `request` on a fresh connection; what the server sent until it closed (or the timeout)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=read_timeout_s) as sock:
        sock.sendall(request)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except TimeoutError:
            pytest.fail(f"the server kept the connection open past {read_timeout_s} s; got {out[:200]!r}")
        return out


def _post_head(url: str, length: int, extra: str = "") -> bytes:
    port = url.rsplit(":", 1)[1]
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n{extra}\r\n"
    ).encode()


def test_a_body_shorter_than_its_content_length_is_closed_within_the_body_timeout(guarded: str) -> None:
    reply = _raw(guarded, _post_head(guarded, 4000) + b'{"messages": ', read_timeout_s=BODY_TIMEOUT_S + 20)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b'"param":"body"' in reply and b"not received in full" in reply


def test_a_content_length_over_the_limit_is_413_before_the_body(guarded: str) -> None:
    reply = _raw(guarded, _post_head(guarded, 10**9), read_timeout_s=20)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"over the limit of 4096 bytes" in reply


def test_a_chunked_body_over_the_limit_is_413(guarded: str) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(10):
            yield b" " * 1000

    r = httpx.post(
        f"{guarded}/v1/chat/completions",
        content=chunks(),
        headers=auth(**{"Content-Type": "application/json"}),
    )
    assert "over the limit" in error(r, 413)["message"]


# ------------------------------------------------------------------ a client that leaves


def test_a_client_that_leaves_is_one_info_line_and_no_traceback() -> None:
    backend = GatedBackend()  # decodes "A", after the test opens its gate
    app = create_app(backend, window_s=0.0)
    lines = Lines()
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "uvicorn", "branchwise.serve")]
    levels = [lg.level for lg in loggers]
    try:
        with serve_in_thread(app) as url:
            for lg in loggers:
                lg.addHandler(lines)
                lg.setLevel(logging.INFO)
            body = {"messages": [{"role": "user", "content": "hi"}]}
            first = threading.Thread(
                target=lambda: httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
            )
            first.start()
            assert backend.in_extend.wait(30)
            with pytest.raises(httpx.TimeoutException):  # waits in the queue, then leaves
                httpx.post(f"{url}/v1/chat/completions", json=body, timeout=0.5)
            for _ in range(500):
                if any("went away" in r.getMessage() for r in lines.records):
                    break
                threading.Event().wait(0.02)
            backend.gate.set()
            first.join(60)
    finally:
        backend.gate.set()
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(lines)
            lg.setLevel(level)
    gone = [r for r in lines.records if "went away" in r.getMessage()]
    assert len(gone) == 1 and gone[0].levelno == logging.INFO and gone[0].exc_info is None
    assert not [r for r in lines.records if r.exc_info or "Exception in ASGI" in r.getMessage()]


@pytest.mark.parametrize(
    ("host", "server", "ok"),
    [
        ("127.0.0.1:8000", ("::ffff:127.0.0.1", 8000), True),  # an IPv4 client of a dual-stack socket
        ("localhost:8000", ("::ffff:127.0.0.1", 8000), True),
        ("10.0.0.5:8000", ("10.0.0.5", 8000), True),  # bound to 0.0.0.0: the address it came in on
        ("localhost:8000", ("10.0.0.5", 8000), False),  # not a loopback connection
        ("[fe80::1]:8000", ("fe80::1", 8000), True),
        ("10.0.0.5:9000", ("10.0.0.5", 8000), False),
        ("10.0.0.5:x", ("10.0.0.5", 8000), False),
        ("", ("127.0.0.1", 8000), False),
    ],
)
def test_the_host_check(host: str, server: tuple[str, int], ok: bool) -> None:
    from branchwise.serve.guard import Guard

    assert Guard(lambda *_: None, allowed_hosts=[])._host_ok(host, server) is ok  # type: ignore[arg-type]
