"""Cancelling a strategy run from another thread: it stops mid-decode, raises `Cancelled` and
leaves no KV behind (what a server does when the client of a strategy request goes away)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from branchwise.backends.base import Cancelled, DecodeParams
from branchwise.backends.cancel import Cancellable
from branchwise.reasoners import Reasoner
from branchwise.strategies import PREBUILT


def test_a_run_cancelled_mid_decode_stops_and_releases(tiny_backend: Any) -> None:
    cancel = threading.Event()
    steps: list[int] = []
    reasoner = Reasoner(PREBUILT["self-consistency"](branches=4, tokens=1500), backend=tiny_backend)
    session = tiny_backend.session

    def counting_session(**kw: Any) -> Any:
        run = session(**kw)
        extend = run.extend

        def watched(nodes: Any, params: DecodeParams, on_step: Any = None, **more: Any) -> Any:
            def listen(step: Any) -> Any:
                steps.append(len(step.tokens))
                if len(steps) == 5:
                    cancel.set()  # as a server's disconnect watcher would, from anywhere
                return on_step(step) if on_step is not None else None

            return extend(nodes, params, on_step=listen, **more)

        run.extend = watched
        return run

    tiny_backend.session = counting_session
    try:
        with pytest.raises(Cancelled):
            reasoner.run("What is 2 + 3?", cancel=cancel)
    finally:
        del tiny_backend.session
    assert len(steps) <= 6  # the rows stopped at the step after the event was set
    assert tiny_backend.tree.accounts.total.held == 0 and tiny_backend.tree.accounts.total.nodes == 0


def test_a_cancelled_wrapper_refuses_work_but_lets_cleanup_through(tiny_backend: Any) -> None:
    cancel = threading.Event()
    run = Cancellable(tiny_backend, cancel)
    root = run.prefill(tiny_backend.encode("hello there"))
    cancel.set()
    with pytest.raises(Cancelled):
        run.fork(root, 2)
    run.release([root])  # cleanup still goes through
    assert run.kv_stats().bytes_held == 0
