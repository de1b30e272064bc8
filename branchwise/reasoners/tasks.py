"""Small, exact task helpers the tree-search verifiers and examples need: Game of 24 and chain sums.

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
from fractions import Fraction
from pathlib import Path

from branchwise.reasoners.answers import register_extractor

__all__ = [
    "chain_sum_terms",
    "check_game24",
    "equations",
    "evaluate_arithmetic",
    "extract_game24_expression",
    "game24_csv",
    "game24_numbers",
    "game24_puzzles",
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


def game24_puzzles(start: int = 0, limit: int | None = None, path: Path | None = None) -> list[str]:
    """Puzzles ("4 9 10 13") in the CSV's order (sorted from easiest by human solve time).

    ToT's evaluation used rows 900-999 (hard ones); ``start``/``limit`` pick any slice.
    """
    with (path or game24_csv()).open(newline="") as f:
        rows = [row["Puzzles"].strip() for row in csv.DictReader(f)]
    end = None if limit is None else start + limit
    return rows[start:end]


def game24_numbers(question: str) -> list[int]:
    """The puzzle numbers: every integer in the question (pass the bare puzzle, e.g. "4 9 10 13")."""
    return [int(x) for x in re.findall(r"\d+", question)]


def evaluate_arithmetic(expression: str) -> tuple[Fraction, list[int]] | None:
    """Exact value of ``+ - * /`` over integers (and parentheses) and the integers it used.

    None when the text is not such an expression or divides by zero. ``×``/``÷`` are accepted.
    """
    text = expression.replace("×", "*").replace("÷", "/").replace("−", "-").strip()
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


def check_game24(numbers: list[int], expression: str | None) -> bool:
    """True when ``expression`` uses exactly ``numbers`` (as a multiset) and equals 24 exactly."""
    if not expression:
        return False
    result = evaluate_arithmetic(expression)
    if result is None:
        return False
    value, used = result
    return value == 24 and sorted(used) == sorted(numbers)


_EXPR = r"[\d\s+\-*/().×÷−]+"


def extract_game24_expression(text: str) -> str | None:
    """The final expression of a Game-of-24 solution, in ToT's format or close to it.

    Looks for the last "Answer: <expr> = 24" (the part before "=" when present), else the left side
    of the last line that ends in "= 24".
    """
    for match in reversed(list(re.finditer(r"answer\s*(?:is)?\s*:?\s*(" + _EXPR + r")", text, re.I))):
        expr = match.group(1).strip()
        if re.search(r"\d", expr) and any(op in expr for op in "+-*/×÷−"):
            return expr
    for line in reversed(text.splitlines()):
        match = re.search(r"(" + _EXPR + r")=\s*24\b", line)
        if match and any(op in match.group(1) for op in "+-*/×÷−"):
            return match.group(1).strip()
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


# Strategies name extractors by string: "game24" votes on the final expression, not the last number.
register_extractor("game24", extract_game24_expression, replace=True)
