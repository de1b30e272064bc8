"""Small, exact task helpers the verifiers, the eval harness and the examples share: Game of 24
(puzzles, the expression extractor, the checker) and chain sums.

Why here and not in `branchwise.evals`: verifiers live in `reasoners`, and dependencies point one
way (`evals -> reasoners`), so the checkers a score node calls must not import the eval harness.
Everything is pure Python (no torch, no model): the Game-of-24 puzzles are read from the CSV that
the `tree-of-thoughts-llm` package ships, located with `importlib.util.find_spec` so the package
(whose pinned dependencies are ancient) is never imported; expressions are evaluated with fractions
over a whitelisted AST, never `eval`.
"""

from __future__ import annotations

import ast
import csv
import importlib.util
import re
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

from branchwise.reasoners.answers import answer_tag, normalize_answer, register_extractor

__all__ = [
    "chain_sum_terms",
    "check_game24",
    "equations",
    "evaluate_arithmetic",
    "extract_expression",
    "game24_csv",
    "game24_numbers",
    "game24_puzzles",
    "game24_rows",
    "running_totals",
]

_INSTALL_TOT = "pip install --no-deps tree-of-thoughts-llm"


def game24_csv() -> Path:
    """Path of `tot/data/24/24.csv` inside the installed `tree-of-thoughts-llm` package.

    `find_spec` on a top-level name locates the package without running its `__init__`.
    """
    spec = importlib.util.find_spec("tot")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the Game-of-24 puzzles need tree-of-thoughts-llm: {_INSTALL_TOT}")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "24" / "24.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {_INSTALL_TOT}")
    return path


def game24_rows(start: int = 0, limit: int | None = None, path: Path | None = None) -> list[tuple[int, str]]:
    """(rank, puzzle) rows such as (901, "4 9 10 13"), in the CSV's order (easiest first by human
    solve time); the rank is the CSV's own, so ids built from it survive a re-sorted or trimmed file.

    ToT's evaluation used rows 900-999 (hard ones); ``start``/``limit`` pick any slice.
    """
    with (path or game24_csv()).open(newline="") as f:
        rows = [(int(row["Rank"]), row["Puzzles"].strip()) for row in csv.DictReader(f)]
    end = None if limit is None else start + limit
    return rows[start:end]


def game24_puzzles(start: int = 0, limit: int | None = None, path: Path | None = None) -> list[str]:
    """The puzzles of :func:`game24_rows` without their ranks."""
    return [puzzle for _, puzzle in game24_rows(start, limit, path)]


def game24_numbers(question: str) -> list[int]:
    """The puzzle numbers: every integer in the question (pass the bare puzzle, e.g. "4 9 10 13")."""
    return [int(x) for x in re.findall(r"\d+", question)]


# Models write these for * / - ; every expression is read through this table first.
_OPERATORS = str.maketrans({"×": "*", "÷": "/", "−": "-"})


def evaluate_arithmetic(expression: str) -> tuple[Fraction, list[int]] | None:
    """Exact value of ``+ - * /`` over integers (and parentheses) and the integers it used.

    None when the text is not such an expression or divides by zero. ``×``/``÷`` are accepted.
    """
    text = expression.translate(_OPERATORS).strip()
    if not text or len(text) > 200:
        return None
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return None
    used: list[int] = []

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            inner = value(node.operand)
            return -inner if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult | ast.Div):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            if isinstance(node.op, ast.Mult):
                return left * right
            if right == 0:
                raise ZeroDivisionError
            return left / right
        raise ValueError(type(node).__name__)

    try:
        return value(tree), used
    except (ValueError, ZeroDivisionError, RecursionError):
        return None


_EXPR_CHARS = re.compile(r"^[\d\s+\-*/().xX]+$")
_EXPR_RUN = re.compile(r"[\d(][\d\s+\-*/().]*[\d)]")


def _clean_expression(answer: str) -> str | None:
    """A model's answer as a bare expression (LaTeX operators, "x" for times and a trailing "= 24"
    removed), or None when what is left is not arithmetic over numbers."""
    s = normalize_answer(answer).translate(_OPERATORS).replace("\\times", "*").replace("\\div", "/")
    s = s.split("=")[0].strip()
    s = re.sub(r"(?<=\d)\s*[xX]\s*(?=[\d(])", "*", s)
    return s if s and _EXPR_CHARS.match(s) and re.search(r"\d", s) else None


def check_game24(numbers: Sequence[int], expression: str | None) -> bool:
    """True when ``expression`` uses exactly ``numbers`` (as a multiset) and equals 24 exactly.

    The answer is cleaned first (see `_clean_expression`), then evaluated exactly over a whitelisted
    AST, never `eval`.
    """
    cleaned = _clean_expression(expression) if expression else None
    result = evaluate_arithmetic(cleaned) if cleaned else None
    if result is None:
        return False
    value, used = result
    return value == 24 and sorted(used) == sorted(numbers)


def extract_expression(text: str) -> str | None:
    """The arithmetic expression a solution commits to (Game of 24, countdown), cleaned.

    Tried from most to least explicit: the ``<answer>`` tag, the phrase after the last "answer is" /
    "Answer:" (ToT's format, "Answer: (1 + 2) * 8 = 24"), then the longest expression on the last
    line that has one (cut at '=', so "... = 24" gives its left side).
    """
    markers = list(re.finditer(r"answer\s*(?:is|:)\s*:?\s*(.+)", text, re.IGNORECASE))
    for candidate in (answer_tag(text), markers[-1].group(1) if markers else None):
        cleaned = _clean_expression(candidate) if candidate else None
        if cleaned:
            return cleaned
    for line in reversed(text.splitlines()):
        head = line.split("=")[0].translate(_OPERATORS)
        runs = [r.strip() for r in _EXPR_RUN.findall(head)]
        runs = [r for r in runs if any(op in r for op in "+-*/") and r.count("(") == r.count(")")]
        if runs:
            return max(runs, key=len)
    return None


def chain_sum_terms(question: str) -> list[int] | None:
    """Signed terms of a reasoning-gym ``chain_sum`` problem ("... problem: 4 - 1 - 7 =" -> [4, -1, -7])."""
    match = re.search(r"(-?\d+(?:\s*[+-]\s*\d+)+)\s*=", question)
    if match is None:
        return None
    tokens = re.findall(r"[+-]|\d+", match.group(1))
    terms: list[int] = []
    sign = 1
    for tok in tokens:
        if tok in "+-":
            sign = -1 if tok == "-" else 1
        else:
            terms.append(sign * int(tok))
            sign = 1
    return terms


def running_totals(terms: list[int]) -> list[int]:
    """Partial sums after each term from the second on (the totals a step-by-step solution passes)."""
    totals, acc = [], terms[0]
    for t in terms[1:]:
        acc += t
        totals.append(acc)
    return totals


_EQUATION = re.compile(r"([\d\s+\-*/().×÷−]*\d[\d\s+\-*/().×÷−]*)=\s*(-?\d+(?:\.\d+)?)")


def equations(text: str) -> list[tuple[str, Fraction, Fraction | None]]:
    """Every ``lhs = number`` in ``text`` with the claimed value and the exact value of lhs.

    The exact value is None when lhs is not an arithmetic expression (say "x = 3"); a bare number on
    the left ("7 = 7") counts as an expression.
    """
    out = []
    for match in _EQUATION.finditer(text):
        lhs = match.group(1).strip()
        claimed = Fraction(match.group(2))
        result = evaluate_arithmetic(lhs)
        if result is None:  # "1. 4 - 1 = 3": a list enumerator is not part of the expression
            lhs = re.sub(r"^\d+[.)]\s+", "", lhs)
            result = evaluate_arithmetic(lhs)
        out.append((lhs, claimed, None if result is None else result[0]))
    return out


# Strategies name extractors by string: "expression" votes on the final expression, not the last number.
register_extractor("expression", extract_expression)
