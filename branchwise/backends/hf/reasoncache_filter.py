"""ReasonCache's collaborative filter (the ReasonCache paper, §IV-A) as plain functions.

Why a separate module: which earlier reasoning step a new step may borrow KV from is pure logic on
token ids, text and small tensors, and it is what the paper's ablations vary; keeping it apart from
the plug-in (`reasoncache.py`, which moves KV) lets each rule be tested on hand-made inputs.

- **Stage 1, steps** (§IV-A1): the lexical pre-filter is the cosine of bag-of-token-id vectors times
  a length penalty min(|Sc|,|Sk|)/max(|Sc|,|Sk|) (character lengths), kept above a dynamic threshold
  τ = τ_strict − (τ_strict − τ_soft)·mean(history). Steps in a formal language (here: arithmetic
  and algebra written inline, or code) must also have the same abstract syntax trees: tree edit
  distance 0 (Zhang-Shasha, through `zss`), so `2x+5=10` never reuses `2x-5=10`. Prose skips it.
- **Stage 2, blocks** (§IV-A2): the normalised Euclidean distance between two blocks' keys and
  values over all layers, (ΔK + ΔV)/(2·d·h) averaged over layers, from cached squared norms and one
  dot product; `PercentileThreshold` admits a distance at or below the p-th percentile of those
  seen so far, after a warm-up with no reuse (PAT).
"""

from __future__ import annotations

import ast
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import zss

# ---------------------------------------------------------------------------------------------- stage 1


def lexical_similarity(a: Counter[int], b: Counter[int], chars_a: int, chars_b: int) -> float:
    """Eq. (1): cosine of the bag-of-token-id vectors × min/max of the steps' character lengths."""
    if not a or not b or not chars_a or not chars_b:
        return 0.0
    small, large = (a, b) if len(a) <= len(b) else (b, a)
    dot = sum(n * large.get(t, 0) for t, n in small.items())
    norm = math.sqrt(sum(n * n for n in a.values())) * math.sqrt(sum(n * n for n in b.values()))
    return dot / norm * min(chars_a, chars_b) / max(chars_a, chars_b)


def dynamic_tau(history: Sequence[float], strict: float, soft: float) -> float:
    """Eq. (2): τ = τ_strict − (τ_strict − τ_soft)·μ(history); τ_strict with no history."""
    if not history:
        return strict
    return strict - (strict - soft) * (sum(history) / len(history))


_TERM = r"(?:\d+(?:\.\d+)?|(?<![A-Za-z])[A-Za-z](?![A-Za-z])|[-+*/^=<>()×÷·])"
_EXPRESSION = re.compile(rf"{_TERM}(?:\s*{_TERM})+")
_OPERATOR = re.compile(r"[-+*/^=<>×÷·]")
_CODE = re.compile(r"```|^\s*(?:def|return|for|while|if|import|print)\b", re.MULTILINE)


def _python_expression(text: str) -> str:
    """Inline math as a Python expression: implicit products, `^` powers, `=` as a comparison."""
    text = text.replace("×", "*").replace("·", "*").replace("÷", "/").replace("^", "**")
    text = re.sub(r"(\d|\))\s*(?=[A-Za-z(])", r"\1*", text)
    return re.sub(r"(?<![<>=!])=(?!=)", "==", text)


def formal_trees(text: str) -> list[ast.AST]:
    """The abstract syntax trees of a step's formal content ([] = prose, no structural check).

    Code (a fenced block or a line starting with a statement keyword) parses as Python. Otherwise
    every inline expression with an operator (`2x+5=10`, `3*(4+1)`) parses on its own; fragments
    that are not well-formed (a lone `-`, a dangling bracket) are left out.
    """
    if _CODE.search(text):
        body = "\n".join(line for line in text.splitlines() if not line.strip().startswith("```"))
        try:
            return [ast.parse(body)]
        except SyntaxError:
            pass
    trees: list[ast.AST] = []
    for match in _EXPRESSION.finditer(text):
        expr = match.group().strip().strip("=").strip()
        if not _OPERATOR.search(expr):
            continue
        try:
            trees.append(ast.parse(_python_expression(expr), mode="eval").body)
        except SyntaxError:
            continue
    return trees


def _label(node: ast.AST) -> str:
    value = getattr(node, "id", None) or getattr(node, "attr", None) or getattr(node, "arg", None)
    if isinstance(node, ast.Constant):
        value = repr(node.value)
    return type(node).__name__ if value is None else f"{type(node).__name__}:{value}"


def _children(node: ast.AST) -> list[ast.AST]:
    return [c for c in ast.iter_child_nodes(node) if not isinstance(c, ast.expr_context)]


def tree_edit_distance(a: Sequence[ast.AST], b: Sequence[ast.AST]) -> int:
    """Zhang-Shasha edit distance between two forests of syntax trees (under one common root)."""
    # The root is a synthetic node only `_children` and `_label` read, so it holds any AST (a
    # statement's `Module` too), not only the expressions `ast.List` is typed for.
    forest_a = ast.List(elts=list(a))  # type: ignore[arg-type]
    forest_b = ast.List(elts=list(b))  # type: ignore[arg-type]
    return int(zss.simple_distance(forest_a, forest_b, get_children=_children, get_label=_label))


def structurally_equal(a: Sequence[ast.AST], b: Sequence[ast.AST]) -> bool:
    """The structural check: True for prose (neither step has formal content), else TED == 0."""
    if not a and not b:
        return True
    return tree_edit_distance(a, b) == 0


# ---------------------------------------------------------------------------------------------- stage 2


@dataclass(frozen=True)
class BlockNorms:
    """Per-layer squared norms of one block's keys and values (computed once, then reused)."""

    keys: torch.Tensor  # [L] float32
    values: torch.Tensor

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor) -> BlockNorms:
        """`keys`/`values` `[L, H, d, D]`."""
        return cls(_sq_norms(keys), _sq_norms(values))


def _sq_norms(x: torch.Tensor) -> torch.Tensor:
    flat = x.flatten(1).float()
    return (flat * flat).sum(1)


def block_distance(
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    norms_a: BlockNorms,
    norms_b: BlockNorms,
) -> float:
    """Eq. (4): mean over layers of (‖K_a−K_b‖ + ‖V_a−V_b‖)/(2·d·h) for blocks `(keys, values)`
    `[L, H, d, D]`, through ‖x−y‖² = ‖x‖² + ‖y‖² − 2·xᵀy with the norms cached."""
    keys_a, values_a = a
    keys_b, values_b = b
    _, h, d, _ = keys_a.shape
    dk = norms_a.keys + norms_b.keys - 2 * (keys_a.flatten(1).float() * keys_b.flatten(1).float()).sum(1)
    dv = (
        norms_a.values
        + norms_b.values
        - 2 * (values_a.flatten(1).float() * values_b.flatten(1).float()).sum(1)
    )
    per_layer = (dk.clamp_min(0).sqrt() + dv.clamp_min(0).sqrt()) / (2 * d * h)
    return float(per_layer.mean())


@dataclass
class PercentileThreshold:
    """PAT: collect `warmup` distances with no reuse, then admit a distance at or below the
    `percentile`-th percentile of every distance seen so far."""

    percentile: float
    warmup: int
    seen: list[float] = field(default_factory=list)

    def threshold(self) -> float | None:
        """The current threshold (None during the warm-up)."""
        if len(self.seen) < self.warmup or not self.seen:
            return None
        return float(np.percentile(self.seen, self.percentile))

    def admit(self, distance: float) -> bool:
        """Record `distance`; whether a block at this distance may be reused."""
        limit = self.threshold()
        self.seen.append(distance)
        return limit is not None and distance <= limit
