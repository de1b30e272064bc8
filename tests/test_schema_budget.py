"""`branchwise.schema_budget` measures a schema's shortest valid value without building it.

The counts in a schema (``minItems``, ``minLength``, ``minProperties``, a pattern's repetitions)
come from whoever sent it; the value's length, free strings and whitespace gaps are worked out by
arithmetic, each subschema read once, so neither the time nor the memory grows with a count (a
billion-item array used to be built on the server's event loop). Where the value is short, what is
measured is what is built. No model, no server.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import pytest

from branchwise.schema_budget import (
    MAX_COUNT,
    MAX_DEPTH,
    MAX_TEXT_CHARS,
    _gaps,
    _Reader,
    pattern_least_chars,
    shortest,
    shortest_text,
)

SMALL: list[dict[str, Any]] = [
    {"type": "array", "items": {"type": "integer", "minimum": 7}, "minItems": 3},
    {"type": "array", "prefixItems": [{"const": "x"}, {"type": "boolean"}], "items": {}, "minItems": 4},
    {"type": "array", "items": {"type": "array", "items": {"type": "null"}, "minItems": 2}, "minItems": 2},
    {"type": "string", "minLength": 5},
    {"type": "string", "pattern": "^[A-Z]{3}-\\d{2}$"},
    {"enum": ["long one", "ab", {"k": [1, 2]}]},
    {"anyOf": [{"type": "string", "minLength": 9}, {"type": "array", "minItems": 2}]},
    {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"$ref": "#/$defs/pair"}, "c": {"type": "integer"}},
        "required": ["b", "a"],
        "$defs": {"pair": {"type": "array", "items": {"type": "number"}, "minItems": 2}},
    },
    {"type": "object", "properties": {"opt": {"type": "integer"}}, "minProperties": 3},
]


@pytest.mark.parametrize("schema", SMALL, ids=range(len(SMALL)))
def test_what_is_measured_is_what_is_built(schema: dict[str, Any]) -> None:
    least = shortest(schema)
    assert least is not None
    assert least.gaps == _gaps(least.value)
    if "minProperties" in schema:  # unnamed properties are counted with empty names, the least a name takes
        assert least.chars == len(least.text) - 1  # built as "" and "0": one name of one character
        assert set(least.value) == {"opt", "", "0"}
    else:
        assert least.chars == len(least.text)


def test_the_measured_values() -> None:
    texts = [shortest_text(s) for s in SMALL[:8]]
    assert texts == [
        "[7,7,7]",
        '["x",true,0,0]',
        "[[null,null],[null,null]]",
        '"aaaaa"',
        '"aaaaaa"',  # the pattern's least length (6), not a match of it
        '"ab"',
        "[0,0]",
        '{"b":[0,0],"a":""}',
    ]
    assert shortest(SMALL[7]).free == 1  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("schema", "chars", "free", "gaps"),
    [
        ({"type": "array", "items": {"type": "integer"}, "minItems": 10**9}, 2 * 10**9 + 1, 0, 2 * 10**9),
        ({"type": "string", "minLength": 10**9}, 10**9 + 2, 1, 0),
        ({"type": "array", "items": {"type": "string"}, "minItems": 10**9}, 3 * 10**9 + 1, 10**9, 2 * 10**9),
        ({"type": "object", "minProperties": 10**9}, 5 * 10**9 + 1, 0, 4 * 10**9),
        ({"type": "string", "pattern": "^(ab|c){1000000000}$"}, 10**9 + 2, 0, 0),
        ({"type": "array", "items": {"type": "integer"}, "minItems": 1e9}, 2 * 10**9 + 1, 0, 2 * 10**9),
    ],
    ids=["minItems", "minLength", "free-strings", "minProperties", "pattern", "float-count"],
)
def test_a_billion_is_measured_not_built(schema: dict[str, Any], chars: int, free: int, gaps: int) -> None:
    tracemalloc.start()
    try:
        least = shortest(schema)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert least is not None and (least.chars, least.free, least.gaps) == (chars, free, gaps)
    assert peak < 1 << 20  # a megabyte: nothing the size of the value was made
    with pytest.raises(ValueError, match=f"only up to {MAX_TEXT_CHARS} are built"):
        _ = least.text
    assert shortest_text(schema) is None


def test_counts_of_any_size_are_held() -> None:
    """Counts past `MAX_COUNT` (a hundred-digit integer, ten nested billions) stay machine-sized,
    so the arithmetic stays quick and the numbers printable."""
    huge = shortest({"type": "string", "minLength": 10**100})
    assert huge is not None and huge.chars == MAX_COUNT
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(10):
        schema = {"type": "array", "items": schema, "minItems": 10**9}
    nested = shortest(schema)
    assert nested is not None and nested.chars == nested.gaps == MAX_COUNT


def _chain(levels: int, fan_out: int) -> dict[str, Any]:
    """Definitions that each hold `fan_out` required references to the next: the value has
    ``fan_out ** levels`` leaves, the schema a few lines per level."""
    names = [f"p{j}" for j in range(fan_out)]
    defs: dict[str, Any] = {
        f"d{i}": {
            "type": "object",
            "properties": {n: {"$ref": f"#/$defs/d{i + 1}"} for n in names},
            "required": names,
        }
        for i in range(levels)
    }
    defs[f"d{levels}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def test_a_definition_used_many_times_is_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """15 levels of 10 references each: 10**15 leaves, once expanded one by one; each subschema is
    read once per depth now, so the reads are counted by the schema's size."""
    reads = []
    real = _Reader._read

    def counted(self: _Reader, schema: Any, depth: int) -> Any:
        reads.append(depth)
        return real(self, schema, depth)

    monkeypatch.setattr(_Reader, "_read", counted)
    least = shortest(_chain(15, 10))
    assert least is not None and least.chars == MAX_COUNT  # 10**15 leaves, each "0" in "p0":0
    assert len(reads) <= 15 * 12 + 2  # each level: its $ref, its object, its ten properties' $refs
    small = shortest(_chain(3, 2))
    assert small is not None and small.text == '{"p0":{"p0":{"p0":0,"p1":0},"p1":{"p0":0,"p1":0}},' + (
        '"p1":{"p0":{"p0":0,"p1":0},"p1":{"p0":0,"p1":0}}}'
    )


def test_recursion_past_the_depth_is_unknown() -> None:
    loop = {
        "$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1}},
        "$ref": "#/$defs/a",
    }
    assert shortest(loop) is None  # every level needs one more: no finite value below MAX_DEPTH
    assert MAX_DEPTH == 32


def test_min_properties_takes_the_shortest_named_ones_first() -> None:
    schema = {
        "type": "object",
        "properties": {"long_name": {"type": "integer"}, "b": {"type": "string", "minLength": 4}, "c": {}},
        "required": ["long_name"],
        "minProperties": 2,
    }
    assert shortest_text(schema) == '{"long_name":0,"c":0}'
    closed = {**schema, "minProperties": 5, "additionalProperties": False}
    assert shortest(closed) is None  # four names, no others allowed: nothing valid to measure


@pytest.mark.parametrize(
    ("pattern", "least"),
    [
        ("a{1000000000}", 10**9),
        ("(ab|c){3,}", 3),
        ("^[A-Z]{3}-\\d{2}$", 6),
        ("(?=abc)a", 1),
        ("(a{4294967294}){4294967294}", (2**32 - 2) ** 2),
        ("((a{4294967294}){4294967294}){4294967294}", MAX_COUNT),
        ("(?<name>a)", 0),  # another dialect's syntax: Python cannot parse it, nothing is known
        ("a{99999999999}", 0),  # past Python's repetition limit: refused elsewhere, unknown here
    ],
)
def test_a_patterns_least_length_is_read_from_its_counts(pattern: str, least: int) -> None:
    assert pattern_least_chars(pattern) == min(least, MAX_COUNT)
