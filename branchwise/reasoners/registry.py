"""The names a strategy may use, checked before a model is loaded.

A strategy file refers to verifiers and answer extractors by name, so that it stays plain data; the
names resolve to code only in the reasoner. Checking them here, against the same registries the
reasoner reads, is what lets `branchwise strategy validate` promise that what it accepts runs:
an unknown name is rejected at validation, not after a model has loaded and branches decoded.
"""

from __future__ import annotations

from collections.abc import Iterable

from branchwise.reasoners.answers import extractor_names
from branchwise.reasoners.verifiers import default_verifiers
from branchwise.strategies import AggregateNode, ScoreNode, Strategy

__all__ = ["UnknownNameError", "check_names", "verifier_names"]


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
