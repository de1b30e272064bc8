"""`Reasoner.batch` in lockstep: several questions' plans run side by side, and every generate step's
`extend` of all of them decodes as ONE batch.

Why: a serial loop of `Reasoner.run` decodes one question's branches at a time, so the model runs
at batch n (e.g. 4) even when 8 questions are waiting; decode on a small model is bound by reading
the weights once per step, so 8 × 4 rows cost little more than 4.

How: each question runs its plan in its own thread on its own session (its own tree nodes, ledger,
notes and verifiers). Its session's `extend` is replaced by a call to a shared `Lockstep`, which
waits until every question still running is waiting in `extend` (or has finished), then decodes the
waiting requests with equal decoding parameters together, rows ordered by prompt length and cut
into groups of similar length (SkipKV §4.3's batch grouping, `group_by_length`), on one batch
session. Everything else (prefill, fork, verifiers, selects) runs in each question's thread on its
own session, serialised by the backend's lock.

Per-run statistics: KV bytes held and peaks are per question (each node belongs to its question's
ledger); the tokens and forwards of a merged `extend` are counted by the batch session and handed to
each question in proportion to the tokens its rows generated (`lockstep_*` in `kv_stats`). Sampling
draws come from one generator per merged batch, so sampled (not greedy) tokens differ from a serial
run with the same seed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from branchwise.backends.base import Backend, DecodeParams, Generation

__all__ = ["Lockstep"]

MAX_ROWS = 64
"""Rows per merged decode batch: beyond this, rows are cut into groups of similar prompt length."""


@dataclass
class _Request:
    owner: int
    nodes: list[int]
    params: DecodeParams
    result: list[Generation] | None = None
    error: BaseException | None = None


@dataclass
class Lockstep:
    """The meeting point of `n` questions' `extend` calls (see the module docstring)."""

    session: Backend
    """Where merged batches decode (no accelerations: plug-in state is per run)."""
    n: int
    prompt_lens: list[int]
    """Each question's prompt length, for grouping rows by length."""
    max_rows: int = MAX_ROWS
    tokens: list[float] = field(init=False)
    forwards: list[float] = field(init=False)
    merged: list[int] = field(init=False)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _waiting: list[_Request] = field(default_factory=list)
    _active: int = field(init=False)

    def __post_init__(self) -> None:
        self._active = self.n
        self.tokens = [0.0] * self.n
        self.forwards = [0.0] * self.n
        self.merged = [0] * self.n

    def extend_for(self, owner: int) -> Callable[[Sequence[int], DecodeParams], list[Generation]]:
        """The `extend` that question `owner`'s session uses while the batch runs."""

        def extend(nodes: Sequence[int], params: DecodeParams) -> list[Generation]:
            req = _Request(owner, list(nodes), params)
            with self._cond:
                self._waiting.append(req)
                self._maybe_run()
                while req.result is None and req.error is None:
                    self._cond.wait()
            if req.error is not None:
                raise req.error
            assert req.result is not None
            return req.result

        return extend

    def finished(self) -> None:
        """Question done (or failed): the others no longer wait for it."""
        with self._cond:
            self._active -= 1
            self._maybe_run()

    def stats(self, owner: int) -> dict[str, float]:
        return {
            "lockstep_tokens_computed": self.tokens[owner],
            "lockstep_forward_calls": self.forwards[owner],
            "lockstep_merged_extends": float(self.merged[owner]),
        }

    # ------------------------------------------------------------------ internals
    def _maybe_run(self) -> None:
        """With the condition held: once every running question waits, decode what they asked."""
        if not self._waiting or len(self._waiting) < self._active:
            return
        todo, self._waiting = self._waiting, []
        groups: dict[str, list[_Request]] = {}
        for req in todo:
            groups.setdefault(req.params.model_dump_json(), []).append(req)
        try:
            for reqs in groups.values():
                self._decode(reqs)
        finally:
            self._cond.notify_all()

    def _decode(self, reqs: list[_Request]) -> None:
        from branchwise.backends.hf.skipkv_policy import group_by_length

        rows = [(req, i) for req in reqs for i in range(len(req.nodes))]
        for req in reqs:
            req.result = [None] * len(req.nodes)  # type: ignore[list-item]
        lengths = [self.prompt_lens[req.owner] for req, _ in rows]
        try:
            for group in group_by_length(lengths, self.max_rows):
                chunk = [rows[i] for i in group]
                before = self.session.kv_stats()
                gens = self.session.extend([req.nodes[i] for req, i in chunk], reqs[0].params)
                after = self.session.kv_stats()
                self._account(
                    chunk,
                    gens,
                    after.tokens_computed - before.tokens_computed,
                    after.forward_calls - before.forward_calls,
                )
                for (req, i), gen in zip(chunk, gens, strict=True):
                    assert req.result is not None
                    req.result[i] = gen
        except BaseException as exc:  # every waiting question sees the failure
            for req in reqs:
                req.result, req.error = None, exc

    def _account(
        self, chunk: list[tuple[_Request, int]], gens: list[Generation], tokens: float, forwards: float
    ) -> None:
        """Hand a merged extend's tokens to its questions by generated tokens; each rode its forwards."""
        made: dict[int, int] = {}
        for (req, _), gen in zip(chunk, gens, strict=True):
            made[req.owner] = made.get(req.owner, 0) + max(len(gen.token_ids), 1)
        total = sum(made.values())
        for owner, n in made.items():
            self.tokens[owner] += tokens * n / total
            self.forwards[owner] += forwards
            self.merged[owner] += 1


def run_threads(fns: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run each function in its own thread; results in order, the first error re-raised."""
    out: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out
