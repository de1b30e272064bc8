"""`RemoteBackend`: the Backend protocol over an OpenAI-compatible server.

Everything runs on 127.0.0.1: `branchwise serve` over the tiny model in a thread, and, for fault
injection, a stdlib proxy in front of it that follows a script per request (drop the connection
without answering, answer 500 or 429, stall past the client's timeout, or forward). It can also
pose as a vLLM-like server (``owned_by`` not branchwise, no branchwise extensions) to exercise the
standard OpenAI paths.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from branchwise.backends.accel import Accel, CGEEConfig, RiverConfig  # noqa: E402
from branchwise.backends.base import Backend, DecodeParams  # noqa: E402
from branchwise.backends.remote import (  # noqa: E402
    RemoteBackend,
    RemoteCapabilityError,
    RemoteError,
    UnsupportedOnRemote,
)
from branchwise.reasoners import Reasoner  # noqa: E402
from branchwise.strategies import PREBUILT  # noqa: E402

QUESTION = "What is 12 + 7?"


# --------------------------------------------------------------------------------------------------
# Same tokens as the local backend
# --------------------------------------------------------------------------------------------------


def test_remote_is_a_backend_and_tokenizes_like_the_local_one(served: str, tiny_backend: Any) -> None:
    remote = RemoteBackend(served)
    assert isinstance(remote, Backend)
    assert remote.model_name == "tiny" and remote.branchwise_server
    msgs = [{"role": "user", "content": QUESTION}]
    assert remote.chat_prompt(msgs) == tiny_backend.chat_prompt(msgs)
    assert remote.encode(QUESTION) == tiny_backend.encode(QUESTION)
    assert remote.decode(remote.encode(QUESTION)) == QUESTION


@pytest.mark.parametrize(
    ("name", "knobs"),
    [
        ("self-consistency", {"branches": 4, "temperature": 0.0, "tokens": 12}),
        ("self-consistency", {"branches": 4, "temperature": 0.8, "tokens": 12, "seed": 5}),
        ("beam-search", {"branches": 4, "temperature": 0.0, "tokens": 6}),
        ("rebase", {"branches": 4, "temperature": 0.0, "tokens": 6}),
        ("ets", {"branches": 4, "temperature": 0.0, "tokens": 6}),
    ],
)
def test_strategies_give_the_local_tokens(
    served: str, tiny_backend: Any, name: str, knobs: dict[str, Any]
) -> None:
    strategy = PREBUILT[name](**knobs)
    local = Reasoner(strategy, backend=tiny_backend).run(QUESTION)
    remote = Reasoner(strategy, backend=RemoteBackend(served)).run(QUESTION)
    assert [b.text for b in remote.branches] == [b.text for b in local.branches]
    assert [b.n_tokens for b in remote.branches] == [b.n_tokens for b in local.branches]
    assert remote.answer == local.answer
    assert remote.votes == pytest.approx(local.votes, rel=1e-4)  # confidence-weighted: float noise
    for r, lo in zip(remote.branches, local.branches, strict=True):
        assert r.scores == pytest.approx(lo.scores, rel=1e-3, abs=1e-6)
        assert r.selected == lo.selected


def test_tree_ops_keep_the_protocol(served: str) -> None:
    remote = RemoteBackend(served)
    root = remote.prefill(remote.encode("The answer is"))
    kids = remote.fork(root, 2)
    with pytest.raises(ValueError, match="live children"):
        remote.append([root], [[5]])
    gens = remote.extend(kids, DecodeParams(max_tokens=3))
    assert [g.node for g in gens] == kids
    assert remote.tokens(kids[0]) == remote.encode("The answer is") + gens[0].token_ids
    probs = remote.score_next(kids, [7], [5, 6])
    assert len(probs) == 2 and all(0.0 < p < 1.0 for row in probs for p in row)
    remote.release([root, *kids])
    assert remote.kv_stats().live_nodes == 0
    with pytest.raises(KeyError, match="not live"):
        remote.tokens(root)


def _heard(steps: list[Any], rows: int) -> tuple[list[list[int]], dict[int, Any]]:
    """Each row's tokens as a listener heard them, and the rows it heard end (each once)."""
    tokens: list[list[int]] = [[] for _ in range(rows)]
    ended: dict[int, Any] = {}
    for step in steps:
        for i, ids in step.tokens.items():
            assert i not in ended, "tokens after the row ended"
            tokens[i].extend(ids)
        for i, gen in step.finished.items():
            assert i not in ended, "a row ended twice"
            ended[i] = gen
    return tokens, ended


def test_extend_tells_a_listener_each_request_whole(served: str) -> None:
    """A branchwise server's streamed chunks carry no token ids: a listener hears each row's tokens
    whole, when its request is answered, and every row ends once."""
    remote = RemoteBackend(served)
    a = remote.prefill(remote.encode("The answer is"))
    b = remote.prefill(remote.encode("Count to five:"))
    kids = remote.fork(a, 2)
    steps: list[Any] = []
    gens = remote.extend([kids[0], b, kids[1]], DecodeParams(max_tokens=4), on_step=steps.append)
    tokens, ended = _heard(steps, 3)
    assert sorted(ended) == [0, 1, 2] and all(ended[i] is gens[i] for i in ended)
    assert tokens == [g.token_ids for g in gens]
    for step in steps:  # whole: a row's tokens come in the step that ends it
        assert set(step.tokens) <= set(step.finished)
    assert remote.tokens(b)[-4:] == gens[1].token_ids  # the tree grew
    remote.release([a, b, *kids])


def test_a_listened_extend_streams_tokens_as_vllm_sends_them(served: str) -> None:
    """On a vLLM-like server a listener hears tokens as they are streamed: the same tokens, text and
    log-probabilities as the unstreamed reply, row by row, and the tree grows by them."""
    with FaultProxy(served, [], vllm=True) as proxy:
        remote = RemoteBackend(proxy.url)
        prompt = remote.encode("The answer is")
        params = DecodeParams(max_tokens=6, min_tokens=6)
        root = remote.prefill(prompt)
        (whole,) = remote.extend([root], params)
        other = remote.prefill(remote.encode("Count to five:"))
        kids = remote.fork(remote.prefill(prompt), 2)
        steps: list[Any] = []
        gens = remote.extend([kids[0], other, kids[1]], params, on_step=steps.append)
        tokens, ended = _heard(steps, 3)
        assert sorted(ended) == [0, 1, 2] and tokens == [g.token_ids for g in gens]
        assert sum(1 for s in steps if s.tokens.get(0)) > 1, "row 0's tokens came in one piece"
        for g in (gens[0], gens[2]):  # greedy: one request, copied to both rows
            assert g.token_ids == whole.token_ids and g.text == whole.text
            assert g.logprobs == pytest.approx(whole.logprobs, abs=1e-5)
        assert remote.tokens(kids[0]) == [*prompt, *whole.token_ids]
        assert remote.kv_stats().forward_calls == 3


def _aborted(proxy: FaultProxy, wait_s: float = 10.0) -> int:
    """The proxy's count of streams their client closed, once one is seen (or `wait_s` passed)."""
    deadline = time.monotonic() + wait_s
    while not proxy.aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    return proxy.aborted


def test_rows_a_listener_stops_close_their_stream(served: str) -> None:
    """Rows the listener gives back end "cancelled" with the tokens heard so far; once a request's
    rows are all stopped its stream is closed (the server aborts it), and its node does not grow."""
    with FaultProxy(served, [], vllm=True, chunk_delay_s=0.05) as proxy:
        remote = RemoteBackend(proxy.url)
        a = remote.prefill(remote.encode("The answer is"))
        b = remote.prefill(remote.encode("Count to five:"))
        steps: list[Any] = []

        def listen(step: Any) -> list[int]:
            steps.append(step)
            return [0] if step.tokens.get(0) else []

        gens = remote.extend([a, b], DecodeParams(max_tokens=12, min_tokens=12), on_step=listen)
        assert gens[0].finish_reason == "cancelled" and 0 < len(gens[0].token_ids) < 12
        assert gens[1].finish_reason == "length" and len(gens[1].token_ids) == 12
        assert len(remote.tokens(a)) == len(remote.encode("The answer is"))
        assert not any(0 in s.finished for s in steps)
        assert _aborted(proxy) == 1


def test_admitted_rows_decode_beside_the_running_ones_with_their_own_params(served: str) -> None:
    """Continuous batching through a remote server: `admit` is asked while rows decode, and what it
    hands in goes out at once, numbered after the others, with its own parameters."""
    with FaultProxy(served, [], vllm=True, chunk_delay_s=0.02) as proxy:
        remote = RemoteBackend(proxy.url)
        first = remote.prefill(remote.encode("The answer is"))
        late = remote.prefill(remote.encode("Count to five:"))
        asked: list[int] = []

        def admit(alive: int) -> list[Any]:
            asked.append(alive)
            return [(late, DecodeParams(max_tokens=3, min_tokens=3))] if len(asked) == 1 else []

        steps: list[Any] = []
        gens = remote.extend(
            [first], DecodeParams(max_tokens=8, min_tokens=8), on_step=steps.append, admit=admit
        )
        assert asked[0] == 1 and len(asked) > 1
        assert [len(g.token_ids) for g in gens] == [8, 3]
        assert [g.node for g in gens] == [first, late]
        tokens, ended = _heard(steps, 2)
        assert sorted(ended) == [0, 1] and tokens == [g.token_ids for g in gens]
        (alone,) = remote.extend(
            [remote.prefill(remote.encode("Count to five:"))], DecodeParams(max_tokens=3)
        )
        assert gens[1].token_ids == alone.token_ids


def test_accelerations_that_need_the_model_raise_clearly(served: str) -> None:
    remote = RemoteBackend(served)
    with pytest.raises(UnsupportedOnRemote, match="River"):
        remote.accel = Accel(river=RiverConfig())
    reasoner = Reasoner(
        PREBUILT["best-of-n"](branches=2, tokens=4), backend=remote, accel=Accel(cgee=CGEEConfig(level2=True))
    )
    with pytest.raises(UnsupportedOnRemote, match="CGEE level 2"):
        reasoner.run(QUESTION)
    level1 = Accel(cgee=CGEEConfig())  # level 1 alone (level 2 is off by default)
    assert not level1.cgee.level2
    result = Reasoner(PREBUILT["best-of-n"](branches=2, tokens=4), backend=remote, accel=level1).run(QUESTION)
    assert result.verify_calls == 1


# --------------------------------------------------------------------------------------------------
# Fault injection
# --------------------------------------------------------------------------------------------------


class FaultProxy:
    """A proxy to `upstream` that answers request k with ``script[k]`` (then "ok" forever).

    "drop": close the connection without a response; "500"/"429": that status (429 with
    ``Retry-After: retry_after``); "stall": wait `stall_s` before forwarding; "ok": forward. With
    `vllm=True` it lists the model as not owned by branchwise, so `RemoteBackend` uses the standard
    paths, and streams a completion asked with ``stream`` as vLLM does (a chunk per token, its id
    in ``logprobs``; `chunk_delay_s` apart); `strip_logprobs` removes the log-probabilities from
    completion replies. `aborted` counts streams whose client left before the end. While `hold` is
    set to an unset event, a stream stops halfway until the event is set, or for 10 s (a test that
    must see the text arrive in parts sets it once the first part has reached it).
    """

    def __init__(
        self,
        upstream: str,
        script: list[str],
        *,
        vllm: bool = False,
        stall_s: float = 2.0,
        retry_after: str = "0",
        strip_logprobs: bool = False,
        chunk_delay_s: float = 0.0,
    ) -> None:
        self.upstream, self.script, self.vllm, self.stall_s = upstream, list(script), vllm, stall_s
        self.retry_after, self.strip_logprobs, self.chunk_delay_s = retry_after, strip_logprobs, chunk_delay_s
        self.seen: list[str] = []
        self.hold: threading.Event | None = None
        self.aborted = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self._handle(None)

            def do_POST(self) -> None:
                self._handle(self.rfile.read(int(self.headers.get("content-length", 0))))

            def _handle(self, body: bytes | None) -> None:
                with proxy.lock:
                    action = proxy.script.pop(0) if proxy.script and self.path != "/v1/models" else "ok"
                    proxy.seen.append(f"{self.path}:{action}")
                if action == "drop":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if action in ("500", "429"):
                    self._reply(
                        int(action), b'{"error": {"message": "injected"}}', {"Retry-After": proxy.retry_after}
                    )
                    return
                if action == "stall":
                    time.sleep(proxy.stall_s)
                url = proxy.upstream + self.path
                kind = {"Content-Type": self.headers.get("content-type", "application/json")}
                stream = False
                if body is not None and proxy.vllm and self.path == "/v1/completions":
                    asked = json.loads(body)
                    stream = bool(asked.pop("stream", False))
                    body = json.dumps(asked).encode()
                r = (
                    httpx.get(url)
                    if body is None
                    else httpx.post(url, content=body, headers=kind, timeout=60)
                )
                data = r.content
                if proxy.vllm and self.path == "/v1/models":
                    models = r.json()
                    for m in models["data"]:
                        m["owned_by"] = "vllm"
                    data = json.dumps(models).encode()
                if proxy.strip_logprobs and self.path == "/v1/completions":
                    reply = r.json()
                    for choice in reply["choices"]:
                        choice["logprobs"] = None
                    data = json.dumps(reply).encode()
                if stream and r.status_code == 200:
                    self._stream(json.loads(data)["choices"])
                    return
                self._reply(r.status_code, data, {})

            def _stream(self, choices: list[dict[str, Any]]) -> None:
                """vLLM's stream of a whole reply: a chunk per token, choices interleaved."""
                chunks = []
                for c in choices:
                    lp = c.get("logprobs") or {}
                    tokens = lp.get("tokens") or []
                    offsets = [*(lp.get("text_offset") or [0] * len(tokens)), len(c["text"])]
                    for k, token in enumerate(tokens):
                        piece = c["text"][offsets[k] : offsets[k + 1]] if lp.get("text_offset") else ""
                        top = (lp.get("top_logprobs") or [None] * len(tokens))[k]
                        part = {
                            "tokens": [token],
                            "token_logprobs": [lp["token_logprobs"][k]],
                            "top_logprobs": [top],
                        }
                        chunks.append((k, {"index": c["index"], "text": piece, "logprobs": part}))
                    end = {"index": c["index"], "text": "" if lp.get("text_offset") else c["text"]}
                    end.update(finish_reason=c["finish_reason"], stop_reason=c.get("stop_reason"))
                    chunks.append((len(tokens), end))
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.end_headers()
                try:
                    ordered = [part for _, part in sorted(chunks, key=lambda kc: kc[0])]
                    for k, part in enumerate(ordered):
                        if k == len(ordered) // 2 and proxy.hold is not None:
                            proxy.hold.wait(10)
                        self.wfile.write(f"data: {json.dumps({'choices': [part]})}\n\n".encode())
                        self.wfile.flush()
                        time.sleep(proxy.chunk_delay_s)
                    self.wfile.write(b"data: [DONE]\n\n")
                except OSError:  # the client closed the stream
                    with proxy.lock:
                        proxy.aborted += 1

            def _reply(self, status: int, data: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                with contextlib.suppress(OSError):  # the client timed out and left
                    self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def _client(url: str, **kwargs: Any) -> RemoteBackend:
    kwargs.setdefault("backoff_s", 0.01)
    return RemoteBackend(url, **kwargs)


def _ask(remote: RemoteBackend) -> str:
    root = remote.prefill(remote.encode("The answer is"))
    try:
        return remote.extend([root], DecodeParams(max_tokens=3))[0].text
    finally:
        remote.release([root])


def test_dropped_connections_500_and_429_are_retried(served: str) -> None:
    expected = _ask(RemoteBackend(served))
    with FaultProxy(served, ["ok", "drop", "500", "429", "ok"]) as proxy:
        remote = _client(proxy.url)
        assert _ask(remote) == expected  # encode ("ok"), then three failures before the answer
        assert remote.kv_stats().extra["retries"] == 3
        assert [s.split(":")[1] for s in proxy.seen[1:]] == ["ok", "drop", "500", "429", "ok"]


def test_retry_after_is_honoured(served: str) -> None:
    with FaultProxy(served, ["ok", "429"], retry_after="0.2") as proxy:
        remote = _client(proxy.url)  # backoff 0.01 s: only the server's Retry-After makes it 0.2
        _ask(remote)
        assert remote.kv_stats().extra["retries"] == 1
        assert remote.kv_stats().extra["retry_wait_s"] >= 0.2


def test_a_server_that_keeps_failing_raises_a_clear_error(served: str) -> None:
    with FaultProxy(served, ["ok", *["500"] * 10]) as proxy:
        remote = _client(proxy.url, max_attempts=3)
        with pytest.raises(RemoteError, match=r"failed 3 time\(s\).*HTTP 500"):
            _ask(remote)


def test_a_stalled_server_times_out_then_raises(served: str) -> None:
    with FaultProxy(served, ["ok", "stall", "stall", "stall"], stall_s=1.5) as proxy:
        remote = _client(proxy.url, timeout_s=0.3, max_attempts=2)
        with pytest.raises(RemoteError, match="ReadTimeout"):
            _ask(remote)


def test_a_dead_server_raises_after_bounded_attempts(served: str) -> None:
    with FaultProxy(served, []) as proxy:
        remote = _client(proxy.url, max_attempts=3)
    # the proxy is gone: nothing listens on its port any more
    with pytest.raises(RemoteError, match=r"failed 3 time\(s\).*ConnectError"):
        _ask(remote)


def test_bad_requests_are_not_retried(served: str) -> None:
    remote = _client(served)
    root = remote.prefill([10**9])
    with pytest.raises(RemoteError, match=r"HTTP 400.*prompt"):
        remote.extend([root], DecodeParams(max_tokens=2))
    assert "retries" not in remote.kv_stats().extra


# --------------------------------------------------------------------------------------------------
# A vLLM-like server: the standard OpenAI paths
# --------------------------------------------------------------------------------------------------


def test_standard_paths_on_a_server_without_branchwise_extensions(served: str, tiny_backend: Any) -> None:
    with FaultProxy(served, [], vllm=True) as proxy:
        remote = RemoteBackend(proxy.url)
        assert not remote.branchwise_server
        prompt = tiny_backend.encode("The answer is")
        root = remote.prefill(prompt)
        (gen,) = remote.extend([root], DecodeParams(max_tokens=4))
        local_root = tiny_backend.prefill(prompt)
        (local,) = tiny_backend.extend([local_root], DecodeParams(max_tokens=4))
        tiny_backend.release([local_root])
        assert gen.token_ids == local.token_ids and gen.text == local.text
        assert gen.logprobs == pytest.approx(local.logprobs, abs=1e-4)
        assert gen.top1_probs == pytest.approx(local.top1_probs, abs=1e-4)
        # the greedy token is the top-1 after the prompt: it is in the server's top-20 with its probability
        stem = remote.prefill(prompt[:-1])
        probs = remote.score_next([stem], prompt[-1:], [local.token_ids[0]])
        assert probs[0][0] == pytest.approx(local.top1_probs[0], abs=1e-4)
        remote.release([stem])
        remote.release([root])


def test_score_next_names_what_a_server_without_logprobs_lacks(served: str) -> None:
    with FaultProxy(served, [], vllm=True, strip_logprobs=True) as proxy:
        remote = RemoteBackend(proxy.url)
        root = remote.prefill([1, 2, 3])
        with pytest.raises(RemoteCapabilityError, match=r"no top log-probabilities.*--max-logprobs"):
            remote.score_next([root], [4], [5])


# --------------------------------------------------------------------------------------------------
# `branchwise run --endpoint`
# --------------------------------------------------------------------------------------------------


def test_cli_run_on_an_endpoint(served: str, tiny_backend: Any) -> None:
    from typer.testing import CliRunner

    from branchwise.cli import app

    runner = CliRunner()
    args = ["run", QUESTION, "--endpoint", served, "--n", "2", "--max-tokens", "6", "--temperature", "0"]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    remote_run = json.loads(result.output.strip().splitlines()[-1])
    strategy = PREBUILT["self-consistency"](branches=2, tokens=6, temperature=0.0, seed=0)
    local = Reasoner(strategy, backend=tiny_backend).run(QUESTION)
    assert [b["text"] for b in remote_run["branches"]] == [b.text for b in local.branches]

    refused = runner.invoke(app, [*args, "--river-threshold", "0.5"])
    assert refused.exit_code == 2 and "--endpoint" in refused.output and "River" in refused.output
    with FaultProxy(served, []) as proxy:
        dead = proxy.url
    unreachable = runner.invoke(app, ["run", QUESTION, "--endpoint", dead])
    assert unreachable.exit_code == 2 and "ConnectError" in unreachable.output


def _sse(lines: Iterator[str]) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_serve_in_front_of_a_vllm_like_server_streams_its_tokens(served: str) -> None:
    """``serve --endpoint``: a streamed chat reply through serve → RemoteBackend → a vLLM-like
    server comes in several chunks joining to the unstreamed reply (the server holds the second half
    of its stream until text from the first has reached the client, so a busy machine cannot merge
    it all into one delta); a client that leaves mid-stream has its upstream stream closed (the
    server aborts the request)."""
    from branchwise.serve import create_app
    from branchwise.serve.runner import serve_in_thread

    with FaultProxy(served, [], vllm=True, chunk_delay_s=0.02) as proxy:
        remote = RemoteBackend(proxy.url)
        with serve_in_thread(create_app(remote)) as front:
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": QUESTION}],
                "max_tokens": 10,
                "min_tokens": 10,
                "temperature": 0,
            }
            whole = httpx.post(f"{front}/v1/chat/completions", json=body, timeout=60).json()
            streamed = {**body, "stream": True}
            proxy.hold = threading.Event()
            with httpx.stream("POST", f"{front}/v1/chat/completions", json=streamed, timeout=60) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                events = []
                for line in lines:  # up to the first text
                    events += _sse(iter([line]))
                    if any(c["delta"].get("content") for e in events for c in e["choices"]):
                        break
                proxy.hold.set()
                events += _sse(lines)
            proxy.hold = None
            deltas = [c["delta"].get("content") or "" for e in events for c in e["choices"]]
            assert sum(1 for d in deltas if d) > 1
            assert "".join(deltas) == whole["choices"][0]["message"]["content"]

            proxy.chunk_delay_s = 0.1  # 60 chunks: 6 s of streaming, left after the first
            slow = {**body, "max_tokens": 60, "min_tokens": 60, "stream": True}
            with httpx.stream("POST", f"{front}/v1/chat/completions", json=slow, timeout=60) as r:
                next(line for line in r.iter_lines() if '"content"' in line)  # then leave
            assert _aborted(proxy) == 1
        remote.close()


def test_cli_serve_on_an_endpoint_refuses_local_model_options(served: str) -> None:
    from typer.testing import CliRunner

    from branchwise.cli import app

    result = CliRunner().invoke(app, ["serve", "--endpoint", served, "--dtype", "float32", "--port", "0"])
    assert result.exit_code == 2 and "--dtype" in result.output and "--endpoint" in result.output


# --------------------------------------------------------------------------------------------------
# `branchwise eval --endpoint ...`: problems spread over servers, resume exact when one dies
# --------------------------------------------------------------------------------------------------


def _eval_suite(tmp_path: Path, model: Path, problems: int) -> Any:
    from branchwise.evals.suite import SuiteConfig

    data = tmp_path / "arith.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
            for i in range(problems)
        )
    )
    return SuiteConfig.model_validate(
        {
            "name": "remote",
            "models": [str(model)],
            "datasets": [{"kind": "jsonl", "path": str(data), "label": "arith"}],
            "strategies": [
                {
                    "label": "sc2",
                    "prebuilt": "self_consistency",
                    "params": {"n": 2, "max_tokens": 4, "seed": 0},
                }
            ],
            "accelerations": [{"label": "exact", "reasoner": {"share": "exact"}}],
        }
    )


def _keys(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(r["cell"], r["problem_id"]) for r in rows]


def test_eval_survives_a_dying_endpoint_with_every_row_once(
    tmp_path: Path, served: str, tiny_llama_dir: Path
) -> None:
    from branchwise.evals.harness import read_rows, run_suite

    suite = _eval_suite(tmp_path, tiny_llama_dir, 8)
    local = run_suite(suite, tmp_path / "local", progress=False)
    # the second server answers a few requests, then fails for good (500 through every retry)
    with FaultProxy(served, ["ok"] * 4 + ["500"] * 1000) as dying:
        summary = run_suite(
            suite, tmp_path / "remote", progress=False, endpoints=[served, dying.url], workers_per_endpoint=2
        )
    rows = read_rows(tmp_path / "remote")
    assert summary.rows_written == local.rows_written == 8 and summary.errors == 0
    assert sorted(_keys(rows)) == sorted(_keys(read_rows(tmp_path / "local")))  # each row exactly once
    by_key = {(r["cell"], r["problem_id"]): r for r in read_rows(tmp_path / "local")}
    for row in rows:  # the remote runs decoded the local tokens
        assert row["text"] == by_key[(row["cell"], row["problem_id"])]["text"]


def test_eval_with_every_endpoint_down_keeps_its_rows_and_resumes_exactly(
    tmp_path: Path, served: str, tiny_llama_dir: Path
) -> None:
    from branchwise.evals.harness import EndpointsUnavailable, read_rows, run_suite

    suite = _eval_suite(tmp_path, tiny_llama_dir, 6)
    out = tmp_path / "run"
    with (
        FaultProxy(served, ["ok"] * 6 + ["500"] * 1000) as failing,
        pytest.raises(EndpointsUnavailable, match="rerun the same command"),
    ):
        run_suite(suite, out, progress=False, endpoints=[failing.url], workers_per_endpoint=1)
    partial = read_rows(out)
    assert 0 < len(partial) < 6 and len(set(_keys(partial))) == len(partial)
    resumed = run_suite(suite, out, progress=False, endpoints=[served])
    rows = read_rows(out)
    assert resumed.rows_skipped == len(partial) and len(rows) == 6 == len(set(_keys(rows)))


def test_eval_cli_takes_endpoints(tmp_path: Path, served: str, tiny_llama_dir: Path) -> None:
    from typer.testing import CliRunner

    from branchwise.cli import app

    suite = _eval_suite(tmp_path, tiny_llama_dir, 2)
    path = tmp_path / "suite.json"
    path.write_text(suite.model_dump_json())
    args = ["eval", str(path), "--out", str(tmp_path / "run"), "--no-progress", "--no-report"]
    result = CliRunner().invoke(app, [*args, "--endpoint", served, "--endpoint-workers", "2"])
    assert result.exit_code == 0, result.output
    assert "2 rows written" in result.output
    bad = CliRunner().invoke(app, [*args, "--endpoint", served, "--endpoint-workers", "0"])
    assert bad.exit_code == 2 and "0 is not in the range 1<=x<=1024" in bad.output


# --------------------------------------------------------------------------------------------------
# Typed answers and tool calls travel to the server
# --------------------------------------------------------------------------------------------------


def test_tool_votes_over_a_remote_backend_equal_the_local_ones(served: str, tiny_backend: Any) -> None:
    """The tools reach the prompt and the grammar reaches the server (branchwise serve's
    ``branchwise.constraint``): the remote run's calls and votes are the local run's."""

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    strategy = PREBUILT["self-consistency"](branches=3, temperature=0.0, tokens=300)
    kwargs = {"tools": [add], "tool_choice": "required", "parallel_tool_calls": False}
    local = Reasoner(strategy, backend=tiny_backend, **kwargs).run(QUESTION)
    remote = Reasoner(strategy, backend=RemoteBackend(served), **kwargs).run(QUESTION)
    assert remote.tool_calls and remote.tool_calls[0].name == "add"
    assert [b.text for b in remote.branches] == [b.text for b in local.branches]
    assert remote.answer == local.answer and remote.votes == local.votes


def test_constraints_in_vllms_structured_outputs_field() -> None:
    from branchwise.backends.remote_wire import structured_outputs
    from branchwise.constraints import Constraint

    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    assert structured_outputs(Constraint.of_json_schema(schema)) == {"json": schema}
    assert structured_outputs(Constraint.of_json_object()) == {"json_object": True}
    assert structured_outputs(Constraint.of_regex("[ab]+")) == {"regex": "[ab]+"}
    assert structured_outputs(Constraint.of_choice(["a", "b"])) == {"choice": ["a", "b"]}
    tools = [{"type": "function", "function": {"name": "add", "parameters": schema}}]
    tag = json.loads(structured_outputs(Constraint.of_tools(tools, "required"))["structural_tag"])
    assert tag["type"] == "structural_tag" and "add" in json.dumps(tag)


# --------------------------------------------------------------------------------------------------
# Several endpoints: prefix affinity, the round-robin baseline, failover
# --------------------------------------------------------------------------------------------------

AFFINITY_QUESTIONS = [f"What is {i} + {i + 3}?" for i in range(6)]


def _completions(proxy: FaultProxy) -> int:
    return sum(s.startswith("/v1/completions") for s in proxy.seen)


def _beam() -> Any:
    from branchwise.strategies import beam_search

    return beam_search(width=4, depth=2, max_step_tokens=4, temperature=0.8, seed=3, verifier="confidence")


def test_affinity_sends_every_request_of_a_tree_to_one_endpoint(served: str) -> None:
    """A step search sends many requests per question; all of one question's land on one server,
    and the questions spread over both. The results are those of one server."""
    single = RemoteBackend(served)
    with FaultProxy(served, []) as a, FaultProxy(served, []) as b:
        remote = RemoteBackend([a.url, b.url])
        assert remote.endpoints == [a.url, b.url] and remote.base_url == a.url
        used = set()
        for question in AFFINITY_QUESTIONS:
            before = (_completions(a), _completions(b))
            result = Reasoner(_beam(), backend=remote).run(question)
            sent = (_completions(a) - before[0], _completions(b) - before[1])
            assert sum(sent) > 2 and 0 in sent, sent  # several requests, one endpoint
            used.add(sent.index(0))
            expected = Reasoner(_beam(), backend=single).run(question)
            assert [x.text for x in result.branches] == [x.text for x in expected.branches]
        assert used == {0, 1}  # the trees spread over both endpoints
        # the route is a stable function of the root tokens: a new client picks the same endpoints
        again = RemoteBackend([b.url, a.url])
        for question in AFFINITY_QUESTIONS:
            ids = remote.encode(question)
            assert again.endpoint_for(again.prefill(ids)) == remote.endpoint_for(remote.prefill(ids))


def test_without_affinity_requests_go_round_robin(served: str) -> None:
    with FaultProxy(served, []) as a, FaultProxy(served, []) as b:
        remote = RemoteBackend([a.url, b.url], affinity=False)
        Reasoner(_beam(), backend=remote).run(AFFINITY_QUESTIONS[0])
        assert _completions(a) > 0 and _completions(b) > 0
        assert abs(_completions(a) - _completions(b)) <= 1
        assert remote.endpoint_for(remote.prefill([1, 2])) is None


def test_a_failing_endpoint_moves_its_tree_to_another(served: str) -> None:
    """The tree's endpoint fails through every retry: the request goes to the other endpoint, and
    so do the tree's later requests (no retries wasted on the failed one)."""
    single = RemoteBackend(served)
    ids = single.encode("The answer is")
    with FaultProxy(served, ["500"] * 1000) as failing, FaultProxy(served, []) as healthy:
        remote = _client([failing.url, healthy.url], max_attempts=2)
        # a prompt whose tree ranks the failing endpoint first (the rank is a hash of the tokens)
        prompt = next(
            [*ids, *extra]
            for extra in ([], *([k] for k in range(100, 200)))
            if remote.endpoint_for(remote.prefill([*ids, *extra])) == failing.url
        )
        root = remote.prefill(prompt)
        assert remote.endpoint_for(root) == failing.url
        (gen,) = remote.extend(remote.fork(root, 1), DecodeParams(max_tokens=3))
        single_root = single.prefill(prompt)
        assert gen.token_ids == single.extend([single_root], DecodeParams(max_tokens=3))[0].token_ids
        stats = remote.kv_stats().extra
        assert stats["failovers"] == 1 and stats["retries"] == 1  # two attempts on the failing one
        assert remote.endpoint_for(root) == healthy.url
        tried = _completions(failing)
        kids = remote.fork(root, 2)
        remote.extend(kids, DecodeParams(max_tokens=2, temperature=0.5, seed=1))
        assert _completions(failing) == tried and remote.kv_stats().extra["failovers"] == 1


def test_every_endpoint_failing_raises_naming_each(served: str) -> None:
    from branchwise.backends.remote import RemoteUnavailable

    with FaultProxy(served, ["500"] * 1000) as a, FaultProxy(served, ["500"] * 1000) as b:
        remote = _client([a.url, b.url], max_attempts=2)
        with pytest.raises(RemoteUnavailable, match=r"every endpoint failed.*HTTP 500.*; .*HTTP 500") as err:
            _ask(remote)
        assert a.url in str(err.value) and b.url in str(err.value)


def test_an_endpoint_down_at_start_is_passed_over(served: str) -> None:
    with FaultProxy(served, []) as gone:
        dead = gone.url
    remote = _client([dead, served], max_attempts=2)
    assert remote.model_name == "tiny"
    assert _ask(remote) == _ask(RemoteBackend(served))
    with pytest.raises(RemoteError, match="ConnectError"):
        _client([dead], max_attempts=2)


def test_cli_run_on_two_endpoints(served: str) -> None:
    from typer.testing import CliRunner

    from branchwise.cli import app

    with FaultProxy(served, []) as a, FaultProxy(served, []) as b:
        args = ["run", QUESTION, "--n", "2", "--max-tokens", "4", "--temperature", "0", "--json"]
        result = CliRunner().invoke(app, [*args, "--endpoint", a.url, "--endpoint", b.url])
        assert result.exit_code == 0, result.output
        assert _completions(a) + _completions(b) >= 1
        assert json.loads(result.output.strip().splitlines()[-1])["answer"] is not None
