"""Greedy fidelity in any number format: do two decodes of the same prompts agree, up to ties?

Why a criterion beyond token equality: the lossless paths (exact prefix sharing, batching, CGEE
level 2) compute the same function as the baseline in a different order (a split attention merged
by log-sum-exp, other kernels, other padding). In fp32 that changes logits by ~1e-6 and greedy
tokens stay identical. In bf16 (8 significant bits) the same reordering moves a logit of 7 by ~0.1
(a logit near 30 by ~0.5), so wherever the top two candidates are that close, either path may
pick either one, and both are right. Token equality would then call correct code wrong, and a loose
"most tokens agree" would let a real bug through.

The criterion, per row: the tokens are identical, or they first differ at a step where the
reference's choice and the candidate's choice are a near-tie *for an independent judge*: one plain
forward of the unmodified model (no branchwise code on its path) over the prompt and the common
tokens, in the backend's own dtype. The row matches up to a tie when the judge's logits of the two
tokens differ by at most `rel_tol` times the largest logit magnitude at that step. The default
`rel_tol` is `8 · eps` of the dtype (bf16: 6.25 %, fp16: 0.8 %, fp32: 1e-6): the judge is itself a
bf16 computation, so its margin carries rounding of the same order as the two decodes it judges.
Measured margins at a differing step: 1.2 eps of the largest logit on the embedded model (0.25 at
logits near 26), and on a random tiny Llama up to 4.2 eps on one CPU (0.219 at logits near 6.6: the
bf16 kernels, and so the rounding, differ between CPUs), which 4 eps failed. 8 eps covers both with
headroom, while a token the judge prefers by a clear margin still counts as wrong. After the first difference the
two decodes continue from different tokens, so nothing after it is compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from branchwise.backends.hf.segment import common_prefix

ULPS = 8
"""Default tie tolerance in units of the dtype's machine epsilon, relative to the largest logit."""


@dataclass(frozen=True)
class RowAgreement:
    """One row: where it first differs (None if identical) and the judge's margin there."""

    first_difference: int | None
    margin: float | None
    """Judge's logit of the reference token minus that of the candidate token (≥ 0 if the judge
    agrees with the reference; negative when it would have picked the candidate)."""
    tolerance: float | None
    """`rel_tol` × the largest logit magnitude at that step: a |margin| below it is a tie."""

    @property
    def identical(self) -> bool:
        return self.first_difference is None

    @property
    def matches(self) -> bool:
        """Identical, or first differing at a near-tie."""
        return self.identical or abs(self.margin or 0.0) <= (self.tolerance or 0.0)


@dataclass(frozen=True)
class GreedyAgreement:
    """The criterion over a batch of rows (see the module docstring)."""

    rows: tuple[RowAgreement, ...]
    rel_tol: float

    @property
    def identical(self) -> bool:
        return all(r.identical for r in self.rows)

    @property
    def matches(self) -> bool:
        return all(r.matches for r in self.rows)

    def as_dict(self) -> dict[str, Any]:
        """For a benchmark's JSON: the verdicts, how many rows differ, and each difference's margin."""
        return {
            "identical": self.identical,
            "match_up_to_ties": self.matches,
            "rows": len(self.rows),
            "rows_differing": sum(not r.identical for r in self.rows),
            "rel_tol": self.rel_tol,
            "differences": [asdict(r) for r in self.rows if not r.identical],
        }


def default_rel_tol(dtype: torch.dtype) -> float:
    """`ULPS` machine epsilons of `dtype` (see the module docstring for why)."""
    return ULPS * torch.finfo(dtype).eps


def greedy_agreement(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    reference: Sequence[Sequence[int]],
    candidate: Sequence[Sequence[int]],
    *,
    rel_tol: float | None = None,
) -> GreedyAgreement:
    """Compare `candidate` decodes with `reference` decodes of the same `prompts`, row by row.

    Raises ValueError when the lists' lengths differ, since a missing row is not a tie.
    """
    if not len(prompts) == len(reference) == len(candidate):
        raise ValueError(
            f"prompts ({len(prompts)}), reference ({len(reference)}) and candidate ({len(candidate)}) "
            "must have one entry per row"
        )
    tol = default_rel_tol(model.dtype) if rel_tol is None else rel_tol
    rows = [
        _row(model, list(p), list(r), list(c), tol)
        for p, r, c in zip(prompts, reference, candidate, strict=True)
    ]
    return GreedyAgreement(tuple(rows), tol)


def _row(
    model: PreTrainedModel, prompt: list[int], ref: list[int], cand: list[int], tol: float
) -> RowAgreement:
    at = common_prefix(ref, cand)
    if at == len(ref) == len(cand):
        return RowAgreement(None, None, None)
    if at == min(len(ref), len(cand)):
        # one stopped where the other went on: a length difference is a difference, never a tie
        return RowAgreement(at, float("inf"), 0.0)
    ids = torch.tensor([prompt + ref[:at]], device=model.device)
    with torch.inference_mode():
        logits = model(ids).logits[0, -1].float()
    margin = (logits[ref[at]] - logits[cand[at]]).item()
    return RowAgreement(at, margin, tol * logits.abs().max().item())
