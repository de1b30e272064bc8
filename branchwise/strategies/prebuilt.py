"""Ready-made strategies: the two sampling baselines and the tree searches compared against them.

They are plain ``Strategy`` values (not special cases in the reasoner), so they serialise,
compile and validate exactly like a hand-written graph and double as worked examples.
Nodes are constructed directly so that a bad argument (``n=0``) fails with a pydantic
``ValidationError`` whose ``loc`` is the argument's own name.

Every step-level search has the same shape, which is why one helper builds them all::

    first_step (generate N steps) -> search loop [score_step -> select -> next_step] -> score_last -> answer

The select node is what differs (beam, DVTS, REBASE, ETS, ToT's top-b or DFS); an allocating
select tells ``next_step`` how many children each kept leaf gets. ``depth`` counts reasoning
steps, so the loop runs ``depth - 1`` times after the first step; ``score_last`` scores the leaves
of the last expansion (leaves scored earlier keep their score) so the final vote can weigh every
branch by its last-step score.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Literal

from pydantic import Field

from .graph import Edge, Strategy
from .nodes import MAX_SEED, AggregateNode, GenerateNode, LoopNode, Node, ScoreNode, SelectNode, SpecModel

__all__ = [
    "PREBUILT",
    "Knobs",
    "Prebuilt",
    "StepParams",
    "beam_search",
    "best_of_n",
    "dvts",
    "ets",
    "rebase",
    "self_consistency",
    "tree_of_thoughts",
]

Aggregate = Literal["majority", "weighted_majority", "best_score"]


def self_consistency(
    n: int = 8,
    temperature: float = 0.7,
    top_p: float = 0.95,
    max_tokens: int = 256,
    stop: list[str] | None = None,
    aggregate: Literal["majority", "weighted_majority", "best_score"] = "majority",
    extractor: str = "auto",
    seed: int | None = None,
    min_tokens: int = 0,
) -> Strategy:
    """Sample ``n`` full answers and vote: ``generate -> aggregate`` (Wang et al., 2022).
    ``min_tokens`` masks the end of sequence until each answer is that long (`GenerateNode`)."""
    generate = GenerateNode(
        id="generate",
        n=n,
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
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
    chain: list[Node] = [generate, score, select, agg]
    return Strategy(
        name="best_of_n",
        description=f"Sample {n} answers, score them with {verifier!r} and keep the best.",
        nodes=chain,
        edges=[Edge(source=a.id, target=b.id) for a, b in pairwise(chain)],
    )


class StepParams(SpecModel):
    """The parameters every step-level search shares (beam, DVTS, REBASE, ETS, Tree of Thoughts).

    One model instead of the same nine keyword arguments on five functions: each search takes its
    own parameters explicitly and these as ``**step``, so a typo (``depht=3``) or a bad value fails
    with a ``ValidationError`` that names the field, exactly as a strategy file would.
    """

    depth: int = Field(default=8, ge=1, le=10000, description="reasoning steps (generate levels)")
    verifier: str = Field(default="step_judge", min_length=1, description="scores each step")
    temperature: float = Field(default=0.7, ge=0.0, le=5.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_step_tokens: int = Field(default=96, ge=1, le=131072)
    step_delimiter: str = Field(default="\n\n", min_length=1)
    aggregate: Aggregate = "weighted_majority"
    extractor: str = Field(default="auto", min_length=1)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)


def _step_search(
    name: str, description: str, select: SelectNode, p: StepParams, *, first_n: int, expand_n: int
) -> Strategy:
    """The common step-search graph (see the module docstring); ``p.depth`` >= 1 steps in all."""

    def step(node_id: str, n: int) -> GenerateNode:
        return GenerateNode(
            id=node_id,
            n=n,
            temperature=p.temperature,
            top_p=p.top_p,
            max_tokens=p.max_step_tokens,
            until="step",
            step_delimiter=p.step_delimiter,
            seed=p.seed,
        )

    first = step("first_step", first_n)
    last = ScoreNode(id="score_last", verifier=p.verifier, target="step")
    agg = AggregateNode(id="answer", method=p.aggregate, extractor=p.extractor, finished_only=True)
    if p.depth == 1:
        nodes: list[Node] = [first, last, agg]
        edges = [Edge(source=a.id, target=b.id) for a, b in pairwise(nodes)]
        return Strategy(name=name, description=description, nodes=nodes, edges=edges)
    score = ScoreNode(id="score_step", verifier=p.verifier, target="step")
    expand = step("next_step", expand_n)
    loop = LoopNode(id="search", body=[score.id, select.id, expand.id], max_iterations=p.depth - 1)
    pairs: list[tuple[Node, Node]] = [
        (first, loop),
        (loop, score),
        (score, select),
        (select, expand),
        (expand, loop),
        (loop, last),
        (last, agg),
    ]
    return Strategy(
        name=name,
        description=description,
        nodes=[first, loop, score, select, expand, last, agg],
        edges=[Edge(source=a.id, target=b.id) for a, b in pairs],
    )


def _kept(width: int, keep: Literal["fixed", "sqrt"], k: int) -> int:
    """How many leaves a beam keeps per step: ``k``, or round(sqrt(width)) (Snell et al.'s sqrt(N))."""
    return max(1, round(math.sqrt(width))) if keep == "sqrt" else k


def beam_search(
    width: int = 16, keep: Literal["fixed", "sqrt"] = "sqrt", k: int = 4, **step: Any
) -> Strategy:
    """PRM-guided beam search: keep M = ``k`` (or sqrt(N)) best steps, expand each N/M times.

    ``step`` takes the fields of :class:`StepParams`: ``verifier`` scores each step (the process
    reward); the final answer is a vote over the finished branches weighted by their last-step
    score (``aggregate``).
    """
    p = StepParams(**step)
    m = _kept(width, keep, k)
    select = SelectNode(
        id="select", method="beam", width=width, keep=keep, **({"k": k} if keep == "fixed" else {})
    )
    return _step_search(
        "beam_search",
        f"PRM beam search: width {width}, keep {m} per step, scored by {p.verifier!r}.",
        select,
        p,
        first_n=width,
        expand_n=max(1, width // m),
    )


def dvts(width: int = 16, subtrees: int | None = None, **step: Any) -> Strategy:
    """Diverse verifier tree search: independent greedy beam searches in ``subtrees`` subtrees.

    ``subtrees`` defaults to round(sqrt(width)); each subtree owns width/subtrees of the width and
    keeps its single best step per iteration (Beeching et al.), so the subtrees never compete.
    ``step`` takes the fields of :class:`StepParams`.
    """
    p = StepParams(**step)
    select = (
        SelectNode(id="select", method="beam", width=width, keep="sqrt", group_by="subtree")
        if subtrees is None
        else SelectNode(id="select", method="beam", width=width, k=subtrees, group_by="subtree")
    )
    s = _kept(width, "sqrt", 1) if subtrees is None else subtrees
    return _step_search(
        "dvts",
        f"DVTS: width {width} in {s} independent subtrees, scored by {p.verifier!r}.",
        select,
        p,
        first_n=width,
        expand_n=max(1, width // s),
    )


def rebase(
    width: int = 16,
    T: float = 0.2,  # the paper's symbol T_R (allocation temperature)
    **step: Any,
) -> Strategy:
    """REBASE (Wu et al., 2024): split the width over all leaves by softmax(R/T), best first.

    ``T`` is the allocation temperature (0.2 in the public code); ``temperature`` (one of the
    :class:`StepParams` fields ``step`` takes) the sampling one.
    """
    p = StepParams(**step)
    select = SelectNode(id="select", method="rebase", width=width, temperature=T)
    return _step_search(
        "rebase",
        f"REBASE: width {width}, T={T}, scored by {p.verifier!r}.",
        select,
        p,
        first_n=width,
        expand_n=1,
    )


def ets(
    width: int = 16,
    lambda_b: float = 1.0,
    lambda_d: float = 1.4,
    T: float = 0.2,  # the paper's symbol T_R (allocation temperature)
    cluster_distance: float = 0.05,
    embedder: Literal["minilm", "hidden"] = "minilm",
    time_limit: float = 5.0,
    **step: Any,
) -> Strategy:
    """ETS (Hooper et al., 2025): REBASE weights -> KV/coverage ILP -> REBASE over the kept leaves.

    ``lambda_b`` penalises retained tree nodes (KV), ``lambda_d`` rewards covering the clusters of
    the leaves' last steps (``embedder``, cut at ``cluster_distance``); ``time_limit`` bounds the
    solver per step (a greedy answer is used, and reported, if it fails). ``step`` takes the
    fields of :class:`StepParams`.
    """
    p = StepParams(**step)
    select = SelectNode(
        id="select",
        method="ets",
        width=width,
        temperature=T,
        lambda_b=lambda_b,
        lambda_d=lambda_d,
        cluster_distance=cluster_distance,
        embedder=embedder,
        time_limit=time_limit,
    )
    return _step_search(
        "ets",
        f"ETS: width {width}, lambda_b={lambda_b}, lambda_d={lambda_d}, T={T}, scored by {p.verifier!r}.",
        select,
        p,
        first_n=width,
        expand_n=1,
    )


def tree_of_thoughts(
    breadth: int = 5,
    n_generate: int = 5,
    evaluator: Literal["value", "vote"] = "value",
    search: Literal["bfs", "dfs"] = "bfs",
    threshold: float = 0.5,
    max_expansions: int | None = None,
    **step: Any,
) -> Strategy:
    """Tree of Thoughts (Yao et al., 2023): sample ``n_generate`` thoughts per state, evaluate, search.

    ``evaluator="value"`` scores each state on its own (verifier ``tot_value``: sure/likely/impossible),
    ``"vote"`` compares the candidate states in one prompt (verifier ``tot_vote``); register
    task-specific prompts under those names. ``search="bfs"`` keeps the ``breadth`` best states per
    step for ``depth`` steps; ``"dfs"`` expands the deepest best state first, prunes states valued
    below ``threshold``, backtracks to the parked frontier, and stops at the first finished state that
    passes the threshold (at most ``max_expansions`` expansions, default ``breadth * depth``).
    The answer is the best-valued finished state. ``step`` takes the fields of :class:`StepParams`
    (with ToT's own defaults: ``depth=3``, one-line thoughts of up to 64 tokens) except
    ``verifier`` and ``aggregate``, which the evaluator decides.
    """
    fixed = sorted({"verifier", "aggregate"} & step.keys())
    if fixed:
        raise ValueError(
            f"tree_of_thoughts sets {' and '.join(fixed)} itself (evaluator={evaluator!r}); "
            "register a task-specific verifier under 'tot_value' or 'tot_vote' instead"
        )
    verifier = "tot_value" if evaluator == "value" else "tot_vote"
    p = StepParams(
        **{"depth": 3, "max_step_tokens": 64, "step_delimiter": "\n", **step},
        verifier=verifier,
        aggregate="best_score",
    )
    if search == "bfs":
        select = SelectNode(id="select", method="top_k", k=breadth)
        iterations = p.depth
    elif search == "dfs":
        select = SelectNode(id="select", method="dfs", threshold=threshold)
        iterations = max_expansions if max_expansions is not None else breadth * p.depth
    else:
        raise ValueError(f"search={search!r} is not one of 'bfs', 'dfs'")
    return _step_search(
        "tree_of_thoughts",
        f"Tree of Thoughts ({search.upper()}): {n_generate} thoughts per state, "
        f"{'keep ' + str(breadth) if search == 'bfs' else 'threshold ' + str(threshold)}, "
        f"{evaluator} evaluator.",
        select,
        StepParams.model_validate({**p.model_dump(), "depth": iterations}),
        first_n=n_generate,
        expand_n=n_generate,
    )


class Knobs(SpecModel):
    """The generic knobs a front end sets on any prebuilt strategy; ``None`` keeps the builder's own
    default. Declared once, here: the CLI generates its ``--n``, ``--temperature``, ``--max-tokens``,
    ``--depth``, ``--seed`` and ``--verifier`` options from these fields (their descriptions and
    ranges are the options' help and checks), and `Prebuilt` validates what any front passes."""

    branches: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="Branches per question (n, or the search width); default: the strategy's.",
    )
    temperature: float | None = Field(
        None, ge=0.0, le=5.0, description="Sampling temperature; default: the strategy's."
    )
    tokens: int | None = Field(
        None,
        ge=1,
        le=131072,
        description="Tokens per answer (per step in tree searches); default: the strategy's.",
    )
    depth: int | None = Field(
        None,
        ge=1,
        le=10000,
        description="Reasoning steps of a step search (beam search, DVTS, REBASE, ETS, tree-of-thoughts).",
    )
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Sampling seed (reproducible runs).")
    verifier: str | None = Field(
        None, description="Verifier of best-of-n and the step searches (default: theirs)."
    )


@dataclass(frozen=True)
class Prebuilt:
    """How a front end (the CLI, a suite file) drives one prebuilt strategy with the generic `Knobs`.

    ``branches`` and ``tokens`` name the builder's own parameters for "how many branches" and
    "tokens per generate", which differ (``n``, ``width``, ``n_generate``; ``max_tokens`` or
    ``max_step_tokens``); ``verifier`` says whether the builder takes a verifier name. A step
    search (one with ``max_step_tokens``) also takes ``depth``, its number of reasoning steps.
    """

    build: Callable[..., Strategy]
    branches: str
    tokens: str
    verifier: bool
    summary: str

    def __call__(self, **knobs: Any) -> Strategy:
        """Build the strategy from `Knobs` fields (a bad name or value is a ``ValidationError``
        naming it); ``None`` keeps the builder's own default for that knob."""
        k = Knobs.model_validate(knobs)
        if k.verifier is not None and not self.verifier:
            raise ValueError(f"{self.build.__name__} chooses its own verifier; it takes no verifier name")
        if k.depth is not None and not self.steps:
            raise ValueError(f"{self.build.__name__} answers in one step; it takes no depth")
        renamed = {"branches": self.branches, "tokens": self.tokens}
        given = k.model_dump(exclude_none=True)
        return self.build(**{renamed.get(name, name): value for name, value in given.items()})

    @property
    def steps(self) -> bool:
        """Whether this is a step search (it takes ``depth``): its tokens are counted per step."""
        return self.tokens == "max_step_tokens"


#: Every prebuilt strategy under its command-line name.
PREBUILT: dict[str, Prebuilt] = {
    "self-consistency": Prebuilt(self_consistency, "n", "max_tokens", False, "sample n answers and vote"),
    "best-of-n": Prebuilt(best_of_n, "n", "max_tokens", True, "sample n answers, keep the best scored"),
    "tree-of-thoughts": Prebuilt(
        tree_of_thoughts, "n_generate", "max_step_tokens", False, "BFS over thoughts with a value evaluator"
    ),
    "beam-search": Prebuilt(beam_search, "width", "max_step_tokens", True, "PRM-guided beam search"),
    "dvts": Prebuilt(dvts, "width", "max_step_tokens", True, "independent beam searches in subtrees"),
    "rebase": Prebuilt(rebase, "width", "max_step_tokens", True, "reward-balanced tree search"),
    "ets": Prebuilt(ets, "width", "max_step_tokens", True, "REBASE + KV/coverage ILP pruning"),
}
