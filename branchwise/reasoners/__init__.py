"""User-facing runnables: `Reasoner` (strategy + backend + verifiers), verifiers, answer handling."""

from branchwise.reasoners.reasoner import Reasoner
from branchwise.reasoners.result import Branch, ReasoningResult, TreeNode
from branchwise.reasoners.verifiers import (
    Candidate,
    ConfidenceVerifier,
    JudgeVerifier,
    LogprobVerifier,
    Verifier,
    default_verifiers,
)

__all__ = [
    "Branch",
    "Candidate",
    "ConfidenceVerifier",
    "JudgeVerifier",
    "LogprobVerifier",
    "Reasoner",
    "ReasoningResult",
    "TreeNode",
    "Verifier",
    "default_verifiers",
]
