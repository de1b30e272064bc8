"""Constraints and tool calls as values (no model): validation that names the field, the OpenAI
shapes in and out, parsing replies and the canonical form votes compare."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pydantic import BaseModel, ValidationError

from branchwise.backends.base import DecodeParams
from branchwise.constraints import Constraint, OutputError
from branchwise.toolcalls import (
    ToolCall,
    normalize_tool_choice,
    normalize_tools,
    parse_tool_calls,
    render_messages,
    repeats_a_call,
    template_has_tools,
)

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}


class Answer(BaseModel):
    value: int
    why: str


def test_no_torch_is_imported() -> None:
    code = "import sys, branchwise.constraints, branchwise.toolcalls; print('torch' in sys.modules)"
    assert (
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        == "False"
    )


def test_constructors_and_openai_response_format() -> None:
    c = Constraint.of_json_schema(Answer)
    assert c.kind == "json_schema" and c.json_schema["required"] == ["value", "why"]
    assert Constraint.from_response_format({"type": "text"}) is None
    assert Constraint.from_response_format({"type": "json_object"}) == Constraint.of_json_object()
    rf = {
        "type": "json_schema",
        "json_schema": {"name": "a", "schema": Answer.model_json_schema(), "strict": False},
    }
    assert Constraint.from_response_format(rf).strict is False
    # the OpenAI shape validates wherever a Constraint does (a YAML strategy's response_format)
    assert (
        DecodeParams.model_validate({"constraint": {"type": "json_object"}}).constraint
        == Constraint.of_json_object()
    )


def test_constraints_are_hashable_values() -> None:
    """Decode calls are grouped by their parameters, so equal constraints must hash equal."""
    a = DecodeParams(
        constraint=Constraint.of_json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    )
    b = DecodeParams(
        constraint=Constraint.of_json_schema({"properties": {"x": {"type": "integer"}}, "type": "object"})
    )
    assert a == b and hash(a) == hash(b)
    assert hash(Constraint.of_choice(["x"])) != hash(Constraint.of_choice(["y"]))


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: Constraint.of_json_schema({"type": "nope"}), "json_schema"),
        (lambda: Constraint.of_json_schema([1, 2]), "json_schema"),
        (lambda: Constraint.of_regex("(unclosed"), "pattern"),
        (lambda: Constraint.of_choice([]), "choices"),
        (lambda: Constraint.of_choice(["a", ""]), "choices"),
        (lambda: Constraint.of_tools([ADD], "mul"), "tool_choice"),
        (lambda: Constraint.of_tools([], "auto"), "tools"),
        (
            lambda: Constraint.of_tools([{"type": "function", "function": {"name": "bad name"}}]),
            r"tools\[0\].function.name",
        ),
        (lambda: Constraint.of_tools([ADD, ADD]), r"tools\[1\].function.name"),
        (
            lambda: Constraint.of_tools(
                [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]
            ),
            r"tools\[0\].function.parameters",
        ),
        (lambda: Constraint.from_response_format({"type": "xml"}), "response_format.type"),
        (lambda: Constraint.from_response_format({"type": "json_schema"}), "response_format.json_schema"),
    ],
)
def test_bad_constraints_name_the_field(build, field) -> None:
    with pytest.raises((ValueError, ValidationError), match=field):
        build()


def test_tool_choice_shapes() -> None:
    tools = normalize_tools([ADD])
    assert normalize_tool_choice({"type": "function", "function": {"name": "add"}}, tools) == "add"
    assert normalize_tool_choice("any", tools) == "required"  # LangChain's word
    assert normalize_tool_choice(None, tools) == "auto"
    assert Constraint.of_tools(tools, "none") is None


def test_parse_replies() -> None:
    tools = normalize_tools([ADD])
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3.0}}\n</tool_call>\n'
    prose, calls = parse_tool_calls(text, tools)
    assert prose == "Let me add." and calls[0].name == "add" and calls[0].arguments == {"a": 2, "b": 3.0}
    assert calls[0].canonical() == ToolCall(name="add", arguments={"b": 3, "a": 2}).canonical()
    # broken JSON and an unknown tool stay prose; a block cut by max_tokens is dropped
    for bad in [
        '<tool_call>{"name": "add", "arguments": {</tool_call>',
        '<tool_call>{"name": "mul", "arguments": {}}</tool_call>',
    ]:
        assert parse_tool_calls(bad, tools) == (bad.strip(), [])
    assert parse_tool_calls("Adding. <tool_call>\n{", tools) == ("Adding.", [])
    cut = parse_tool_calls(text + '<tool_call>\n{"name": "add", "argu', tools)
    assert cut[0] == "Let me add." and [c.canonical() for c in cut[1]] == [calls[0].canonical()]
    c = Constraint.of_tools(tools, "required")
    with pytest.raises(OutputError, match="tool call"):
        c.parse("no call here")
    openai = calls[0].openai()
    assert openai["type"] == "function" and json.loads(openai["function"]["arguments"]) == {"a": 2, "b": 3.0}


def test_a_repeated_call_ends_the_reply() -> None:
    """A call identical to an earlier one (canonically: key order, 3 vs 3.0, whitespace) ends the
    reply: it and all after it are dropped, prose included; different calls all count."""
    tools = normalize_tools([ADD])

    def block(args: str) -> str:
        return f'<tool_call>\n{{"name": "add", "arguments": {args}}}\n</tool_call>'

    one, other, again = block('{"a": 2, "b": 3}'), block('{"a": 1, "b": 1}'), block('{ "b": 3.0, "a": 2 }')
    text = f"Adding.\n{one}\n{other}\n{again}\nthen more {one}"
    prose, calls = parse_tool_calls(text, tools)
    assert prose == "Adding." and [c.arguments for c in calls] == [{"a": 2, "b": 3}, {"a": 1, "b": 1}]
    assert repeats_a_call(text, tools) and not repeats_a_call(f"{one}\n{other}", tools)
    parsed = Constraint.of_tools(tools, "required").parse(text)
    assert [c.canonical() for c in parsed] == [c.canonical() for c in calls]


def test_parse_json_outputs() -> None:
    c = Constraint.of_json_schema(Answer)
    assert c.parse('{"value": 19, "why": "12 + 7"}') == {"value": 19, "why": "12 + 7"}
    with pytest.raises(OutputError, match="complete JSON"):
        c.parse('{"value": 19, "wh')
    with pytest.raises(OutputError, match="shortest JSON this schema allows is 20 characters"):
        c.parse('{"value": 19, "wh')  # {"value":0,"why":""}: what a budget must leave room for
    with pytest.raises(OutputError, match="schema"):
        c.parse('{"value": "x", "why": ""}')


def test_render_history_fallback_and_native() -> None:
    tools = normalize_tools([ADD])
    history = [
        {"role": "user", "content": "2+3?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]
    fallback = render_messages(history, tools, native=False)
    assert fallback[0]["role"] == "system" and "<tools>" in fallback[0]["content"]
    assert (
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in fallback[2]["content"]
    )
    assert fallback[3] == {"role": "user", "content": "<tool_response>\n5\n</tool_response>"}
    native = render_messages(history, tools, native=True)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"a": 2, "b": 3}
    assert native[2]["role"] == "tool"
    bad = [{"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": "{oops"}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\].tool_calls\[0\].function.arguments"):
        render_messages(bad, tools, native=False)
    assert template_has_tools("{% if tools %}<tool_call>{% endif %}") and not template_has_tools(
        "{{ messages }}"
    )
