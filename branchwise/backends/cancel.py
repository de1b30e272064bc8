"""Cancelling a run that drives a backend: `Cancellable` wraps any `Backend` with a stop signal.

Why a wrapper and not a flag in each backend: a strategy run (`Reasoner.run`) makes many backend
calls from its own thread, and the caller that wants it stopped (a server whose client left, a
deadline) is elsewhere. Checking one `threading.Event` at each call, and handing `extend` a step
listener that stops every row once it is set, stops the run within one decode step on a backend
that stops rows (the local one) and at the next call on one that cannot (a remote server finishes
the request it sent). The run then raises `Cancelled`, and its own cleanup releases its nodes.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from typing import Any

from branchwise.backends.base import Backend, Cancelled, DecodeParams, DecodeStep, Generation, StepListener

__all__ = ["Cancellable"]

_PASS = frozenset({"release", "kv_stats", "reset_stats", "encode", "decode", "tokens", "name"})
"""Calls that go through even once cancelled: the run's cleanup and its reading of what it held."""


class Cancellable:
    """`backend` with every operation refused (`Cancelled`) once `event` is set (see the module
    docstring). Attributes the backend lacks stay missing, so capability checks (`isinstance` with
    the `Supports*` protocols) answer as they would for the backend itself."""

    def __init__(self, backend: Backend, event: threading.Event) -> None:
        self._backend = backend
        self._event = event

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        """Raise `Cancelled` once the event is set."""
        if self._event.is_set():
            raise Cancelled("the run was cancelled")

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._backend, name)
        if name in _PASS or not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.check()
            return attr(*args, **kwargs)

        return call

    def extend(
        self, nodes: Any, params: DecodeParams, on_step: StepListener | None = None, **kwargs: Any
    ) -> list[Generation]:
        """`Backend.extend` whose rows all stop at the next step once the event is set."""
        self.check()
        event = self._event

        def listen(step: DecodeStep) -> Collection[int] | None:
            drop = on_step(step) if on_step is not None else None
            if event.is_set():
                return list(step.tokens)  # every row that is still decoding steps in each step
            return drop

        gens = self._backend.extend(nodes, params, on_step=listen, **kwargs)
        self.check()
        return gens
