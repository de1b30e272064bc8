"""What a generation must look like: a JSON Schema, any JSON object, a regex, one of some strings, or
tool calls.

Why its own top-level module (pydantic and jsonschema only, no torch): a strategy file asks for a
typed answer (`GenerateNode(response_format=...)`), a decode call carries it
(`DecodeParams(constraint=...)`), the server reads it from OpenAI's ``response_format`` and
``tools`` fields, and the LangChain and DSPy adapters build it from their users' schemas. All of
them describe the same thing, so it is described once, here, and validated once, at construction:
an invalid JSON Schema, a tool without a name or an unknown ``tool_choice`` fails with a
``ValidationError`` naming the field before any model is touched. Compiling it into a token mask is
the local backend's job (`backends/hf/grammar.py`); a remote backend forwards it to its server.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from branchwise.pattern_limits import check_regex
from branchwise.schema_budget import shortest
from branchwise.schema_limits import check_choices, check_pattern
from branchwise.toolcalls import (
    TOOL_CALL_OPEN,
    ToolCall,
    check_json_schema,
    normalize_tool_choice,
    normalize_tools,
    parse_tool_calls,
)

__all__ = [
    "Constraint",
    "ConstraintError",
    "ConstraintKind",
    "OutputError",
    "check_json_schema",
    "tool_calls_of",
]

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "tool_calls"]


class ConstraintError(ValueError):
    """The grammar engine refused a constraint that validated here (a schema or regex feature it
    cannot compile); the message names the constraint's field. Raised by a backend before any
    decoding, so front ends answer it as a bad request."""


class OutputError(ValueError):
    """A constrained generation did not produce what its constraint asked for (it was cut by
    ``max_tokens``, or the grammar had no token left): the text is kept, the typed value is not."""


class Constraint(BaseModel):
    """One constraint on a generation, as a frozen, hashable value (decode calls are grouped by it).

    Build it with the class methods (`json_schema`, `json_object`, `regex`, `choice`, `tools`) or
    from OpenAI's ``response_format`` object (`from_response_format`; also accepted wherever a
    `Constraint` is validated, so a YAML strategy can write ``response_format: {type: json_object}``).

    ``tool_calls``: the generation is free text until the model opens a ``<tool_call>`` block, whose
    body is then forced to be a call of one of ``tools`` with arguments valid under its schema
    (``tool_choice="auto"``); ``"required"`` forces at least one call from the first token, a tool's
    name forces a call of that tool. ``parallel_tool_calls=False`` allows one call only.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: ConstraintKind
    json_schema: dict[str, Any] | None = Field(None, description="kind json_schema: the schema")
    strict: bool = Field(
        True,
        description="json_schema: objects take no property the schema does not name (OpenAI's strict); "
        "False follows the schema's own additionalProperties",
    )
    pattern: str | None = Field(None, description="kind regex: the whole output must match it")
    choices: tuple[str, ...] = Field((), description="kind choice: the output is exactly one of these")
    tools: tuple[dict[str, Any], ...] = Field((), description="kind tool_calls: OpenAI function tools")
    tool_choice: str = Field("auto", description="kind tool_calls: auto, required, or a tool's name")
    parallel_tool_calls: bool = True

    @model_validator(mode="before")
    @classmethod
    def _openai_shape(cls, value: Any) -> Any:
        if isinstance(value, Mapping) and "type" in value and "kind" not in value:
            made = cls.from_response_format(value)
            if made is None:
                raise ValueError("response_format: type 'text' puts no constraint; leave the field out")
            return made.model_dump()
        return value

    @field_validator("json_schema", mode="before")
    @classmethod
    def _schema(cls, value: Any) -> Any:
        return None if value is None else check_json_schema(value, "json_schema")

    @field_validator("pattern")
    @classmethod
    def _regex(cls, value: str | None) -> str | None:
        if value is not None:
            check_pattern(value)
            try:
                re.compile(value)
            except re.error as err:
                raise ValueError(f"pattern: not a valid regular expression ({err})") from None
            except RecursionError:  # Python's regex parser recurses on nested groups
                raise ValueError("groups nested too deep for the regular expression parser") from None
            except OverflowError as err:  # a repetition count past Python's (2**32 - 1), e.g. a{10**10}
                raise ValueError(f"pattern: not a valid regular expression ({err})") from None
            check_regex(value)  # what it costs to compile: its counted repetitions written out
        return value

    @field_validator("choices")
    @classmethod
    def _choices(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        check_choices(value)
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _tools(cls, value: Any) -> Any:
        return tuple(normalize_tools(value)) if value else ()

    @model_validator(mode="after")
    def _fields_fit_kind(self) -> Constraint:
        need = {
            "json_schema": self.json_schema,
            "regex": self.pattern,
            "choice": self.choices,
            "tool_calls": self.tools,
        }
        if self.kind in need and not need[self.kind]:
            field = {
                "json_schema": "json_schema",
                "regex": "pattern",
                "choice": "choices",
                "tool_calls": "tools",
            }
            raise ValueError(f"{field[self.kind]}: required by kind {self.kind!r}")
        if self.kind == "choice" and any(c == "" for c in self.choices):
            raise ValueError("choices: an empty string cannot be told from no output")
        if self.kind == "tool_calls":
            choice = normalize_tool_choice(self.tool_choice, self.tools)
            if choice == "none":
                raise ValueError("tool_choice: 'none' puts no constraint; build no Constraint for it")
        return self

    def __hash__(self) -> int:
        return hash(self.key())

    def key(self) -> str:
        """Canonical JSON of the constraint: equal constraints have equal keys (the grammar cache's)."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    # -- constructors ------------------------------------------------------------------------

    @classmethod
    def of_json_schema(cls, schema: Any, *, strict: bool = True) -> Constraint:
        """Output is one JSON value valid under `schema` (a dict, or a pydantic model class)."""
        return cls(kind="json_schema", json_schema=check_json_schema(schema, "json_schema"), strict=strict)

    @classmethod
    def of_json_object(cls) -> Constraint:
        """Output is one JSON object (OpenAI's ``response_format={"type": "json_object"}``)."""
        return cls(kind="json_object")

    @classmethod
    def of_regex(cls, pattern: str) -> Constraint:
        return cls(kind="regex", pattern=pattern)

    @classmethod
    def of_choice(cls, choices: Sequence[str]) -> Constraint:
        return cls(kind="choice", choices=tuple(choices))

    @classmethod
    def of_tools(
        cls, tools: Sequence[Any], tool_choice: Any = "auto", *, parallel_tool_calls: bool = True
    ) -> Constraint | None:
        """Calls of `tools`; None for ``tool_choice="none"`` (nothing to constrain)."""
        normalized = normalize_tools(tools)
        choice = normalize_tool_choice(tool_choice, normalized)
        if choice == "none":
            return None
        return cls(
            kind="tool_calls",
            tools=tuple(normalized),
            tool_choice=choice,
            parallel_tool_calls=parallel_tool_calls,
        )

    @classmethod
    def from_response_format(cls, response_format: Any) -> Constraint | None:
        """OpenAI's ``response_format`` object: ``text`` (None), ``json_object`` or ``json_schema``."""
        if isinstance(response_format, BaseModel):
            response_format = response_format.model_dump(by_alias=True, exclude_none=True)
        if not isinstance(response_format, Mapping):
            raise ValueError("response_format: expected an object with a 'type'")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.of_json_object()
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, Mapping) or "schema" not in spec:
                raise ValueError("response_format.json_schema: expected an object with a 'schema'")
            try:
                schema = check_json_schema(spec["schema"], "response_format.json_schema.schema")
            except ValueError as err:
                raise ValueError(str(err)) from None
            return cls(kind="json_schema", json_schema=schema, strict=bool(spec.get("strict", True)))
        raise ValueError(
            f"response_format.type: expected 'text', 'json_object' or 'json_schema', got {kind!r}"
        )

    def structural_tag(self, max_whitespace: int | None = None) -> dict[str, Any]:
        """Kind tool_calls as a structural tag (xgrammar's JSON format, which vLLM's
        ``structured_outputs.structural_tag`` takes too): the Hermes blocks of `branchwise.toolcalls`.

        ``required`` / a named tool: one or more blocks (one with ``parallel_tool_calls=False``) and
        nothing else; ``auto``: any text without the opening tag, then optionally the blocks. A
        newline may follow each block, then the next block or the end: nothing may follow the last
        one, so a reply is prose, or prose that ends in calls. (A separator that forced another block
        would trap a model that just ends its line into repeating its call.)
        """
        if self.kind != "tool_calls":
            raise ValueError(f"kind: {self.kind!r} has no structural tag; only 'tool_calls' does")
        fns = [t["function"] for t in self.tools]
        if self.tool_choice not in ("auto", "required"):
            fns = [fn for fn in fns if fn["name"] == self.tool_choice]
        tags = [
            {
                "type": "tag",
                "begin": f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(fn["name"])}, "arguments": ',
                "content": {
                    "type": "json_schema",
                    "json_schema": fn["parameters"],
                    "max_whitespace_cnt": max_whitespace,
                },
                "end": "}\n</tool_call>",
            }
            for fn in fns
        ]
        one = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
        newline = {"type": "optional", "content": {"type": "const_string", "value": "\n"}}
        item = {"type": "sequence", "elements": [one, newline]}
        calls = {"type": "plus", "content": item} if self.parallel_tool_calls else item
        if self.tool_choice != "auto":
            return {"type": "structural_tag", "format": calls}
        prose = {"type": "any_text", "excludes": [TOOL_CALL_OPEN]}
        return {
            "type": "structural_tag",
            "format": {"type": "sequence", "elements": [prose, {"type": "optional", "content": calls}]},
        }

    # -- reading the output ------------------------------------------------------------------

    def parse(self, text: str) -> Any:
        """The typed value of a finished generation: the JSON value (validated against the schema),
        the chosen string, the regex match, or the tool calls (a list of `ToolCall`).

        Raises `OutputError` when the text is not what the constraint asked for (a generation cut by
        ``max_tokens`` is the usual cause).
        """
        if self.kind == "tool_calls":
            _, calls = parse_tool_calls(text, self.tools)
            if not calls and self.tool_choice != "auto":
                raise OutputError(
                    f"tool_choice={self.tool_choice!r} asked for a tool call; the output holds none"
                )
            return calls
        if self.kind == "choice":
            if text not in self.choices:
                raise OutputError(f"output {text[:80]!r} is not one of {list(self.choices)}")
            return text
        if self.kind == "regex":
            assert self.pattern is not None
            if re.fullmatch(self.pattern, text) is None:
                raise OutputError(f"output {text[:80]!r} does not match {self.pattern!r}")
            return text
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            least = shortest(self.json_schema) if self.json_schema is not None else None
            need = f"; the shortest JSON this schema allows is {least.chars} characters" if least else ""
            raise OutputError(f"output is not complete JSON ({err.msg} at char {err.pos}){need}") from None
        except RecursionError:  # an open schema (``{}``, json_object) lets a model nest without end
            raise OutputError("output is JSON nested too deep to read") from None
        if self.kind == "json_object" and not isinstance(value, dict):
            raise OutputError("output is JSON but not an object")
        if self.json_schema is not None:
            try:
                jsonschema.validate(value, self.json_schema)
            except jsonschema.ValidationError as err:
                raise OutputError(f"output does not follow the schema: {err.message}") from None
        return value


def tool_calls_of(text: str, constraint: Constraint | None) -> tuple[str, list[ToolCall]]:
    """The content and tool calls of a reply decoded under `constraint` (no calls without tools)."""
    if constraint is None or constraint.kind != "tool_calls":
        return text, []
    return parse_tool_calls(text, constraint.tools)
