"""A JSON Schema's shortest valid value, and its free-text strings bounded so a valid value fits a
small token budget.

Why: a grammar decides what every token may be, not when the output ends. Under a small
``max_tokens`` a model that fills a free-text field (or pads with whitespace) is cut before the
closing brace, and the reply cannot be parsed however right its shape was (OpenAI's client raises
``LengthFinishReasonError``). The shortest valid value tells how much of the budget the schema's
structure takes; what is left is shared among the strings that have no ``maxLength`` of their own.
The local backend's grammar compiler (`backends/hf/grammar.py`) turns that into a length bound
per string before compiling, when the budget is small enough for it to matter, and the server
refuses a request whose budget the shortest value does not fit. Pure (no torch, no tokenizer): the
backend counts the tokens.

Why the value is measured, not built: the counts in a schema (``minItems``, ``minLength``,
``minProperties``, a ``pattern``'s repetitions) come from whoever sent it, and the shortest value
grows with them. Built, ``"minItems": 1000000000`` was a billion-item list made on the server's
event loop (and ``"minLength"`` a gigabyte string handed to the tokenizer). So `shortest` works out
the value's length, its free strings and its whitespace gaps by arithmetic, reading each subschema
once (a ``$ref`` used in many places is not expanded again per use), in time that grows with the
schema's size and never with a count written in it; the text itself is built only on request and
only up to `MAX_TEXT_CHARS` characters.

The shortest value is an estimate where the schema is one this module does not read exactly (a
``format`` string, ``multipleOf``, ``not``, ``if``/``then``, ``contains``; a ``pattern`` string is
given the pattern's least length, not a matching text); None where it cannot tell at all (an
unresolvable ``$ref``, a recursion deeper than `MAX_DEPTH`).
"""

from __future__ import annotations

import copy
import importlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

_sre_parse: Any
try:  # the regex parser `re` itself uses (Python 3.11 moved it; typeshed has no stub for it there)
    _sre_parse = importlib.import_module("re._parser")
except ImportError:  # pragma: no cover - Python 3.10
    _sre_parse = importlib.import_module("sre_parse")

__all__ = [
    "MAX_COUNT",
    "MAX_DEPTH",
    "MAX_TEXT_CHARS",
    "OutputFloor",
    "Shortest",
    "cap_strings",
    "capped_string",
    "pattern_least_chars",
    "shortest",
    "shortest_text",
]

MAX_DEPTH = 32
"""Deepest schema nesting (``$ref`` hops included) read; a deeper schema has no known shortest value."""

MAX_TEXT_CHARS = 64 * 1024
"""Longest shortest value `Shortest.text` builds. Beyond it only the length is known: the backend
bounds its tokens from below instead of tokenizing it, and no context near it could hold it anyway
at a few characters a token."""

MAX_COUNT = 1 << 48
"""Largest length any count reaches here (a ``minItems``, a length, a product of nested counts): a
larger one is held at this. Why: every output this bounds is refused long before (no context holds
2**48 characters), and held there the arithmetic stays on machine-sized integers, and the numbers in
messages stay printable, whatever size of integer a request writes."""

_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "contains", "not", "if", "then", "else", "propertyNames")


def _held(n: int) -> int:
    return n if n < MAX_COUNT else MAX_COUNT


@dataclass(frozen=True)
class OutputFloor:
    """The tokens one output a constraint allows takes at the least, as a backend counted them
    (this module counts characters; the backend's tokenizer turns them into tokens): `exact` when
    the shortest output was tokenized, else a lower bound. `where` names the output within the
    constraint: ``""`` for the constraint's own schema or regex, ``"tools[i].function.parameters"``
    for a call of its i-th tool."""

    where: str
    tokens: int
    exact: bool


@dataclass(frozen=True, eq=False)
class Shortest:
    """A shortest valid value, measured: its compact JSON length (`chars`), its free strings
    (`free`: strings with no ``maxLength``, ``pattern``, ``format``, ``enum`` or ``const``, what
    `cap_strings` bounds) and its whitespace gaps (`gaps`: places where JSON allows whitespace
    between two tokens), each held at `MAX_COUNT`. The value itself is built only when asked
    (`value`, `text`), and only when short.

    `chars` is the length of `text`, except under ``minProperties`` beyond the properties a schema
    names: each such property is counted with an empty name (the least any name takes), while the
    value built gives each one a distinct name, as JSON needs.
    """

    chars: int
    free: int
    gaps: int
    _make: Callable[[], Any]

    @classmethod
    def of(cls, value: Any, free: int = 0) -> Shortest | None:
        """A value known whole (a ``const``, an ``enum`` entry, a number): measured from its JSON;
        None when it is not JSON (an integer too long for Python to print, say)."""
        try:
            chars = len(_compact(value))
            gaps = _gaps(value)
        except (TypeError, ValueError, RecursionError):
            return None
        return cls(chars, free, gaps, lambda: value)

    @property
    def value(self) -> Any:
        """The value (a ValueError when its text would pass `MAX_TEXT_CHARS`)."""
        if self.chars > MAX_TEXT_CHARS:
            raise ValueError(
                f"the shortest value is {self.chars} characters of JSON; only up to "
                f"{MAX_TEXT_CHARS} are built"
            )
        return self._make()

    @property
    def text(self) -> str:
        """The value as compact JSON (no whitespace: what a grammar allows at the least)."""
        return _compact(self.value)


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _gaps(value: Any) -> int:
    if isinstance(value, dict):
        return (4 * len(value) or 1) + sum(_gaps(v) for v in value.values())
    if isinstance(value, list):
        return (2 * len(value) or 1) + sum(_gaps(v) for v in value)
    return 0


def _count(schema: Mapping[str, Any], key: str) -> int:
    """A count keyword (``minItems``, ``minLength``, ...) as an int held at `MAX_COUNT` (0 when
    absent or not a count; an integral float counts, as JSON Schema reads ``1e9`` as an integer)."""
    n = schema.get(key, 0)
    if isinstance(n, bool):
        return 0
    if isinstance(n, float):
        n = int(n) if n.is_integer() else 0
    return _held(n) if isinstance(n, int) and n > 0 else 0


def _free(schema: Mapping[str, Any]) -> bool:
    """A string schema with nothing that bounds its length or fixes its text."""
    return not any(k in schema for k in ("maxLength", "pattern", "format", "enum", "const"))


def pattern_least_chars(pattern: str) -> int:
    """The fewest characters a match of the regex `pattern` holds, read from Python's parse of it
    (arithmetic over its repetition counts: ``a{1000000000}`` is 10**9 without matching anything),
    held at `MAX_COUNT`; 0 when Python cannot parse it (a syntax of another regex dialect)."""
    try:
        least = _sre_parse.parse(pattern).getwidth()[0]
    except (re.error, ValueError, OverflowError, RecursionError, TypeError):
        return 0
    return _held(int(least))


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
    return a if a.chars <= b.chars else b


def _number(schema: Mapping[str, Any], integer: bool) -> Shortest | None:
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    high = schema.get("maximum", schema.get("exclusiveMaximum"))
    step = 1 if integer else 0.5
    if isinstance(low, int | float) and not isinstance(low, bool) and low > 0:
        value = low if "minimum" in schema else low + step
    elif isinstance(high, int | float) and not isinstance(high, bool) and high < 0:
        value = high if "maximum" in schema else high - step
    else:
        value = 0
    try:
        return Shortest.of(int(value) if integer or float(value).is_integer() else value)
    except (OverflowError, ValueError):  # an infinite bound
        return None


def _array(items: list[Shortest], repeat: Shortest | None, times: int) -> Shortest:
    """`items`, then `times` copies of `repeat`, measured without building the list."""
    n = _held(len(items) + times)
    rep_chars, rep_free, rep_gaps = (repeat.chars, repeat.free, repeat.gaps) if repeat else (0, 0, 0)
    chars = 2 + max(n - 1, 0) + sum(s.chars for s in items) + times * rep_chars
    free = sum(s.free for s in items) + times * rep_free
    gaps = (2 * n or 1) + sum(s.gaps for s in items) + times * rep_gaps

    def make() -> list[Any]:
        tail = [repeat.value] * times if repeat is not None and times else []
        return [s.value for s in items] + tail

    return Shortest(_held(chars), _held(free), _held(gaps), make)


def _object(named: list[tuple[str, Shortest]], unnamed: Shortest | None, times: int) -> Shortest:
    """The properties `named`, then `times` more valued `unnamed` under names of their own (counted
    as empty names, the least a name takes; built as "", "0", "1", ... skipping names taken)."""
    n = _held(len(named) + times)
    rep_chars, rep_free, rep_gaps = (unnamed.chars, unnamed.free, unnamed.gaps) if unnamed else (0, 0, 0)
    chars = 2 + max(n - 1, 0) + sum(len(_compact(k)) + 1 + s.chars for k, s in named)
    chars += times * (3 + rep_chars)  # '""' and ':' each
    free = sum(s.free for _, s in named) + times * rep_free
    gaps = (4 * n or 1) + sum(s.gaps for _, s in named) + times * rep_gaps

    def make() -> dict[str, Any]:
        out = {k: s.value for k, s in named}
        if unnamed is not None and times:
            fill = unnamed.value
            names = ("" if i < 0 else str(i) for i in range(-1, len(out) + times))
            for name in names:
                if len(out) == len(named) + times:
                    break
                out.setdefault(name, fill)
        return out

    return Shortest(_held(chars), _held(free), _held(gaps), make)


class _Reader:
    """One `shortest` call: the root `$ref`s resolve against, and each subschema's result at each
    depth read once (a subschema reached again, through another ``$ref`` say, is not read again:
    a few definitions that each refer to the next several times no longer take time exponential in
    their number). The memo keeps each schema it saw alive, so no id is reused while it is kept."""

    def __init__(self, root: Mapping[str, Any]) -> None:
        self.root = root
        self.memo: dict[tuple[int, int], tuple[Any, Shortest | None]] = {}

    def read(self, schema: Any, depth: int) -> Shortest | None:
        if depth > MAX_DEPTH:
            return None
        key = (id(schema), depth)
        known = self.memo.get(key)
        if known is not None:
            return known[1]
        found = self._read(schema, depth)
        self.memo[key] = (schema, found)
        return found

    def _read(self, schema: Any, depth: int) -> Shortest | None:
        if schema is True:
            return Shortest.of(0)
        if not isinstance(schema, Mapping):
            return None
        if isinstance(schema.get("$ref"), str):
            return self.read(_resolve(schema["$ref"], self.root), depth + 1)
        if "const" in schema:
            return Shortest.of(schema["const"])
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            best: Shortest | None = None
            for v in schema["enum"]:
                best = _shorter(best, Shortest.of(v))
            return best
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list):
                best = None
                for option in schema[key]:
                    best = _shorter(best, self.read(option, depth + 1))
                return best
        if isinstance(schema.get("allOf"), list):  # merged one level: what pydantic and most tools write
            merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
            for part in schema["allOf"]:
                if isinstance(part, Mapping) and isinstance(part.get("$ref"), str):
                    part = _resolve(part["$ref"], self.root)
                if not isinstance(part, Mapping):
                    return None
                merged.update(part)
            return self.read(merged, depth + 1)
        kind = schema.get("type")
        if kind is None:
            kind = "object" if "properties" in schema else "array" if "items" in schema else "integer"
        kinds = [kind] if isinstance(kind, str) else list(kind) if isinstance(kind, list) else []
        found: Shortest | None = None
        for k in kinds:
            found = _shorter(found, self._of_type(k, schema, depth))
        return found

    def _of_type(self, kind: str, schema: Mapping[str, Any], depth: int) -> Shortest | None:
        if kind == "null":
            return Shortest.of(None)
        if kind == "boolean":
            return Shortest.of(True)
        if kind in ("integer", "number"):
            return _number(schema, kind == "integer")
        if kind == "string":
            n = _count(schema, "minLength")
            pattern = schema.get("pattern")
            if isinstance(pattern, str):
                n = max(n, pattern_least_chars(pattern))
            return Shortest(_held(n + 2), int(_free(schema)), 0, lambda: "a" * n)
        if kind == "array":
            return self._array(schema, depth)
        if kind == "object":
            return self._object(schema, depth)
        return None

    def _array(self, schema: Mapping[str, Any], depth: int) -> Shortest | None:
        at_least = _count(schema, "minItems")
        prefix = schema.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        items: list[Shortest] = []
        for sub in prefix[:at_least]:
            got = self.read(sub, depth + 1)
            if got is None:
                return None
            items.append(got)
        times = at_least - len(items)
        repeat = self.read(schema.get("items", {}), depth + 1) if times else None
        if times and repeat is None:
            return None
        return _array(items, repeat, times)

    def _object(self, schema: Mapping[str, Any], depth: int) -> Shortest | None:
        props = schema.get("properties")
        props = props if isinstance(props, Mapping) else {}
        extra = schema.get("additionalProperties", {})
        named: list[tuple[str, Shortest]] = []
        required = schema.get("required")
        for name in dict.fromkeys(required if isinstance(required, list) else ()):
            if not isinstance(name, str):
                continue
            got = self.read(props.get(name, extra if isinstance(extra, Mapping) else {}), depth + 1)
            if got is None:
                return None
            named.append((name, got))
        # ``minProperties`` past the required ones: the shortest optional properties the schema names,
        # then (where the schema allows others) unnamed ones
        wanted = _count(schema, "minProperties") - len(named)
        if wanted > 0:
            taken = {name for name, _ in named}
            optional = []
            for name, sub in props.items():
                got = None if name in taken else self.read(sub, depth + 1)
                if got is not None:
                    optional.append((len(_compact(name)) + got.chars, name, got))
            optional.sort(key=lambda entry: entry[0])
            named += [(name, got) for _, name, got in optional[:wanted]]
            wanted -= min(wanted, len(optional))
        unnamed: Shortest | None = None
        if wanted > 0:
            if extra is False:
                return None  # the schema allows no more properties: nothing valid to measure
            unnamed = self.read(extra if isinstance(extra, Mapping) else {}, depth + 1)
            if unnamed is None:
                return None
        return _object(named, unnamed, max(wanted, 0))


def shortest(schema: Mapping[str, Any]) -> Shortest | None:
    """A shortest valid value of `schema` (see the module docstring), or None when not known."""
    return _Reader(schema).read(schema, 0)


def shortest_text(schema: Mapping[str, Any]) -> str | None:
    """The compact JSON text of `shortest`, or None (not known, or longer than `MAX_TEXT_CHARS`)."""
    found = shortest(schema)
    return None if found is None or found.chars > MAX_TEXT_CHARS else found.text


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
