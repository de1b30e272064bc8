"""Score arithmetic shared across layers, with no torch.

Why its own module: the LM judge's score is computed by the verifiers (`reasoners/verifiers.py`,
which must import without torch), replayed per layer by CGEE's calibration (`hf/cgee.py`) and by the
benchmarks; CGEE level 1's skip rule (RKSC Eq. 4) runs in the local plug-in and in the remote
backend, which must not import the local one. Kept with none of them, each reads the one formula
without loading the others.
"""

from __future__ import annotations

from collections.abc import Sequence


def judge_score(probs: Sequence[float], n_yes: int = 1) -> float:
    """The judge's P(Yes) / (P(Yes) + P(No)) when `probs` = [yes spellings…, no spellings…]; 0.5
    (undecided) when the judge put no mass on either."""
    total = sum(probs)
    return sum(probs[:n_yes]) / total if total > 0 else 0.5


def gap_ratio(confidences: Sequence[float]) -> float:
    """(max − second max) / max; 1.0 for a single branch (nothing competes), 0.0 when max is 0."""
    ordered = sorted(confidences, reverse=True)
    if not ordered or ordered[0] <= 0:
        return 0.0
    second = ordered[1] if len(ordered) > 1 else 0.0
    return (ordered[0] - second) / ordered[0]


def verify_skip(confidences: Sequence[float], tau_conf: float, r_gap: float) -> bool:
    """CGEE level 1 (RKSC Eq. 4): skip the verify pass when both the best branch's absolute
    confidence and its relative gap to the runner-up are decisive."""
    return bool(confidences) and max(confidences) >= tau_conf and gap_ratio(confidences) >= r_gap
