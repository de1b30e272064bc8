"""Bounds on the regular expressions a constraint compiles: a ``regex`` constraint's pattern, and every
``pattern``, ``patternProperties`` key and string length bound of a JSON Schema (the local backend
compiles ``minLength``/``maxLength`` as a pattern, ``{least,most}``: `schema_budget.capped_string`).

Why: a pattern's size is not its length. ``c{1,30000}`` is 10 characters, and xgrammar expands a
counted repetition into that many grammar states; inside a JSON string (a schema's ``pattern``) the
compile then grows with the square of the count (SmolLM2's 49,152-token vocabulary, xgrammar 0.2.9,
two compiler threads on 2 cores shared with other jobs): ``a{1,1000}`` 0.19 s, ``{1,2000}`` 0.95 s,
``{1,4000}`` 4.3 s, ``{1,8000}`` 15 s, so ``{1,30000}`` takes minutes, holding a compile worker and
a core. A ``regex`` constraint compiles otherwise: a counted character is cheap there
(``a{1,60000}`` 0.02 s) but a counted wide class is not, up to a level it keeps past about 1,000
(``.{0,100}`` 1.5 s, ``.{0,1000}`` and ``.{0,16000}`` 3.7 s). The same limits hold for both. What such a
pattern costs is known before compiling it: Python's own regex parser (``re._parser``; every pattern
here has passed ``re.compile`` already, the schema check's ``format: regex`` included) gives the
quantifier tree, and `pattern_size` counts the characters it stands for once every counted
repetition is written out. A pattern is refused, with a ``ValueError`` naming the field and the
limit, when one count passes `MAX_REPEAT`, when it stands for more than `MAX_PATTERN_SIZE`
characters, or when a constraint's patterns together stand for more than
`MAX_CONSTRAINT_PATTERN_SIZE`.

Nested repetition with nothing fixed between the repeats (``(a+)+``, ``(b*)*``, ``(\\w+\\s?)+``) is
refused whatever its counts: xgrammar compiles it in milliseconds, but Python's backtracking ``re``,
which checks outputs (`Constraint.parse`, jsonschema's ``pattern``), tries every way of splitting a
text among the repeats when the text does not match, as a reply cut by ``max_tokens`` does:
``(a+)+b`` against 24 ``a`` took 2.5 s, doubling with each one more. A repeated group with a fixed
character in it (``([a-z0-9]+-)*``, a slug) splits one way only and is accepted.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

# Python's regex parser: `re._parser` from 3.11 on, `sre_parse` (deprecated there) before
_parse: Any = importlib.import_module("re._parser" if sys.version_info >= (3, 11) else "sre_parse")
_sre: Any = importlib.import_module("re._constants" if sys.version_info >= (3, 11) else "sre_constants")

__all__ = [
    "MAX_CONSTRAINT_PATTERN_SIZE",
    "MAX_PATTERN_SIZE",
    "MAX_REPEAT",
    "PatternSize",
    "check_regex",
    "pattern_size",
]

MAX_REPEAT = 1_000
"""Largest count of one repetition (``{n}``, ``{n,}``, ``{n,m}``) and largest ``minLength`` or
``maxLength``. Inside a JSON string a count of 1,000 compiles in 0.1-0.2 s (``a{1,1000}``) and
0.6-2 s (the ``[^\\x00-\\x1f"\\\\]{0,1000}`` a ``maxLength`` of 1,000 becomes), 2,000 in 0.4-1 s and
2.9 s, 4,000 in 4.3 s (``a{1,4000}``): the compile grows with the square of the count. A bound of a
few hundred characters, the usual one, compiles in a tenth of a second (``maxLength`` 250: 0.1 s)."""

MAX_PATTERN_SIZE = 2_000
"""Characters one pattern stands for with its counted repetitions written out (``(ab{1,100}){1,100}``
stands for 10,100; ``a+`` for 1: a loop is compiled once, not unrolled). Counts within `MAX_REPEAT`
can still multiply through nested groups; this bounds the product. The costliest patterns within it
measured: a ``regex`` constraint ``[^"]{0,1000}.{0,1000}`` 6.9-7.4 s (one compiler thread, busy
cores), a schema's ``[^"]{0,1000}[^"]{0,1000}`` 1.4-1.8 s."""

MAX_CONSTRAINT_PATTERN_SIZE = 4_000
"""`pattern_size` of all of one constraint's patterns and length bounds together (a tool call
constraint's tools count as one): each compiles separately, so their costs add up. Four strings
with a ``maxLength`` of 1,000 fit, and compile in 3.7-5.3 s (one compiler thread, busy cores);
twenty of 200 in 0.9 s."""

_REPEATS = frozenset({_sre.MAX_REPEAT, _sre.MIN_REPEAT, getattr(_sre, "POSSESSIVE_REPEAT", _sre.MAX_REPEAT)})
_ZERO_WIDTH = frozenset({_sre.AT, _sre.ASSERT, _sre.ASSERT_NOT})
_UNBOUNDED = _sre.MAXREPEAT
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
"""Schema keywords whose values are data, not schemas: a ``pattern`` key inside them is no pattern."""


def _parsed(pattern: str) -> Any:
    try:
        return _parse.parse(pattern)
    except re.error as err:
        raise ValueError(f"not a valid regular expression ({err})") from None
    except RecursionError:  # Python's regex parser recurses on nested groups
        raise ValueError("groups nested too deep for the regular expression parser") from None


def _children(op: Any, av: Any) -> Iterator[Any]:
    """The sub-sequences of one parsed item (none for a character or a class)."""
    if op is _sre.SUBPATTERN:
        yield av[-1]
    elif op is _sre.BRANCH:
        yield from av[1]
    elif op in _REPEATS:
        yield av[2]
    elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
        yield av[1]
    elif op is getattr(_sre, "ATOMIC_GROUP", None):
        yield av
    elif op is _sre.GROUPREF_EXISTS:
        yield from (seq for seq in av[1:] if seq is not None)


def _loose(seq: Any) -> bool:
    """Whether `seq` is made of variable repetitions alone (and anchors), at least one of which may
    repeat more than once: a text it matches splits among them in many ways. A group counts by its
    content, an alternation when one of its branches is loose; a fixed character makes it strict."""
    repeats = False
    for op, av in seq:
        if op in _ZERO_WIDTH:
            continue
        if op in _REPEATS:
            low, high, _ = av
            if high == low:
                return False  # a fixed count is as fixed as the characters it repeats
            repeats = repeats or high > 1
        elif op is _sre.SUBPATTERN or op is getattr(_sre, "ATOMIC_GROUP", None):
            body = av[-1] if op is _sre.SUBPATTERN else av
            if not _loose(body):
                return False
            repeats = True
        elif op is _sre.BRANCH:
            if not any(_loose(branch) for branch in av[1]):
                return False
            repeats = True
        else:
            return False
    return repeats


def pattern_size(pattern: str) -> int:
    """Characters `pattern` stands for with its counted repetitions written out (alternatives
    added, a loop counted once); a ValueError (naming no field: the caller does) when a count
    passes `MAX_REPEAT`, the size passes `MAX_PATTERN_SIZE` (counting stops there), or a
    repetition repeats a loose group (see the module docstring)."""
    size = 0
    stack: list[tuple[Any, int]] = [(_parsed(pattern), 1)]
    try:
        while stack:
            seq, times = stack.pop()
            for op, av in seq:
                if op in _REPEATS:
                    low, high, body = av
                    count = low if high == _UNBOUNDED else high
                    if count > MAX_REPEAT:
                        raise ValueError(
                            f"a repetition count of {count}, over the limit of {MAX_REPEAT} "
                            "(each count is compiled as that many grammar states)"
                        )
                    if high > 1 and _loose(body):
                        raise ValueError(
                            "a repetition of a group that is itself only repetitions, such as "
                            "(a+)+ or (b*)*: put a fixed character in the group, or drop the "
                            "inner quantifier (checking an output against it can take exponential time)"
                        )
                    stack.append((body, times * max(count, 1)))
                    continue
                kids = list(_children(op, av))
                if kids:
                    stack.extend((kid, times) for kid in kids)
                elif op not in _ZERO_WIDTH:
                    size += times
                if size > MAX_PATTERN_SIZE:
                    break
            if size > MAX_PATTERN_SIZE:
                raise ValueError(
                    f"stands for more than {MAX_PATTERN_SIZE} characters once its counted "
                    f"repetitions are written out (the limit per pattern)"
                )
    except RecursionError:
        raise ValueError("groups nested too deep for the regular expression parser") from None
    return size


def check_regex(pattern: str) -> int:
    """`pattern_size` of a ``regex`` constraint's pattern, also held to `MAX_CONSTRAINT_PATTERN_SIZE`
    (the caller, a pydantic field validator, names the field)."""
    return PatternSize().add_pattern(pattern, "", named=False)


@dataclass
class PatternSize:
    """Running total of one constraint's patterns against `MAX_CONSTRAINT_PATTERN_SIZE` (`add_schema`
    each schema, `add_pattern` a regex)."""

    total: int = 0

    def add_pattern(self, pattern: str, field: str, *, named: bool = True) -> int:
        """Count `pattern` in; a ValueError naming `field` (when `named`) at the first limit passed."""
        where = f"{field}: " if named else ""
        try:
            size = pattern_size(pattern)
        except ValueError as err:
            raise ValueError(f"{where}{err}") from None
        return self._add(size, where)

    def add_length(self, length: int, field: str) -> int:
        """Count in a ``minLength``/``maxLength`` of `length` characters (compiled as a pattern)."""
        if length > MAX_REPEAT:
            raise ValueError(
                f"{field}: {length}, over the limit of {MAX_REPEAT} characters for a length bound "
                "(compiled as a repetition of that count)"
            )
        return self._add(length, f"{field}: ")

    def _add(self, size: int, where: str) -> int:
        self.total += size
        if self.total > MAX_CONSTRAINT_PATTERN_SIZE:
            raise ValueError(
                f"{where}the patterns and length bounds of this request stand for more than "
                f"{MAX_CONSTRAINT_PATTERN_SIZE} characters together (the limit per request, all "
                "schemas together)"
            )
        return size

    def add_schema(self, schema: Any, field: str) -> None:
        """Count in every ``pattern``, ``patternProperties`` key and ``minLength``/``maxLength`` of
        `schema` (walked iteratively; its depth and size are bounded by `schema_limits` first)."""
        stack: list[tuple[Any, str]] = [(schema, field)]
        while stack:
            node, where = stack.pop()
            if isinstance(node, list | tuple):
                stack.extend((v, f"{where}[{i}]") for i, v in enumerate(node))
                continue
            if not isinstance(node, Mapping):
                continue
            lengths = [(v, k) for k in ("maxLength", "minLength") if type(v := node.get(k)) is int]
            if lengths:  # one pattern of `{least,most}` characters: the larger bound counts
                length, key = max(lengths)
                self.add_length(length, f"{where}.{key}")
            for key, value in node.items():
                at = f"{where}.{key}"
                if key == "pattern" and isinstance(value, str):
                    self.add_pattern(value, at)
                elif key == "patternProperties" and isinstance(value, Mapping):
                    for name in value:
                        if isinstance(name, str):
                            self.add_pattern(name, f"{at}[{name[:40]!r}]")
                if key not in _DATA_KEYWORDS and isinstance(value, Mapping | list | tuple):
                    stack.append((value, at))
