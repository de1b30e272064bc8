"""`serve`'s per-request log lines (`serve/progress.py`): progress in tokens and branches while a
request decodes, and one line when it ends, whatever the ending (docs/SERVING.md, "Logs")."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from branchwise.backends.base import DecodeStep, Generation  # noqa: E402
from branchwise.serve import create_app  # noqa: E402
from branchwise.serve.progress import Progress  # noqa: E402
from branchwise.serve.runner import serve_in_thread  # noqa: E402


@pytest.fixture(scope="module")
def app(tiny_backend: Any) -> Iterator[tuple[str, Any]]:
    """A server over the tiny model whose requests say their progress at every step."""
    application = create_app(tiny_backend, model_name="tiny")
    application.state.server.progress_every_s = 0.0
    with serve_in_thread(application) as url:
        yield url, application


def _lines(caplog: pytest.LogCaptureFixture, rid: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if rid in r.getMessage()]


def test_a_request_logs_its_progress_and_one_last_line_with_its_usage(
    app: tuple[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    url, _ = app
    caplog.set_level(logging.INFO, logger="branchwise.serve")
    body = {"prompt": "Count with me: one two", "n": 3, "max_tokens": 6, "temperature": 0.0}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    lines = _lines(caplog, reply["id"])
    progress = [line for line in lines if "tokens decoded" in line]
    assert progress, lines
    counts = [int(m.group(1)) for m in (re.search(r": (\d+) tokens decoded", p) for p in progress) if m]
    assert counts == sorted(counts) and counts[-1] <= reply["usage"]["completion_tokens"]
    assert all("of 3 branches ended" in p for p in progress)
    last = [line for line in lines if "answered" in line]
    assert len(last) == 1, lines
    usage = reply["usage"]
    assert (
        f"{usage['prompt_tokens']} prompt tokens, {usage['completion_tokens']} completion tokens" in last[0]
    )
    assert "over 3 branches" in last[0] and "3 length" in last[0]
    assert "/v1/completions" in last[0] and "first token after" in last[0]


def test_a_streamed_request_logs_its_end_too(app: tuple[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    url, _ = app
    caplog.set_level(logging.INFO, logger="branchwise.serve")
    body = {"prompt": "Count: one two", "n": 2, "max_tokens": 4, "temperature": 0.0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: {")]
    rid = re.search(r'"id": "([^"]+)"', events[0])
    assert rid is not None
    lines = _lines(caplog, rid.group(1))
    last = [line for line in lines if "answered" in line]
    assert len(last) == 1 and "(streamed)" in last[0] and "8 completion tokens over 2 branches" in last[0]


def test_a_strategy_run_logs_its_end_with_the_tokens_its_branches_decoded(
    app: tuple[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    url, _ = app
    caplog.set_level(logging.INFO, logger="branchwise.serve")
    body = {
        "messages": [{"role": "user", "content": "What is 12 + 7?"}],
        "branchwise": {"strategy": "self-consistency", "branches": 2, "tokens": 4},
    }
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    (last,) = [line for line in _lines(caplog, reply["id"]) if "answered" in line]
    assert "(strategy self-consistency)" in last
    assert f"{reply['usage']['completion_tokens']} completion tokens (" in last


def test_a_cancelled_or_failed_job_says_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="branchwise.serve")

    async def run() -> None:
        loop = asyncio.get_running_loop()
        cancelled = Progress("r-cancelled", 5, 2, every_s=1e9)
        cancelled.on_step(DecodeStep({0: [1], 1: [2]}, {}))
        work: asyncio.Future[list[Generation]] = loop.create_future()
        work.add_done_callback(cancelled.ended)
        work.cancel()
        failed = Progress("r-failed", 5, 2, every_s=1e9)
        broken: asyncio.Future[list[Generation]] = loop.create_future()
        broken.add_done_callback(failed.ended)
        broken.set_exception(RuntimeError("the batch raised"))
        await asyncio.sleep(0)  # done callbacks run on the loop's next turn

    asyncio.run(run())
    said = {r.getMessage().split(":")[0]: r.getMessage() for r in caplog.records}
    assert (
        "cancelled after" in said["r-cancelled"]
        and "2 completion tokens over 2 branches" in said["r-cancelled"]
    )
    assert "failed (RuntimeError: the batch raised)" in said["r-failed"]
    assert not [r for r in caplog.records if "tokens decoded" in r.getMessage()]  # every_s not reached
