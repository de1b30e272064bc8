"""Strategies over typed answers and actions: self-consistency and best-of-n vote on values and
canonical tool calls decoded in one shared-prefix batch under the grammar."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from branchwise.constraints import Constraint
from branchwise.reasoners import Reasoner
from branchwise.reasoners.typed import Typed
from branchwise.strategies import Strategy, best_of_n, self_consistency
from branchwise.toolcalls import ToolCall


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class Verdict(BaseModel):
    ok: bool
    n: int


def test_votes_compare_canonical_calls() -> None:
    typed = Typed.build(tools=[add], tool_choice="auto", parallel_tool_calls=True, response_format=None)
    assert typed is not None
    one = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    same = '<tool_call>\n{"name": "add", "arguments": {"b": 3.0, "a": 2}}\n</tool_call>'
    assert typed.key(one) == typed.key(same) == 'add({"a":2,"b":3})'
    assert typed.key("The answer is 5.") == "5"  # auto: a prose reply votes with its answer
    json_typed = Typed.build(
        tools=None, tool_choice="auto", parallel_tool_calls=True, response_format=Verdict
    )
    assert json_typed.key('{"n": 2, "ok": true}') == json_typed.key('{"ok":true,"n":2.0}')
    assert json_typed.key('{"ok": true') is None  # cut output abstains
    assert json_typed.value('{"ok": true, "n": 2}') == Verdict(ok=True, n=2)


def test_tools_and_response_format_together_are_refused() -> None:
    with pytest.raises(ValueError, match="response_format"):
        Typed.build(tools=[add], tool_choice="auto", parallel_tool_calls=True, response_format=Verdict)
    assert (
        Typed.build(tools=[add], tool_choice="none", parallel_tool_calls=True, response_format=None) is None
    )


def test_self_consistency_over_tool_calls(tiny_backend) -> None:
    reasoner = Reasoner(
        self_consistency(n=6, temperature=1.0, max_tokens=400, seed=1),
        backend=tiny_backend,
        tools=[add],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    result = reasoner.run("What is 2 + 3?")
    assert all(isinstance(c, ToolCall) for c in result.tool_calls) and result.tool_calls
    assert result.tool_calls[0].name == "add" and set(result.tool_calls[0].arguments) == {"a", "b"}
    assert result.answer == result.tool_calls[0].canonical()
    assert sum(result.votes.values()) == 6  # every branch wrote a valid call, so every branch voted
    assert result.runner_up is None or result.runner_up in result.votes
    assert result.value == result.tool_calls
    assert tiny_backend.kv_stats().bytes_held == 0 or tiny_backend.kv_stats().live_nodes == 0


def test_best_of_n_over_actions_with_a_verifier(tiny_backend) -> None:
    reasoner = Reasoner(
        best_of_n(n=3, verifier="confidence", temperature=1.0, max_tokens=400, seed=2),
        backend=tiny_backend,
        tools=[add],
        tool_choice="add",
    )
    result = reasoner.run("What is 2 + 3?")
    assert result.tool_calls and all(c.name == "add" for c in result.tool_calls)
    assert sum(b.selected for b in result.branches) == 1


def test_a_typed_answer_is_a_validated_model(tiny_backend) -> None:
    reasoner = Reasoner(
        self_consistency(n=3, temperature=1.0, max_tokens=300, seed=0),
        backend=tiny_backend,
        response_format=Verdict,
    )
    result = reasoner.run("Is 2 + 3 = 5?")
    assert isinstance(result.value, Verdict)
    assert Verdict.model_validate_json(result.answer) == result.value


def test_a_yaml_strategy_asks_for_typed_answers(tiny_backend) -> None:
    """`response_format` on a generate node round-trips through YAML in OpenAI's shape and decodes
    under its grammar without any reasoner argument."""
    strategy = self_consistency(n=2, temperature=1.0, max_tokens=300, seed=0)
    gen = strategy.nodes[0].model_copy(update={"response_format": Constraint.of_json_schema(Verdict)})
    spec = strategy.model_copy(update={"nodes": [gen, *strategy.nodes[1:]]}).to_yaml()
    loaded = Strategy.from_yaml(spec)
    assert loaded.nodes[0].response_format == Constraint.of_json_schema(Verdict)
    openai_shape = spec.replace("kind: json_schema", "type: json_object").split("json_schema:")[0]
    assert "response_format" in openai_shape
    result = Reasoner(loaded, backend=tiny_backend).run("Is 2 + 3 = 5?")
    Verdict.model_validate_json(result.answer)
    from_openai = Strategy.model_validate(
        {
            **loaded.model_dump(),
            "nodes": [
                {**loaded.nodes[0].model_dump(), "response_format": {"type": "json_object"}},
                loaded.nodes[1].model_dump(),
            ],
        }
    )
    assert from_openai.nodes[0].response_format == Constraint.of_json_object()
