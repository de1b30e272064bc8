"""Tool calls that end, and small budgets that still parse, on the local backend.

A random model under ``parallel_tool_calls`` writes calls for as long as it may: a call identical
to one it made already must end the row (and never come back twice), a reply cut by ``max_tokens``
in a later call keeps the whole calls before it. A JSON output under a small ``max_tokens`` must
still close: the free strings get a ``maxLength`` from the budget (`Grammars.fit`). The same rules
as the front ends see them are tested in test_serve_tools.py, test_dspy_tools.py and here
(LangChain, the votes over actions).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import pytest
from pydantic import BaseModel

from branchwise.backends.base import DecodeParams
from branchwise.constraints import Constraint
from branchwise.schema_budget import cap_strings, capped_string, shortest
from branchwise.toolcalls import ToolCallStream, normalize_tools, parse_tool_calls, split_calls

pytest.importorskip("xgrammar")

PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
"""A tool whose every call is the same call: a model that goes on calling can only repeat it."""
VERDICT = {
    "type": "object",
    "properties": {"verdict": {"type": "string"}, "ok": {"type": "boolean"}},
    "required": ["verdict", "ok"],
}


def _call(name: str, args: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


# --------------------------------------------------------------------------------------------------
# The shortest valid value of a schema, and free strings bounded (no model)
# --------------------------------------------------------------------------------------------------


class Place(BaseModel):
    city: str
    country: Literal["FR", "IT"]


class Trip(BaseModel):
    where: Place
    days: int
    note: str | None
    tags: list[str] = []


def test_shortest_value_of_a_pydantic_schema() -> None:
    least = shortest(Trip.model_json_schema())
    assert least is not None
    # required fields only, each at its shortest: $ref followed, the enum's shortest member, "" over null
    assert least.value == {"where": {"city": "", "country": "FR"}, "days": 0, "note": ""}
    assert least.text == '{"where":{"city":"","country":"FR"},"days":0,"note":""}'
    assert least.free == 2  # city and note; the enum is not free text
    assert least.gaps == 4 * 3 + 4 * 2  # around every ':' and ',' and inside every brace
    assert shortest({"type": "integer", "minimum": 5}).value == 5  # type: ignore[union-attr]
    assert shortest({"type": "array", "items": {"type": "string"}, "minItems": 2}).free == 2  # type: ignore[union-attr]
    assert shortest({"$ref": "#/$defs/missing"}) is None


def test_cap_strings_bounds_free_strings_only() -> None:
    schema = {
        "type": "object",
        "properties": {
            "free": {"type": "string"},
            "long": {"type": "string", "minLength": 9},
            "bounded": {"type": "string", "maxLength": 3},
            "code": {"type": "string", "pattern": "^[A-Z]+$"},
            "pick": {"type": "string", "enum": ["a", "b"]},
            "many": {"type": "array", "items": {"type": "string"}},
            "maybe": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
    }
    capped = cap_strings(schema, 5)["properties"]
    assert capped["free"]["pattern"] == capped_string(0, 5) and capped["long"]["pattern"] == capped_string(
        9, 9
    )
    assert capped["bounded"] == {"type": "string", "pattern": capped_string(0, 3)}  # its own bound
    assert capped["code"] == schema["properties"]["code"] and capped["pick"] == schema["properties"]["pick"]
    assert capped["many"]["items"]["pattern"] == capped["maybe"]["anyOf"][0]["pattern"] == capped_string(0, 5)
    assert "pattern" not in schema["properties"]["free"]  # a copy: the caller's schema is kept
    # with no cap, only the strings with a length bound of their own take the pattern form
    own = cap_strings(schema, None)["properties"]
    assert own["free"] == {"type": "string"} and own["long"] == {
        "type": "string",
        "pattern": capped_string(9, None),
    }
    # a bounded string is JSON: no raw control character, no quote or backslash (no escapes either)
    bound = re.compile(capped_string(0, 5))
    assert bound.match("héllo") and not bound.match("toolong") and not bound.match("a\x01")
    assert not bound.match('a"b') and not bound.match("a\\b")


# --------------------------------------------------------------------------------------------------
# The grammar and the decode loop, on the tiny random model
# --------------------------------------------------------------------------------------------------


def test_the_grammar_lets_a_reply_end_after_any_whole_call(tiny_backend: Any) -> None:
    """Under ``parallel_tool_calls`` the structural tag allows another call after each one, and the
    end of the reply too: after one call, after two, with or without the newline between."""
    import xgrammar as xgr

    tools = normalize_tools([PING, {"type": "function", "function": {"name": "pong"}}])
    grammars = tiny_backend.engine.grammars
    eos = min(grammars.eos_ids)
    for choice in ("required", "auto", "pong"):
        compiled = grammars.compile(Constraint.of_tools(tools, choice))
        name = "pong" if choice == "pong" else "ping"
        for text in (_call(name, {}), _call(name, {}) + "\n", _call(name, {}) + "\n" + _call("pong", {})):
            matcher = xgr.GrammarMatcher(compiled)
            assert matcher.accept_string(text), (choice, text)
            assert matcher.is_completed() and matcher.accept_token(eos), (choice, text)


def test_a_repeated_call_ends_the_row(tiny_backend: Any) -> None:
    """With the end of the reply masked (``min_tokens``), the model must go on after its call; the
    only call it can write is the same one, and the row stops as soon as that repeat closes, well
    before ``max_tokens``; the call is read once."""
    constraint = Constraint.of_tools([PING], "required")
    assert constraint is not None and constraint.parallel_tool_calls
    root = tiny_backend.prefill(tiny_backend.chat_prompt([{"role": "user", "content": "ping"}], tools=[PING]))
    (gen,) = tiny_backend.extend([root], DecodeParams(max_tokens=400, min_tokens=400, constraint=constraint))
    assert gen.finish_reason == "stop" and len(gen.token_ids) < 400
    assert gen.text.count("<tool_call>") == 2 and gen.text.rstrip().endswith("</tool_call>")
    prose, calls = parse_tool_calls(gen.text, constraint.tools)
    assert prose == "" and [c.name for c in calls] == ["ping"]
    tiny_backend.release([root])


@pytest.mark.parametrize("max_tokens", [48, 64])
def test_a_small_budget_still_closes_the_object(tiny_backend: Any, max_tokens: int) -> None:
    """Unfitted, the random model fills ``verdict`` (and whitespace) until ``max_tokens`` cuts it;
    fitted to the budget, its output is a whole, valid object."""
    constraint = Constraint.of_json_schema(VERDICT)
    fit = tiny_backend.engine.grammars.fit(constraint, max_tokens)
    cap = fit.constraint.json_schema["properties"]["verdict"]["pattern"]
    assert cap.startswith("^[^") and int(cap.split(",")[1].split("}")[0]) < max_tokens
    assert fit.floor_tokens is not None and 0 < fit.floor_tokens < max_tokens
    root = tiny_backend.prefill(tiny_backend.chat_prompt([{"role": "user", "content": "True?"}]))
    (gen,) = tiny_backend.extend([root], DecodeParams(max_tokens=max_tokens, constraint=constraint))
    assert gen.finish_reason == "eos", gen.text
    assert set(constraint.parse(gen.text)) == {"verdict", "ok"}
    tiny_backend.release([root])


def test_a_large_budget_leaves_the_constraint_as_it_is(tiny_backend: Any) -> None:
    grammars = tiny_backend.engine.grammars
    constraint = Constraint.of_json_schema(VERDICT)
    assert grammars.fit(constraint, 4096).constraint is constraint
    auto = Constraint.of_tools([PING], "auto")
    assert auto is not None and grammars.fit(auto, 16).constraint is auto  # prose first: nothing to fit


def test_a_short_floor_is_tokenized_a_long_one_bounded(tiny_backend: Any) -> None:
    """The shortest output is tokenized where it is short; a billion-item one is never built: its
    length over the longest token's bounds its tokens from below, and says so (not exact)."""
    grammars = tiny_backend.engine.grammars
    small = Constraint.of_json_schema(VERDICT)
    fit = grammars.fit(small, 64)
    assert fit.floor_exact and fit.floor_tokens == len(
        tiny_backend.tokenizer.encode('{"verdict":"","ok":true}')
    )
    longest = grammars.longest_token()
    assert longest == max(len(t) for t in tiny_backend.tokenizer.get_vocab())
    huge = Constraint.of_json_schema({"type": "array", "items": {"type": "integer"}, "minItems": 10**9})
    fit = grammars.fit(huge, 16, warn=False)
    assert not fit.floor_exact and fit.floor_tokens == -(-(2 * 10**9 + 1) // longest)
    regex = Constraint.of_regex("c{1000}")  # (a longer count is refused before: `pattern_limits`)
    fit = grammars.fit(regex, 16, warn=False)
    assert fit.constraint is regex and not fit.floor_exact and fit.floor_tokens == -(-1000 // longest)


def test_a_budget_below_the_floor_leaves_the_constraint_unfitted(tiny_backend: Any) -> None:
    """Nothing fitted can help such a budget, so nothing is fitted (a free string's length bound
    written as a pattern past Python's repetition limit once made fitting itself raise, a 500; such
    a bound is now refused before, by `pattern_limits`, and a budget below the floor still leaves
    the constraint as it was)."""
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "minLength": 1000}},
        "required": ["s"],
    }
    constraint = Constraint.of_json_schema(schema)
    fit = tiny_backend.engine.grammars.fit(constraint, 16, warn=False)
    assert fit.constraint is constraint and fit.floor_tokens is not None and fit.floor_tokens > 16


def test_each_callable_tools_call_is_counted_under_any_tool_choice(tiny_backend: Any) -> None:
    """A server refuses a tool whose shortest call cannot fit the context, whatever ``tool_choice``;
    the reply's own floor is the least of those calls, and under ``"auto"`` there is none (prose)."""
    grammars = tiny_backend.engine.grammars
    big = {
        "type": "function",
        "function": {"name": "big", "parameters": {"type": "object", "minProperties": 10**6}},
    }
    tools = [PING, big]
    fits = {
        choice: grammars.fit(Constraint.of_tools(tools, choice), 64, warn=False)
        for choice in ("auto", "required", "big")
    }
    where = {choice: [(out.where, out.exact) for out in fit.outputs] for choice, fit in fits.items()}
    assert (
        where["auto"]
        == where["required"]
        == [
            ("tools[0].function.parameters", True),
            ("tools[1].function.parameters", False),
        ]
    )
    assert where["big"] == [("tools[1].function.parameters", False)]
    assert fits["auto"].floor_tokens is None
    assert fits["required"].floor_tokens == fits["required"].outputs[0].tokens < 64
    assert fits["big"].floor_tokens == fits["big"].outputs[0].tokens > 10**6 // grammars.longest_token()


def test_a_budget_below_the_floor_is_logged_once_and_never_when_asked_not_to(
    tiny_backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    grammars = tiny_backend.engine.grammars
    constraint = Constraint.of_json_schema(VERDICT)  # at a budget no other test here fits it to
    with caplog.at_level("WARNING", logger="branchwise.backends.hf.grammar"):
        grammars.fit(constraint, 3, warn=False)
        assert caplog.records == []  # a server asking before it refuses: nothing to warn about
        grammars.fit(constraint, 3)
        grammars.fit(constraint, 3)
    (record,) = caplog.records
    assert "max_tokens=3 is below the" in record.getMessage() and "will be cut" in record.getMessage()


# --------------------------------------------------------------------------------------------------
# Front ends: LangChain and the votes over actions (the server and DSPy: their own test files)
# --------------------------------------------------------------------------------------------------

REPEATED = "Checking.\n" + "\n".join([_call("calculator", {"expression": "12 * 7"})] * 3)
CUT = _call("calculator", {"expression": "12 * 7"}) + '\n<tool_call>\n{"name": "calculator", "argu'
CUT_IN_TAG = _call("calculator", {"expression": "12 * 7"}) + "\n<tool_"
"""Cut inside the opening tag itself (seen on the embedded model: ``'<tool_'`` was left in content)."""


@pytest.mark.parametrize("stream", [False, True], ids=["invoke", "stream"])
@pytest.mark.parametrize(
    ("reply", "content"),
    [(REPEATED, "Checking."), (CUT, ""), (CUT_IN_TAG, "")],
    ids=["repeated", "cut", "cut-in-tag"],
)
def test_chat_model_returns_each_call_once_and_no_cut_call(reply: str, content: str, stream: bool) -> None:
    pytest.importorskip("langchain_core")
    from test_langchain import ScriptedBackend, calculator

    from branchwise.integrations.langchain import ChatBranchwise

    chat = ChatBranchwise(backend=ScriptedBackend(reply)).bind_tools([calculator], tool_choice="required")
    if stream:
        chunks = list(chat.stream("What is 12 * 7?"))
        msg = chunks[0]
        for chunk in chunks[1:]:
            msg = msg + chunk
    else:
        msg = chat.invoke("What is 12 * 7?")
    assert msg.content == content
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("calculator", {"expression": "12 * 7"})]
    assert msg.response_metadata["finish_reason"] == "tool_calls"


CALCULATOR = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


def _both_readers(reply: str, cut: bool) -> tuple[str, int, bool]:
    """(content, calls, whether the stream says it dropped a cut call) as `parse_tool_calls`, the
    whole-reply `split_calls` and a `ToolCallStream` fed a character at a time read `reply`;
    asserting the three agree."""
    tools = normalize_tools(CALCULATOR)
    prose, calls = parse_tool_calls(reply, tools, cut=cut)
    streamed, streamed_calls = split_calls(reply, tools, cut=cut)
    assert streamed == prose and [c.canonical() for c in streamed_calls] == [c.canonical() for c in calls]
    reader = ToolCallStream(tools)
    pieces = [p for ch in reply for p in reader.push(ch)] + reader.finish(cut)
    assert "".join(p for p in pieces if isinstance(p, str)) == prose
    return prose, len(calls), reader.cut


@pytest.mark.parametrize(
    ("reply", "cut", "content", "n_calls"),
    [
        (CUT_IN_TAG, False, "", 1),  # right after a call only another call may begin: cut, either way
        (CUT_IN_TAG, True, "", 1),
        ("Checking.\n<tool_c", True, "Checking.", 0),
        ("Checking. <", True, "Checking.", 0),
    ],
)
def test_a_call_cut_inside_its_opening_tag_is_dropped_by_both_readers(
    reply: str, cut: bool, content: str, n_calls: int
) -> None:
    assert _both_readers(reply, cut) == (content, n_calls, True)


@pytest.mark.parametrize(
    "reply",
    ["a < b and x <t", "Checking. <", "Checking.\n<tool_c", _call("calculator", {"e": 1}) + " so x <tool"],
)
def test_a_finished_reply_that_ends_like_the_tag_keeps_its_end(reply: str) -> None:
    """A reply the model ended (not cut by ``max_tokens``) with text that merely starts like
    ``<tool_call>`` says what it says: its end was once dropped as if a call had begun."""
    content, n_calls, dropped = _both_readers(reply, cut=False)
    assert content == reply.split("</tool_call>")[-1].strip() and not dropped
    assert n_calls == reply.count("</tool_call>")


def test_the_server_reads_such_an_end_by_the_finish_reason() -> None:
    """Whole or streamed, a reply that ends ``<t`` keeps it when the model ended it, and drops it
    when ``max_tokens`` cut it (a call may have begun)."""
    pytest.importorskip("fastapi")
    from branchwise.backends.base import Generation
    from branchwise.serve.replies import ChatChunks, chat_choice_message

    constraint = Constraint.of_tools(CALCULATOR)
    assert constraint is not None
    text = "a < b and x <t"
    for reason, content in (("eos", text), ("length", "a < b and x")):
        g = Generation(0, [1], text, [0.0], [0.0], reason)  # type: ignore[arg-type]
        assert chat_choice_message(g, constraint)[0]["content"] == content
        chunks = ChatChunks(constraint.tools)
        deltas = chunks.push(text[:5]) + chunks.push(text[5:], end=True, cut=reason == "length")
        assert "".join(d["delta"].get("content", "") for d in deltas) == content


def test_a_branch_that_repeats_its_call_votes_for_the_call_once() -> None:
    """Self-consistency over actions: a branch that wrote its call three times and one that wrote it
    once (or was cut in a second call) vote for the same action."""
    from branchwise.reasoners.typed import Typed

    typed = Typed.build(
        tools=[{"type": "function", "function": {"name": "calculator"}}],
        tool_choice="required",
        parallel_tool_calls=True,
        response_format=None,
    )
    assert typed is not None
    once = _call("calculator", {"expression": "12 * 7"})
    assert typed.key(REPEATED) == typed.key(once) == typed.key(CUT) == 'calculator({"expression":"12 * 7"})'
    assert len(typed.calls(REPEATED)) == 1
