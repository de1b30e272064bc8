"""`branchwise serve`'s bounds: token ids, the model's context, and server-side strategy runs.

The tiny model has a 2,048-token context and a 512-token vocabulary. Each bad request is its own
test and is refused before anything is computed; the strategy tests check that a run whose client
left, or whose deadline passed, stops: `/health` is no longer busy and the backend holds no more
KV than before (both polled, bounded).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from testkit import Lines, wait_until  # noqa: E402

from branchwise.schema_limits import MAX_CHOICES, MAX_ENUM_VALUES, MAX_SCHEMA_DEPTH  # noqa: E402
from branchwise.serve import create_app  # noqa: E402
from branchwise.serve.errors import MAX_BODY_DEPTH  # noqa: E402
from branchwise.serve.runner import serve_in_thread  # noqa: E402

MSGS = [{"role": "user", "content": "What is 12 + 7?"}]
LONG_RUN = {"strategy": "self-consistency", "branches": 64, "tokens": 1900}
"""A strategy run of a minute or more on the tiny model (64 branches of up to 1,900 tokens)."""


def error(r: Any, status: int, param: str) -> str:
    """The error message, after checking the status, the JSON shape and the param it names."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return str(err["message"])


def chat(url: str, timeout: float = 60, **body: Any) -> Any:
    return httpx.post(f"{url}/v1/chat/completions", json={"messages": MSGS, **body}, timeout=timeout)


# ------------------------------------------------------------------ token ids


def test_detokenize_a_huge_id_is_400(served: str) -> None:
    message = error(httpx.post(f"{served}/detokenize", json={"tokens": [1, 2**70]}), 400, "tokens")
    assert message.startswith("tokens") and "[0, 512)" in message


def test_detokenize_an_id_past_the_vocabulary_is_400(served: str) -> None:
    message = error(httpx.post(f"{served}/detokenize", json={"tokens": [10**9]}), 400, "tokens")
    assert "[0, 512)" in message and str(10**9) in message


def test_a_token_prompt_past_the_vocabulary_is_400(served: str) -> None:
    r = httpx.post(f"{served}/v1/completions", json={"prompt": [5, 2**70], "max_tokens": 1})
    assert "[0, 512)" in error(r, 400, "prompt")


# ------------------------------------------------------------------ the model's context


def test_prompt_plus_max_tokens_over_the_context_is_400_naming_both(served: str, tiny_backend: Any) -> None:
    prompt = len(tiny_backend.chat_prompt(MSGS))
    message = error(chat(served, max_tokens=5000), 400, "max_tokens")
    assert f"({prompt} tokens)" in message and "(5000)" in message and "context of 2048 tokens" in message


def test_max_completion_tokens_over_the_context_is_400(served: str) -> None:
    message = error(chat(served, max_completion_tokens=2048), 400, "max_completion_tokens")
    assert "2048" in message


def test_a_prompt_over_the_context_is_400(served: str) -> None:
    r = httpx.post(f"{served}/v1/completions", json={"prompt": [5] * 3000, "max_tokens": 1})
    message = error(r, 400, "prompt")
    assert "3000 tokens" in message and "2048" in message


def test_over_the_context_carries_openais_code_which_dspy_acts_on(served: str) -> None:
    """OpenAI's ``context_length_exceeded`` code on both kinds of overflow: clients act on the code
    (DSPy raises `ContextWindowExceededError`, and `dspy.ReAct` then drops its oldest steps and goes
    on; a code-less 400 stopped the agent at its context's end)."""
    over_prompt = httpx.post(f"{served}/v1/completions", json={"prompt": [5] * 3000, "max_tokens": 1})
    over_budget = chat(served, max_tokens=5000)
    for r in (over_prompt, over_budget):
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    dspy = pytest.importorskip("dspy")
    lm = dspy.LM(
        "openai/tiny", api_base=f"{served}/v1", api_key="unused", max_tokens=5000, cache=False, num_retries=0
    )
    with pytest.raises(dspy.ContextWindowExceededError):
        lm("What is 12 + 7?")


def test_a_two_megabyte_prompt_is_a_json_400(served: str) -> None:
    messages = [{"role": "user", "content": "twelve plus seven " * 120_000}]  # ~2.2 MB
    r = httpx.post(f"{served}/v1/chat/completions", json={"messages": messages, "max_tokens": 1}, timeout=120)
    assert "2048 tokens" in error(r, 400, "messages")


def test_a_default_max_tokens_is_clamped_to_what_the_context_leaves(served: str) -> None:
    prompt = [5] * 2040
    r = httpx.post(
        f"{served}/v1/completions", json={"prompt": prompt, "temperature": 0, "min_tokens": 16}, timeout=60
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8  # 16 asked by default, 8 left


def test_a_chat_without_max_tokens_fits_the_context(served: str, tiny_backend: Any) -> None:
    content = "one two " * 350
    messages = [{"role": "user", "content": content}]
    prompt = len(tiny_backend.chat_prompt(messages))
    assert 2048 - 512 < prompt < 2048  # the default 512 would not fit
    r = httpx.post(
        f"{served}/v1/chat/completions", json={"messages": messages, "temperature": 0}, timeout=120
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2048 - prompt


def test_a_strategy_over_the_context_is_400(served: str) -> None:
    messages = [{"role": "user", "content": "one two " * 2000}]
    body = {"messages": messages, "branchwise": {"strategy": "self-consistency", "branches": 2, "tokens": 4}}
    assert "2048" in error(
        httpx.post(f"{served}/v1/chat/completions", json=body, timeout=60), 400, "messages"
    )


# ------------------------------------------------------------------ strategy bounds


def test_strategy_branches_over_the_limit_are_400(served: str) -> None:
    r = chat(served, branchwise={"strategy": "self-consistency", "branches": 4096, "tokens": 8})
    message = error(r, 400, "branchwise")
    assert message.startswith("branchwise.branches") and "limit of 64" in message


def test_strategy_branches_times_tokens_over_the_limit_are_400(served: str) -> None:
    r = chat(served, branchwise={"strategy": "self-consistency", "branches": 48, "tokens": 131072})
    message = error(r, 400, "branchwise")
    assert message.startswith("branchwise.tokens") and "limit of 131072" in message


def test_a_strategy_spec_over_the_limit_is_400(served: str) -> None:
    from branchwise.strategies import self_consistency

    spec = self_consistency(n=65, max_tokens=4).model_dump(mode="json")
    assert "65 branches" in error(chat(served, branchwise={"strategy": spec}), 400, "branchwise")


def _idle_and_released(url: str, backend: Any, baseline: int) -> None:
    def idle() -> bool:
        health = httpx.get(f"{url}/health", timeout=10).json()
        return not health["busy"] and health["strategy_runs"] == 0

    wait_until(idle, "/health says nothing runs")
    wait_until(lambda: backend.kv_stats().bytes_held <= baseline, "the run's KV is released")


def test_a_client_leaving_mid_strategy_cancels_the_run(served: str, tiny_backend: Any) -> None:
    baseline = tiny_backend.kv_stats().bytes_held
    out: dict[str, Any] = {}

    def ask() -> None:
        try:
            out["r"] = chat(served, timeout=3, temperature=0.7, seed=0, branchwise=LONG_RUN)
        except httpx.TimeoutException as err:
            out["r"] = err

    thread = threading.Thread(target=ask)
    thread.start()
    wait_until(lambda: httpx.get(f"{served}/health").json()["strategy_runs"] == 1, "the run starts")
    assert httpx.get(f"{served}/health").json()["busy"] is True
    thread.join(60)
    assert isinstance(out["r"], httpx.TimeoutException)  # the client left, the run was still going
    _idle_and_released(served, tiny_backend, baseline)


@pytest.fixture
def short_deadline(tiny_backend: Any) -> Iterator[str]:
    with serve_in_thread(create_app(tiny_backend, strategy_timeout_s=1.0)) as url:
        yield url


def test_a_strategy_past_its_deadline_is_504_and_stops(short_deadline: str, tiny_backend: Any) -> None:
    baseline = tiny_backend.kv_stats().bytes_held
    r = chat(short_deadline, temperature=0.7, seed=0, branchwise=LONG_RUN)
    assert r.status_code == 504, r.text
    assert "exceeded 1 s" in r.json()["error"]["message"]
    _idle_and_released(short_deadline, tiny_backend, baseline)


def test_health_reports_the_kv_figures(served: str) -> None:
    kv = httpx.get(f"{served}/health").json()["kv"]
    assert {"used_bytes", "cache_bytes", "preemptions"} <= set(kv)


# ------------------------------------------------------------------ schemas, grammars and token ids


@pytest.fixture
def logged() -> Iterator[list[logging.LogRecord]]:
    """The server's and uvicorn's log records during one test."""
    lines = Lines()
    loggers = [logging.getLogger(n) for n in ("branchwise", "uvicorn", "uvicorn.error")]
    for lg in loggers:
        lg.addHandler(lines)
    try:
        yield lines.records
    finally:
        for lg in loggers:
            lg.removeHandler(lines)


def nested(levels: int) -> dict[str, Any]:
    """An object schema `levels` properties deep (two JSON levels each), as the outside probe sent."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _schema_body(where: str, schema: dict[str, Any]) -> dict[str, Any]:
    if where == "response_format":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}


@pytest.mark.parametrize("where", ["response_format", "tools"])
@pytest.mark.parametrize("levels", [94, 98, 200])
def test_a_deep_schema_is_400_naming_the_depth_limit(
    served: str, logged: list[logging.LogRecord], where: str, levels: int
) -> None:
    """Once a 500 with a 1,920-line traceback (94-98 levels) or "malformed JSON" (99+): the schema
    is refused by its depth, or the body by the JSON parser's, both naming the schema's limit."""
    r = chat(served, max_tokens=1, **_schema_body(where, nested(levels)))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] in (where, "body") and f"{MAX_SCHEMA_DEPTH} levels" in err["message"], err
    assert "malformed" not in err["message"]
    if err["param"] == "body":  # deeper than the parser reads: its limit is named too
        assert f"more than {MAX_BODY_DEPTH} levels" in err["message"]
    assert not [rec for rec in logged if rec.exc_info or rec.levelno >= logging.ERROR]


def test_a_schema_within_the_depth_limit_is_served(served: str) -> None:
    r = chat(served, max_tokens=4, temperature=0, **_schema_body("response_format", nested(20)))
    assert r.status_code == 200, r.text


def test_an_enum_of_100000_strings_is_400(served: str, logged: list[logging.LogRecord]) -> None:
    schema = {"type": "object", "properties": {"a": {"enum": [f"value-{i}" for i in range(100_000)]}}}
    message = error(
        chat(served, max_tokens=1, **_schema_body("response_format", schema)), 400, "response_format"
    )
    assert f"more than {MAX_ENUM_VALUES} values" in message
    assert not [rec for rec in logged if rec.exc_info]


@pytest.mark.parametrize("where", ["response_format", "tools"])
def test_a_pattern_repeated_past_pythons_limit_is_400(
    served: str, logged: list[logging.LogRecord], where: str
) -> None:
    """Once a 500 with a traceback: Python's regex parser raises OverflowError, not re.error."""
    schema = {"type": "string", "pattern": "a{99999999999}"}
    message = error(chat(served, max_tokens=4, **_schema_body(where, schema)), 400, where)
    assert "not a valid JSON Schema (a pattern: the repetition number is too large)" in message
    assert not [rec for rec in logged if rec.exc_info or rec.levelno >= logging.ERROR]


def test_a_choice_of_100000_strings_is_400(served: str) -> None:
    constraint = {"kind": "choice", "choices": [f"value-{i}" for i in range(100_000)]}
    message = error(chat(served, max_tokens=1, branchwise={"constraint": constraint}), 400, "branchwise")
    assert message.startswith("branchwise.constraint.choices") and f"limit of {MAX_CHOICES}" in message


# ------------------------------------------------------------------ the shortest reply a schema allows


BILLION = 10**9


def required(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """An object schema whose one property, `name`, is required."""
    return {"type": "object", "properties": {name: schema}, "required": [name]}


@pytest.fixture
def health_polled(served: str) -> Iterator[list[tuple[int, float]]]:
    """/health asked every 20 ms from a thread for the test's length: (status, seconds) each."""
    answers: list[tuple[int, float]] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            status = httpx.get(f"{served}/health", timeout=10).status_code
            answers.append((status, time.perf_counter() - start))
            stop.wait(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        wait_until(lambda: len(answers) >= 1, "/health answers")
        yield answers
    finally:
        stop.set()
        poller.join(30)


@pytest.mark.parametrize(
    ("where", "schema"),
    [
        ("tools", required("xs", {"type": "array", "items": {"type": "integer"}, "minItems": BILLION})),
        ("response_format", required("s", {"type": "string", "minLength": BILLION})),
    ],
    ids=["tool-minItems", "response_format-minLength"],
)
def test_a_billion_in_a_schema_is_400_at_once_while_health_answers(
    served: str, health_polled: list[tuple[int, float]], where: str, schema: dict[str, Any]
) -> None:
    """Once the shortest output was built on the event loop (a billion-item list, a gigabyte string
    handed to the tokenizer): the request never came back, /health stopped answering, SIGTERM was
    not heard, and the tokenizer's 4 GiB allocation could abort the process. Measured now, the
    reply is a 400 naming the field, the count (a bound: the output is far too long to tokenize)
    and what the context leaves; /health answers all along. A tool under ``tool_choice: "auto"``
    is refused too: prose may come first, but a call of it could never be completed."""
    start = time.perf_counter()
    r = chat(served, timeout=30, max_tokens=16, **_schema_body(where, schema))
    took = time.perf_counter() - start
    message = error(r, 400, where)
    assert took < 1.0, f"the refusal took {took:.2f} s"
    prefix = "tools[0].function.parameters: the shortest call of this tool" if where == "tools" else where
    assert message.startswith(prefix), message
    if "minLength" in json.dumps(schema):  # a length bound is sized before anything is counted
        assert "1000000000, over the limit of 1000 characters for a length bound" in message, message
    else:
        assert "takes at least " in message and "context of 2048" in message and "max_tokens is 16" in message
    answered = len(health_polled)
    wait_until(lambda: len(health_polled) > answered, "/health answers after the refusal")
    assert all(status == 200 and seconds < 1.0 for status, seconds in health_polled), health_polled


def test_a_max_tokens_below_the_shortest_output_is_400_naming_both(served: str, tiny_backend: Any) -> None:
    """The shortest JSON fits the context but not ``max_tokens``: no reply could close, so the
    request is refused naming ``max_tokens`` and both counts (it was a warning in the log, and a
    reply cut with ``finish_reason: "length"``)."""
    schema = required("answer", {"type": "string", "minLength": 40})
    floor = len(tiny_backend.tokenizer.encode('{"answer":"' + "a" * 40 + '"}', add_special_tokens=False))
    assert 8 < floor < 2000
    message = error(chat(served, max_tokens=8, **_schema_body("response_format", schema)), 400, "max_tokens")
    assert message.startswith(f"max_tokens: 8 is below the {floor} tokens of the shortest output")
    assert "response_format" in message
    assert chat(served, max_tokens=floor, **_schema_body("response_format", schema)).status_code == 200


def test_a_forced_call_below_its_shortest_length_is_400(served: str, tiny_backend: Any) -> None:
    body = _schema_body("tools", required("n", {"type": "integer"}))
    message = error(chat(served, max_tokens=4, tool_choice="required", **body), 400, "max_tokens")
    assert message.startswith("max_tokens: 4 is below the ") and "tools constraint" in message
    auto = chat(served, max_tokens=4, **body)  # prose may come first: a small budget is the client's call
    assert auto.status_code == 200, auto.text


def test_a_default_budget_below_the_shortest_output_says_it_is_the_default(served: str) -> None:
    schema = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": required("s", {"type": "string", "minLength": 60})},
    }
    r = httpx.post(f"{served}/v1/completions", json={"prompt": "Say:", "response_format": schema}, timeout=30)
    assert error(r, 400, "max_tokens").startswith("max_tokens: 16 (the default) is below the ")


@pytest.mark.parametrize("kind", ["choice", "json_schema"])
def test_a_grammar_compiling_never_stalls_another_requests_decode(
    served: str, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """One request's grammar compiles (held here until released) while two others, one free and one
    with a grammar of its own, are decoded and answered; the first is answered once it is released.
    Before, the compile ran on the scheduler's one worker (and under the cache's lock): both waited.
    ``json_schema``: the grammar held is the one fitted to the request's small ``max_tokens``, which
    is what its rows decode under (compiled ahead too, not in the decode)."""
    from branchwise.backends.hf import grammar
    from branchwise.constraints import Constraint

    real = grammar._compile
    slow, quick = [f"slowmarker-{kind}-one", f"slowmarker-{kind}-two"], ["quick-one", "quick-two"]
    # a required free string: its length is fitted to the small budget, so a fitted grammar exists
    field = f"slowmarker_{kind}"
    schema = {"type": "object", "properties": {field: {"type": "string"}}, "required": [field]}
    slow_body: dict[str, Any] = (
        {"branchwise": {"constraint": {"kind": "choice", "choices": slow}}}
        if kind == "choice"
        else _schema_body("response_format", schema)
    )
    started, release = threading.Event(), threading.Event()

    def held(compiler: Any, constraint: Any) -> Any:
        fitted = type(constraint) is not Constraint  # the grammar cache's constraint fitted to a budget
        if "slowmarker" in constraint.key() and (kind == "choice" or fitted):
            started.set()
            release.wait(120)
        return real(compiler, constraint)

    monkeypatch.setattr(grammar, "_compile", held)
    out: dict[str, Any] = {}

    def ask_slow() -> None:
        out["slow"] = chat(served, max_tokens=24, **slow_body)

    first = threading.Thread(target=ask_slow)
    first.start()
    try:
        assert started.wait(60), "the slow grammar never started compiling"
        free = chat(served, timeout=30, max_tokens=4, temperature=0)
        own = chat(
            served, timeout=30, max_tokens=24, branchwise={"constraint": {"kind": "choice", "choices": quick}}
        )
        assert free.status_code == 200 and own.status_code == 200, (free.text, own.text)
        assert own.json()["choices"][0]["message"]["content"] in quick
        assert "slow" not in out and not release.is_set()  # answered while the compile still ran
        assert httpx.get(f"{served}/health").json()["busy"] is True  # the compiling request counts
    finally:
        release.set()
        first.join(60)
    assert out["slow"].status_code == 200, out["slow"].text
    if kind == "choice":
        assert out["slow"].json()["choices"][0]["message"]["content"] in slow


@pytest.mark.parametrize(
    ("body", "param", "named"),
    [
        (
            {"branchwise": {"constraint": {"kind": "regex", "pattern": "a{1,60000}"}}},
            "branchwise",
            "branchwise.constraint.pattern: a repetition count of 60000, over the limit of 1000",
        ),
        (
            _schema_body("response_format", {"type": "string", "pattern": "(a+)+(b*)*c{1,30000}"}),
            "response_format",
            "response_format.json_schema.schema.pattern: a repetition of a group that is itself only",
        ),
        (
            _schema_body("response_format", {"type": "string", "pattern": "c{1,30000}"}),
            "response_format",
            "response_format.json_schema.schema.pattern: a repetition count of 30000, over the limit of 1000",
        ),
        (
            _schema_body(
                "tools", {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5000}}}
            ),
            "tools",
            "tools[0].function.parameters.properties.s.maxLength: 5000, over the limit of 1000",
        ),
    ],
    ids=["regex-count", "schema-nested", "schema-count", "tool-max-length"],
)
def test_a_pathological_pattern_is_400_within_a_second(
    served: str, body: dict[str, Any], param: str, named: str
) -> None:
    """Patterns that once held a grammar worker for minutes (``c{1,30000}`` in a schema compiled for
    more than 600 s) are refused before compiling, naming the field and the limit."""
    start = time.monotonic()
    message = error(chat(served, max_tokens=4, **body), 400, param)
    assert time.monotonic() - start < 1.0
    assert message.startswith(named), message


def test_a_grammar_past_the_compile_limit_is_400_then_refused_at_once(
    served: str, tiny_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compile that runs past ``--grammar-timeout`` (a fake held until the test ends) fails its
    request with a 400 naming the limit; the same constraint again is refused without compiling."""
    from branchwise.backends.hf import grammar

    real, release, calls = grammar._compile, threading.Event(), []

    def held(compiler: Any, constraint: Any) -> Any:
        if "slowlimit" in constraint.key():
            calls.append(constraint.key())
            release.wait(120)
        return real(compiler, constraint)

    monkeypatch.setattr(grammar, "_compile", held)
    monkeypatch.setattr(tiny_backend, "grammar_timeout", 0.5)
    body = {"branchwise": {"constraint": {"kind": "regex", "pattern": "slowlimit[0-9]"}}}
    try:
        message = error(chat(served, max_tokens=4, **body), 400, "branchwise")
        assert message.startswith("branchwise.constraint: pattern: ") and "within 0.5 s" in message
        start = time.monotonic()
        assert error(chat(served, max_tokens=4, **body), 400, "branchwise") == message
        assert time.monotonic() - start < 1.0 and len(calls) == 1
        quick = {"branchwise": {"constraint": {"kind": "choice", "choices": ["yes", "no"]}}}
        assert chat(served, max_tokens=4, **quick).status_code == 200  # the threads go on
    finally:
        release.set()


def test_detokenize_refuses_booleans(served: str) -> None:
    message = error(httpx.post(f"{served}/detokenize", json={"tokens": [5, True]}), 400, "tokens")
    assert message.startswith("tokens[1]") and "true" in message


def test_a_token_prompt_of_booleans_is_400(served: str) -> None:
    r = httpx.post(f"{served}/v1/completions", json={"prompt": [True, 5], "max_tokens": 1})
    assert r.status_code == 400, r.text


def test_a_body_deeper_than_the_parser_reads_is_400_not_malformed(served: str) -> None:
    deep = "[" * (MAX_BODY_DEPTH + 50) + "]" * (MAX_BODY_DEPTH + 50)
    for path in ("/detokenize", "/v1/chat/completions"):
        r = httpx.post(
            f"{served}{path}", content=f'{{"tokens": {deep}}}', headers={"Content-Type": "application/json"}
        )
        message = error(r, 400, "body")
        assert f"more than {MAX_BODY_DEPTH} levels" in message and "malformed" not in message


def test_the_body_depth_limit_is_the_parsers() -> None:
    """`MAX_BODY_DEPTH` names the JSON parser's own limit: a body that deep parses, one level more
    does not (fails when a new pydantic-core moves its limit)."""
    from branchwise.serve.errors import RequestError, json_object

    within = "[" * (MAX_BODY_DEPTH - 1) + "]" * (MAX_BODY_DEPTH - 1)
    assert json_object(f'{{"a": {within}}}'.encode())
    with pytest.raises(RequestError, match=f"more than {MAX_BODY_DEPTH} levels"):
        json_object(f'{{"a": [{within}]}}'.encode())
