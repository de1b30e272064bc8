"""The mutable state of one `Reasoner.run`: its live branches (leaves) and what it recorded so far.

Shared by the executor (`reasoner.py`) and the tree-search selects (`search/tree.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from branchwise.backends.base import Backend, StepListener
from branchwise.reasoners.result import SearchStep, TreeNode
from branchwise.reasoners.typed import Typed


@dataclass
class Leaf:
    """A live branch during execution: its backend node and everything generated on its path."""

    node: int
    record: TreeNode
    text: str = ""
    top1: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    n_tokens: int = 0
    finished: bool = False
    score: float | None = None
    scores: dict[str, float] = field(default_factory=dict)
    steps: tuple[str, ...] = ()
    """The text each generate added on this path, root first (a step-level verifier's input)."""
    retired: bool = False
    """Finished and set aside by a search select: kept for the vote, backend node released."""
    group: int | None = None
    """DVTS subtree, assigned at the first grouped select and inherited by children."""


@dataclass
class RunState:
    """Mutable state of one `Reasoner.run`."""

    question: str
    backend: Backend
    """This run's view of the backend (its own session where the backend has sessions)."""
    leaves: list[Leaf]
    variants: list[str]
    tree: dict[int, TreeNode]
    timings: dict[str, float]
    notes: list[str]
    answer: str | None = None
    verify_calls: int = 0
    verify_skipped: int = 0
    votes: dict[str, float] = field(default_factory=dict)
    support: float = 0.0
    runner_up: str | None = None
    typed: Typed | None = None
    """The typed output the answer steps decoded under (votes compare its values)."""
    winners: set[int] = field(default_factory=set)
    allocation: dict[int, int | None] | None = None
    """Children per leaf chosen by the last allocating select (None: the generate's own n)."""
    exhausted: bool = False
    """The last allocating select left nothing to expand: the enclosing loop stops."""
    kv_per_step: list[int] = field(default_factory=list)
    search: list[SearchStep] = field(default_factory=list)
    on_step: StepListener | None = None
    """Shown every decode step of the run (a progress display's listener), if set."""
