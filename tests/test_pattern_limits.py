"""The bounds of `branchwise.pattern_limits`: every regex a constraint compiles (a ``regex``
constraint, a schema's ``pattern`` and ``patternProperties`` keys, its ``minLength``/``maxLength``)
is sized from Python's parse of it before anything compiles, and refused with a ValueError naming
the field and the limit. No model, no server."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

import branchwise.pattern_limits as limits
from branchwise.constraints import Constraint
from branchwise.pattern_limits import (
    MAX_CONSTRAINT_PATTERN_SIZE,
    MAX_PATTERN_SIZE,
    MAX_REPEAT,
    PatternSize,
    pattern_size,
)
from branchwise.toolcalls import check_json_schema, normalize_tools

NESTED = "is itself only repetitions"
"""Words of the refusal of a nested repetition."""


def string(**keywords: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {"s": {"type": "string", **keywords}}, "required": ["s"]}


def tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.mark.parametrize(
    ("pattern", "size"),
    [
        (r"\d{4}-\d{2}-\d{2}", 10),
        ("a{1,1000}", 1000),
        ("a{7,}", 7),  # seven copies, then a loop
        ("(ab|c){3}", 9),  # alternatives add up
        ("x+y*", 2),  # a loop is compiled once
        ("^(?:ab)?$", 2),  # anchors stand for no character
        ("([a-z0-9]+-)*[a-z0-9]+", 3),
    ],
)
def test_a_pattern_stands_for_its_characters_written_out(pattern: str, size: int) -> None:
    assert pattern_size(pattern) == size


def test_a_count_at_the_limit_passes_one_more_does_not() -> None:
    Constraint.of_regex(f"a{{1,{MAX_REPEAT}}}")
    Constraint.of_regex(f"a{{{MAX_REPEAT},}}")
    for over in (f"a{{1,{MAX_REPEAT + 1}}}", f"a{{{MAX_REPEAT + 1}}}", f"a{{{MAX_REPEAT + 1},}}"):
        with pytest.raises(
            ValidationError, match=rf"count of {MAX_REPEAT + 1}, over the limit of {MAX_REPEAT}"
        ):
            Constraint.of_regex(over)


def test_counts_multiply_through_nested_groups() -> None:
    """Each count within `MAX_REPEAT`, but their product past `MAX_PATTERN_SIZE`."""
    inner = MAX_REPEAT // 2 - 1  # with the fixed "y", a group of MAX_REPEAT // 2 characters
    times = MAX_PATTERN_SIZE // (inner + 1) + 1
    assert pattern_size(f"(x{{1,{inner}}}y){{{times - 1}}}") == (inner + 1) * (times - 1)
    with pytest.raises(ValidationError, match=f"more than {MAX_PATTERN_SIZE} characters"):
        Constraint.of_regex(f"(x{{1,{inner}}}y){{{times}}}")


@pytest.mark.parametrize(
    "pattern", ["(a+)+", "(b*)*", r"(\w+\s?)+", "(a|b+)+", "(?:ab|c*)+", "(a+){3}", "((a+)+)+"]
)
def test_a_repetition_of_repetitions_alone_is_refused(pattern: str) -> None:
    with pytest.raises(ValidationError, match=NESTED):
        Constraint.of_regex(pattern)
    with pytest.raises(ValueError, match=rf"^json_schema\.properties\.s\.pattern: .*{NESTED}"):
        Constraint.of_json_schema(string(pattern=pattern))


@pytest.mark.parametrize(
    "pattern", ["([a-z0-9]+-)*[a-z0-9]+", r"(\d{3}-)+\d{4}", "(a{2})+", "(a+)?", "(x(ab)+)+"]
)
def test_a_repeated_group_with_a_fixed_character_is_accepted(pattern: str) -> None:
    assert Constraint.of_regex(pattern).pattern == pattern


def test_why_nested_repetition_is_refused() -> None:
    """What the refusal prevents, measured small: Python's backtracking ``re`` (which checks outputs)
    doubles its time with each character of a non-matching text under ``(a+)+``; the same text
    under the refused pattern's fixed form is checked at once."""
    import re

    def seconds(pattern: str, text: str) -> float:
        start = time.perf_counter()
        assert re.fullmatch(pattern, text) is None
        return time.perf_counter() - start

    slow = min(seconds(r"(a+)+b", "a" * 20) for _ in range(3))
    fast = min(seconds(r"(a+-)+b", "a-" * 20) for _ in range(3))
    assert slow > 20 * fast


def test_length_bounds_count_as_the_pattern_they_compile_to() -> None:
    """``minLength``/``maxLength`` become ``{least,most}`` (`schema_budget.capped_string`): one
    repetition of the larger bound, held to `MAX_REPEAT`, the field named."""
    Constraint.of_json_schema(string(minLength=10, maxLength=MAX_REPEAT))
    with pytest.raises(ValueError, match=rf"^json_schema\.properties\.s\.maxLength: {MAX_REPEAT + 1}, over"):
        Constraint.of_json_schema(string(maxLength=MAX_REPEAT + 1))
    with pytest.raises(ValueError, match=rf"properties\.s\.minLength: {MAX_REPEAT + 1}, over the limit"):
        Constraint.of_json_schema(string(minLength=MAX_REPEAT + 1))
    size = PatternSize()
    size.add_schema(string(minLength=10, maxLength=300), "schema")
    assert size.total == 300


def test_pattern_property_names_are_patterns() -> None:
    schema = {"type": "object", "patternProperties": {f"^k{{{MAX_REPEAT + 1}}}$": {"type": "integer"}}}
    with pytest.raises(ValueError, match=r"^schema\.patternProperties\[.*\]: a repetition count"):
        check_json_schema(schema, "schema")


def test_data_is_not_read_as_a_schema() -> None:
    """An ``enum``, ``const``, ``default`` or ``examples`` value that looks like a schema is data."""
    huge = {"pattern": "a{99999}", "maxLength": 10**9}
    schema = {"type": "object", "enum": [huge], "const": huge, "default": huge, "examples": [huge]}
    assert check_json_schema(schema, "schema") == schema


def test_a_requests_patterns_add_up_across_its_tools() -> None:
    """Each tool within the limits, all of them together past `MAX_CONSTRAINT_PATTERN_SIZE`."""
    per_tool = string(maxLength=MAX_REPEAT)
    fit = MAX_CONSTRAINT_PATTERN_SIZE // MAX_REPEAT
    normalize_tools([tool(f"t{i}", per_tool) for i in range(fit)])
    with pytest.raises(
        ValueError, match=rf"^tools\[{fit}\]\.function\.parameters\.properties\.s\.maxLength: "
    ):
        normalize_tools([tool(f"t{i}", per_tool) for i in range(fit + 1)])
    with pytest.raises(ValueError, match=f"more than {MAX_CONSTRAINT_PATTERN_SIZE} characters together"):
        Constraint.of_json_schema(
            {
                "type": "object",
                "properties": {f"p{i}": {"type": "string", "maxLength": MAX_REPEAT} for i in range(fit + 1)},
            }
        )


@pytest.mark.parametrize(
    "build",
    [
        lambda: Constraint.of_regex("a{1,60000}"),
        lambda: Constraint.of_json_schema(string(pattern="(a+)+(b*)*c{1,30000}")),
        lambda: Constraint.of_json_schema(string(pattern="c{1,30000}")),
        lambda: Constraint.of_tools([tool("f", string(maxLength=60000))], "required"),
    ],
    ids=["regex", "nested-schema-pattern", "schema-pattern", "tool-max-length"],
)
def test_a_pathological_pattern_is_refused_within_a_second(build: Any) -> None:
    """Patterns that compiled for minutes (a schema's ``c{1,30000}``) are refused before compiling."""
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"over the limit|only repetitions"):
        build()
    assert time.perf_counter() - start < 1.0


def test_an_unparsable_pattern_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="not a valid regular expression"):
        pattern_size("(a")


def test_every_limit_is_documented() -> None:
    """docs/SERVING.md's limits table names each constant."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "SERVING.md").read_text(encoding="utf-8")
    assert [name for name in limits.__all__ if name.startswith("MAX_") and f"`{name}`" not in doc] == []
