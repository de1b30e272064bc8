"""Declarative multi-branch reasoning strategies.

This package only describes *what* to run (nodes, edges, a compiled ``Plan``); it deliberately
imports nothing heavy (no torch/transformers) and nothing from the rest of ``branchwise``, so
strategies can be written, validated and serialised on any machine, including in CI and tools
that never load a model.
"""

from .graph import Edge, LoopStep, OpStep, Plan, PlanStep, Strategy, StrategyGraphError
from .nodes import AggregateNode, GenerateNode, LoopNode, Node, ScoreNode, SelectNode
from .prebuilt import best_of_n, self_consistency

__all__ = [
    "AggregateNode",
    "Edge",
    "GenerateNode",
    "LoopNode",
    "LoopStep",
    "Node",
    "OpStep",
    "Plan",
    "PlanStep",
    "ScoreNode",
    "SelectNode",
    "Strategy",
    "StrategyGraphError",
    "best_of_n",
    "self_consistency",
]
