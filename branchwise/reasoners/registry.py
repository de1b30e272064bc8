"""The names a strategy may use, checked before a model is loaded.

A strategy file refers to verifiers and answer extractors by name, so that it stays plain data; the
names resolve to code only in the reasoner. Checking them here, against the same registries the
reasoner reads, is what lets `branchwise strategy validate` promise that what it accepts runs:
an unknown name is rejected at validation, not after a model has loaded and branches decoded.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from pydantic import ValidationError

from branchwise.reasoners.answers import extractor_names
from branchwise.reasoners.verifiers import default_verifiers
from branchwise.strategies import AggregateNode, ScoreNode, Strategy
from branchwise.strategies.errors import validation_problems
from branchwise.strategies.graph import StrategyGraphError

__all__ = ["UnknownNameError", "check_names", "strategy_problems", "verifier_names"]


class UnknownNameError(ValueError):
    """A strategy names a verifier or extractor that no registry knows; lists every such node."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


def verifier_names(extra: Iterable[str] = ()) -> list[str]:
    """Every verifier a reasoner knows by name: the built-in ones plus ``extra``."""
    return sorted({*default_verifiers(), *extra})


def check_names(strategy: Strategy, verifiers: Iterable[str] = ()) -> None:
    """Raise ``UnknownNameError`` naming each node whose verifier or extractor is not registered.

    ``verifiers`` adds the names of task-specific verifiers given to a ``Reasoner``.
    """
    known_verifiers = verifier_names(verifiers)
    known_extractors = extractor_names()
    problems: list[str] = []
    for i, node in enumerate(strategy.nodes):
        if isinstance(node, ScoreNode) and node.verifier not in known_verifiers:
            problems.append(
                f"nodes[{i}].verifier {node.verifier!r} (score {node.id!r}) is not a known verifier; "
                f"allowed: {', '.join(known_verifiers)}"
            )
        if isinstance(node, AggregateNode) and node.extractor not in known_extractors:
            problems.append(
                f"nodes[{i}].extractor {node.extractor!r} (aggregate {node.id!r}) is not a known extractor; "
                f"allowed: {', '.join(known_extractors)}"
            )
    if problems:
        raise UnknownNameError(problems)


def _name_problems(data: Any) -> list[str]:
    """`check_names`'s problems, read from the document itself (so they are found even when a
    field or the graph is wrong too)."""
    nodes = data.get("nodes") if isinstance(data, dict) else None
    if not isinstance(nodes, list):
        return []
    known = {"score": ("verifier", verifier_names()), "aggregate": ("extractor", extractor_names())}
    problems = []
    for i, node in enumerate(nodes):
        kind = node.get("kind") if isinstance(node, dict) else None
        if kind not in known:
            continue
        key, names = known[kind]
        value = node.get(key)
        if isinstance(value, str) and value and value not in names:
            problems.append(
                f"nodes[{i}].{key} {value!r} ({kind} {node.get('id')!r}) is not a known {key}; "
                f"allowed: {', '.join(names)}"
            )
    return problems


def _drop(data: Any, loc: tuple[Any, ...]) -> bool:
    """Remove the field at pydantic's `loc` from the document (its default then applies); a loc part
    the document does not hold (a node's kind tag) is skipped. False when nothing could be removed."""
    cur = data
    for part in loc[:-1]:
        at_index = isinstance(cur, list) and isinstance(part, int) and 0 <= part < len(cur)
        if at_index or (isinstance(cur, dict) and part in cur):
            cur = cur[part]
    if isinstance(cur, dict) and loc and loc[-1] in cur and loc[-1] not in ("kind", "id"):
        del cur[loc[-1]]
        return True
    return False


def strategy_problems(data: Any) -> list[str]:
    """Every problem of a parsed strategy document, not only the first: its fields' ranges, its
    graph, and the verifier and extractor names it uses; [] when it is valid and compiles.

    Why several passes: a wrong field keeps pydantic from building the nodes, so the graph is not
    checked at all. Each pass drops the fields found wrong (their defaults apply) and validates
    again, until the document validates or nothing more can be dropped; the graph's problems come
    one per line (`StrategyGraphError.problems`)."""
    data = copy.deepcopy(data)
    problems: list[str] = []
    for _ in range(4):
        try:
            Strategy.model_validate(data).compile()
            break
        except ValidationError as err:
            dropped = False
            for e, line in zip(err.errors(), validation_problems(err), strict=True):
                graph = (e.get("ctx") or {}).get("error")
                if isinstance(graph, StrategyGraphError):
                    problems += [f"graph: {p}" for p in graph.problems]
                else:
                    problems.append(line)
                    dropped |= _drop(data, tuple(e["loc"]))
            if not dropped:
                break
    return [*dict.fromkeys(problems), *_name_problems(data)]
