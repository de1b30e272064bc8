"""The KV budget is a bound, and a cancelled request stops where it is, through the scheduler a
server uses.

The tiny model holds 768 bytes of KV per token. The budget is sized so that two of the requests fit
at once and eight are sent together: admission, chunked prefill (prompts of 300 tokens, 128-token
chunks) and growth must keep every byte counted within the budget, checked before every forward
(prefill chunks and decode steps alike), not by sampling. A request cancelled while it waits,
while its prompt is prefilled or while it decodes stops within one step, and its KV is released.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from branchwise.backends.base import Cancelled, DecodeParams, KVBudgetExceeded
from branchwise.backends.hf.compute import Computation
from branchwise.backends.scheduler import Job, Scheduler

PROMPT = 300
"""Prompt tokens per request: more than one prefill chunk (128), so prompts are prefilled in chunks."""


def prompt(seed: int, n: int = PROMPT) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(n)]


def budgeted(backend: Any, prompt_tokens: int) -> Iterator[Any]:
    """`backend` with a budget of about two requests' worst-case KV (`prompt_tokens` each, 16 new
    tokens); restored after."""
    before = backend.kv_budget
    backend.kv_budget = int(2.2 * backend.kv_cost(prompt_tokens, 1, 16, "exact"))
    try:
        yield backend
    finally:
        backend.kv_budget = before


@pytest.fixture
def bounded(tiny_backend: Any) -> Iterator[Any]:
    """`tiny_backend` with a budget of about two requests of `PROMPT` tokens."""
    yield from budgeted(tiny_backend, PROMPT)


LONG = 1500
"""A long prompt: three chunks when nothing decodes beside it (`intake.ALONE_CHUNK`)."""


@pytest.fixture
def roomy(tiny_backend: Any) -> Iterator[Any]:
    """`tiny_backend` with a budget of about two requests of `LONG` tokens."""
    yield from budgeted(tiny_backend, LONG)


@pytest.fixture
def forwards(monkeypatch: pytest.MonkeyPatch, tiny_backend: Any) -> list[int]:
    """The KV bytes counted before each forward of the backend (prefill chunks and decode steps)."""
    seen: list[int] = []
    forward = Computation.forward

    def watched(self: Computation, *args: Any, **kwargs: Any) -> Any:
        seen.append(tiny_backend.engine.pool.used())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Computation, "forward", watched)
    return seen


def job(seed: int, max_tokens: int = 16, n: int = PROMPT) -> Job:
    """A one-sample request of an `n`-token prompt that decodes exactly `max_tokens` tokens."""
    params = DecodeParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)
    return Job(prompt=prompt(seed, n), n=1, params=params)


def test_concurrent_requests_keep_the_counted_kv_within_the_budget(bounded: Any, forwards: list[int]) -> None:
    scheduler = Scheduler(bounded)
    try:
        jobs = [scheduler.enqueue(job(i)) for i in range(8)]
        for j in jobs:
            assert len(got(j, 300)[0].token_ids) == 16
    finally:
        scheduler.close(timeout=30)
    pool = bounded.engine.pool
    assert len(forwards) > 8 * 16 // 2  # every prompt's chunks and decode steps were watched
    assert max(forwards) <= pool.budget, (max(forwards), pool.budget)
    assert pool.overruns == 0 and pool.overrun_bytes == 0
    assert scheduler.stats.max_rows_per_call < 8  # the budget held requests back
    assert bounded.tree.accounts.total.held == 0


def test_a_request_that_can_never_fit_is_refused_naming_the_budget(bounded: Any) -> None:
    scheduler = Scheduler(bounded)
    try:
        with pytest.raises(KVBudgetExceeded, match="kv_budget") as err:
            scheduler.enqueue(job(0, n=1800))
    finally:
        scheduler.close(timeout=30)
    message = str(err.value)
    assert str(bounded.kv_budget) in message and "1800 prompt tokens" in message


def test_a_request_cancelled_while_its_prompt_is_prefilled_stops_at_once(
    roomy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch is idle (no row decodes), so chunks run back to back: the cancel is seen before the
    next one, and the request's partial prompt is released."""
    bounded = roomy
    scheduler = Scheduler(bounded)
    chunks: list[int] = []
    cancelled = threading.Event()
    compute_part = Computation.compute_part
    long = job(1, n=LONG)

    def counted(self: Computation, seg: Any, limit: int) -> None:
        compute_part(self, seg, limit)
        chunks.append(limit)
        if len(chunks) == 1:
            scheduler.cancel(long)
            cancelled.set()

    monkeypatch.setattr(Computation, "compute_part", counted)
    try:
        scheduler.enqueue(long)
        with pytest.raises(Cancelled):
            got(long, 120)
        assert cancelled.is_set()
        assert len(chunks) == 1, chunks  # no chunk after the one it was cancelled in
        wait_idle(scheduler)
        assert bounded.tree.accounts.total.held == 0
    finally:
        scheduler.close(timeout=30)


def test_a_cancelled_request_waiting_to_join_a_decode_is_let_go(
    roomy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One request decodes; a second, long one prefills a chunk per step beside it and is cancelled
    meanwhile: it computes no more chunks, the first one is answered, nothing stays held."""
    bounded = roomy
    scheduler = Scheduler(bounded)
    steps: list[int] = []
    second = job(2, n=LONG)
    chunks: list[int] = []
    end_part = Computation._end_part

    def counted(self: Computation, *args: Any) -> None:
        end_part(self, *args)
        chunks.append(1)

    monkeypatch.setattr(Computation, "_end_part", counted)
    prefilled: list[int] = []

    def listen(step: Any) -> None:
        steps.append(len(steps))
        if len(steps) == 3:
            scheduler.enqueue(second)
        if len(steps) == 8:
            prefilled.append(len(chunks))
            scheduler.cancel(second)
        if len(steps) == 12:
            prefilled.append(len(chunks))

    first = job(3, max_tokens=40, n=100)
    first.on_step = listen
    try:
        scheduler.enqueue(first)
        assert len(got(first, 120)[0].token_ids) == 40
        with pytest.raises(Cancelled):
            got(second, 60)
        wait_idle(scheduler)
        assert len(prefilled) == 2 and prefilled[0] >= 2, prefilled  # it was prefilling beside
        assert prefilled[1] - prefilled[0] <= 1, prefilled  # at most the chunk under way
        assert bounded.tree.accounts.total.held == 0
    finally:
        scheduler.close(timeout=30)


def test_a_cancelled_decoding_request_stops_within_a_step(bounded: Any) -> None:
    scheduler = Scheduler(bounded)
    seen: list[int] = []
    running = job(4, max_tokens=200, n=50)

    def listen(step: Any) -> None:
        seen.append(1)
        if len(seen) == 4:
            scheduler.cancel(running)

    running.on_step = listen
    try:
        scheduler.enqueue(running)
        with pytest.raises(Cancelled):
            got(running, 60)
        wait_idle(scheduler)
        assert len(seen) <= 5
        assert bounded.tree.accounts.total.held == 0
    finally:
        scheduler.close(timeout=30)


def got(j: Job, timeout_s: float) -> list[Any]:
    """The job's generations (its error raised), after at most `timeout_s` seconds."""
    assert j.done.wait(timeout_s), "the job was not answered in time"
    return j.result()


def wait_idle(scheduler: Scheduler) -> None:
    from testkit import wait_until

    wait_until(scheduler.idle, "the scheduler is idle after the cancel")


# ------------------------------------------------------------------ over HTTP


def test_a_prompt_that_can_never_fit_the_budget_is_a_400_naming_both_sizes(bounded: Any) -> None:
    httpx = pytest.importorskip("httpx")
    from branchwise.serve import create_app
    from branchwise.serve.runner import serve_in_thread

    with serve_in_thread(create_app(bounded, model_name="tiny")) as url:
        body = {"prompt": prompt(5, 1800), "max_tokens": 8}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        health = httpx.get(f"{url}/health").json()
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert f"kv_budget={bounded.kv_budget} bytes" in message and "1800 prompt tokens" in message
    assert health["kv"]["overruns"] == 0 and health["kv"]["overrun_bytes"] == 0


def test_health_answers_503_starting_until_the_app_is_ready(tiny_backend: Any) -> None:
    httpx = pytest.importorskip("httpx")
    from branchwise.serve import create_app
    from branchwise.serve.runner import serve_in_thread
    from branchwise.serve.starting import RETRY_AFTER_S, Starting

    starting = Starting(drain_timeout_s=5.0)
    with serve_in_thread(starting) as url:
        starting.begin("loading the model")
        health = httpx.get(f"{url}/health")
        models = httpx.get(f"{url}/v1/models")
        chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": []})
        starting.ready(create_app(tiny_backend, model_name="tiny"))
        ready = httpx.get(f"{url}/health")
    assert health.status_code == 503
    assert health.json()["status"] == "starting" and health.json()["stage"] == "loading the model"
    for r in (models, chat):
        assert r.status_code == 503 and r.headers["retry-after"] == str(RETRY_AFTER_S)
        assert "starting" in r.json()["error"]["message"]
    assert ready.status_code == 200 and ready.json()["status"] == "ok"


def test_serve_listens_while_the_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command answers /health 503 while `load_backend` has not returned; a load that fails
    stops the server with its error."""
    httpx = pytest.importorskip("httpx")
    import socket

    import typer
    from typer.testing import CliRunner

    import branchwise.cli_backend
    from branchwise.cli import app

    release = threading.Event()

    def slow_load(*_: Any) -> Any:
        release.wait(60)
        raise typer.Exit(3)

    monkeypatch.setattr(branchwise.cli_backend, "load_backend", slow_load)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results: list[Any] = []
    thread = threading.Thread(
        target=lambda: results.append(CliRunner().invoke(app, ["serve", "--port", str(port)]))
    )
    thread.start()
    try:
        from testkit import wait_until

        def starting() -> bool:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            except httpx.HTTPError:
                return False
            return r.status_code == 503 and r.json()["stage"] == "loading the model"

        wait_until(starting, "/health answers 503 starting while the model loads")
    finally:
        release.set()
        thread.join(60)
    assert results and results[0].exit_code == 3, results


@pytest.mark.slow
def test_the_serve_bounds_probe_reports_a_bound_kept(tiny_llama_dir: Any) -> None:
    """`benchmarks/serve_bounds.py` against a server of the tiny model whose budget holds two of
    its six requests, two of whose clients leave midway: its JSON adds up and says the bound held."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    argv = [sys.executable, str(root / "benchmarks" / "serve_bounds.py"), "--model", str(tiny_llama_dir)]
    argv += ["--kv-budget", "600000", "--requests", "6", "--prompt-tokens", "300", "--max-tokens", "16"]
    argv += ["--disconnect-every", "3", "--disconnect-after", "1", "--decode-step", "eager"]
    argv += ["--id-range", "5", "500", "--dtype", "float32", "--threads", "1", "--distinct"]
    proc = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["benchmark"] == "serve_bounds" and out["budget_bytes"] == 600000
    ends = ("answered", "refused", "too_big", "disconnected", "lost")
    assert sum(out[k] for k in ends) == out["requests"] == 6
    assert out["lost"] == 0 and out["too_big"] == 0 and out["answered"] >= 1
    assert out["peak_used_bytes"] <= out["budget_bytes"] and out["within_budget"] is True
    assert out["peak_over_budget"] == round(out["peak_used_bytes"] / out["budget_bytes"], 3)
    assert out["overruns"] == 0 and out["idle_after_s"] is not None
    assert out["kv_released_after_s"] is not None
