"""Hostile counts in a request's constraint, fuzzed through what `branchwise serve` does with a
request before decoding it, on the tiny model.

Every count a schema or regex may carry (``minItems``, ``minLength``, ``minProperties``, nesting
depth, ``enum`` size, a regex's ``{n,m}``) is drawn from small to absurd. Each request goes the
server's own way to its decode (`door`: the body parsed and checked, the prompt built, the budget
checked against the context and against the constraint's shortest reply, the constraint fitted and
its grammars compiled) and must come out either as a 400 naming the field (the constraint's own
where the count makes its shortest output longer than the whole context could hold) or as a fitted
constraint whose shortest reply fits and whose grammar allows a first token. Bounds per request:
one second (timed untraced), 32 MiB of Python allocations at the peak (tracemalloc, the request run
again from cold caches) and 128 MiB more of the process's peak resident memory (what tracemalloc
cannot see: the tokenizer's and the grammar engine's own). A count once built into a value (a
billion-item list on the event loop) fails all three. Decoding itself is left out: its time is the
model's, not the request's (`test_serve_bounds.py` sends the worst two through HTTP while /health
is polled).

One cost is known and left out: xgrammar (0.2.9) expands a string's bounded repetition (a length
bound, which is compiled as a pattern; a pattern's own ``{n,m}``) count by count up to some
thousands, in time that grows with the count's square (tiny vocabulary, ``minLength``: 1,024 takes
0.4 s, 4,096 9 s, 8,192 over a minute, while 20,000 takes 0.02 s; ``(ab|c){6,11855}`` 17 s). That
runs in a grammar compile worker, not on the event loop, and only for a request not refused first
(a ``"tool_choice": "auto"`` tool, or a budget the shortest reply fits); a case with such a count
over `EXPANDED` is checked up to its compile, not compiled (`Case.compiles`).

The time bound is the one wall-clock bound of this kind in the suite, and deliberately loose: the
work it bounds takes milliseconds, a count-sized build takes minutes.
"""

from __future__ import annotations

import asyncio
import json
import resource
import time
import tracemalloc
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
xgr = pytest.importorskip("xgrammar")

from branchwise.constraints import ConstraintError  # noqa: E402
from branchwise.schema_limits import MAX_ENUM_VALUES  # noqa: E402
from branchwise.serve import create_app  # noqa: E402
from branchwise.serve.errors import RequestError  # noqa: E402
from branchwise.serve.server import Server  # noqa: E402
from branchwise.serve.translate import chat_completion  # noqa: E402

CONTEXT = 2048
"""The tiny model's context (`max_position_embeddings`)."""
LIMIT_S = 1.0
PYTHON_BYTES = 32 << 20
RSS_BYTES = 128 << 20
PYTHON_REPEAT = 2**32 - 1
"""The largest repetition count Python's regex parser takes."""
EXPANDED = 256
"""String repetition counts past this are not compiled here (see the module docstring)."""

COUNTS = st.one_of(
    st.integers(0, 6),
    st.integers(0, 10**12),
    st.sampled_from([10**9, 2**31 - 1, 2**31, PYTHON_REPEAT, 2**32, 10**15, 10**30]),
)
WHERE = st.sampled_from(["response_format", "tools-required", "tools-auto"])


@dataclass
class Case:
    """One request's constraint fields, the field a refusal must name, whether it must be refused
    by that field (with `says` in the message) whatever ``max_tokens``, and whether it is compiled."""

    body: dict[str, Any]
    field: str
    must_refuse: bool = False
    says: str = ""
    compiles: bool = True
    """False: a string repetition count over `EXPANDED`, whose compile is not run here."""


def _over_context(chars: int, longest: int) -> bool:
    """Whether an output of at least `chars` characters takes more tokens than the context holds."""
    return chars > CONTEXT * longest


def _schema_case(where: str, schema: dict[str, Any], least_chars: int | None, longest: int) -> Case:
    """`schema` as the request's response_format or its one tool's parameters, required to hold
    at least `least_chars` characters (None: no promise)."""
    if where == "response_format":
        body: dict[str, Any] = {
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        }
    else:
        body = {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
            "tool_choice": where.removeprefix("tools-"),
        }
    field = where.split("-")[0]
    return Case(body, field, least_chars is not None and _over_context(least_chars, longest))


def _required(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {name: schema}, "required": [name]}


@st.composite
def cases(draw: st.DrawFn, longest: int) -> Case:
    kind = draw(
        st.sampled_from(["items", "length", "properties", "depth", "refs", "enum", "regex", "pattern"])
    )
    where = draw(WHERE)
    if kind == "items":
        n = draw(COUNTS)
        schema = _required("v", {"type": "array", "items": {"type": "integer"}, "minItems": n})
        return _schema_case(where, schema, 2 * n, longest)
    if kind == "length":
        n = draw(COUNTS)
        case = _schema_case(where, _required("v", {"type": "string", "minLength": n}), n, longest)
        case.compiles = n <= EXPANDED
        return case
    if kind == "properties":
        n, more = draw(COUNTS), draw(st.booleans())
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": n}
        schema["additionalProperties"] = more
        # each property takes 4 characters at the least ("":0), unless none may be added
        return _schema_case(where, schema, 4 * n if more else None, longest)
    if kind == "depth":  # arrays nested `levels` deep, each holding at least `k`
        levels, k = draw(st.integers(1, 40)), draw(st.integers(0, 12))
        schema: dict[str, Any] = {"type": "integer"}
        chars = 1
        for _ in range(levels):
            schema = {"type": "array", "items": schema, "minItems": k}
            chars = 2 + k * chars + max(k - 1, 0)
        # read to MAX_DEPTH (32) levels: promised to 15, as the references below
        return _schema_case(where, _required("v", schema), chars if levels <= 15 else None, longest)
    if kind == "refs":  # definitions that each refer to the next `fan_out` times
        levels, fan_out = draw(st.integers(1, 20)), draw(st.integers(1, 10))
        names = [f"p{j}" for j in range(fan_out)]
        defs: dict[str, Any] = {
            f"d{i}": {"type": "object", "properties": {n: {"$ref": f"#/$defs/d{i + 1}"} for n in names}}
            for i in range(levels)
        }
        for d in defs.values():
            d["required"] = names
        defs[f"d{levels}"] = {"type": "integer"}
        leaves = fan_out**levels
        # past 15 levels the reading stops (MAX_DEPTH: two a level): nothing is promised there. A
        # response_format only: a tool's schema is shown in the prompt, which these may overflow
        schema = {"$defs": defs, "$ref": "#/$defs/d0"}
        return _schema_case("response_format", schema, leaves if levels <= 15 else None, longest)
    if kind == "enum":
        size = draw(st.integers(1, 1500))
        schema = {"type": "object", "properties": {"e": {"enum": [f"v{i}" for i in range(size)]}}}
        case = _schema_case("response_format", schema, None, longest)  # a tool's is in the prompt too
        if size > MAX_ENUM_VALUES:
            case.must_refuse, case.says = True, f"more than {MAX_ENUM_VALUES} values"
        return case
    n = draw(COUNTS)
    m = draw(st.one_of(st.none(), COUNTS))
    repeat = f"{{{n},{'' if m is None else m}}}"
    if kind == "pattern":
        case = _schema_case(
            where, _required("v", {"type": "string", "pattern": f"^(ab|c){repeat}$"}), n, longest
        )
    else:
        case = Case(
            {"branchwise": {"constraint": {"kind": "regex", "pattern": f"(ab|c){repeat}"}}}, "branchwise"
        )
        case.must_refuse = _over_context(n, longest)
    case.compiles = kind == "regex" or max(n, m or 0) <= EXPANDED
    if max(n, m or 0) > PYTHON_REPEAT:
        case.must_refuse, case.says = True, "too large"
    return case


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


@pytest.fixture(scope="module")
def longest(tiny_backend: Any) -> int:
    """The tiny tokenizer's longest entry: an output of c characters takes at least c / it tokens."""
    return int(tiny_backend.engine.grammars.longest_token())


@pytest.fixture(scope="module")
def server(tiny_backend: Any) -> Server:
    """A server's request handling over the tiny model (its app is never served: `door` calls what
    its chat route calls), once each path a case takes has run (the grammar compiler built, the
    tokenizer read), so that what an example allocates is its own."""
    server = create_app(tiny_backend, model_name="tiny").state.server
    for body in (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}},
            }
        },
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
        {"branchwise": {"constraint": {"kind": "regex", "pattern": "(ab|c){2}"}}},
    ):
        door(server, body, 48)
    return server


def door(server: Server, body: dict[str, Any], max_tokens: int, compiles: bool = True) -> tuple[int, Any]:
    """What the chat route does with a request up to its decode: (400, the error) of a refusal, or
    (200, the constraint fitted to the budget and, with `compiles`, its compiled grammar)."""
    payload = {"messages": [{"role": "user", "content": "Go."}], "max_tokens": max_tokens, **body}
    try:
        c = chat_completion(server, json.dumps(payload).encode())
        budget = server.fit(c.req, c.prompt, c.field)
        asyncio.run(server.check_constraint_fits(c.req, c.prompt, budget))
        grammars = server.backend.engine.grammars
        fit = grammars.fit(c.req.constraint, budget)
        if not compiles:
            return 200, (budget, fit, None)
        try:  # what the scheduler waits for before queueing (`outcome` answers its error so)
            grammars.prepare(c.req.constraint, budget).result(timeout=30)
        except ConstraintError as err:
            source = c.req.constraint_field
            raise RequestError(400, f"{source}: {err}", source.split(".")[0]) from None
        return 200, (budget, fit, grammars.compile(fit.constraint))
    except RequestError as err:
        return err.status, err.body()["error"]


def allows_a_token(compiled: Any, vocab: int) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return bool(bitmask.any())


@seed(20261129)
@settings(
    max_examples=60,
    deadline=timedelta(seconds=10),  # the real bound is asserted per request, below
    suppress_health_check=[HealthCheck.too_slow],
)
@given(data=st.data(), max_tokens=st.integers(1, 48))
def test_any_count_is_a_400_naming_the_field_or_a_fitted_grammar(
    server: Server, longest: int, data: st.DataObject, max_tokens: int
) -> None:
    case = data.draw(cases(longest))
    rss = _rss()
    start = time.perf_counter()
    status, got = door(server, case.body, max_tokens, case.compiles)
    took = time.perf_counter() - start
    assert took < LIMIT_S, f"answered {status} in {took:.2f} s"
    # again from cold caches, allocations traced (tracing slows Python several times: not timed)
    server.backend.engine.grammars.clear()
    tracemalloc.start()
    try:
        again = door(server, case.body, max_tokens, case.compiles)
        allocated = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert again[0] == status
    assert allocated < PYTHON_BYTES, f"{allocated >> 20} MiB of Python allocations"
    assert _rss() - rss < RSS_BYTES, f"peak resident memory grew {(_rss() - rss) >> 20} MiB"
    if status == 200:
        assert not case.must_refuse, case
        budget, fit, compiled = got
        assert fit.floor_tokens is None or fit.floor_tokens <= budget, fit
        assert compiled is None or allows_a_token(compiled, server.backend.engine.grammars.vocab_size)
        return
    assert status == 400, got
    assert got["param"] in (case.field, "max_tokens") and got["message"].startswith(got["param"]), got
    if case.must_refuse:
        assert got["param"] == case.field and case.says in got["message"], got
