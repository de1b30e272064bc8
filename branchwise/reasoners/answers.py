"""Final-answer extraction from free-form reasoning text, and (weighted) majority voting.

Multi-branch strategies (self-consistency, best-of-n, tree search) only agree or disagree through the
*answers* their branches reach, never through the reasoning text, so the extractors normalise
surface forms ("19.0", "19", "$19$", "\\boxed{19}") onto one string before anything is counted.

This module is deliberately pure Python (no torch) so evals and tests can import it cheaply.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation

__all__ = [
    "Extractor",
    "VoteResult",
    "answer_tag",
    "extract_answer",
    "extract_answer_tag",
    "extractor_names",
    "get_extractor",
    "majority_vote",
    "normalize_answer",
    "normalize_number",
    "register_extractor",
]

Extractor = Callable[[str], str | None]
"""An extractor maps model output to a normalised answer string, or None when it finds none."""

_EXTRACTORS: dict[str, Extractor] = {}


# --------------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------------


def register_extractor(name: str, fn: Extractor, *, replace: bool = False) -> None:
    """Register ``fn`` under ``name`` so strategies can refer to it by a string in their config.

    Re-registering an existing name needs ``replace=True``: silently shadowing a built-in (say
    ``"last_number"``) from some plugin would change every vote without any visible sign.
    """
    if not isinstance(name, str) or not name:
        raise ValueError("extractor name must be a non-empty string")
    if not callable(fn):
        raise TypeError(f"extractor {name!r} must be callable, got {type(fn).__name__}")
    if name in _EXTRACTORS and not replace:
        raise ValueError(f"extractor {name!r} is already registered; pass replace=True to override it")
    _EXTRACTORS[name] = fn


def extractor_names() -> list[str]:
    """Registered extractor names, sorted (for error messages and CLI help)."""
    return sorted(_EXTRACTORS)


def get_extractor(name: str) -> Extractor:
    """Look up an extractor; an unknown name lists the allowed ones, since it is usually a typo."""
    try:
        return _EXTRACTORS[name]
    except (KeyError, TypeError):
        allowed = ", ".join(repr(n) for n in extractor_names())
        raise ValueError(f"unknown answer extraction method {name!r}; allowed: {allowed}") from None


def extract_answer(text: str, method: str = "auto") -> str | None:
    """Extract the final answer from ``text`` with the named method (see :func:`extractor_names`)."""
    return get_extractor(method)(text)


# --------------------------------------------------------------------------------------------------
# Normalisation
# --------------------------------------------------------------------------------------------------

_MINUS_SIGNS = str.maketrans({"\u2212": "-"})  # U+2212 MINUS SIGN; dashes are punctuation

# A leading '-' is a sign only when it does not continue a word or an expression ("3-4", "x-1"):
# otherwise "pages 3-4" would end in the number -4.
_SIGN = r"(?:(?<![\w)\]}.])-)?"
_NUMBER_RE = re.compile(
    _SIGN
    + r"(?:"
    + r"\d+/\d+(?![\d.])"  # fraction: kept as written
    + r"|\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)"  # thousands separators
    + r"|\d+(?:\.\d+)?"  # integer / decimal
    + r"|\.\d+"  # leading-dot decimal
    + r")"
)
_FULL_NUMBER_RE = re.compile(
    r"[-+]?(?:\d+/\d+|\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)",
)


def normalize_number(token: str) -> str:
    """Canonical form of one numeric token: "19.0"→"19", "1,000"→"1000", "-0.50"→"-0.5", "3/4" kept.

    Fractions are not reduced or evaluated ("6/8" stays): a model writing "6/8" against gold "3/4"
    is a different answer at the string level, and deciding mathematical equivalence is the job of
    a task-specific grader, not of the voter.
    """
    s = token.strip().translate(_MINUS_SIGNS).replace(",", "").replace(" ", "")
    sign = ""
    if s[:1] in "+-":
        sign, s = ("-" if s[0] == "-" else ""), s[1:]
    if "/" in s:
        num, _, den = s.partition("/")
        return f"{sign}{int(num)}/{int(den)}"
    try:
        value = Decimal(s)
    except InvalidOperation:
        return token.strip()
    if value == 0:
        return "0"  # also folds "-0" and "0.00"
    if value == value.to_integral_value():
        text = str(int(value))
    else:
        text = format(value.normalize(), "f")
        if text.startswith("."):
            text = "0" + text
    return sign + text


_LATEX_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*(-?[\d.,]+)\s*\}\s*\{\s*(-?[\d.,]+)\s*\}")
_LATEX_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\s*\{([^{}]*)\}")
_LATEX_SPACING_RE = re.compile(r"\\[,!;: ]|\\quad|\\qquad")
_WRAPPERS = "$*_`\"' "


def normalize_answer(answer: str) -> str:
    """Canonical form of an extracted answer phrase (also usable on gold answers before comparing).

    Strips markdown/LaTeX dressing (``$...$``, ``**...**``, ``\\text{}``, ``\\frac{a}{b}``→``a/b``,
    a trailing full stop) and, when what remains is a single number, possibly with a currency sign,
    percent or degree sign, returns :func:`normalize_number` of it. Anything else is returned
    trimmed but otherwise as written, since non-numeric answers cannot be canonicalised generally.
    """
    s = answer.strip().translate(_MINUS_SIGNS)
    s = re.sub(r"^\\\(|\\\)$|^\\\[|\\\]$", "", s).strip()
    s = _LATEX_FRAC_RE.sub(lambda m: f"{m.group(1)}/{m.group(2)}", s)
    s = _LATEX_TEXT_RE.sub(lambda m: m.group(1), s)
    s = _LATEX_SPACING_RE.sub("", s)
    prev = None
    while prev != s:  # peel nested wrappers such as "**$19$**." in any order
        prev = s
        s = s.strip(_WRAPPERS).rstrip(".").strip()
    # "(C)" / "(19)" lose their brackets, but a tuple such as "(1, 2)" keeps them.
    inner = s[1:-1]
    if (
        len(s) >= 2
        and s[0] + s[-1] in ("()", "[]", "{}")
        and re.fullmatch(r"[^\s,]+", inner)
        and _balanced(inner)
    ):
        s = inner
    numeric = re.sub(r"^(?:\\\$|[$€£¥])\s*|\s*(?:\\%|%|°|\^\\circ|\^\{\\circ\})$", "", s)
    if _FULL_NUMBER_RE.fullmatch(numeric):
        return normalize_number(numeric)
    return s


def _balanced(s: str) -> bool:
    """True when brackets in ``s`` nest properly, so "(1) or (2)" is not unwrapped to "1) or (2"."""
    depth = 0
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth < 0:
                return False
    return depth == 0


# --------------------------------------------------------------------------------------------------
# Built-in extractors
# --------------------------------------------------------------------------------------------------


def extract_last_number(text: str) -> str | None:
    """The last integer/decimal/fraction in ``text``, normalised (the GSM8K-style fallback)."""
    matches = _NUMBER_RE.findall(text.translate(_MINUS_SIGNS))
    return normalize_number(matches[-1]) if matches else None


_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


def _boxed_contents(text: str) -> list[str]:
    """Contents of every *closed* ``\\boxed{...}`` in order, honouring nested braces."""
    found: list[str] = []
    for m in _BOXED_RE.finditer(text):
        depth, start = 1, m.end()
        for i in range(start, len(text)):
            ch = text[i]
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    found.append(text[start:i])
                    break
    return found


def extract_boxed(text: str) -> str | None:
    """Content of the last closed ``\\boxed{...}``, normalised.

    An unterminated last box (generation cut off by the token limit) is skipped in favour of an
    earlier complete one, rather than returning a truncated answer.
    """
    for content in reversed(_boxed_contents(text)):
        answer = normalize_answer(content)
        if answer:
            return answer
    return None


_ANSWER_IS_RE = re.compile(
    r"(?:####[ \t]*"
    r"|\banswer\b[ \t]*(?:\*\*|__)?[ \t]*(?:is\b[ \t]*:?|[:=])[ \t]*(?:\*\*|__)?)",
    re.IGNORECASE,
)
_PHRASE_END_RE = re.compile(r"\.(?:\s|$)|;|,\s|\s+(?:because|since|as|which)\b", re.IGNORECASE)
_LEADING_NUMBER_RE = re.compile(
    r"^\s*(?:\\\(|\\\[|\$|\*\*|__|\\\$)*\s*(?:[€£¥]\s*)?(" + _FULL_NUMBER_RE.pattern + r")(?![\w/])"
)


def extract_answer_is(text: str) -> str | None:
    """Answer after the last "the answer is X" / "Answer: X" / "#### X" (case-insensitive).

    When X starts with a number, the number alone is returned ("19 apples." → "19") so that unit
    words do not split the vote; otherwise the phrase up to the end of its sentence, de-dressed.
    """
    # The marker regex matches only the marker (not the rest of the line), so two statements on
    # one line ("The answer is 3. No wait, the answer is 4.") are both seen and the last one wins.
    for m in reversed(list(_ANSWER_IS_RE.finditer(text))):
        line_end = text.find("\n", m.end())
        rest = text[m.end() : line_end if line_end >= 0 else len(text)].strip()
        boxed = extract_boxed(rest)
        if boxed:
            return boxed
        number = _LEADING_NUMBER_RE.match(rest.translate(_MINUS_SIGNS))
        if number:
            return normalize_number(number.group(1))
        cut = _PHRASE_END_RE.search(rest)
        phrase = normalize_answer(rest[: cut.start()] if cut else rest)
        if phrase:
            return phrase
    return None


_CHOICE_AFTER_ANSWER_RE = re.compile(
    r"(?i:\banswer\b)[^\n]{0,20}?(?i:\bis\b|:)\s*(?:\*\*|__|\$|\\boxed\{|\\text\{|[(\[])*\s*"
    r"(?:(?i:option|choice)\s+)?"
    r"(?P<letter>[A-E])(?![A-Za-z])"
)
_CHOICE_OPTION_RE = re.compile(r"(?i:\b(?:option|choice)\s+)\(?(?P<letter>[A-E])\b")
_CHOICE_MARKER_RE = re.compile(
    r"\((?P<a>[A-Ea-e])\)"  # (C) / (c)
    r"|\*\*\(?(?P<b>[A-E])[).:]?\*\*"  # **C**, **(C)**, **C)**
    r"|(?<![A-Za-z0-9(])(?P<c>[A-E])\)"  # C)
)
_CHOICE_SOLE_RE = re.compile(r"^\W*(?P<letter>[A-Ea-e])\W*$")


def extract_choice(text: str) -> str | None:
    """A multiple-choice letter A–E, upper-cased.

    Tried from most to least explicit — "answer is (C)" / "Answer: C", then ``\\boxed{C}``, then
    "option C", then bare markers "(C)", "C)", "**C**", then a reply that is only a letter — so a
    model that restates the option list before committing is judged on its commitment. Free-text
    capitals count only when upper-case: "the answer is a ..." is an article, not option A.
    """
    hits = list(_CHOICE_AFTER_ANSWER_RE.finditer(text))
    if hits:
        return hits[-1].group("letter")
    for content in reversed(_boxed_contents(text)):
        sole = _CHOICE_SOLE_RE.match(normalize_answer(content))
        if sole:
            return sole.group("letter").upper()
    hits = list(_CHOICE_OPTION_RE.finditer(text))
    if hits:
        return hits[-1].group("letter")
    hits = list(_CHOICE_MARKER_RE.finditer(text))
    if hits:
        last = hits[-1]
        return next(g for g in last.groups() if g).upper()
    sole = _CHOICE_SOLE_RE.match(text)
    return sole.group("letter").upper() if sole else None


def extract_auto(text: str) -> str | None:
    """boxed → answer_is → last_number: the most explicit commitment the text contains wins."""
    return extract_boxed(text) or extract_answer_is(text) or extract_last_number(text)


# A closed tag's content may span lines (reasoning-gym has grid answers); it never runs into the next
# tag. An unclosed tag (generation stopped at "</answer>" as a stop string, or at the token limit)
# counts up to the end of its line, so trailing text is not taken for the answer.
_ANSWER_TAG_RE = re.compile(
    r"<answer>(?P<closed>(?:(?!<answer>).)*?)</answer>|<answer>(?P<open>[^<\n]*)",
    re.DOTALL | re.IGNORECASE,
)


def answer_tag(text: str) -> str | None:
    """Raw content of the last non-empty ``<answer>`` tag (reasoning-gym's answer format), or None."""
    for match in reversed(list(_ANSWER_TAG_RE.finditer(text))):
        inner = (match["closed"] or match["open"] or "").strip()
        if inner:
            return inner
    return None


def extract_answer_tag(text: str) -> str | None:
    """``<answer>X</answer>`` (normalised), else the generic :func:`extract_auto` fallback."""
    inner = answer_tag(text)
    return normalize_answer(inner) if inner is not None else extract_auto(text)


register_extractor("last_number", extract_last_number)
register_extractor("boxed", extract_boxed)
register_extractor("answer_is", extract_answer_is)
register_extractor("choice", extract_choice)
register_extractor("auto", extract_auto)
register_extractor("answer_tag", extract_answer_tag)


# --------------------------------------------------------------------------------------------------
# Voting
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VoteResult:
    """Outcome of a (weighted) majority vote over branch answers.

    ``counts`` holds the total weight per distinct answer in first-occurrence order; ``support`` is
    the winner's share of the total weight of valid answers (0.0 when there is no winner), which
    strategies use as a cheap confidence for early stopping; ``n_valid`` counts non-None answers.
    """

    answer: str | None
    counts: dict[str, float] = field(default_factory=dict)
    support: float = 0.0
    n_valid: int = 0


def majority_vote(answers: Sequence[str | None], weights: Sequence[float] | None = None) -> VoteResult:
    """Pick the answer with the largest total weight (weight 1 each when ``weights`` is None).

    None answers (branches where extraction failed) abstain rather than forming a "None" bloc, which
    could otherwise out-vote real answers when a weak model often fails to conclude. Ties go to the
    answer that occurred first, so the result is deterministic for a given branch order — the
    same run replays identically, unlike a random tie-break or one that depends on hash order. When
    no valid answer carries positive weight there is no evidence for any answer, and ``answer`` is
    None.
    """
    if weights is None:
        weight_list = [1.0] * len(answers)
    else:
        weight_list = [float(w) for w in weights]
        if len(weight_list) != len(answers):
            raise ValueError(
                f"weights must have the same length as answers ({len(weight_list)} != {len(answers)})"
            )
        bad = [w for w in weight_list if not (math.isfinite(w) and w >= 0.0)]
        if bad:
            raise ValueError(f"weights must be finite and >= 0, got {bad[0]!r}")

    counts: dict[str, float] = {}
    n_valid = 0
    for answer, weight in zip(answers, weight_list, strict=True):  # lengths checked above
        if answer is None:
            continue
        n_valid += 1
        counts[answer] = counts.get(answer, 0.0) + weight

    total = sum(counts.values())
    if total <= 0.0:
        return VoteResult(answer=None, counts=counts, support=0.0, n_valid=n_valid)
    # max() returns the first maximal item, and dicts iterate in insertion (first-occurrence) order.
    winner = max(counts, key=counts.__getitem__)
    return VoteResult(answer=winner, counts=counts, support=counts[winner] / total, n_valid=n_valid)
