"""JSON that is always whole within ``max_tokens``: a random tiny model (which takes any token its
grammar allows, so it opens strings, arrays and objects wherever it may) decodes under
``json_object``, a nested JSON Schema and a forced tool call at every budget from the least that
holds the shortest output up to 64, and every reply parses and validates; a reply whose closure the
budget forced says ``length``."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr

from branchwise.backends.base import DecodeParams
from branchwise.constraints import Constraint
from branchwise.toolcalls import normalize_tools, parse_tool_calls, valid_arguments

NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "inner": {
            "type": "object",
            "properties": {"x": {"type": "integer"}, "ok": {"type": "boolean"}, "note": {"type": "string"}},
            "required": ["x", "ok"],
        },
    },
    "required": ["name", "tags", "inner"],
}
TOOLS = normalize_tools(
    [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "parameters": {
                    "type": "object",
                    "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                    "required": ["query", "limit"],
                },
            },
        }
    ]
)


def _replies(backend: Any, constraint: Constraint, max_tokens: int) -> list[Any]:
    root = backend.prefill(backend.chat_prompt([{"role": "user", "content": "hello there"}]))
    kids = backend.fork(root, 3)
    params = DecodeParams(temperature=1.0, seed=max_tokens, max_tokens=max_tokens, constraint=constraint)
    gens = backend.extend(kids, params)
    backend.release([*kids, root])
    return gens


def _least(backend: Any, constraint: Constraint) -> int:
    """The tokens the closing walk takes from the empty output: the least budget it can keep."""
    grammars = backend.engine.grammars
    plan = grammars.closer().plan(xgr.GrammarMatcher(grammars.compile(constraint)))
    assert plan is not None
    return len(plan)


def _json_object(text: str) -> None:
    assert isinstance(json.loads(text), dict)


def _nested(text: str) -> None:
    jsonschema.validate(json.loads(text), NESTED)


def _tool_call(text: str) -> None:
    prose, calls = parse_tool_calls(text, TOOLS)
    assert prose == "" and len(calls) >= 1, text
    for call in calls:
        assert call.name == "lookup"
        assert valid_arguments(call, TOOLS), call


CASES = [
    (Constraint.of_json_object(), _json_object),
    (Constraint.of_json_schema(NESTED), _nested),
    (Constraint.of_tools(TOOLS, "required", parallel_tool_calls=False), _tool_call),
]
IDS = ["json_object", "nested_schema", "tool_call"]


def _sweep(backend: Any, constraint: Constraint | None, check: Any, budgets: range) -> int:
    """Decode at each budget, check every reply; the count of replies whose closure was forced."""
    assert constraint is not None
    forced = 0
    for max_tokens in budgets:
        for g in _replies(backend, constraint, max_tokens):
            assert len(g.token_ids) <= max_tokens
            check(g.text)
            assert g.finish_reason in ("eos", "length"), (max_tokens, g.finish_reason, g.text)
            forced += g.finish_reason == "length"
    return forced


@pytest.mark.parametrize(("constraint", "check"), CASES, ids=IDS)
def test_small_budgets_give_whole_json(tiny_backend: Any, constraint: Constraint, check: Any) -> None:
    least = _least(tiny_backend, constraint)
    assert _sweep(tiny_backend, constraint, check, range(least, least + 3)) > 0


@pytest.mark.slow
@pytest.mark.parametrize(("constraint", "check"), CASES, ids=IDS)
def test_every_budget_gives_whole_json(tiny_backend: Any, constraint: Constraint, check: Any) -> None:
    """Every budget from the least up to 64 (up to the least + 40 for a tool call, whose fixed text
    alone takes most of 64 tokens in the tiny vocabulary)."""
    least = _least(tiny_backend, constraint)
    assert _sweep(tiny_backend, constraint, check, range(least, max(65, least + 41))) > 0


def test_a_forced_closure_says_length(tiny_backend: Any) -> None:
    """At the least budget the model cannot write anything of its own: the closure is all there is."""
    c = Constraint.of_json_schema(NESTED)
    least = _least(tiny_backend, c)
    for g in _replies(tiny_backend, c, least):
        _nested(g.text)
        assert g.finish_reason == "length"


def test_the_closing_walk_closes_and_leaves_the_matcher_as_it_was(tiny_backend: Any) -> None:
    grammars = tiny_backend.engine.grammars
    tokenizer = tiny_backend.engine.tokenizer
    matcher = xgr.GrammarMatcher(grammars.compile(Constraint.of_json_object()))
    start = '{"a": [1, {"b": "x\\'
    for token in tokenizer.encode(start, add_special_tokens=False):
        assert matcher.accept_token(token)
    plan = grammars.closer().plan(matcher)
    assert plan is not None
    closing = tokenizer.decode(plan)
    assert isinstance(json.loads(start + closing), dict), closing
    assert len(plan) <= len(closing.encode())  # pieces of the vocabulary, never more than a byte each
    assert not matcher.is_completed()
    for token in plan:  # the matcher is where it was: the plan's tokens take it to the end
        assert matcher.accept_token(token)
    assert matcher.is_completed()
