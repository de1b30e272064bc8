"""`branchwise serve`: the OpenAI-compatible server over the shared scheduler.

Every server runs on 127.0.0.1 on a free port (`serve_in_thread`), started by a fixture and shut
down at its end. The tiny random model replies gibberish, which is fine: the tests compare the
server's tokens with the local backend's, not with any expected wording. Queue-full and disconnect
tests use a fake backend whose `extend` waits on a gate, so "the worker is busy" is a state the
test sets, not a timing it hopes for.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from testkit import GatedBackend, wait_until  # noqa: E402

from branchwise.backends.base import DecodeParams, DecodeStep, Generation  # noqa: E402
from branchwise.serve import create_app  # noqa: E402
from branchwise.serve.runner import serve_in_thread  # noqa: E402

MSGS = [{"role": "user", "content": "What is 12 + 7?"}]


@pytest.fixture
def client(served: str) -> Any:
    return openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0, timeout=60)


def local_greedy(backend: Any, prompt: list[int], n: int, max_tokens: int) -> list[Generation]:
    """What the backend decodes in-process for the same request."""
    root = backend.prefill(prompt)
    kids = backend.fork(root, n)
    backend.release([root])
    try:
        return backend.extend(kids, DecodeParams(max_tokens=max_tokens))
    finally:
        backend.release(kids)


# --------------------------------------------------------------------------------------------------
# The OpenAI client
# --------------------------------------------------------------------------------------------------


def test_chat_n_choices_usage_and_logprobs(client: Any, tiny_backend: Any) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, n=3, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    prompt = tiny_backend.chat_prompt(MSGS)
    local = local_greedy(tiny_backend, prompt, 3, 6)
    assert [c.message.content for c in r.choices] == [g.text for g in local]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == len(prompt)  # counted once for all n choices
    assert r.usage.completion_tokens == sum(len(g.token_ids) for g in local)
    for choice, g in zip(r.choices, local, strict=True):
        content = choice.logprobs.content
        assert [e.logprob for e in content] == pytest.approx(g.logprobs, abs=1e-4)
        for entry in content:
            assert len(entry.top_logprobs) == 3
            tops = [t.logprob for t in entry.top_logprobs]
            assert tops == sorted(tops, reverse=True)
            # greedy: the chosen token is the most likely one
            assert entry.top_logprobs[0].token == entry.token
            assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)


def test_completions_on_token_ids_with_logprobs_and_details(client: Any, tiny_backend: Any) -> None:
    prompt = tiny_backend.encode("The answer is")
    r = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={"return_tokens_as_token_ids": True, "branchwise": {"details": True}},
    )
    (g,) = local_greedy(tiny_backend, prompt, 1, 5)
    choice = r.choices[0]
    assert choice.text == g.text
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in g.token_ids]
    assert all(len(row) == 2 for row in choice.logprobs.top_logprobs)
    details = choice.model_extra["branchwise"]
    assert details["token_ids"] == g.token_ids and details["finish_reason"] == g.finish_reason


@pytest.mark.parametrize("n", [1, 3])
def test_streaming_yields_the_non_streamed_text(client: Any, n: int) -> None:
    kwargs: dict[str, Any] = {"model": "tiny", "n": n, "max_tokens": 12, "temperature": 0}
    whole = client.chat.completions.create(messages=MSGS, **kwargs)
    streamed: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in client.chat.completions.create(
        messages=MSGS, stream=True, stream_options={"include_usage": True}, **kwargs
    ):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert streamed == {c.index: c.message.content for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert usage is not None and usage.total_tokens == whole.usage.total_tokens

    text_whole = client.completions.create(prompt="What is", **kwargs)
    text_streamed: dict[int, str] = {}
    for chunk in client.completions.create(prompt="What is", stream=True, **kwargs):
        for c in chunk.choices:
            text_streamed[c.index] = text_streamed.get(c.index, "") + c.text
    assert text_streamed == {c.index: c.text for c in text_whole.choices}


def _stream_chat(client: Any, **kwargs: Any) -> tuple[dict[int, list[str]], dict[int, str]]:
    """Each choice's content deltas and finish reason, read with the OpenAI client's stream."""
    deltas: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            if c.delta.content:
                deltas.setdefault(c.index, []).append(c.delta.content)
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return deltas, finish


def test_streaming_cuts_at_stop_strings_like_the_whole_reply(client: Any) -> None:
    """Stop strings taken from the model's own output: the streamed deltas never show text the
    stop cuts, so they add up to the non-streamed (cut) text exactly, for n=2, chat and text."""
    kwargs: dict[str, Any] = {"model": "tiny", "max_tokens": 24, "temperature": 0}
    free = client.chat.completions.create(messages=MSGS, extra_body={"min_tokens": 24}, **kwargs)
    free = free.choices[0].message.content
    stops = [free[12:15], free[18:20]]  # one occurs mid-answer (an earlier one may come first)
    kwargs.update(n=2, stop=stops)
    whole = client.chat.completions.create(messages=MSGS, **kwargs)
    assert whole.choices[0].finish_reason == "stop" and len(whole.choices[0].message.content) <= 12
    deltas, finish = _stream_chat(client, messages=MSGS, **kwargs)
    assert {i: "".join(d) for i, d in deltas.items()} == {c.index: c.message.content for c in whole.choices}
    assert finish == {0: "stop", 1: "stop"}
    assert all(len(d) > 1 for d in deltas.values())  # several chunks, not one at the end

    text_whole = client.completions.create(prompt="What is", **kwargs)
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(prompt="What is", stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c.index: c.text for c in text_whole.choices}


def test_models_health_and_tokenize(served: str, tiny_backend: Any) -> None:
    models = httpx.get(f"{served}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    health = httpx.get(f"{served}/health").json()
    assert health["status"] == "ok" and health["queued_rows"] == 0
    assert health["batching"]["continuous"] is True  # the local backend admits into a running decode
    tokens = httpx.post(f"{served}/tokenize", json={"messages": MSGS}).json()["tokens"]
    assert tokens == tiny_backend.chat_prompt(MSGS)
    text = httpx.post(f"{served}/detokenize", json={"tokens": tokens[:5]}).json()["prompt"]
    assert text == tiny_backend.decode(tokens[:5])


def test_concurrent_requests_share_decode_passes(served: str, tiny_backend: Any) -> None:
    """8 concurrent greedy requests: each gets its own serial answer, in fewer than 8 decodes."""
    prompts = [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(8)]
    before = httpx.get(f"{served}/health").json()["batching"]["extend_calls"]
    barrier = threading.Barrier(8)
    replies: dict[int, str] = {}

    def ask(i: int) -> None:
        barrier.wait()
        body = {"messages": prompts[i], "max_tokens": 8, "temperature": 0, "n": 2}
        replies[i] = httpx.post(f"{served}/v1/chat/completions", json=body, timeout=60).json()["choices"][1][
            "message"
        ]["content"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i in range(8):
        assert replies[i] == local_greedy(tiny_backend, tiny_backend.chat_prompt(prompts[i]), 1, 8)[0].text
    after = httpx.get(f"{served}/health").json()["batching"]["extend_calls"]
    assert after - before < 8


# --------------------------------------------------------------------------------------------------
# The strategy extension
# --------------------------------------------------------------------------------------------------


def test_strategy_extension_matches_a_local_run(client: Any, tiny_backend: Any) -> None:
    from branchwise.reasoners import Reasoner
    from branchwise.strategies import PREBUILT

    r = client.chat.completions.create(
        model="tiny",
        messages=MSGS,
        temperature=0.8,
        seed=3,
        extra_body={"branchwise": {"strategy": "self-consistency", "branches": 4, "tokens": 10}},
    )
    ext = r.model_extra["branchwise"]
    strategy = PREBUILT["self-consistency"](branches=4, temperature=0.8, tokens=10, seed=3)
    local = Reasoner(strategy, backend=tiny_backend).run(MSGS[0]["content"])
    assert ext["answer"] == local.answer and ext["votes"] == local.votes
    assert [b["text"] for b in ext["branches"]] == [b.text for b in local.branches]
    assert {"tokens_computed", "peak_bytes"} <= set(ext["kv_stats"])
    assert r.choices[0].message.content in {b.text for b in local.branches}


def test_strategy_reply_carries_the_run_notes(served: str, tiny_backend: Any) -> None:
    """An acceleration that never acted says so in the run's notes, and the server passes them on
    (``branchwise.notes``, which OpenAI clients ignore)."""
    from branchwise.backends.accel import Accel, ASKSConfig

    body = {"messages": MSGS, "branchwise": {"strategy": "self-consistency", "branches": 2, "tokens": 4}}
    tiny_backend.accel = Accel(asks=ASKSConfig())  # one prompt: ASKS's gate never runs
    try:
        r = httpx.post(f"{served}/v1/chat/completions", json=body, timeout=120)
    finally:
        tiny_backend.accel = Accel()
    assert r.status_code == 200, r.text
    notes = r.json()["branchwise"]["notes"]
    assert any(n.startswith("asks: no fork met a differently phrased prompt") for n in notes), notes


def test_strategy_spec_is_accepted_and_bad_ones_are_400(served: str) -> None:
    from branchwise.strategies import self_consistency

    spec = self_consistency(n=2, max_tokens=4).model_dump(mode="json")
    body = {"messages": MSGS, "branchwise": {"strategy": spec}}
    ok = httpx.post(f"{served}/v1/chat/completions", json=body, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["branchwise"]["branches"]) == 2
    bad = httpx.post(f"{served}/v1/chat/completions", json={**body, "branchwise": {"strategy": "nope"}})
    assert bad.status_code == 400 and "self-consistency" in bad.json()["error"]["message"]


# --------------------------------------------------------------------------------------------------
# Bad requests
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        ("chat/completions", b"{not json", "body", "malformed JSON"),
        ("chat/completions", b"[1, 2]", "body", "an object"),
        ("chat/completions", {"messages": MSGS, "n": 0}, "n", "greater than or equal to 1"),
        ("chat/completions", {"messages": MSGS, "n": 1000}, "n", "less than or equal to 128"),
        ("chat/completions", {"messages": MSGS, "temperature": 3}, "temperature", "less than or equal to 2"),
        ("chat/completions", {"messages": MSGS, "top_p": 0}, "top_p", "greater than 0"),
        ("chat/completions", {"messages": MSGS, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ("chat/completions", {"messages": MSGS, "seed": -1}, "seed", "greater than or equal to 0"),
        ("chat/completions", {"messages": MSGS, "top_logprobs": 2}, "top_logprobs", "logprobs=true"),
        ("chat/completions", {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
        ("chat/completions", {"n": 1}, "messages", "Field required"),
        ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages", "'user'"),
        ("chat/completions", {"messages": MSGS, "branchwise": {"branches": 3}}, "branchwise", "strategy"),
        ("chat/completions", {"messages": MSGS, "n": 2, "branchwise": {"strategy": "dvts"}}, "n", "branches"),
        ("completions", {"prompt": [-1]}, "prompt", "greater than or equal to 0"),
        ("completions", {"prompt": [10**9]}, "prompt", "prompt"),
        ("completions", {"prompt": ["a", "b"]}, "prompt", "one prompt"),
        ("completions", {"prompt": "x", "logprobs": 50}, "logprobs", "less than or equal to 20"),
    ],
)
def test_bad_requests_get_400_naming_the_field(
    served: str, path: str, body: Any, param: str, says: str
) -> None:
    url = f"{served}/v1/{path}"
    r = (
        httpx.post(url, content=body, headers={"Content-Type": "application/json"})
        if isinstance(body, bytes)
        else httpx.post(url, json=body)
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err
    assert err["message"].startswith(param) or param == "body"


# --------------------------------------------------------------------------------------------------
# Queue bounds and disconnects (a gated fake backend)
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def gated() -> Iterator[tuple[str, GatedBackend, Any]]:
    backend = GatedBackend()
    app = create_app(backend, max_queued_rows=3, window_s=0.0)
    try:
        with serve_in_thread(app) as url:
            yield url, backend, app.state.scheduler
    finally:
        backend.gate.set()


def _post_in_thread(
    url: str, content: str, n: int, out: dict[str, Any], timeout: float = 60
) -> threading.Thread:
    def post() -> None:
        try:
            body = {"messages": [{"role": "user", "content": content}], "n": n}
            out[content] = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)
        except httpx.HTTPError as err:
            out[content] = err

    thread = threading.Thread(target=post)
    thread.start()
    return thread


def test_full_queue_answers_429_then_recovers(gated: tuple[str, GatedBackend, Any]) -> None:
    url, backend, scheduler = gated
    out: dict[str, Any] = {}
    first = _post_in_thread(url, "first", 1, out)
    assert backend.in_extend.wait(30)  # the worker is busy decoding "first"
    second = _post_in_thread(url, "second", 3, out)
    wait_until(lambda: scheduler.queued_rows() == 3, "3 branches wait")
    refused = httpx.post(f"{url}/v1/chat/completions", json={"messages": MSGS}, timeout=30)
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"
    assert "limit 3" in refused.json()["error"]["message"]
    backend.gate.set()
    for t in (first, second):
        t.join(30)
    assert out["first"].status_code == out["second"].status_code == 200
    assert len(out["second"].json()["choices"]) == 3
    assert scheduler.stats.rejected == 1


def test_a_disconnected_client_is_never_prefilled(gated: tuple[str, GatedBackend, Any]) -> None:
    url, backend, scheduler = gated
    out: dict[str, Any] = {}
    first = _post_in_thread(url, "first", 1, out)
    assert backend.in_extend.wait(30)
    quitter = _post_in_thread(url, "quitter", 2, out, timeout=0.5)  # gives up while queued
    quitter.join(30)
    assert isinstance(out["quitter"], httpx.TimeoutException)
    wait_until(lambda: scheduler.stats.cancelled == 1, "the server cancels the quitter's job")
    assert scheduler.queued_rows() == 0
    backend.gate.set()
    first.join(30)
    assert out["first"].status_code == 200
    assert backend.encode("quitter") not in backend.prefilled


# --------------------------------------------------------------------------------------------------
# Streaming as tokens are decoded (a fake backend that steps under the test's control)
# --------------------------------------------------------------------------------------------------

ANSWER = "Hello, streaming world"


class SteppingBackend(GatedBackend):
    """Decodes ANSWER, one character per step, telling `on_step` after each step; after the first
    step it waits until the test opens `gate`. Rows `on_step` gives back stop at once."""

    def __init__(self) -> None:
        super().__init__()
        self.decoded = threading.Event()
        self.stopped_at: dict[int, int] = {}  # row -> tokens it had when it was stopped

    def extend(self, nodes: Sequence[int], params: DecodeParams, on_step: Any = None) -> list[Generation]:
        self.in_extend.set()
        outs: list[list[int]] = [[] for _ in nodes]
        reasons: dict[int, str] = {}
        alive = set(range(len(nodes)))
        for k, ch in enumerate(ANSWER):
            for i in alive:
                outs[i].append(ord(ch))
            if k == len(ANSWER) - 1:
                reasons.update((i, "eos") for i in alive)
            finished = {i: self._gen(nodes[i], outs[i], "eos") for i in alive if i in reasons}
            drop = on_step(DecodeStep({i: outs[i][-1:] for i in alive}, finished)) if on_step else None
            alive -= set(reasons)
            for i in drop or []:
                if i in alive:
                    alive.discard(i)
                    reasons[i] = "cancelled"
                    self.stopped_at[i] = len(outs[i])
            if k == 0:
                assert self.gate.wait(30), "the test never opened the gate"
            if not alive:
                break
        self.decoded.set()
        return [self._gen(n, out, reasons[i]) for i, (n, out) in enumerate(zip(nodes, outs, strict=True))]

    def _gen(self, node: int, out: list[int], reason: str) -> Generation:
        return Generation(node, out, self.decode(out), [0.5] * len(out), [-0.7] * len(out), reason)  # type: ignore[arg-type]


@pytest.fixture
def stepping() -> Iterator[tuple[str, SteppingBackend, Any]]:
    backend = SteppingBackend()
    app = create_app(backend, window_s=0.0)
    try:
        with serve_in_thread(app) as url:
            yield url, backend, app.state.scheduler
    finally:
        backend.gate.set()


def _events(lines: Iterator[str]) -> Iterator[Any]:
    import json

    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line.removeprefix("data: "))


def test_stream_sends_tokens_while_the_batch_still_decodes(
    stepping: tuple[str, SteppingBackend, Any],
) -> None:
    url, backend, _ = stepping
    body = {"messages": MSGS, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as r:
        events = _events(r.iter_lines())
        first = next(e for e in events if e["choices"] and e["choices"][0]["delta"].get("content"))
        # the backend is still held in its first step: this chunk cannot have waited for the end
        assert first["choices"][0]["delta"]["content"] == "H" and not backend.decoded.is_set()
        backend.gate.set()
        rest = [first, *events]
    content = [
        (e["choices"][0]["index"], e["choices"][0]["delta"].get("content")) for e in rest if e["choices"]
    ]
    content = [(i, c) for i, c in content if c]
    assert {i: "".join(c for j, c in content if j == i) for i in (0, 1)} == {0: ANSWER, 1: ANSWER}
    assert [i for i, _ in content[:4]] == [0, 1, 0, 1]  # the choices interleave, step by step
    finishes = [e["choices"][0] for e in rest if e["choices"] and e["choices"][0]["finish_reason"]]
    assert [(c["index"], c["finish_reason"]) for c in finishes] == [(0, "stop"), (1, "stop")]
    assert rest[-1]["usage"]["completion_tokens"] == 2 * len(ANSWER)


def test_a_client_leaving_mid_stream_stops_its_branches(
    stepping: tuple[str, SteppingBackend, Any], caplog: pytest.LogCaptureFixture
) -> None:
    url, backend, scheduler = stepping
    caplog.set_level(logging.INFO, logger="branchwise.serve")
    body = {"prompt": "go", "n": 2, "stream": True, "max_tokens": 100}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
        first = next(e for e in _events(r.iter_lines()) if e["choices"][0]["text"])
        assert first["choices"][0]["text"] == "H"
    # the connection is closed while the backend still sits in its first step
    wait_until(lambda: scheduler.stats.cancelled == 1, "the server cancels the stream's job")
    backend.gate.set()
    assert backend.decoded.wait(30)
    assert backend.stopped_at == {0: 2, 1: 2}  # stopped at the next step, not after len(ANSWER)
    wait_until(lambda: not backend.prompts, "the branches are released")
    assert scheduler.idle()
    # docs/SERVING.md: each client that disconnects before its answer is one INFO line, no traceback
    gone = [r for r in caplog.records if "went away" in r.getMessage()]
    assert [(r.levelno, r.exc_info) for r in gone] == [(logging.INFO, None)], caplog.records


class SlowTextBackend(SteppingBackend):
    """A backend whose detokenizer blocks (as a remote backend's HTTP call does) while the test
    holds it: `decode` waits for `released` whenever the decode is held in its first step."""

    def __init__(self) -> None:
        super().__init__()
        self.in_decode = threading.Event()
        self.released = threading.Event()

    def decode(self, ids: Sequence[int]) -> str:
        if not self.gate.is_set() and ids:  # only the stream's text is computed meanwhile
            self.in_decode.set()
            assert self.released.wait(30), "the test never released the detokenizer"
        return super().decode(ids)


def test_a_blocking_detokenizer_never_stalls_the_server() -> None:
    """The stream's text is computed off the event loop: while its detokenizer blocks, the server
    still answers (with the old in-loop text, /health waited for the detokenizer)."""
    backend = SlowTextBackend()
    app = create_app(backend, window_s=0.0)
    body = {"prompt": "go", "stream": True, "max_tokens": 100}
    texts: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            texts.extend(e["choices"][0]["text"] for e in _events(r.iter_lines()) if e["choices"])

    try:
        with serve_in_thread(app) as url:
            client = threading.Thread(target=stream)
            client.start()
            assert backend.in_decode.wait(30), "the stream never detokenized its first step"
            health = httpx.get(f"{url}/health", timeout=10)
            assert health.status_code == 200 and health.json()["busy"]
            backend.released.set()
            backend.gate.set()
            client.join(60)
            assert not client.is_alive()
    finally:
        backend.released.set()
        backend.gate.set()
    assert "".join(texts) == ANSWER


# --------------------------------------------------------------------------------------------------
# SIGTERM drains (the real `branchwise serve` process)
# --------------------------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM")
def test_sigterm_finishes_in_flight_requests_then_exits(tiny_llama_dir: Path) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "branchwise", "serve", "--model", str(tiny_llama_dir), "--port", str(port)]
    cmd += ["--drain-timeout", "600"]  # a loaded shared CPU must not turn the drain into a cancel
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:

        def up() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return proc.poll() is not None  # died: stop waiting, the assert below says so

        wait_until(up, "the server answers /health", limit_s=60)
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        out: dict[str, Any] = {}

        def ask() -> None:
            body = {"messages": MSGS, "n": 2, "max_tokens": 150, "min_tokens": 150, "temperature": 0}
            out["r"] = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)

        thread = threading.Thread(target=ask)
        thread.start()
        wait_until(lambda: httpx.get(f"{url}/health", timeout=5).json()["busy"], "the request is decoding")
        proc.send_signal(signal.SIGTERM)
        thread.join(600)
        assert out["r"].status_code == 200
        assert out["r"].json()["usage"]["completion_tokens"] == 2 * 150
        assert proc.wait(60) == 0  # a clean drain is a clean exit (the signal is not re-raised)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_serve_command_rejects_bad_options_in_one_line() -> None:
    from typer.testing import CliRunner

    from branchwise.cli import app

    result = CliRunner().invoke(app, ["serve", "--port", "70000"])
    assert result.exit_code == 2
    assert "Invalid value for '--port': 70000 is not in the range 0<=x<=65535" in result.output


@pytest.mark.slow
def test_serve_load_benchmark_runs(embedded_dir: Path) -> None:
    """`benchmarks/serve_load.py` end to end, shrunk: no errors, and the overload burst is answered
    with 200 or 429 only (no speed is asserted: a benchmark measures, a test asserts behaviour)."""
    import json

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, str(root / "benchmarks" / "serve_load.py")]
    cmd += ["--clients", "4", "--requests", "1", "--serial", "2", "--max-tokens", "4", "--threads", "1"]
    cmd += ["--long-prompt", "600", "--long-clients", "2", "--long-requests", "1"]
    cmd += ["--kv-burst", "4", "--kv-burst-n", "2", "--kv-burst-tokens", "8"]
    cmd += ["--sigterm-burst", "4", "--sigterm-tokens", "8", "--drain-timeout", "5"]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["benchmark"] == "serve_load" and out["errors"] == 0
    assert out["config"]["quick"] is False and out["config"]["clients"] == 4 and out["seconds"] > 0
    assert out["requests"] == 4 and out["throughput_rps"]["serial"] > 0
    burst = out["overload"]
    assert burst["other"] == 0 and burst["ok"] + burst["rejected_429"] == burst["sent"]
    rss = out["rss_mb"]
    assert {"start", "after_warmup", "after_serial", "end", "peak"} <= set(rss)
    assert len(rss["after_concurrent"]) == 1 and rss["peak"] >= rss["start"] > 0
    long = out["long_request"]
    assert all(long[k]["errors"] == 0 for k in ("no_long", "with_long_chunked", "with_long_whole"))
    assert out["kv_burst"]["errors_other_than_429"] == 0
    assert out["sigterm"]["exit_code"] == 0 and out["sigterm"]["all_in_flight_answered"]
