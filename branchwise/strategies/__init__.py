"""Declarative multi-branch reasoning strategies.

This package only describes *what* to run (nodes, edges, a compiled ``Plan``); it deliberately
imports nothing heavy (no torch/transformers) and nothing from the rest of ``branchwise``, so
strategies can be written, validated and serialised on any machine, including in CI and tools
that never load a model.
"""

from .graph import Edge, LoopStep, OpStep, Plan, PlanStep, Strategy, StrategyGraphError
from .nodes import (
    ALLOCATING_METHODS,
    MAX_SEED,
    AggregateNode,
    GenerateNode,
    LoopNode,
    Node,
    ScoreNode,
    SelectNode,
)
from .prebuilt import (
    PREBUILT,
    Prebuilt,
    StepParams,
    beam_search,
    best_of_n,
    dvts,
    ets,
    rebase,
    self_consistency,
    tree_of_thoughts,
)

__all__ = [
    "ALLOCATING_METHODS",
    "MAX_SEED",
    "PREBUILT",
    "AggregateNode",
    "Edge",
    "GenerateNode",
    "LoopNode",
    "LoopStep",
    "Node",
    "OpStep",
    "Plan",
    "PlanStep",
    "Prebuilt",
    "ScoreNode",
    "SelectNode",
    "StepParams",
    "Strategy",
    "StrategyGraphError",
    "beam_search",
    "best_of_n",
    "dvts",
    "ets",
    "rebase",
    "self_consistency",
    "tree_of_thoughts",
]
