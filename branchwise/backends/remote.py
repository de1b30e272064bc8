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

Several servers (``RemoteBackend([url_a, url_b])``), retries and failover are `remote_http`'s: each
branch tree's requests go to one endpoint (prefix affinity; ``affinity=False``: round-robin),
failures are retried with backoff, then sent to the tree's next endpoint, and `RemoteUnavailable`
says what failed when none answers; no call hangs. The request bodies and replies of both kinds of
server are `remote_wire`'s, the streamed extend `remote_stream`'s: this module holds the branch
tree and the `Backend` protocol over them.

Accelerations that need the model's internals (hidden states, per-layer exits, KV eviction) cannot
run remotely: setting them raises `UnsupportedOnRemote`. CGEE level 1 (skip the verify pass when
the generation confidence is decisive) needs only generation probabilities, so it is supported.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from branchwise.backends.accel import Accel
from branchwise.backends.base import Admit, DecodeParams, Generation, KVStats, NodeId, ShareMode, StepListener
from branchwise.backends.remote_http import (
    Endpoints,
    RemoteCapabilityError,
    RemoteError,
    RemoteUnavailable,
    tree_key,
)
from branchwise.backends.remote_stream import Emit, LiveExtend
from branchwise.backends.remote_wire import (
    blank_step_rest,
    candidate_body,
    candidate_probs,
    completion_body,
    generations,
    joined,
    read_stream,
    to_copies,
)
from branchwise.backends.scores import verify_skip
from branchwise.toolcalls import render_messages, template_has_tools

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "RemoteBackend",
    "RemoteCapabilityError",
    "RemoteError",
    "RemoteUnavailable",
    "UnsupportedOnRemote",
]


class UnsupportedOnRemote(ValueError):
    """An acceleration that needs the model's internals was asked of a remote backend."""


@dataclass
class _Node:
    tokens: list[int]
    parent: int | None
    tree: bytes
    """The routing key of the node's tree: a hash of its root's token ids (`remote_http.tree_key`)."""
    children: int = 0
    released: bool = False


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
    admits_rows = True  # `SupportsAdmission`: admitted rows go out as streamed requests at once
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
        if max_attempts < 1 or max_parallel < 1 or max_logprobs < 1:
            raise ValueError("max_attempts, max_parallel and max_logprobs must be >= 1")
        self._http = Endpoints(
            base_url,
            api_key,
            timeout_s=timeout_s,
            max_attempts=max_attempts,
            max_wait_s=max_wait_s,
            backoff_s=backoff_s,
            affinity=affinity,
        )
        """The servers and the routing state, shared by every session view (copy.copy keeps it)."""
        self.endpoints: list[str] = self._http.urls
        """The server roots, in the order given (duplicates dropped)."""
        self.base_url = self.endpoints[0]
        self.max_logprobs = max_logprobs
        self._pool = ThreadPoolExecutor(max_parallel, thread_name_prefix="branchwise-remote")
        self._lock = threading.RLock()
        self._nodes: dict[int, _Node] = {}
        self._next_id = 0
        self._stats = KVStats()
        self._accel = Accel()
        model_name, branchwise_server = self._http.connect(model, self._bump)
        self.model_name: str = model_name
        self.branchwise_server: bool = branchwise_server
        """A `branchwise serve` server: exact token ids and candidate log-probabilities via extensions."""
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.tokenizer = tokenizer

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._http.close()

    # ------------------------------------------------------------------ endpoints
    def endpoint_for(self, node: NodeId) -> str | None:
        """The endpoint the next request of `node`'s tree goes to (after any failover); None with
        several endpoints and affinity off, where each request takes the next endpoint in turn."""
        with self._lock:
            tree = self._get_node(node).tree
        if len(self.endpoints) > 1 and not self._http.affinity:
            return None
        return self.endpoints[self._http.order(tree)[0]]

    def prefix_cache_counters(self) -> dict[str, tuple[float, float] | None]:
        """Each endpoint's prefix-cache counters so far, (queried tokens, hit tokens), from its
        Prometheus ``/metrics`` (vLLM's ``vllm:prefix_cache_queries_total`` and ``..._hits_total``,
        summed over its engines); None for an endpoint that exposes no such counters.

        Why: the hit rate is what prefix affinity buys (and what round-robin loses); take the
        counters before and after a workload and compare their differences."""
        return self._http.prefix_cache_counters()

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
            return self._http.post(path, body, self._bump)[0]
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
            return self._new(ids, None, tree_key(ids))

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
        """`gen`, decoded on while it is a blank step (`remote_wire.blank_step_rest` says why)."""
        while (rest := blank_step_rest(gen, params)) is not None:
            (more,) = self._request_choices([*prompt, *gen.token_ids], 1, rest, tree, emit)
            self._bump("blank_step_continuations")
            gen = joined(gen, more)
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
        body = completion_body(self.model_name, prompt, n, params, branchwise=self.branchwise_server)
        if emit is not None and not self.branchwise_server:
            body["stream"] = True
            to_rows = emit if copies == 1 else partial(to_copies, emit, copies)
            read = partial(read_stream, n=n, emit=to_rows, stopped=stopped)
            reply, url = self._http.post("/v1/completions", body, self._bump, tree, read)
        else:
            reply, url = self._http.post("/v1/completions", body, self._bump, tree)
        gens = generations(reply, url, n, params, self.encode)
        return gens + [copy.deepcopy(gens[0]) for _ in range(copies - 1)]

    def _candidate_probs(self, prompt: list[int], tree: bytes, candidates: list[int]) -> list[float]:
        branchwise, top = self.branchwise_server, self.max_logprobs
        body = candidate_body(self.model_name, prompt, candidates, branchwise=branchwise, max_logprobs=top)
        reply, url = self._http.post("/v1/completions", body, self._bump, tree)
        return candidate_probs(reply, url, candidates, branchwise=branchwise, max_logprobs=top)
