"""The bounds of `branchwise.schema_limits`: every schema, choice list and regex a constraint takes is
measured before anything recursive or slow touches it, and refused with a ValueError naming the
field and the limit (never a RecursionError, whatever the depth). No model, no server."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from branchwise.constraints import Constraint, OutputError
from branchwise.schema_limits import (
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_ENUM_VALUES,
    MAX_PATTERN_CHARS,
    MAX_SCHEMA_CHARS,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_NODES,
    MAX_TOOLS,
    SchemaSize,
)
from branchwise.toolcalls import check_json_schema, normalize_tools


def nested_items(depth: int) -> dict[str, Any]:
    """A schema whose JSON nests `depth` levels (``items`` adds one level a step), built without
    recursion so that any depth can be made."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_a_schema_at_the_depth_limit_passes_one_level_more_does_not() -> None:
    check_json_schema(nested_items(MAX_SCHEMA_DEPTH), "schema")
    with pytest.raises(ValueError, match=rf"^schema: .*more than {MAX_SCHEMA_DEPTH} levels"):
        check_json_schema(nested_items(MAX_SCHEMA_DEPTH + 1), "schema")


def test_any_depth_is_a_value_error_never_a_recursion_error() -> None:
    """100,000 levels: the walk is iterative and stops at the limit (jsonschema alone would recurse
    past Python's limit at about 150)."""
    with pytest.raises(ValueError, match=f"more than {MAX_SCHEMA_DEPTH} levels"):
        Constraint.of_json_schema(nested_items(100_000))


def test_enum_values_are_bounded_across_a_requests_tools() -> None:
    half = MAX_ENUM_VALUES // 2 + 1
    params = {"type": "object", "properties": {"a": {"enum": list(range(half))}}}
    normalize_tools([tool("one", params)])  # alone, each tool fits
    with pytest.raises(ValueError, match=rf"^tools\[1\]\.function\.parameters: .*{MAX_ENUM_VALUES} values"):
        normalize_tools([tool("one", params), tool("two", params)])


def test_an_enum_of_100000_strings_is_refused() -> None:
    with pytest.raises(ValueError, match=f"more than {MAX_ENUM_VALUES} values"):
        Constraint.from_response_format(
            {"type": "json_schema", "json_schema": {"schema": {"enum": [f"v{i}" for i in range(100_000)]}}}
        )


def test_nodes_and_characters_are_bounded() -> None:
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(MAX_SCHEMA_NODES)}}
    with pytest.raises(ValueError, match=f"more than {MAX_SCHEMA_NODES} JSON values"):
        check_json_schema(wide, "schema")
    long = {"type": "string", "description": "x" * MAX_SCHEMA_CHARS}
    with pytest.raises(ValueError, match=f"over the limit of {MAX_SCHEMA_CHARS}"):
        check_json_schema(long, "schema")


def test_the_totals_add_up_across_schemas() -> None:
    size = SchemaSize()
    size.add({"type": "string"}, "a")
    size.add({"type": "integer"}, "b")
    assert (size.nodes, size.enum_values, size.chars) == (4, 0, len('{"type":"string"}{"type":"integer"}'))


def test_too_many_tools_are_refused_before_any_is_checked() -> None:
    tools = [tool(f"t{i}", {"type": "object"}) for i in range(MAX_TOOLS + 1)]
    with pytest.raises(ValueError, match=f"^tools: {MAX_TOOLS + 1} tools, over the limit of {MAX_TOOLS}"):
        normalize_tools(tools)
    assert len(normalize_tools(tools[:MAX_TOOLS])) == MAX_TOOLS


def test_choice_lists_are_bounded_in_count_and_length() -> None:
    Constraint.of_choice([f"c{i}" for i in range(MAX_CHOICES)])
    with pytest.raises(ValidationError, match=f"over the limit of {MAX_CHOICES}"):
        Constraint.of_choice([f"c{i}" for i in range(MAX_CHOICES + 1)])
    with pytest.raises(ValidationError, match=f"over the limit of {MAX_CHOICE_CHARS}"):
        Constraint.of_choice(["x" * (MAX_CHOICE_CHARS // 2 + 1), "y" * (MAX_CHOICE_CHARS // 2)])


def test_regexes_are_bounded_in_length_and_nesting() -> None:
    with pytest.raises(ValidationError, match=f"over the limit of {MAX_PATTERN_CHARS}"):
        Constraint.of_regex("a" * (MAX_PATTERN_CHARS + 1))
    with pytest.raises(ValidationError, match="nested too deep"):  # Python's parser recurses
        Constraint.of_regex("(" * 3000 + "a" + ")" * 3000)


def test_a_repetition_count_past_pythons_is_a_value_error() -> None:
    """Python's regex parser raises OverflowError (no ValueError) past 2**32 - 1 repetitions, and
    RecursionError on groups nested too deep: both once escaped the validators as a server's 500."""
    with pytest.raises(ValidationError, match=r"pattern: not a valid regular expression .*too large"):
        Constraint.of_regex("a{99999999999}")
    with pytest.raises(ValueError, match=r"^json_schema: not a valid JSON Schema \(a pattern: .*too large"):
        Constraint.of_json_schema({"type": "string", "pattern": "(ab){4294967296}"})
    with pytest.raises(ValueError, match=r"^tools\[0\]\.function\.parameters: .*nests its groups too deep"):
        normalize_tools([tool("f", {"type": "string", "pattern": "(" * 1000 + "a" + ")" * 1000})])
    # within Python's limit, a count is then sized for the grammar engine (`pattern_limits`)
    with pytest.raises(ValidationError, match=r"a repetition count of 4294967294, over the limit of 1000"):
        Constraint.of_regex("a{4294967294}")


def test_output_nested_past_the_parser_is_an_output_error() -> None:
    """A ``json_object`` reply may nest without bound: reading it is an OutputError, not a crash."""
    with pytest.raises(OutputError, match="nested too deep"):
        Constraint.of_json_object().parse("[" * 100_000 + "]" * 100_000)


def test_every_limit_is_documented() -> None:
    """docs/SERVING.md's limits table names each constant (and so says why it is there)."""
    from pathlib import Path

    import branchwise.schema_limits as limits

    doc = (Path(__file__).resolve().parent.parent / "docs" / "SERVING.md").read_text(encoding="utf-8")
    assert [name for name in limits.__all__ if name.startswith("MAX_") and f"`{name}`" not in doc] == []
