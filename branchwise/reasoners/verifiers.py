"""Verifiers: how a score node turns a branch into a number in [0, 1].

Why an interface: score nodes name a verifier (`"judge"`, `"confidence"`, ...) so strategies stay
serialisable; the reasoner resolves the name here. An LM-as-judge, a confidence signal, an exact
outcome checker and (for hub users) a PRM head all fit the same `score()` call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from branchwise.backends.base import Backend, NodeId
from branchwise.backends.hf.cgee import judge_score


@dataclass(frozen=True)
class Candidate:
    """What a verifier sees of a branch: its backend node, full text and the extracted answer."""

    node: NodeId
    text: str
    answer: str | None
    top1_probs: Sequence[float]
    logprobs: Sequence[float]


@runtime_checkable
class Verifier(Protocol):
    """Scores candidates of one question; higher is better, in [0, 1]."""

    name: str

    def score(self, backend: Backend, question: str, candidates: Sequence[Candidate]) -> list[float]: ...


class ConfidenceVerifier:
    """Mean top-1 probability of the branch's own tokens (RKSC Eq. 3): free, no extra forward pass."""

    name = "confidence"

    def score(self, backend: Backend, question: str, candidates: Sequence[Candidate]) -> list[float]:
        return [sum(c.top1_probs) / len(c.top1_probs) if c.top1_probs else 0.0 for c in candidates]


class LogprobVerifier:
    """exp(mean log-probability) of the branch's tokens: the sequence's per-token likelihood."""

    name = "logprob"

    def score(self, backend: Backend, question: str, candidates: Sequence[Candidate]) -> list[float]:
        return [math.exp(sum(c.logprobs) / len(c.logprobs)) if c.logprobs else 0.0 for c in candidates]


class JudgeVerifier:
    """LM-as-judge on the same backend: P(Yes) / (P(Yes) + P(No)) after a judge question.

    The question is appended to each branch's own node, so the judge pass reads the prompt and the
    branch's KV instead of recomputing them; all candidates are scored in one batched pass.
    """

    name = "judge"

    def __init__(self, question: str = "\n\nIs the answer above correct? Reply Yes or No.\nReply:") -> None:
        self.question = question

    def probe(self, backend: Backend) -> tuple[list[int], list[int], int]:
        """The judge suffix, the candidate tokens ([yes spellings…, no spellings…]) and how many are yes."""
        yes = _first_tokens(backend, ["Yes", " Yes", "yes", " yes"])
        no = [t for t in _first_tokens(backend, ["No", " No", "no", " no"]) if t not in yes]
        return backend.encode(self.question), yes + no, len(yes)

    def score(self, backend: Backend, question: str, candidates: Sequence[Candidate]) -> list[float]:
        if not candidates:
            return []
        suffix, tokens, n_yes = self.probe(backend)
        probs = backend.score_next([c.node for c in candidates], suffix, tokens)
        return [judge_score(p, n_yes) for p in probs]


def _first_tokens(backend: Backend, words: Sequence[str]) -> list[int]:
    """First token id of each spelling, deduplicated (so a probability is never counted twice)."""
    seen: list[int] = []
    for w in words:
        ids = backend.encode(w)
        if ids and ids[0] not in seen:
            seen.append(ids[0])
    return seen


def default_verifiers() -> dict[str, Verifier]:
    """The verifiers every reasoner knows by name."""
    return {v.name: v for v in (JudgeVerifier(), ConfidenceVerifier(), LogprobVerifier())}
