"""`RemoteBackend`: the `Backend` protocol over an OpenAI-compatible server (vLLM, SGLang,
`branchwise serve`).

Why: a model too big for one machine, or several machines, should run every branchwise strategy
unchanged. The branch tree lives here, as token lists; the KV lives on the server:

* `prefill`/`fork`/`append` only record tokens; `extend` sends one ``/v1/completions`` request per
  distinct token sequence, on token-id prompts with ``n`` = the number of nodes holding it, so the
  ``n`` forks of one prompt are one request and the server's prefix caching shares the prompt (and
  the tree's common ancestors across requests). Distinct sequences go out concurrently, so the
  server batches them.
* `score_next` reads log-probabilities: exactly, from a branchwise server's
  ``branchwise.score_candidates`` extension; otherwise from the top ``max_logprobs`` log-probabilities
  of the first generated token (vLLM's and SGLang's ``logprobs``), where a candidate outside the
  top ``max_logprobs`` gets probability 0.
* Generated token ids come from a branchwise server's ``branchwise.details``, or from vLLM's
  ``return_tokens_as_token_ids``; a server that offers neither has the text re-tokenized.
* Tokenization uses a local tokenizer when one is given (``tokenizer=`` the served model's hub id
  or path), else the server's vLLM-style ``/tokenize`` and ``/detokenize``.
* vLLM refuses ``n`` > 1 under greedy sampling (HTTP 400), so a greedy request to a server other
  than branchwise asks for one continuation and copies it to the ``n`` nodes (greedy rows are
  identical by definition, and the server computes the row once instead of ``n`` times).

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

Accelerations that need the model's internals (hidden states, per-layer exits, KV eviction) cannot
run remotely: setting them raises `UnsupportedOnRemote`. CGEE level 1 (skip the verify pass when
the generation confidence is decisive) needs only generation probabilities, so it is supported.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import tenacity

from branchwise.backends.accel import Accel
from branchwise.backends.base import (
    Admit,
    DecodeParams,
    FinishReason,
    Generation,
    KVStats,
    NodeId,
    ShareMode,
    StepListener,
)
from branchwise.backends.remote_stream import Choices, Emit, LiveExtend, Stopped, sse_events
from branchwise.backends.scores import verify_skip
from branchwise.constraints import Constraint
from branchwise.toolcalls import render_messages, template_has_tools

if TYPE_CHECKING:
    import httpx
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "RemoteBackend",
    "RemoteCapabilityError",
    "RemoteError",
    "RemoteUnavailable",
    "UnsupportedOnRemote",
]

_RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class RemoteError(RuntimeError):
    """The server could not be reached, kept failing, or refused the request."""


class RemoteUnavailable(RemoteError):
    """The server stayed unreachable, overloaded or failing through every retry: another server
    could still answer the same request (the eval harness moves the problem elsewhere)."""


class RemoteCapabilityError(RemoteError):
    """The server lacks something this operation needs (named in the message)."""


class UnsupportedOnRemote(ValueError):
    """An acceleration that needs the model's internals was asked of a remote backend."""


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


@dataclass
class _Node:
    tokens: list[int]
    parent: int | None
    tree: bytes
    """The routing key of the node's tree: a hash of its root's token ids (see `_tree_key`)."""
    children: int = 0
    released: bool = False


def _tree_key(token_ids: Sequence[int]) -> bytes:
    """A stable hash of a tree root's tokens: equal prompts route alike in every process."""
    return hashlib.blake2b(",".join(map(str, token_ids)).encode(), digest_size=16).digest()


def _rank(key: bytes, url: str) -> int:
    """Rendezvous (highest-random-weight) score of `url` for a tree: each tree ranks the endpoints
    in its own stable order, and removing an endpoint moves only that endpoint's trees."""
    return int.from_bytes(hashlib.blake2b(key + url.encode(), digest_size=8).digest(), "big")


class RemoteBackend:
    """A `Backend` over an OpenAI-compatible server. See the module docstring.

    Args:
        base_url: the server root, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is accepted),
            or a list of them: servers of the same model, each tree routed to one of them.
        model: the served model's id; default: the first one ``/v1/models`` lists.
        api_key: sent as a bearer token.
        tokenizer: a tokenizer (or its hub id / path) matching the served model; default: the
            server's ``/tokenize`` endpoints.
        timeout_s: per-request timeout (connect, read, write).
        max_attempts: tries per request before `RemoteError`.
        max_wait_s: total time a request may spend retrying before `RemoteError`.
        backoff_s: first backoff; it doubles per retry, with jitter, up to ``max_wait_s``.
        max_logprobs: top log-probabilities asked for by `score_next` on non-branchwise servers.
        max_parallel: concurrent requests one `extend`/`score_next` may have in flight.
        affinity: with several endpoints, send each tree to one endpoint (prefix affinity); False
            sends requests round-robin.
    """

    name = "remote"
    max_context: int | None = None
    """Unknown here: the server checks its own context and answers 400 for what does not fit."""
    seeds_per_request = True
    """Each request carries its own seed to the server, so a seeded row decodes the same tokens
    whatever it is batched with (a `Scheduler` batches seeded jobs here)."""

    def __init__(
        self,
        base_url: str | Sequence[str],
        model: str | None = None,
        api_key: str | None = None,
        *,
        tokenizer: str | PreTrainedTokenizerBase | None = None,
        timeout_s: float = 120.0,
        max_attempts: int = 5,
        max_wait_s: float = 60.0,
        backoff_s: float = 0.5,
        max_logprobs: int = 20,
        max_parallel: int = 16,
        affinity: bool = True,
    ) -> None:
        import httpx  # the serve extra; imported here so that the error classes import without it

        if max_attempts < 1 or max_parallel < 1 or max_logprobs < 1:
            raise ValueError("max_attempts, max_parallel and max_logprobs must be >= 1")
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        self.endpoints: list[str] = list(dict.fromkeys(u.rstrip("/").removesuffix("/v1") for u in urls))
        """The server roots, in the order given (duplicates dropped)."""
        if not self.endpoints:
            raise ValueError("base_url must name at least one server")
        self.base_url = self.endpoints[0]
        self.affinity = affinity
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._clients = [
            httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(timeout_s))
            for url in self.endpoints
        ]
        self.max_attempts, self.max_wait_s, self.backoff_s = max_attempts, max_wait_s, backoff_s
        self.max_logprobs = max_logprobs
        self._pool = ThreadPoolExecutor(max_parallel, thread_name_prefix="branchwise-remote")
        self._lock = threading.RLock()
        self._nodes: dict[int, _Node] = {}
        self._next_id = 0
        self._stats = KVStats()
        self._accel = Accel()
        # routing state, shared by every session view (copy.copy keeps these objects)
        self._round_robin = itertools.count()
        self._down: dict[int, float] = {}
        """Endpoint index -> when it last failed through every retry (passed over for max_wait_s)."""
        self._down_lock = threading.Lock()
        self.model_name: str = ""
        self.branchwise_server = False
        """A `branchwise serve` server: exact token ids and candidate log-probabilities via extensions."""
        self._connect(model)
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.tokenizer = tokenizer

    def _connect(self, model: str | None) -> None:
        """Read every endpoint's ``/v1/models``: each reachable one must serve the model, and all of
        them the same kind of server (the request format depends on it). An unreachable endpoint is
        marked down; only when none answers does this raise."""
        listed: dict[int, list[dict[str, Any]]] = {}
        failures: list[RemoteUnavailable] = []
        for i in range(len(self.endpoints)):
            try:
                listed[i] = self._request("GET", "/v1/models", None, endpoint=i)["data"]
            except RemoteUnavailable as err:
                self._mark_down(i)
                failures.append(err)
        if not listed:
            if len(failures) == 1:
                raise failures[0]
            raise RemoteUnavailable("no endpoint answered: " + "; ".join(map(str, failures))) from failures[
                -1
            ]
        kinds: set[bool] = set()
        for i, served in listed.items():
            url = self.endpoints[i]
            if not served:
                raise RemoteCapabilityError(f"{url}/v1/models lists no model")
            wanted = model or self.model_name or served[0]["id"]
            entry = next((m for m in served if m["id"] == wanted), None)
            if entry is None:
                raise RemoteError(f"{url} does not serve {wanted!r}; it serves {[m['id'] for m in served]}")
            self.model_name = entry["id"]
            kinds.add(entry.get("owned_by") == "branchwise")
        if len(kinds) > 1:
            raise RemoteError(
                f"the endpoints {self.endpoints} mix branchwise servers with others; give servers of one kind"
            )
        self.branchwise_server = kinds.pop()

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        for client in self._clients:
            client.close()

    # ------------------------------------------------------------------ HTTP
    def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        endpoint: int = 0,
        stream: Callable[[httpx.Response], Any] | None = None,
    ) -> Any:
        """One call to one endpoint with retries (see the module docstring); the decoded JSON reply,
        or what `stream` made of the streamed response (a failure after `stream` reported anything
        is not retried: the listener would hear the same tokens twice)."""
        import httpx

        http, url = self._clients[endpoint], self.endpoints[endpoint]

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
            with self._lock:
                self._stats.extra["requests"] = self._stats.extra.get("requests", 0.0) + 1
            return response

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type((httpx.TransportError, _Retryable)),
            wait=wait,
            stop=tenacity.stop_after_attempt(self.max_attempts) | tenacity.stop_after_delay(self.max_wait_s),
            before_sleep=self._count_retry,
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

    def _count_retry(self, state: tenacity.RetryCallState) -> None:
        self._bump("retries")
        self._bump("retry_wait_s", state.next_action.sleep if state.next_action is not None else 0.0)

    def _post(
        self,
        path: str,
        body: dict[str, Any],
        tree: bytes | None = None,
        stream: Callable[[httpx.Response], Any] | None = None,
    ) -> tuple[Any, str]:
        """POST to the endpoint `tree` routes to (round-robin when `tree` is None or affinity is
        off), failing over along the ranking; the reply (or `stream`'s result) and the URL that gave it."""
        order = self._order(tree)
        failures: list[RemoteUnavailable] = []
        for i in order:
            try:
                reply = self._request("POST", path, body, endpoint=i, stream=stream)
            except RemoteUnavailable as err:
                self._mark_down(i)
                failures.append(err)
                if len(failures) < len(order):
                    self._bump("failovers")
                continue
            if i in self._down:
                with self._down_lock:
                    self._down.pop(i, None)
            return reply, self.endpoints[i]
        if len(failures) == 1:
            raise failures[0]
        raise RemoteUnavailable(f"every endpoint failed: {'; '.join(map(str, failures))}") from failures[-1]

    def _order(self, tree: bytes | None) -> list[int]:
        """Endpoint indices to try, best first: the tree's rendezvous ranking (or the round-robin
        turn), with endpoints that recently failed through every retry moved to the end."""
        n = len(self.endpoints)
        if n == 1:
            return [0]
        if tree is None or not self.affinity:
            start = next(self._round_robin) % n
            ranked = [(start + k) % n for k in range(n)]
        else:
            ranked = sorted(range(n), key=lambda i: _rank(tree, self.endpoints[i]), reverse=True)
        now = time.monotonic()
        with self._down_lock:
            down = {i for i, t in self._down.items() if now - t < self.max_wait_s}
        return [i for i in ranked if i not in down] + [i for i in ranked if i in down]

    def _mark_down(self, endpoint: int) -> None:
        with self._down_lock:
            self._down[endpoint] = time.monotonic()

    def endpoint_for(self, node: NodeId) -> str | None:
        """The endpoint the next request of `node`'s tree goes to (after any failover); None with
        several endpoints and affinity off, where each request takes the next endpoint in turn."""
        with self._lock:
            tree = self._get_node(node).tree
        if len(self.endpoints) > 1 and not self.affinity:
            return None
        return self.endpoints[self._order(tree)[0]]

    def prefix_cache_counters(self) -> dict[str, tuple[float, float] | None]:
        """Each endpoint's prefix-cache counters so far, (queried tokens, hit tokens), from its
        Prometheus ``/metrics`` (vLLM's ``vllm:prefix_cache_queries_total`` and ``..._hits_total``,
        summed over its engines); None for an endpoint that exposes no such counters.

        Why: the hit rate is what prefix affinity buys (and what round-robin loses); take the
        counters before and after a workload and compare their differences."""
        import httpx

        out: dict[str, tuple[float, float] | None] = {}
        for client, url in zip(self._clients, self.endpoints, strict=True):
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

    def _bump(self, key: str, value: float = 1.0) -> None:
        with self._lock:
            self._stats.extra[key] = self._stats.extra.get(key, 0.0) + value

    # ------------------------------------------------------------------ accelerations
    @property
    def accel(self) -> Accel:
        """The accelerations in force; only CGEE level 1 can run remotely (see the module docstring)."""
        return self._accel

    @accel.setter
    def accel(self, value: Accel) -> None:
        self.check_accel(value)
        self._accel = value

    def session(self, *, share: ShareMode | None = None, accel: Accel | None = None) -> RemoteBackend:
        """A per-run view over the same connection, with its own accelerations, nodes and statistics.

        Why: a `Reasoner` runs each question in its own session, so concurrent runs never share
        settings or counters. Accelerations the server cannot run are refused here, before any
        request. The server decides how it shares prompt KV, so ``share`` has no effect remotely.
        """
        if accel is not None:
            self.check_accel(accel)
        view = copy.copy(self)
        view._lock = threading.RLock()
        view._nodes = {}
        view._next_id = 0
        view._stats = KVStats()
        view._accel = accel or Accel()
        return view

    @staticmethod
    def check_accel(accel: Accel) -> None:
        """Raise `UnsupportedOnRemote` naming every acceleration that needs the model's internals."""
        named = accel.needs_model()
        if named:
            raise UnsupportedOnRemote(
                f"{', '.join(named)} need the model's internals and cannot run on a remote backend; "
                "drop them, or run on a local HFBackend (CGEE level 1 alone works remotely)"
            )

    def skip_verify(self, confidences: Sequence[float]) -> bool:
        """CGEE level 1 (RKSC Eq. 4) with the configured or the paper's thresholds."""
        cgee = self._accel.cgee
        if cgee is None or not cgee.level1:
            return False
        tau, gap = cgee.level1_thresholds()
        return verify_skip(confidences, tau, gap)

    # ------------------------------------------------------------------ text
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        body = {"model": self.model_name, "prompt": text, "add_special_tokens": False}
        return list(self._tokenize(body))

    def decode(self, token_ids: Sequence[int]) -> str:
        if self.tokenizer is not None:
            return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))
        reply = self._post_capability("/detokenize", {"model": self.model_name, "tokens": list(token_ids)})
        return str(reply["prompt"])

    def chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """With a local tokenizer, rendered as the local backend does (`toolcalls.render_messages`);
        otherwise by the server's ``/tokenize``, which renders ``tools`` with the served template
        (vLLM's and branchwise's do)."""
        if self.tokenizer is not None:
            template = getattr(self.tokenizer, "chat_template", None)
            native = template_has_tools(template)
            extra: dict[str, Any] = {"tools": list(tools)} if tools and native else {}
            text = self.tokenizer.apply_chat_template(
                render_messages(messages, tools, native=native),
                add_generation_prompt=True,
                tokenize=False,
                **extra,
            )
            return self.encode(str(text))
        body: dict[str, Any] = {
            "model": self.model_name,
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": True,
            "add_special_tokens": False,
        }
        if tools:
            body["tools"] = list(tools)
        return list(self._tokenize(body))

    def _tokenize(self, body: dict[str, Any]) -> list[int]:
        return list(self._post_capability("/tokenize", body)["tokens"])

    def _post_capability(self, path: str, body: dict[str, Any]) -> Any:
        try:
            return self._post(path, body)[0]
        except RemoteCapabilityError as err:  # "<url> has no <path> endpoint (HTTP 404)"
            raise RemoteCapabilityError(
                f"{str(err).removesuffix(' (HTTP 404)')} (vLLM and branchwise serve have one); pass "
                "tokenizer=<the served model's hub id or path> to tokenize locally"
            ) from None

    # ------------------------------------------------------------------ tree ops
    def prefill(self, token_ids: Sequence[int]) -> NodeId:
        ids = list(token_ids)
        if not ids:
            raise ValueError("token_ids must hold at least 1 token")
        with self._lock:
            return self._new(ids, None, _tree_key(ids))

    def fork(self, node: NodeId, n: int, share: ShareMode | None = None) -> list[NodeId]:
        """`n` children; ``share`` is the server's business (its prefix cache), so it is ignored."""
        if n < 1:
            raise ValueError(f"n={n} must be >= 1")
        with self._lock:
            parent = self._get_node(node)
            parent.children += n
            return [self._new(list(parent.tokens), node, parent.tree) for _ in range(n)]

    def append(self, nodes: Sequence[NodeId], token_ids: Sequence[Sequence[int]]) -> None:
        if len(nodes) != len(token_ids):
            raise ValueError(f"token_ids has {len(token_ids)} entries for {len(nodes)} nodes")
        with self._lock:
            for node, ids in zip(nodes, token_ids, strict=True):
                self._growable(node).tokens.extend(ids)

    def extend(
        self,
        nodes: Sequence[NodeId],
        params: DecodeParams,
        on_step: StepListener | None = None,
        admit: Admit | None = None,
        row_params: Sequence[DecodeParams | None] | None = None,
    ) -> list[Generation]:
        """One completion request per distinct token sequence (``n`` = nodes holding it), in parallel.

        With a listener (`on_step`) or an `admit` (continuous batching), the requests are streamed
        (`remote_stream.LiveExtend`): tokens reach the listener as the server sends them, rows it
        gives back stop, admitted rows go out at once; `row_params` gives rows their own
        parameters. Without either, the replies are read whole, and the tree grows only once every
        request succeeded (a failed call can be retried on the same nodes).
        """
        if on_step is not None or admit is not None:
            return self._extend_live(nodes, params, on_step, admit, row_params)
        if row_params is not None and any(p is not None and p != params for p in row_params):
            raise ValueError(
                "row_params needs admit or on_step (a streamed extend); send one call per parameters"
            )
        with self._lock:
            held = [self._growable(n) for n in nodes]
            if len(set(nodes)) != len(nodes):
                raise ValueError("nodes must be distinct; fork a node to decode it several times")
            groups: dict[tuple[int, ...], list[int]] = {}
            trees: dict[tuple[int, ...], bytes] = {}
            for node, rec in zip(nodes, held, strict=True):
                groups.setdefault(tuple(rec.tokens), []).append(node)
                trees.setdefault(tuple(rec.tokens), rec.tree)
        futures = {
            self._pool.submit(self._complete, list(prompt), len(members), params, trees[prompt]): members
            for prompt, members in groups.items()
        }
        replies: dict[int, Generation] = {}
        for future in as_completed(futures):
            for node, gen in zip(futures[future], future.result(), strict=True):
                gen.node = node
                replies[node] = gen
        with self._lock:  # the tree grows only once every request succeeded
            for prompt, members in groups.items():
                self._account(list(prompt), [replies[node] for node in members])
                for node in members:
                    self._nodes[node].tokens.extend(replies[node].token_ids)
        return [replies[n] for n in nodes]

    def _extend_live(
        self,
        nodes: Sequence[NodeId],
        params: DecodeParams,
        on_step: StepListener | None,
        admit: Admit | None,
        row_params: Sequence[DecodeParams | None] | None,
    ) -> list[Generation]:
        """`extend` with a listener or an admission (see `remote_stream`). A node grows when its
        row ends, unless it was released meanwhile (a serving scheduler frees answered requests')."""
        with self._lock:
            if len(set(nodes)) != len(nodes):
                raise ValueError("nodes must be distinct; fork a node to decode it several times")
            for node in nodes:
                self._growable(node)

        def key(node: NodeId) -> tuple[tuple[int, ...], bytes]:
            with self._lock:
                rec = self._growable(node)
                return tuple(rec.tokens), rec.tree

        live = LiveExtend(self._pool, self._complete, key, on_step, admit)
        gens = live.run(nodes, params, row_params)
        with self._lock:
            for prompt, done in live.requests:
                self._account(prompt, done)
            for gen in gens:
                rec = self._nodes.get(gen.node)
                if gen.finish_reason != "cancelled" and rec is not None and not rec.released:
                    rec.tokens.extend(gen.token_ids)
        return gens

    def _account(self, prompt: list[int], gens: list[Generation]) -> None:
        """Count one answered request (under the lock): its prompt and generated tokens."""
        self._stats.tokens_computed += len(prompt) + sum(len(g.token_ids) for g in gens)
        self._stats.forward_calls += 1

    def score_next(
        self, nodes: Sequence[NodeId], suffix: Sequence[int], candidates: Sequence[int]
    ) -> list[list[float]]:
        if not suffix:
            raise ValueError("suffix must hold at least 1 token")
        with self._lock:
            asks: list[tuple[list[int], bytes]] = [
                ([*self._get_node(n).tokens, *suffix], self._get_node(n).tree) for n in nodes
            ]
        return list(self._pool.map(lambda ask: self._candidate_probs(ask[0], ask[1], list(candidates)), asks))

    def release(self, nodes: Sequence[NodeId]) -> None:
        with self._lock:
            for node in nodes:
                rec = self._nodes.get(node)
                if rec is None or rec.released:
                    raise KeyError(f"node {node} is not live")
                rec.released = True
                self._drop(node)

    def tokens(self, node: NodeId) -> list[int]:
        with self._lock:
            return list(self._get_node(node).tokens)

    def kv_stats(self) -> KVStats:
        """Request accounting: the KV lives on the server, so bytes are 0 here; ``tokens_computed``
        counts prompt and generated tokens sent/received, ``forward_calls`` completion requests, and
        ``extra`` holds ``requests`` (all HTTP calls), ``retries`` and ``retry_wait_s``."""
        with self._lock:
            s = self._stats
            return KVStats(
                tokens_computed=s.tokens_computed,
                forward_calls=s.forward_calls,
                live_nodes=len(self._nodes),
                extra=dict(s.extra),
            )

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = KVStats()

    # ------------------------------------------------------------------ helpers
    def _new(self, tokens: list[int], parent: int | None, tree: bytes) -> int:
        self._next_id += 1
        self._nodes[self._next_id] = _Node(tokens, parent, tree)
        return self._next_id

    def _get_node(self, node: NodeId) -> _Node:
        rec = self._nodes.get(node)
        if rec is None or rec.released:
            raise KeyError(f"node {node} is not live")
        return rec

    def _growable(self, node: NodeId) -> _Node:
        rec = self._get_node(node)
        if rec.children:
            raise ValueError(
                f"node {node} has live children (its KV is shared); fork it instead of growing it"
            )
        return rec

    def _drop(self, node: int) -> None:
        """Forget a released node without live children, and any ancestor that this frees."""
        while True:
            rec = self._nodes[node]
            if not rec.released or rec.children:
                return
            del self._nodes[node]
            if rec.parent is None:
                return
            node = rec.parent
            self._nodes[node].children -= 1

    def _complete(
        self,
        prompt: list[int],
        n: int,
        params: DecodeParams,
        tree: bytes,
        emit: Emit | None = None,
        stopped: Callable[[], bool] | None = None,
    ) -> list[Generation]:
        """One completion request of `n` continuations of `prompt` (see `_request_choices`), each
        continued past a blank first step where the server ends steps otherwise (`_past_blank_step`).
        With `emit`, streamed (`Stopped` once `stopped()` says so: the stream was closed)."""
        gens = self._request_choices(prompt, n, params, tree, emit, stopped)
        if params.step_delimiter and params.constraint is None and not self.branchwise_server:
            for i, g in enumerate(gens):
                more = None if emit is None else (lambda _, ids, i=i: emit(i, ids))
                gens[i] = self._past_blank_step(prompt, g, params, tree, more)
        return gens

    def _past_blank_step(
        self, prompt: list[int], gen: Generation, params: DecodeParams, tree: bytes, emit: Emit | None = None
    ) -> Generation:
        """vLLM ends a step at the first delimiter, even one the step opens with (the model wrote
        the blank line first); branchwise's rule (`backends.text.finish_text`, which the local
        backend and branchwise serve apply) skips leading whitespace, since a blank line is not a
        step. Without this, a step cut by ``max_tokens`` just before its delimiter is followed by a
        step of nothing but the delimiter. So decode on from the blank text, within the same token
        budget, as the local backend would. (Not under a constraint: a second request would
        restart the grammar.)"""
        while gen.finish_reason == "delimiter" and not gen.text.strip():
            left = params.max_tokens - len(gen.token_ids)
            if left <= 0:
                gen.finish_reason = "length"
                break
            rest = params.model_copy(
                update={"max_tokens": left, "min_tokens": max(0, params.min_tokens - len(gen.token_ids))}
            )
            (more,) = self._request_choices([*prompt, *gen.token_ids], 1, rest, tree, emit)
            self._bump("blank_step_continuations")
            gen = Generation(
                node=-1,
                token_ids=gen.token_ids + more.token_ids,
                text=gen.text + more.text,
                top1_probs=gen.top1_probs + more.top1_probs,
                logprobs=gen.logprobs + more.logprobs,
                finish_reason=more.finish_reason,
            )
        return gen

    def _request_choices(
        self,
        prompt: list[int],
        n: int,
        params: DecodeParams,
        tree: bytes,
        emit: Emit | None = None,
        stopped: Callable[[], bool] | None = None,
    ) -> list[Generation]:
        """One ``/v1/completions`` request on the tree's endpoint; `n` generations in index order.

        With `emit` (and a server other than branchwise, whose streamed chunks carry no token
        ids), the reply is streamed: `emit` hears each choice's token ids as they come, and the
        stream is closed once `stopped()` is true (raising `Stopped`)."""
        copies = 1
        if n > 1 and params.temperature == 0 and not self.branchwise_server:
            copies, n = n, 1  # vLLM answers HTTP 400 to n > 1 with greedy sampling (module docstring)
        body: dict[str, Any] = {
            "model": self.model_name,
            "prompt": prompt,
            "n": n,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
        }
        if params.seed is not None:
            body["seed"] = params.seed
        if params.min_tokens:
            body["min_tokens"] = params.min_tokens
        if self.branchwise_server:
            body["stop"] = list(params.stop) or None
            body["branchwise"] = {"details": True, "step_delimiter": params.step_delimiter}
            if params.constraint is not None:
                body["branchwise"]["constraint"] = params.constraint.model_dump(mode="json")
        else:
            if params.constraint is not None:
                body["structured_outputs"] = _structured_outputs(params.constraint)
            stops = [*params.stop, *([params.step_delimiter] if params.step_delimiter else [])]
            body.update(stop=stops or None, logprobs=1, return_tokens_as_token_ids=True)
            if params.step_delimiter:
                body["include_stop_str_in_output"] = True  # vLLM: the delimiter stays in the step
        if emit is not None and not self.branchwise_server:
            body["stream"] = True
            to_rows = emit if copies == 1 else partial(_to_copies, emit, copies)
            read = partial(_read_stream, n=n, emit=to_rows, stopped=stopped)
            reply, url = self._post("/v1/completions", body, tree, read)
        else:
            reply, url = self._post("/v1/completions", body, tree)
        choices = sorted(reply["choices"], key=lambda c: c["index"])
        if len(choices) != n:
            raise RemoteError(f"{url} returned {len(choices)} choices for n={n}")
        gens = [self._generation(c, params) for c in choices]
        return gens + [copy.deepcopy(gens[0]) for _ in range(copies - 1)]

    def _generation(self, choice: dict[str, Any], params: DecodeParams) -> Generation:
        details = choice.get("branchwise")
        if details is not None:
            return Generation(
                node=-1,
                token_ids=list(details["token_ids"]),
                text=choice["text"],
                top1_probs=list(details["top1_probs"]),
                logprobs=list(details["logprobs"]),
                finish_reason=details["finish_reason"],
            )
        text: str = choice["text"]
        lp = choice.get("logprobs") or {}
        tokens = lp.get("tokens") or []
        if tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
            ids = [int(t.removeprefix("token_id:")) for t in tokens]
        else:  # the server gave token strings only: re-tokenize the text (may differ at the edges)
            ids = self.encode(text)
        top = lp.get("top_logprobs") or []
        top1 = [math.exp(max(row.values())) if row else 0.0 for row in top]
        chosen = [x if x is not None else 0.0 for x in (lp.get("token_logprobs") or [])]
        stop_reason = choice.get("stop_reason")
        finish: FinishReason = "length" if choice.get("finish_reason") == "length" else "eos"
        if isinstance(stop_reason, str):
            if stop_reason == params.step_delimiter:
                finish = "delimiter"
            else:
                finish = "stop"
                text = text.removesuffix(stop_reason)  # vLLM kept it (include_stop_str_in_output)
        return Generation(
            node=-1, token_ids=ids, text=text, top1_probs=top1, logprobs=chosen, finish_reason=finish
        )

    def _candidate_probs(self, prompt: list[int], tree: bytes, candidates: list[int]) -> list[float]:
        body: dict[str, Any] = {
            "model": self.model_name,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0.0,
        }
        if self.branchwise_server:
            body["branchwise"] = {"score_candidates": candidates}
            reply, _ = self._post("/v1/completions", body, tree)
            return [math.exp(x) for x in reply["branchwise"]["candidate_logprobs"]]
        body.update(logprobs=self.max_logprobs, return_tokens_as_token_ids=True)
        reply, url = self._post("/v1/completions", body, tree)
        lp = reply["choices"][0].get("logprobs") or {}
        rows = lp.get("top_logprobs") or []
        if not rows or not rows[0]:
            raise RemoteCapabilityError(
                f"{url} returned no top log-probabilities for logprobs={self.max_logprobs}; "
                "score_next needs them (vLLM: start it with --max-logprobs >= max_logprobs)"
            )
        first = rows[0]
        if not all(k.startswith("token_id:") for k in first):
            raise RemoteCapabilityError(
                f"{url} names top log-probabilities by token text, not id "
                "(it ignores return_tokens_as_token_ids); score_next cannot map them to candidates"
            )
        by_id = {int(k.removeprefix("token_id:")): v for k, v in first.items()}
        return [math.exp(by_id[c]) if c in by_id else 0.0 for c in candidates]


def _to_copies(emit: Emit, copies: int, _: int, ids: list[int]) -> None:
    """A greedy request's one choice, reported for each of the `copies` rows it stands for."""
    for k in range(copies):
        emit(k, ids)


def _read_stream(
    response: httpx.Response, *, n: int, emit: Emit, stopped: Callable[[], bool] | None
) -> dict[str, Any]:
    """A streamed completion read into the shape of a whole reply (``{"choices": [...]}``), each
    chunk's token ids handed to `emit` on the way; `Stopped` once `stopped()` (leaving closes the
    stream). A dropped connection after the first chunk is an error, not a retry (`_request`)."""
    import httpx

    choices = Choices(n)
    emitted = False
    try:
        for event in sse_events(response.iter_lines()):
            for i, ids in choices.add(event):
                emit(i, ids)
                emitted = True
            if stopped is not None and stopped():
                raise Stopped
    except ValueError as err:
        raise RemoteError(f"{response.url} failed while streaming: {err}") from None
    except httpx.TransportError as err:
        if not emitted:
            raise
        raise RemoteError(
            f"{response.url} dropped a streamed reply midway: {type(err).__name__}: {err}"
        ) from err
    return {"choices": choices.whole}


def _structured_outputs(c: Constraint) -> dict[str, Any]:
    """A constraint in vLLM's ``structured_outputs`` request field (vLLM's xgrammar backend runs the
    same grammar this package's local backend does). SGLang reads other field names and would
    decode unconstrained: point RemoteBackend at vLLM or branchwise serve for constrained decoding."""
    if c.kind == "json_schema":
        return {"json": c.json_schema}
    if c.kind == "json_object":
        return {"json_object": True}
    if c.kind == "regex":
        return {"regex": c.pattern}
    if c.kind == "choice":
        return {"choice": list(c.choices)}
    return {"structural_tag": json.dumps(c.structural_tag())}
