"""A `RemoteBackend.extend` that someone listens to: token streaming, early stops, and requests
that join while others decode.

Why: `branchwise serve` in front of a remote engine (``serve --endpoint``) streams to its own
clients, cancels the branches of a client that left, and batches continuously; all three need the
remote decode to behave like the local one. So when `extend` gets a listener (``on_step``) or an
``admit``, each request goes out with ``stream: true`` and:

* tokens reach the listener as the server sends them (vLLM's streamed ``logprobs`` with
  ``return_tokens_as_token_ids`` carry the ids; a server that streams text only has its rows'
  tokens reported whole, when they end);
* rows the listener gives back stop: once every row of a request is stopped its stream is closed,
  which a vLLM server takes as an abort (the sequence leaves its batch);
* ``admit`` is asked at every step boundary (a streamed chunk, or every `POLL_S` while the
  server is quiet), and the rows it hands in go out at once as requests of their own, each with
  its own parameters (``row_params``): the server's own batching then runs them beside the rest.

Listener and ``admit`` are called on the thread that called `extend` only (as on the local
backend); request threads hand their chunks over through a queue. The pieces of a streamed choice,
joined (`Choices`), are the choice of an unstreamed reply, so one reader turns both into a
`Generation`: the streamed and the whole answer of a request are the same tokens and text.
"""

from __future__ import annotations

import json
import queue
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from branchwise.backends.base import Admit, DecodeParams, DecodeStep, Generation, NodeId, StepListener

__all__ = ["POLL_S", "Choices", "Emit", "LiveExtend", "Stopped", "sse_events"]

POLL_S = 0.01
"""How long the extend waits for a chunk before it asks ``admit`` again (the server is quiet, or
still computing a long prompt)."""

_TOP_KEYS = ("tokens", "token_logprobs", "top_logprobs")


def sse_events(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The JSON events of a server-sent-events body, up to ``[DONE]``; an error event raises
    `ValueError` with the server's message (vLLM reports a failure after the status line so)."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event and not event.get("choices"):
            error = event["error"]
            raise ValueError(error.get("message", error) if isinstance(error, dict) else error)
        yield event


class Choices:
    """The ``n`` choices of a streamed completion, assembled chunk by chunk into the shape of an
    unstreamed reply's ``choices``."""

    def __init__(self, n: int) -> None:
        self.whole: list[dict[str, Any]] = [
            {
                "index": i,
                "text": "",
                "logprobs": {key: [] for key in _TOP_KEYS},
                "finish_reason": None,
                "stop_reason": None,
            }
            for i in range(n)
        ]

    def add(self, event: dict[str, Any]) -> list[tuple[int, list[int]]]:
        """Fold one chunk in; the (choice, token ids) it streamed, where the server named the ids."""
        streamed = []
        for part in event.get("choices") or []:
            i = int(part["index"])
            if not 0 <= i < len(self.whole):
                raise ValueError(f"a streamed choice has index {i}; the request asked for {len(self.whole)}")
            whole = self.whole[i]
            whole["text"] += part.get("text") or ""
            lp = part.get("logprobs") or {}
            for key in _TOP_KEYS:
                whole["logprobs"][key].extend(lp.get(key) or [])
            ids = [
                int(t.removeprefix("token_id:"))
                for t in lp.get("tokens") or []
                if isinstance(t, str) and t.startswith("token_id:")
            ]
            if part.get("finish_reason") is not None:
                whole["finish_reason"] = part["finish_reason"]
                whole["stop_reason"] = part.get("stop_reason")
            if ids:
                streamed.append((i, ids))
        return streamed


Emit = Callable[[int, list[int]], None]
"""A request thread's report of choice ``i``'s new token ids."""

Complete = Callable[[list[int], int, DecodeParams, bytes, Emit, Callable[[], bool]], list[Generation]]
"""`RemoteBackend`'s request of ``n`` continuations of a prompt on a tree's endpoint, streamed to
an `Emit`; it raises `Stopped` when the last callable said every row was stopped."""


class Stopped(Exception):
    """Every row of a streamed request was stopped: its stream was closed (the server aborts it)."""


@dataclass
class _Request:
    rows: list[int]
    prompt: list[int]
    stopped: set[int] = field(default_factory=set)

    def all_stopped(self) -> bool:
        return len(self.stopped) == len(self.rows)


class LiveExtend:
    """One listened-to `extend` (see the module docstring). `rows` are positions in the call's
    nodes, admitted ones numbered after the others, as `DecodeStep` wants them.

    Args:
        pool: the backend's request threads.
        complete: sends one request (see `Complete`).
        key: a node's request key: its token ids and tree (nodes with equal keys and parameters
            go out as one request with ``n`` choices).
        on_step, admit: the caller's listener and admission (either may be None).
    """

    def __init__(
        self,
        pool: ThreadPoolExecutor,
        complete: Complete,
        key: Callable[[NodeId], tuple[tuple[int, ...], bytes]],
        on_step: StepListener | None,
        admit: Admit | None,
    ) -> None:
        self.pool, self.complete, self.key = pool, complete, key
        self.on_step, self.admit = on_step, admit
        self.nodes: list[NodeId] = []
        self.params: list[DecodeParams] = []
        self.seen: list[list[int]] = []
        """Each row's tokens reported so far."""
        self.results: dict[int, Generation] = {}
        self.stopped: set[int] = set()
        self.events: queue.SimpleQueue[tuple[int, list[int]]] = queue.SimpleQueue()
        self.running: dict[Future[list[Generation]], _Request] = {}
        self.requests: list[tuple[list[int], list[Generation]]] = []
        """Every answered request: (its prompt, its generations), for the backend's accounting."""

    def run(
        self,
        nodes: Sequence[NodeId],
        params: DecodeParams,
        row_params: Sequence[DecodeParams | None] | None = None,
    ) -> list[Generation]:
        """Decode `nodes` (and whatever ``admit`` hands in) to their ends; one `Generation` per row,
        finish reason "cancelled" (with the tokens seen by then) for rows the listener stopped."""
        own = list(row_params) if row_params is not None else [None] * len(nodes)
        if len(own) != len(nodes):
            raise ValueError(f"row_params has {len(own)} entries for {len(nodes)} nodes")
        self._send(list(nodes), [p or params for p in own])
        try:
            while self.running or not self.events.empty():
                self._step(params)
        finally:
            for future, request in self.running.items():  # a failure: stop the others' streams
                request.stopped.update(request.rows)
                future.cancel()
        return [
            self.results[row] if row in self.results else self._cancelled(row)
            for row in range(len(self.nodes))
        ]

    def _send(self, nodes: list[NodeId], params: list[DecodeParams]) -> None:
        """Group new rows by (tokens, tree, parameters) and send one request per group."""
        groups: dict[tuple[tuple[int, ...], bytes, DecodeParams], list[int]] = {}
        for node, p in zip(nodes, params, strict=True):
            row = len(self.nodes)
            self.nodes.append(node)
            self.params.append(p)
            self.seen.append([])
            groups.setdefault((*self.key(node), p), []).append(row)
        for (tokens, tree, p), rows in groups.items():
            request = _Request(rows, list(tokens))

            def emit(i: int, ids: list[int], rows: list[int] = rows) -> None:
                self.events.put((rows[i], ids))

            future = self.pool.submit(
                self.complete, request.prompt, len(rows), p, tree, emit, request.all_stopped
            )
            self.running[future] = request

    def _step(self, params: DecodeParams) -> None:
        """Wait for chunks (up to `POLL_S`), report them as one step, stop what the listener gives
        back, collect answered requests (raising a failed one's error), then admit."""
        step = DecodeStep({}, {})
        try:
            item = self.events.get(timeout=POLL_S)
            while True:
                self._fold(step, *item)
                item = self.events.get_nowait()
        except queue.Empty:
            pass
        for future in [f for f in self.running if f.done()]:
            request = self.running.pop(future)
            try:
                gens = future.result()  # a failed request raises here, ending the call
            except Stopped:
                continue  # every row was stopped; the stream was closed
            self.requests.append((request.prompt, gens))
            for row, gen in zip(request.rows, gens, strict=True):
                if row not in self.stopped:
                    self._finish(step, row, gen)
        if (step.tokens or step.finished) and self.on_step is not None:
            for row in self.on_step(step) or ():
                self._stop(row)
        if self.admit is not None:
            alive = len(self.nodes) - len(self.results) - len(self.stopped)
            new = list(self.admit(alive))
            if new:
                nodes = [a[0] if isinstance(a, tuple) else a for a in new]
                self._send(nodes, [a[1] if isinstance(a, tuple) else params for a in new])

    def _fold(self, step: DecodeStep, row: int, ids: list[int]) -> None:
        if row in self.stopped or row in self.results:
            return
        self.seen[row].extend(ids)
        step.tokens.setdefault(row, []).extend(ids)

    def _finish(self, step: DecodeStep, row: int, gen: Generation) -> None:
        """Row `row` ended: report its tokens not streamed yet (all of them where the server named
        no ids), then its `Generation`."""
        seen = self.seen[row]
        rest = gen.token_ids[len(seen) :] if gen.token_ids[: len(seen)] == seen else []
        if rest:
            step.tokens.setdefault(row, []).extend(rest)
        gen.node = self.nodes[row]
        self.results[row] = gen
        step.finished[row] = gen

    def _stop(self, row: int) -> None:
        if row in self.results or row in self.stopped or not 0 <= row < len(self.nodes):
            return
        self.stopped.add(row)
        for request in self.running.values():
            if row in request.rows:
                request.stopped.add(row)

    def _cancelled(self, row: int) -> Generation:
        return Generation(
            node=self.nodes[row],
            token_ids=list(self.seen[row]),
            text="",
            top1_probs=[],
            logprobs=[],
            finish_reason="cancelled",
        )
