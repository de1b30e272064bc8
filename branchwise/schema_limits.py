"""Bounds on what a constraint may ask of the grammar engine: the depth and size of a JSON Schema, the
number of tools, the length of a ``choice`` list and of a regex.

Why: constraints come from outside (a server's ``response_format`` and ``tools``, a LangChain or
DSPy user's schema), and what handles them either recurses over them (jsonschema's check of a schema
and its validation of an output, pydantic's serialization, the grammar compiler) or takes time that
grows with their size (xgrammar compiled an enum of 100,000 strings in 17 s, a ``choice`` of 100,000
in 8-10 s). Unbounded, a schema nested ~95 levels deep made Python's recursion limit raise
(an HTTP 500 with a 2,000-line traceback), and a huge one held the server for seconds. So every
schema is measured here first, by an iterative walk that cannot recurse itself and stops at the
first limit it passes, and refused with a ``ValueError`` naming the field and the limit before
anything recursive or slow touches it.

The limits are generous beside OpenAI's own for structured outputs (10 levels of object nesting,
5,000 properties, 1,000 enum values, 128 tools): a schema that OpenAI accepts is accepted here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_CHOICES",
    "MAX_CHOICE_CHARS",
    "MAX_ENUM_VALUES",
    "MAX_PATTERN_CHARS",
    "MAX_SCHEMA_CHARS",
    "MAX_SCHEMA_DEPTH",
    "MAX_SCHEMA_NODES",
    "MAX_TOOLS",
    "SchemaSize",
    "check_choices",
    "check_pattern",
    "check_tool_count",
]

MAX_SCHEMA_DEPTH = 64
"""Deepest nesting of a schema's JSON: objects and arrays, the schema itself at level 1 (an object
property is two levels: ``properties`` and the property's schema). jsonschema spends about five
Python frames a level checking a schema, so 64 levels stay far below Python's recursion limit of
1,000 frames under any caller's stack (a server's included), and below the ~200 levels the server's
JSON parser reads at all; OpenAI allows 10 levels of object nesting (about 20 here)."""

MAX_SCHEMA_NODES = 10_000
"""JSON values (objects, arrays, strings, numbers, ...) in one constraint's schemas together (a tool
call constraint's tools count as one): the schema check and the grammar compile take time in
proportion. Two OpenAI-sized schemas (5,000 properties) fit."""

MAX_ENUM_VALUES = 1_000
"""Entries of ``enum`` lists in one constraint's schemas together, OpenAI's own limit: each one is
an alternative the grammar compiles against the whole vocabulary (100,000 took 17 s)."""

MAX_SCHEMA_CHARS = 256 * 1024
"""Characters of one constraint's schemas together, as compact JSON: what the grammar compiler
reads, bounded apart from the node count (a few nodes may hold long strings)."""

MAX_CHOICES = 1_000
"""Strings of a ``choice`` constraint: the same alternatives an enum compiles to (see
`MAX_ENUM_VALUES`)."""

MAX_CHOICE_CHARS = 64 * 1024
"""Characters of a ``choice`` constraint's strings together."""

MAX_TOOLS = 128
"""Tools of one request, OpenAI's own limit: each tool's schema is checked and compiled into the
tool-call grammar (and shown to the model in the prompt)."""

MAX_PATTERN_CHARS = 16 * 1024
"""Characters of a ``regex`` constraint's pattern (Python's parser recurses on its groups too: a
pattern nested too deep for it is refused on its own, whatever its length)."""


@dataclass
class SchemaSize:
    """Running totals of one constraint's schemas against the limits above (`add` each schema).

    Depth is per schema; nodes, enum entries and characters add up across schemas, so a constraint
    of many tools is bounded as a whole, not tool by tool.
    """

    nodes: int = 0
    enum_values: int = 0
    chars: int = 0

    def add(self, schema: Any, field: str) -> None:
        """Count `schema` in; a ValueError naming `field` and the limit at the first one passed."""
        stack: list[tuple[Any, int]] = [(schema, 1)]
        while stack:
            value, depth = stack.pop()
            self.nodes += 1
            if self.nodes > MAX_SCHEMA_NODES:
                raise ValueError(
                    f"{field}: the schema holds more than {MAX_SCHEMA_NODES} JSON values "
                    f"(the limit per request, all schemas together)"
                )
            if isinstance(value, Mapping | list | tuple):
                if depth > MAX_SCHEMA_DEPTH:
                    raise ValueError(
                        f"{field}: the schema is nested more than {MAX_SCHEMA_DEPTH} levels deep "
                        "(the limit for a JSON Schema, counting each object and array)"
                    )
                if isinstance(value, Mapping):
                    entries = value.get("enum")
                    if isinstance(entries, list | tuple):
                        self.enum_values += len(entries)
                        if self.enum_values > MAX_ENUM_VALUES:
                            raise ValueError(
                                f"{field}: the schema's enums hold more than {MAX_ENUM_VALUES} values "
                                "(the limit per request, all enums together)"
                            )
                    stack.extend((v, depth + 1) for v in value.values())
                else:
                    stack.extend((v, depth + 1) for v in value)
        # depth and count are bounded now, so the (recursive) encoder is safe and quick
        self.chars += len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False, default=str))
        if self.chars > MAX_SCHEMA_CHARS:
            raise ValueError(
                f"{field}: the schema is {self.chars} characters of JSON, over the limit of "
                f"{MAX_SCHEMA_CHARS} per request (all schemas together)"
            )


def check_tool_count(tools: Sequence[Any], field: str = "tools") -> None:
    """A ValueError naming `field` when there are more than `MAX_TOOLS` tools."""
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"{field}: {len(tools)} tools, over the limit of {MAX_TOOLS}")


def check_choices(choices: Sequence[str]) -> None:
    """A ValueError when a ``choice`` list is over `MAX_CHOICES` or `MAX_CHOICE_CHARS` (the caller, a
    pydantic field validator, names the field)."""
    if len(choices) > MAX_CHOICES:
        raise ValueError(f"{len(choices)} strings, over the limit of {MAX_CHOICES}")
    chars = sum(len(c) for c in choices)
    if chars > MAX_CHOICE_CHARS:
        raise ValueError(f"{chars} characters in all, over the limit of {MAX_CHOICE_CHARS}")


def check_pattern(pattern: str) -> None:
    """A ValueError when a regex is longer than `MAX_PATTERN_CHARS` (the caller names the field)."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"{len(pattern)} characters, over the limit of {MAX_PATTERN_CHARS}")
