"""DSPy's field format kept by a grammar: an unchanged DSPy program served reliably by a small model.

Why: DSPy's adapters ask for the reply in a format of named fields, in words only. `ChatAdapter`'s
last user message ends "Respond with the corresponding output fields, starting with the field
`[[ ## reasoning ## ]]`, then `[[ ## answer ## ]]`, and then ending with the marker for
`[[ ## completed ## ]]`."; on a parse failure its `JSONAdapter` fallback asks for "a JSON object in
the following order of fields: ...". Against a model name litellm does not know (any served
model), DSPy sends no ``response_format`` with either, so nothing but the prompt holds the model to
the format: a small model misses the markers, then writes prose instead of JSON, and the program
stops with `AdapterParseError`.

What the server does (on by default; `serve --no-dspy-fields` turns it off): a chat request with no
constraint of its own, not streamed, whose last user message ends with one of those two sentences
(exactly DSPy's wording), is decoded under a JSON Schema of the fields it names, in their order and
with their types (`_schema`: scalars, a `Literal` such as `dspy.ReAct`'s tool name, a `dict` such as
its tool arguments, a list of scalars; a field of any other type leaves the request as it came). The
JSON grammar closes what is open within ``max_tokens`` (`finish_reason` "length" then), so the
reply always parses. For `ChatAdapter` the JSON is written back in its markers, for
`JSONAdapter` it is the reply as is. The reply's ``branchwise.notes`` say that this happened.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from branchwise.constraints import Constraint

__all__ = ["FieldFormat"]

_CHAT = re.compile(
    r"Respond with the corresponding output fields, starting with the field (?P<fields>.+?), and then "
    r"ending with the marker for `\[\[ ## completed ## \]\]`\.\s*$",
    re.S,
)
_CHAT_FIELD = re.compile(
    r"^`\[\[ ## (?P<name>\w+) ## \]\]`(?: \(must be formatted as a valid Python (?P<type>.+)\))?$"
)
_JSON = re.compile(
    r"Respond with a JSON object in the following order of fields: (?P<fields>.+?)\.\s*$", re.S
)
_JSON_FIELD = re.compile(r"^`(?P<name>\w+)`(?: \(must be formatted as a valid Python (?P<type>.+)\))?$")
_HEADER = re.compile(r"\[\[ ## (\w+) ## \]\]")
_UNBRACKETED = r"## \1 ##"

_SCALARS: dict[str | None, dict[str, Any]] = {
    None: {"type": "string"},
    "str": {"type": "string"},
    "int": {"type": "integer"},
    "float": {"type": "number"},
    "bool": {"type": "boolean"},
}
"""A field's JSON Schema by the Python type DSPy names (None: a plain ``str`` field names none)."""


def _schema(kind: str | None) -> dict[str, Any] | None:
    """The JSON Schema of a type as DSPy names it (`get_annotation_name`): the scalars, a ``Literal``
    of scalars (an enum: `dspy.ReAct`'s tool name), ``dict[...]`` (an object: its tool arguments) and
    ``list[<scalar>]``; None for any other type."""
    if kind in _SCALARS:
        return _SCALARS[kind]
    assert kind is not None
    if kind.startswith("Literal[") and kind.endswith("]"):
        try:
            values = ast.literal_eval(kind[len("Literal") :])
        except (ValueError, SyntaxError):
            return None
        values = values if isinstance(values, list) else [values]
        if values and all(isinstance(v, str | int | bool) and v is not None for v in values):
            return {"enum": values}
        return None
    if kind == "dict" or kind.startswith("dict["):
        return {"type": "object"}
    if kind.startswith("list[") and kind.endswith("]") and kind[5:-1] in _SCALARS:
        return {"type": "array", "items": _SCALARS[kind[5:-1]]}
    return None


@dataclass(frozen=True)
class FieldFormat:
    """The output fields a DSPy adapter asked for, in order (each with the Python type it named),
    and which adapter asked (`markers`: ChatAdapter's ``[[ ## name ## ]]`` sections; `json`: as is)."""

    fields: tuple[tuple[str, str | None], ...]
    adapter: Literal["markers", "json"]

    @classmethod
    def of(cls, messages: Sequence[dict[str, Any]]) -> FieldFormat | None:
        """The format the last user message asks for in DSPy's words, or None (not DSPy's wording,
        a field type no schema here covers, or no field)."""
        last = next((m for m in reversed(messages) if m.get("role") == "user"), None)
        content = None if last is None else last.get("content")
        if not isinstance(content, str):
            return None
        for adapter, sentence, field in (("markers", _CHAT, _CHAT_FIELD), ("json", _JSON, _JSON_FIELD)):
            found = sentence.search(content)
            if found is None:
                continue
            fields = []
            for part in found.group("fields").split(", then "):
                named = field.match(part.strip())
                if named is None or _schema(named.group("type")) is None:
                    return None
                fields.append((named.group("name"), named.group("type")))
            names = [name for name, _ in fields]
            if not fields or len(set(names)) != len(names):
                return None
            return cls(tuple(fields), adapter)  # type: ignore[arg-type]
        return None

    def constraint(self) -> Constraint:
        """The JSON Schema the reply is decoded under: every field required, in order, no other key."""
        schema = {
            "type": "object",
            "properties": {name: _schema(kind) for name, kind in self.fields},
            "required": [name for name, _ in self.fields],
            "additionalProperties": False,
        }
        return Constraint.of_json_schema(schema)

    def render(self, text: str) -> str:
        """The reply as the adapter reads it: the JSON as is, or each field's value under its marker,
        then ``[[ ## completed ## ]]`` (a value's own marker-like text is unbracketed, so a field
        never ends early). Text that is not the JSON object (never, under the grammar) is kept."""
        if self.adapter == "json":
            return text
        try:
            values = json.loads(text)
        except ValueError:
            return text
        if not isinstance(values, dict):
            return text
        parts = []
        for name, _ in self.fields:
            value = values.get(name, "")
            shown = value if isinstance(value, str) else json.dumps(value)
            parts.append(f"[[ ## {name} ## ]]\n{_HEADER.sub(_UNBRACKETED, shown)}")
        parts.append("[[ ## completed ## ]]")
        return "\n\n".join(parts)

    @property
    def note(self) -> str:
        """What the reply's notes say (it was not decoded as the model would have written it)."""
        names = ", ".join(name for name, _ in self.fields)
        kind = "ChatAdapter's [[ ## field ## ]] markers" if self.adapter == "markers" else "a JSON object"
        return (
            f"dspy_fields: the prompt asks for DSPy's fields ({names}) as {kind}; the reply was decoded "
            "under a JSON Schema of them so that it parses (serve --no-dspy-fields turns this off)"
        )
