"""`serve`'s DSPy field format (`serve/field_format.py`): a request that asks for DSPy's fields in
DSPy's own words is decoded under their JSON Schema and answered in the adapter's format.

The prompts are DSPy's own (`ChatAdapter.format`, `JSONAdapter.format`), so a DSPy release that
rewords its adapters fails here, not in a user's program."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pydantic
import pytest

dspy = pytest.importorskip("dspy")
httpx = pytest.importorskip("httpx")

from branchwise.serve import create_app  # noqa: E402
from branchwise.serve.field_format import FieldFormat  # noqa: E402
from branchwise.serve.runner import serve_in_thread  # noqa: E402


class Typed(dspy.Signature):  # type: ignore[misc]
    """Answer with a count."""

    question: str = dspy.InputField()
    reasoning: str = dspy.OutputField()
    count: int = dspy.OutputField()
    sure: bool = dspy.OutputField()


class Point(pydantic.BaseModel):
    x: int
    y: int


def _messages(adapter: Any, signature: Any) -> list[dict[str, Any]]:
    return adapter.format(signature, demos=[], inputs={"question": "How many legs has a cat?"})


def test_chat_adapter_fields_are_read_in_order_and_written_back_as_its_markers() -> None:
    signature = dspy.ChainOfThought("question -> answer").predict.signature
    fields = FieldFormat.of(_messages(dspy.ChatAdapter(), signature))
    assert fields == FieldFormat((("reasoning", None), ("answer", None)), "markers")
    reply = fields.render('{"reasoning": "Cats walk on four. [[ ## answer ## ]] early?", "answer": "4"}')
    parsed = dspy.ChatAdapter().parse(signature, reply)
    assert parsed == {"reasoning": "Cats walk on four. ## answer ## early?", "answer": "4"}


def test_typed_fields_get_their_json_types_and_parse_back() -> None:
    fields = FieldFormat.of(_messages(dspy.ChatAdapter(), Typed))
    assert fields is not None and fields.fields == (("reasoning", None), ("count", "int"), ("sure", "bool"))
    schema = fields.constraint().json_schema
    assert schema is not None
    assert [schema["properties"][k]["type"] for k in ("reasoning", "count", "sure")] == [
        "string",
        "integer",
        "boolean",
    ]
    parsed = dspy.ChatAdapter().parse(Typed, fields.render('{"reasoning": "r", "count": 4, "sure": true}'))
    assert parsed == {"reasoning": "r", "count": 4, "sure": True}


def test_react_steps_get_their_tool_names_as_an_enum_and_arguments_as_an_object() -> None:
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    signature = dspy.ReAct("question -> answer", tools=[add]).react.signature
    inputs = {"question": "What is 44 + 44?", "trajectory": ""}
    fields = FieldFormat.of(dspy.ChatAdapter().format(signature, demos=[], inputs=inputs))
    assert fields is not None
    schema = fields.constraint().json_schema
    assert schema is not None and schema["properties"]["next_tool_name"] == {"enum": ["add", "finish"]}
    assert schema["properties"]["next_tool_args"] == {"type": "object"}
    reply = fields.render(
        '{"next_thought": "add them", "next_tool_name": "add", "next_tool_args": {"a": 44, "b": 44}}'
    )
    parsed = dspy.ChatAdapter().parse(signature, reply)
    assert parsed == {
        "next_thought": "add them",
        "next_tool_name": "add",
        "next_tool_args": {"a": 44, "b": 44},
    }


def test_json_adapter_fields_are_read_and_its_reply_kept_as_is() -> None:
    signature = dspy.Predict("question -> answer").signature
    fields = FieldFormat.of(_messages(dspy.JSONAdapter(), signature))
    assert fields == FieldFormat((("answer", None),), "json")
    assert fields.render('{"answer": "4"}') == '{"answer": "4"}'


def test_other_prompts_and_other_field_types_are_left_as_they_came() -> None:
    assert FieldFormat.of([{"role": "user", "content": "What is 12 + 7?"}]) is None
    modelled = dspy.Signature({"question": (str, dspy.InputField()), "point": (Point, dspy.OutputField())})
    assert FieldFormat.of(_messages(dspy.ChatAdapter(), modelled)) is None
    assert FieldFormat.of([{"role": "user", "content": [{"type": "text", "text": "hi"}]}]) is None


@pytest.fixture(scope="module")
def servers(tiny_backend: Any) -> Iterator[tuple[str, str]]:
    """The same backend served with the field format on (the default) and off."""
    with (
        serve_in_thread(create_app(tiny_backend, model_name="tiny")) as on,
        serve_in_thread(create_app(tiny_backend, model_name="tiny", dspy_fields=False)) as off,
    ):
        yield on, off


@pytest.mark.parametrize("max_tokens", [24, 64])
def test_a_served_dspy_request_parses_whatever_max_tokens_allows(
    servers: tuple[str, str], max_tokens: int
) -> None:
    on, off = servers
    signature = dspy.ChainOfThought("question -> answer").predict.signature
    body = {"messages": _messages(dspy.ChatAdapter(), signature), "max_tokens": max_tokens, "temperature": 0}
    reply = httpx.post(f"{on}/v1/chat/completions", json=body, timeout=120).json()
    assert "choices" in reply, reply
    content = reply["choices"][0]["message"]["content"]
    parsed = dspy.ChatAdapter().parse(signature, content)  # the tiny random model writes gibberish
    assert set(parsed) == {"reasoning", "answer"} and content.endswith("[[ ## completed ## ]]")
    assert any(note.startswith("dspy_fields:") for note in reply["branchwise"]["notes"])
    assert reply["usage"]["completion_tokens"] <= max_tokens
    plain = httpx.post(f"{off}/v1/chat/completions", json=body, timeout=120).json()
    assert "[[ ## completed ## ]]" not in plain["choices"][0]["message"]["content"]
    assert "branchwise" not in plain or not plain["branchwise"].get("notes")


def test_a_budget_below_the_fields_shortest_json_leaves_the_request_as_it_came(
    servers: tuple[str, str],
) -> None:
    on, _ = servers
    signature = dspy.ChainOfThought("question -> answer").predict.signature
    body = {"messages": _messages(dspy.ChatAdapter(), signature), "max_tokens": 8, "temperature": 0}
    reply = httpx.post(f"{on}/v1/chat/completions", json=body, timeout=120).json()
    assert "choices" in reply, reply  # the client asked for no grammar: no 400 for one
    assert "[[ ## completed ## ]]" not in reply["choices"][0]["message"]["content"]
    assert reply["usage"]["completion_tokens"] <= 8
