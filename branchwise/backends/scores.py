"""Score arithmetic shared across layers, with no torch.

Why its own module: the LM judge's score is computed by the verifiers (`reasoners/verifiers.py`,
which must import without torch), replayed per layer by CGEE's calibration (`hf/cgee.py`) and by the
benchmarks. Kept with none of them, each reads the one formula without loading the others.
"""

from __future__ import annotations

from collections.abc import Sequence


def judge_score(probs: Sequence[float], n_yes: int = 1) -> float:
    """The judge's P(Yes) / (P(Yes) + P(No)) when `probs` = [yes spellings…, no spellings…]; 0.5
    (undecided) when the judge put no mass on either."""
    total = sum(probs)
    return sum(probs[:n_yes]) / total if total > 0 else 0.5
