"""Typed answers and actions: what a reasoner votes on when its branches write JSON or tool calls.

Why its own module: self-consistency over free text votes on an extracted answer ("19"); over
typed output it must vote on the *value* — two branches that wrote ``{"a": 2, "b": 3}`` and
``{"b":3,"a":2.0}`` agree, and two tool calls agree when they name the same tool with the same
normalized arguments (`ToolCall.canonical`). `Typed` turns a reasoner's ``tools`` /
``response_format`` into the `Constraint` its answer-generating steps decode under, into the key
each branch votes with, and back into the value a result carries (a validated pydantic object, a
JSON value, or a list of `ToolCall`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from branchwise.constraints import Constraint, OutputError
from branchwise.reasoners.answers import extract_answer
from branchwise.toolcalls import ToolCall, canonical_json, function_tool, normalize_tools, parse_tool_calls

__all__ = ["Typed"]


@dataclass(frozen=True)
class Typed:
    """A reasoner's typed output: the constraint, the tools shown to the model, the output model."""

    constraint: Constraint
    tools: list[dict[str, Any]] | None = None
    model: type[BaseModel] | None = None

    @classmethod
    def build(
        cls,
        *,
        tools: Sequence[Any] | None,
        tool_choice: Any,
        parallel_tool_calls: bool,
        response_format: Any,
    ) -> Typed | None:
        """From `Reasoner`'s arguments; None when it asks for neither tools nor a format."""
        if tools:
            if response_format is not None:
                raise ValueError(
                    "response_format: a reply under tools is prose or tool calls; pass tools or "
                    "response_format, not both"
                )
            normalized = normalize_tools([function_tool(t) if callable(t) else t for t in tools])
            constraint = Constraint.of_tools(normalized, tool_choice, parallel_tool_calls=parallel_tool_calls)
            if constraint is None:  # tool_choice="none": shown nothing, constrained by nothing
                return None
            return cls(constraint, normalized)
        if response_format is None:
            return None
        if isinstance(response_format, Constraint):
            return cls(response_format)
        if isinstance(response_format, type) and issubclass(response_format, BaseModel):
            return cls(Constraint.of_json_schema(response_format), model=response_format)
        if (
            isinstance(response_format, dict)
            and "type" in response_format
            and response_format["type"]
            in (
                "json_object",
                "json_schema",
                "text",
            )
        ):
            made = Constraint.from_response_format(response_format)
            return None if made is None else cls(made)
        return cls(Constraint.of_json_schema(response_format))

    def key(self, text: str) -> str | None:
        """What a branch votes for: its calls' canonical form (several joined by ``; ``), its value
        as canonical JSON, or the chosen string; a prose reply under ``tool_choice="auto"`` votes
        with its extracted answer; None (abstain) when the output is not what was asked."""
        if self.constraint.kind == "tool_calls":
            prose, calls = parse_tool_calls(text, self.constraint.tools)
            if calls:
                return "; ".join(call.canonical() for call in calls)
            return extract_answer(prose) if self.constraint.tool_choice == "auto" else None
        try:
            value = self.constraint.parse(text)
        except OutputError:
            return None
        if self.constraint.kind in ("json_schema", "json_object"):
            return canonical_json(value)
        return str(value)

    def value(self, text: str) -> Any:
        """The typed value of a branch's text: a `model` instance, a JSON value, a string, or the
        list of `ToolCall` (empty for a prose reply); raises `OutputError` when it has none."""
        parsed = self.constraint.parse(text)
        if self.model is not None:
            return self.model.model_validate(parsed)
        return parsed

    def calls(self, text: str) -> list[ToolCall]:
        if self.constraint.kind != "tool_calls":
            return []
        return parse_tool_calls(text, self.constraint.tools)[1]
