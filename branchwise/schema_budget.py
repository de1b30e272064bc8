"""A JSON Schema's shortest valid value, and its free-text strings bounded so a valid value fits a
small token budget.

Why: a grammar decides what every token may be, not when the output ends. Under a small
``max_tokens`` a model that fills a free-text field (or pads with whitespace) is cut before the
closing brace, and the reply cannot be parsed however right its shape was (OpenAI's client raises
``LengthFinishReasonError``). The shortest valid value tells how much of the budget the schema's
structure takes; what is left is shared among the strings that have no ``maxLength`` of their own.
The local backend's grammar compiler (`backends/hf/grammar.py`) turns that into a length bound
per string before compiling, when the budget is small enough for it to matter. Pure (no torch,
no tokenizer): the backend counts the tokens.

The shortest value is an estimate where the schema is one this module does not read exactly (a
``pattern`` or ``format`` string, ``multipleOf``, ``not``, ``if``/``then``); None where it cannot
tell at all (an unresolvable ``$ref``, a recursion deeper than `MAX_DEPTH`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

__all__ = ["MAX_DEPTH", "Shortest", "cap_strings", "capped_string", "shortest", "shortest_text"]

MAX_DEPTH = 32
"""Deepest schema nesting (``$ref`` hops included) read; a deeper schema has no known shortest value."""

_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "contains", "not", "if", "then", "else", "propertyNames")


class Shortest:
    """A shortest valid value: the value, its number of free strings (a string with no
    ``maxLength``, ``pattern``, ``format``, ``enum`` or ``const``: what `cap_strings` bounds) and
    its whitespace gaps (places where JSON allows whitespace between two tokens)."""

    def __init__(self, value: Any, free: int = 0) -> None:
        self.value = value
        self.free = free

    @property
    def text(self) -> str:
        """The value as compact JSON (no whitespace: what a grammar allows at the least)."""
        return json.dumps(self.value, separators=(",", ":"), ensure_ascii=False)

    @property
    def gaps(self) -> int:
        return _gaps(self.value)


def _gaps(value: Any) -> int:
    if isinstance(value, dict):
        return (4 * len(value) or 1) + sum(_gaps(v) for v in value.values())
    if isinstance(value, list):
        return (2 * len(value) or 1) + sum(_gaps(v) for v in value)
    return 0


def _free(schema: Mapping[str, Any]) -> bool:
    """A string schema with nothing that bounds its length or fixes its text."""
    return not any(k in schema for k in ("maxLength", "pattern", "format", "enum", "const"))


def _resolve(ref: str, root: Mapping[str, Any]) -> Any:
    if not ref.startswith("#"):
        return None
    target: Any = root
    for part in ref[1:].split("/"):
        if not part:
            continue
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, Mapping) or part not in target:
            return None
        target = target[part]
    return target


def _shorter(a: Shortest | None, b: Shortest | None) -> Shortest | None:
    if a is None:
        return b
    if b is None:
        return a
    return a if len(a.text) <= len(b.text) else b


def _number(schema: Mapping[str, Any], integer: bool) -> Shortest:
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    high = schema.get("maximum", schema.get("exclusiveMaximum"))
    step = 1 if integer else 0.5
    if isinstance(low, int | float) and not isinstance(low, bool) and low > 0:
        value = low if "minimum" in schema else low + step
    elif isinstance(high, int | float) and not isinstance(high, bool) and high < 0:
        value = high if "maximum" in schema else high - step
    else:
        value = 0
    return Shortest(int(value) if integer or float(value).is_integer() else value)


def _of_type(kind: str, schema: Mapping[str, Any], root: Mapping[str, Any], depth: int) -> Shortest | None:
    if kind == "null":
        return Shortest(None)
    if kind == "boolean":
        return Shortest(True)
    if kind in ("integer", "number"):
        return _number(schema, kind == "integer")
    if kind == "string":
        n = schema.get("minLength", 0)
        return Shortest("a" * n if isinstance(n, int) else "", int(_free(schema)))
    if kind == "array":
        items: list[Any] = []
        free = 0
        prefix = schema.get("prefixItems") or []
        at_least = schema.get("minItems", 0) if isinstance(schema.get("minItems", 0), int) else 0
        for i in range(at_least):
            sub = prefix[i] if i < len(prefix) else schema.get("items", {})
            got = _shortest(sub, root, depth + 1)
            if got is None:
                return None
            items.append(got.value)
            free += got.free
        return Shortest(items, free)
    if kind == "object":
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties", {})
        out: dict[str, Any] = {}
        free = 0
        for name in schema.get("required") or ():
            sub = props.get(name, extra if isinstance(extra, Mapping) else {})
            got = _shortest(sub, root, depth + 1)
            if got is None:
                return None
            out[name] = got.value
            free += got.free
        return Shortest(out, free)
    return None


def _shortest(schema: Any, root: Mapping[str, Any], depth: int) -> Shortest | None:
    if depth > MAX_DEPTH:
        return None
    if schema is True:
        return Shortest(0)
    if not isinstance(schema, Mapping):
        return None
    if isinstance(schema.get("$ref"), str):
        return _shortest(_resolve(schema["$ref"], root), root, depth + 1)
    if "const" in schema:
        return Shortest(schema["const"])
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return min((Shortest(v) for v in schema["enum"]), key=lambda s: len(s.text))
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            best: Shortest | None = None
            for option in schema[key]:
                best = _shorter(best, _shortest(option, root, depth + 1))
            return best
    if isinstance(schema.get("allOf"), list):  # merged one level: what pydantic and most tools write
        merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
        for part in schema["allOf"]:
            if isinstance(part, Mapping) and isinstance(part.get("$ref"), str):
                part = _resolve(part["$ref"], root)
            if not isinstance(part, Mapping):
                return None
            merged.update(part)
        return _shortest(merged, root, depth + 1)
    kind = schema.get("type")
    if kind is None:
        kind = "object" if "properties" in schema else "array" if "items" in schema else "integer"
    kinds = [kind] if isinstance(kind, str) else list(kind) if isinstance(kind, list) else []
    found: Shortest | None = None
    for k in kinds:
        found = _shorter(found, _of_type(k, schema, root, depth))
    return found


def shortest(schema: Mapping[str, Any]) -> Shortest | None:
    """A shortest valid value of `schema` (see the module docstring), or None when not known."""
    return _shortest(schema, schema, 0)


def shortest_text(schema: Mapping[str, Any]) -> str | None:
    """The compact JSON text of `shortest`, or None."""
    found = shortest(schema)
    return None if found is None else found.text


def capped_string(least: int, cap: int | None) -> str:
    """The ``pattern`` of a string of `least` to `cap` characters (None: no upper bound).

    Why a pattern and not ``minLength``/``maxLength``: xgrammar (0.2.8) compiles those to a
    character class that admits raw control characters, which JSON forbids in a string (the output
    would not parse); its patterns hold to JSON. Neither form lets the model write an escape (a
    quote, a backslash, a newline) in a string of bounded length, the price of knowing its length.
    """
    most = "" if cap is None else max(least, cap)
    return f'^[^\\x00-\\x1f"\\\\]{{{least},{most}}}$'


def cap_strings(schema: Mapping[str, Any], cap: int | None) -> dict[str, Any]:
    """A copy of `schema` whose free strings (see `Shortest`) take at most `cap` characters (at least
    their ``minLength``), wherever they are: properties, items, definitions, alternatives; `cap`
    None bounds none. Either way every length bound, its own or `cap`, is written as a ``pattern``
    (`capped_string` says why: without it a string with a ``maxLength`` may come out as invalid
    JSON), so the grammar compiler is given this copy, never the schema outputs are checked by."""
    out = copy.deepcopy(dict(schema))
    _cap(out, cap, 0)
    return out


def _cap(schema: Any, cap: int | None, depth: int) -> None:
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return
    kind = schema.get("type")
    is_string = kind == "string" or (isinstance(kind, list) and "string" in kind)
    if is_string and not any(k in schema for k in ("pattern", "format", "enum", "const")):
        least, most = schema.get("minLength", 0), schema.get("maxLength")
        least = least if isinstance(least, int) else 0
        bound = most if isinstance(most, int) else cap
        if bound is not None or least:
            schema["pattern"] = capped_string(least, bound)
            schema.pop("minLength", None)
            schema.pop("maxLength", None)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for sub in schema[key].values():
                _cap(sub, cap, depth + 1)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for sub in schema[key]:
                _cap(sub, cap, depth + 1)
    for key in _SUBSCHEMAS:
        _cap(schema.get(key), cap, depth + 1)
