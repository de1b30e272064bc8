"""Ready-made strategies for the two baselines every multi-branch method is compared against.

They are plain ``Strategy`` values (not special cases in the reasoner), so they serialise,
compile and validate exactly like a hand-written graph and double as worked examples.
Nodes are constructed directly so that a bad argument (``n=0``) fails with a pydantic
``ValidationError`` whose ``loc`` is the argument's own name.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Literal

from .graph import Edge, Strategy
from .nodes import AggregateNode, GenerateNode, ScoreNode, SelectNode

__all__ = ["best_of_n", "self_consistency"]


def self_consistency(
    n: int = 8,
    temperature: float = 0.7,
    top_p: float = 0.95,
    max_tokens: int = 256,
    stop: list[str] | None = None,
    aggregate: Literal["majority", "weighted_majority", "best_score"] = "majority",
    extractor: str = "auto",
    seed: int | None = None,
) -> Strategy:
    """Sample ``n`` full answers and vote: ``generate -> aggregate`` (Wang et al., 2022)."""
    generate = GenerateNode(
        id="generate",
        n=n,
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
        stop=list(stop or []),
        until="answer",
        seed=seed,
    )
    agg = AggregateNode(id="aggregate", method=aggregate, extractor=extractor)
    return Strategy(
        name="self_consistency",
        description=f"Sample {n} answers and aggregate them by {aggregate}.",
        nodes=[generate, agg],
        edges=[Edge(source=generate.id, target=agg.id)],
    )


def best_of_n(
    n: int = 8,
    verifier: str = "judge",
    temperature: float = 0.7,
    top_p: float = 0.95,
    max_tokens: int = 256,
    stop: list[str] | None = None,
    extractor: str = "auto",
    seed: int | None = None,
) -> Strategy:
    """Sample ``n`` answers, score each with ``verifier`` and keep the best one.

    ``generate -> score(answer) -> select(top_k, k=1) -> aggregate(best_score)``.
    """
    generate = GenerateNode(
        id="generate",
        n=n,
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
        stop=list(stop or []),
        until="answer",
        seed=seed,
    )
    score = ScoreNode(id="score", verifier=verifier, target="answer")
    select = SelectNode(id="select", method="top_k", k=1)
    agg = AggregateNode(id="aggregate", method="best_score", extractor=extractor)
    chain = [generate, score, select, agg]
    return Strategy(
        name="best_of_n",
        description=f"Sample {n} answers, score them with {verifier!r} and keep the best.",
        nodes=chain,
        edges=[Edge(source=a.id, target=b.id) for a, b in pairwise(chain)],
    )
