"""What a constraint becomes when it is fitted to a row's token budget (`Grammars.fit`): the fitted
constraint, the count of its shortest reply, and the shapes of the JSON outputs it allows.

Why a module of its own: these are plain functions of a constraint and a budget, with no compiler,
cache or worker in them (`grammar.py` holds those); kept apart, each file stays a size a reader can
hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from branchwise.constraints import Constraint
from branchwise.schema_budget import OutputFloor

MAX_WHITESPACE = 20
"""Longest run of whitespace JSON may hold between two tokens: room for pretty-printing four levels
deep, but a small model can no longer pad its JSON with whitespace until ``max_tokens`` runs out
(xgrammar's default is unbounded, and random or small models do exactly that)."""
TIGHT_WHITESPACE = 2
"""Longest whitespace run between two JSON tokens under a small budget: not 1, because trained
models have habits a single character breaks (SmolLM2 writes ``"expression":  "12 * 7"``, two
spaces; held to one it writes ``""``), and not more, because a random or small model pads every
gap it may."""
CAP_LIMIT = 256
"""Free strings are bounded (and whitespace held to `TIGHT_WHITESPACE`) only when the budget leaves
each fewer characters than this: a larger budget leaves the constraint (and its compiled grammar)
as it was, escapes and pretty-printing included. Without free strings, the whitespace is held only
when the budget leaves fewer than four tokens a gap."""


class _Fitted(Constraint):
    """A constraint fitted to a budget (`Grammars.fit`): it also bounds the whitespace JSON may hold
    between two tokens. A field of its own, so its key (the grammar cache's) differs from the
    unfitted constraint's and the cache, `Grammars.prepare` included, needs no other knob."""

    max_whitespace: int = MAX_WHITESPACE


@dataclass(frozen=True)
class BudgetFit:
    """A constraint fitted to a row's ``max_tokens`` (`Grammars.fit`): what to compile (the same
    constraint when nothing needed fitting), and the tokens its shortest valid reply takes (None:
    not known, or a kind with no such bound, such as tool calls under ``"auto"``, where prose will
    do): counted by tokenizing that output when it is short and may fit (`floor_exact`), else
    bounded from below by its length over the longest token's (`Grammars.longest_token`), which is
    all a refusal needs.
    `outputs`: the same count for each output the constraint allows (a call of each tool that may
    be called, under any ``tool_choice``), where known."""

    constraint: Constraint
    floor_tokens: int | None = None
    floor_exact: bool = True
    outputs: tuple[OutputFloor, ...] = ()


def _shapes(constraint: Constraint) -> list[tuple[str, dict[str, Any], str, str]]:
    """(where, schema, the text before its value, the text after) of each output `constraint`
    allows that a JSON Schema shapes: its own schema, or a call of each tool that may be called
    (read from `Constraint.structural_tag`, so the text around a call is what the grammar forces)."""
    if constraint.kind == "json_schema" and constraint.json_schema is not None:
        return [("", constraint.json_schema, "", "")]
    if constraint.kind != "tool_calls":
        return []
    choice = constraint.tool_choice
    callable_ = [
        i
        for i, t in enumerate(constraint.tools)
        if choice in ("auto", "required") or t["function"]["name"] == choice
    ]
    tags = _tags(constraint.structural_tag(MAX_WHITESPACE)["format"])
    return [
        (f"tools[{i}].function.parameters", tag["content"]["json_schema"], tag["begin"], tag["end"])
        for i, tag in zip(callable_, tags, strict=True)
    ]


def _tags(node: Any) -> list[dict[str, Any]]:
    """The ``tag`` nodes of a structural tag, in order (a tag's own content is not searched: it
    holds a tool's schema)."""
    if isinstance(node, list):
        return [tag for item in node for tag in _tags(item)]
    if not isinstance(node, dict):
        return []
    if node.get("type") == "tag":
        return [node]
    return [tag for value in node.values() for tag in _tags(value)]
