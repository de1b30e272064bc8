"""`RemoteBackend`'s HTTP: the endpoints it talks to, retries, failover, which endpoint a branch
tree's requests go to, and the endpoints' vLLM ``/metrics`` counters.

Why a module of its own: none of this knows what a request asks for (a completion, a tokenization,
the model list) or what a `Generation` is; it moves JSON to and from servers that may be slow,
down or several. Kept apart from the wire format (`remote_wire`) and the branch tree
(`remote`), the failure policy reads in one place, and one `Endpoints` object is shared by every
session view of a backend (its routing state is the servers', not a run's), while each view
counts its own requests through the `Count` it passes in.

Several servers (``RemoteBackend([url_a, url_b])``): every request of one branch tree (the nodes
forked from one `prefill`) goes to one endpoint, chosen by rendezvous hashing of the tree root's
token ids over the endpoint URLs. Why: the tree's requests share the root's prompt and their
common ancestors, which only that server's prefix cache holds; spreading them would make every
server compute the prompt again. The choice is stable across processes and sessions (the same
prompt lands on the same server from every client), and trees spread evenly over the endpoints.
``affinity=False`` sends requests round-robin instead (the baseline the affinity is measured
against). Requests outside a tree (``/tokenize``) go round-robin.

Failures: connection errors, timeouts, 429 and 5xx are retried with exponential backoff and jitter
(tenacity), honouring ``Retry-After``, for at most ``max_attempts`` tries and ``max_wait_s`` in
all; then `RemoteUnavailable` says what failed, how often and for how long. With several
endpoints, a request that exhausts its retries on one endpoint is sent to the next one in its
tree's ranking; the failed endpoint is then passed over by every tree for ``max_wait_s`` seconds
(its trees move to their next endpoint) and is tried again afterwards. A call never hangs: every
request has a timeout. Other 4xx are not retried (the request itself is wrong).
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import tenacity

if TYPE_CHECKING:
    import httpx

__all__ = ["Count", "Endpoints", "RemoteCapabilityError", "RemoteError", "RemoteUnavailable", "tree_key"]

_RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class RemoteError(RuntimeError):
    """The server could not be reached, kept failing, or refused the request."""


class RemoteUnavailable(RemoteError):
    """The server stayed unreachable, overloaded or failing through every retry: another server
    could still answer the same request (the eval harness moves the problem elsewhere)."""


class RemoteCapabilityError(RemoteError):
    """The server lacks something this operation needs (named in the message)."""


class _Retryable(Exception):
    """A response worth retrying (429/5xx), with the server's ``Retry-After`` if it gave one."""

    def __init__(self, status: int, text: str, retry_after: float | None) -> None:
        super().__init__(f"HTTP {status}: {text[:300]}")
        self.retry_after = retry_after


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:  # an HTTP date: not worth parsing, the backoff applies
        return None


def tree_key(token_ids: Sequence[int]) -> bytes:
    """A stable hash of a tree root's tokens: equal prompts route alike in every process."""
    return hashlib.blake2b(",".join(map(str, token_ids)).encode(), digest_size=16).digest()


def _rank(key: bytes, url: str) -> int:
    """Rendezvous (highest-random-weight) score of `url` for a tree: each tree ranks the endpoints
    in its own stable order, and removing an endpoint moves only that endpoint's trees."""
    return int.from_bytes(hashlib.blake2b(key + url.encode(), digest_size=8).digest(), "big")


Count = Callable[[str, float], None]
"""Adds to one of the calling backend view's request counters (its ``kv_stats().extra``):
``requests`` answered, ``retries``, ``retry_wait_s``, ``failovers``."""


class Endpoints:
    """The servers of one `RemoteBackend` and the way to them (see the module docstring).

    Args: as `RemoteBackend`'s (``base_url`` one root or several).
    """

    def __init__(
        self,
        base_url: str | Sequence[str],
        api_key: str | None,
        *,
        timeout_s: float,
        max_attempts: int,
        max_wait_s: float,
        backoff_s: float,
        affinity: bool,
    ) -> None:
        import httpx  # the serve extra; imported here so that the error classes import without it

        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        self.urls: list[str] = list(dict.fromkeys(u.rstrip("/").removesuffix("/v1") for u in urls))
        """The server roots, in the order given (duplicates dropped)."""
        if not self.urls:
            raise ValueError("base_url must name at least one server")
        self.affinity = affinity
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.clients = [
            httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(timeout_s)) for url in self.urls
        ]
        self.max_attempts, self.max_wait_s, self.backoff_s = max_attempts, max_wait_s, backoff_s
        self._round_robin = itertools.count()
        self._down: dict[int, float] = {}
        """Endpoint index -> when it last failed through every retry (passed over for max_wait_s)."""
        self._down_lock = threading.Lock()

    def connect(self, model: str | None, count: Count) -> tuple[str, bool]:
        """Read every endpoint's ``/v1/models``: each reachable one must serve the model, and all of
        them the same kind of server (the request format depends on it). An unreachable endpoint is
        marked down; only when none answers does this raise. The served model's id, and whether
        the servers are branchwise servers."""
        listed: dict[int, list[dict[str, Any]]] = {}
        failures: list[RemoteUnavailable] = []
        for i in range(len(self.urls)):
            try:
                listed[i] = self.request("GET", "/v1/models", None, count, endpoint=i)["data"]
            except RemoteUnavailable as err:
                self.mark_down(i)
                failures.append(err)
        if not listed:
            if len(failures) == 1:
                raise failures[0]
            raise RemoteUnavailable("no endpoint answered: " + "; ".join(map(str, failures))) from failures[
                -1
            ]
        model_name = ""
        kinds: set[bool] = set()
        for i, served in listed.items():
            url = self.urls[i]
            if not served:
                raise RemoteCapabilityError(f"{url}/v1/models lists no model")
            wanted = model or model_name or served[0]["id"]
            entry = next((m for m in served if m["id"] == wanted), None)
            if entry is None:
                raise RemoteError(f"{url} does not serve {wanted!r}; it serves {[m['id'] for m in served]}")
            model_name = entry["id"]
            kinds.add(entry.get("owned_by") == "branchwise")
        if len(kinds) > 1:
            raise RemoteError(
                f"the endpoints {self.urls} mix branchwise servers with others; give servers of one kind"
            )
        return model_name, kinds.pop()

    def close(self) -> None:
        for client in self.clients:
            client.close()

    def request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        count: Count,
        *,
        endpoint: int = 0,
        stream: Callable[[httpx.Response], Any] | None = None,
    ) -> Any:
        """One call to one endpoint with retries (see the module docstring); the decoded JSON reply,
        or what `stream` made of the streamed response (a failure after `stream` reported anything
        is not retried: the listener would hear the same tokens twice)."""
        import httpx

        http, url = self.clients[endpoint], self.urls[endpoint]

        def wait(state: tenacity.RetryCallState) -> float:
            # exponential backoff plus jitter (so clients that failed together do not retry together)
            backoff = tenacity.wait_exponential(multiplier=self.backoff_s, max=self.max_wait_s)(state)
            backoff += tenacity.wait_random(0, self.backoff_s)(state)
            exc = state.outcome.exception() if state.outcome is not None else None
            after = exc.retry_after if isinstance(exc, _Retryable) else None
            return max(backoff, after) if after is not None else backoff

        def once() -> Any:
            if stream is None:
                return answered(http.request(method, path, json=body)).json()
            with http.stream(method, path, json=body) as response:
                if response.status_code >= 400:
                    response.read()
                return stream(answered(response))

        def answered(response: httpx.Response) -> httpx.Response:
            if response.status_code in _RETRY_STATUS:
                raise _Retryable(response.status_code, response.text, _retry_after(response))
            if response.status_code == 404:
                raise RemoteCapabilityError(f"{url} has no {path} endpoint (HTTP 404)")
            if response.status_code >= 400:
                raise RemoteError(
                    f"{url}{path} refused the request: HTTP {response.status_code}: {response.text[:500]}"
                )
            count("requests", 1.0)
            return response

        def slept(state: tenacity.RetryCallState) -> None:
            count("retries", 1.0)
            count("retry_wait_s", state.next_action.sleep if state.next_action is not None else 0.0)

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type((httpx.TransportError, _Retryable)),
            wait=wait,
            stop=tenacity.stop_after_attempt(self.max_attempts) | tenacity.stop_after_delay(self.max_wait_s),
            before_sleep=slept,
            reraise=False,
        )
        try:
            return retrying(once)
        except tenacity.RetryError as err:
            attempt = err.last_attempt
            cause = attempt.exception()
            raise RemoteUnavailable(
                f"{url}{path} failed {attempt.attempt_number} time(s) "
                f"(giving up after {self.max_attempts} attempts or {self.max_wait_s:g} s): "
                f"{type(cause).__name__}: {cause}"
            ) from cause

    def post(
        self,
        path: str,
        body: dict[str, Any],
        count: Count,
        tree: bytes | None = None,
        stream: Callable[[httpx.Response], Any] | None = None,
    ) -> tuple[Any, str]:
        """POST to the endpoint `tree` routes to (round-robin when `tree` is None or affinity is
        off), failing over along the ranking; the reply (or `stream`'s result) and the URL that gave it."""
        order = self.order(tree)
        failures: list[RemoteUnavailable] = []
        for i in order:
            try:
                reply = self.request("POST", path, body, count, endpoint=i, stream=stream)
            except RemoteUnavailable as err:
                self.mark_down(i)
                failures.append(err)
                if len(failures) < len(order):
                    count("failovers", 1.0)
                continue
            if i in self._down:
                with self._down_lock:
                    self._down.pop(i, None)
            return reply, self.urls[i]
        if len(failures) == 1:
            raise failures[0]
        raise RemoteUnavailable(f"every endpoint failed: {'; '.join(map(str, failures))}") from failures[-1]

    def order(self, tree: bytes | None) -> list[int]:
        """Endpoint indices to try, best first: the tree's rendezvous ranking (or the round-robin
        turn), with endpoints that recently failed through every retry moved to the end."""
        n = len(self.urls)
        if n == 1:
            return [0]
        if tree is None or not self.affinity:
            start = next(self._round_robin) % n
            ranked = [(start + k) % n for k in range(n)]
        else:
            ranked = sorted(range(n), key=lambda i: _rank(tree, self.urls[i]), reverse=True)
        now = time.monotonic()
        with self._down_lock:
            down = {i for i, t in self._down.items() if now - t < self.max_wait_s}
        return [i for i in ranked if i not in down] + [i for i in ranked if i in down]

    def mark_down(self, endpoint: int) -> None:
        with self._down_lock:
            self._down[endpoint] = time.monotonic()

    def prefix_cache_counters(self) -> dict[str, tuple[float, float] | None]:
        """Each endpoint's (queried tokens, hit tokens) from its Prometheus ``/metrics`` (see
        `RemoteBackend.prefix_cache_counters`); None where it exposes no such counters."""
        import httpx

        out: dict[str, tuple[float, float] | None] = {}
        for client, url in zip(self.clients, self.urls, strict=True):
            try:
                response = client.get("/metrics")
            except httpx.HTTPError:
                out[url] = None
                continue
            queries = hits = 0.0
            found = False
            for line in response.text.splitlines() if response.status_code == 200 else ():
                name, _, value = line.partition(" ")
                if name.startswith("vllm:prefix_cache_queries_total"):
                    queries, found = queries + float(value), True
                elif name.startswith("vllm:prefix_cache_hits_total"):
                    hits += float(value)
            out[url] = (queries, hits) if found else None
        return out
