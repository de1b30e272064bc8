"""User-facing runnables: `Reasoner` (strategy + backend + verifiers), verifiers, answer handling.

Names load lazily so that light submodules (`answers`, `search`) can be imported without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Reasoner": "branchwise.reasoners.reasoner",
    "Branch": "branchwise.reasoners.result",
    "ReasoningResult": "branchwise.reasoners.result",
    "TreeNode": "branchwise.reasoners.result",
    "SearchStep": "branchwise.reasoners.result",
    "Candidate": "branchwise.reasoners.verifiers",
    "ConfidenceVerifier": "branchwise.reasoners.verifiers",
    "JudgeVerifier": "branchwise.reasoners.verifiers",
    "LogprobVerifier": "branchwise.reasoners.verifiers",
    "Verifier": "branchwise.reasoners.verifiers",
    "default_verifiers": "branchwise.reasoners.verifiers",
    "StepJudgeVerifier": "branchwise.reasoners.verifiers",
    "OutcomeVerifier": "branchwise.reasoners.verifiers",
    "ReasoningGymVerifier": "branchwise.reasoners.verifiers",
    "Game24Verifier": "branchwise.reasoners.verifiers",
    "ArithmeticStepVerifier": "branchwise.reasoners.verifiers",
    "ChainSumStepVerifier": "branchwise.reasoners.verifiers",
    "ToTValueVerifier": "branchwise.reasoners.verifiers",
    "ToTVoteVerifier": "branchwise.reasoners.verifiers",
    "PRMVerifier": "branchwise.reasoners.verifiers",
}
__all__ = [
    "ArithmeticStepVerifier",
    "Branch",
    "Candidate",
    "ChainSumStepVerifier",
    "ConfidenceVerifier",
    "Game24Verifier",
    "JudgeVerifier",
    "LogprobVerifier",
    "OutcomeVerifier",
    "PRMVerifier",
    "Reasoner",
    "ReasoningGymVerifier",
    "ReasoningResult",
    "SearchStep",
    "StepJudgeVerifier",
    "ToTValueVerifier",
    "ToTVoteVerifier",
    "TreeNode",
    "Verifier",
    "default_verifiers",
]

if TYPE_CHECKING:
    from branchwise.reasoners.reasoner import Reasoner
    from branchwise.reasoners.result import Branch, ReasoningResult, SearchStep, TreeNode
    from branchwise.reasoners.verifiers import (
        ArithmeticStepVerifier,
        Candidate,
        ChainSumStepVerifier,
        ConfidenceVerifier,
        Game24Verifier,
        JudgeVerifier,
        LogprobVerifier,
        OutcomeVerifier,
        PRMVerifier,
        ReasoningGymVerifier,
        StepJudgeVerifier,
        ToTValueVerifier,
        ToTVoteVerifier,
        Verifier,
        default_verifiers,
    )


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'branchwise.reasoners' has no attribute {name!r}")
