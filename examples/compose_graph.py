"""A strategy composed from nodes in Python: a confidence-guided step search, run on the embedded model.

Each step keeps the `--keep` branches the model is most confident in (the `confidence` verifier reads
the branch's own token probabilities: no extra forward pass) and expands each `--expand` times; the
finished branches vote weighted by score. The graph is printed as YAML, the file that
`branchwise run --strategy FILE` and `branchwise strategy validate FILE` take.

Run: python examples/compose_graph.py "What is 12 + 7?" --steps 3
"""

from __future__ import annotations

from itertools import pairwise

from _cli import example_parser, load_backend

from branchwise import Reasoner
from branchwise.strategies import (
    AggregateNode,
    Edge,
    GenerateNode,
    LoopNode,
    ScoreNode,
    SelectNode,
    Strategy,
)


def confident_steps(first: int, keep: int, expand: int, steps: int, step_tokens: int) -> Strategy:
    """`first` branches write a step; then, `steps - 1` times, score the last steps, keep the best
    `keep` and expand each `expand` times. The loop's edges: into its body, back, and out once."""
    nodes = [
        GenerateNode(id="first", n=first, until="step", max_tokens=step_tokens),
        LoopNode(id="search", body=["score", "keep", "next"], max_iterations=steps - 1),
        ScoreNode(id="score", verifier="confidence", target="step"),
        SelectNode(id="keep", method="top_k", k=keep),
        GenerateNode(id="next", n=expand, until="step", max_tokens=step_tokens),
        AggregateNode(id="vote", method="weighted_majority"),
    ]
    chain = ["first", "search", "score", "keep", "next", "search", "vote"]
    return Strategy(
        name="confident_steps",
        description=f"Keep the {keep} most confident steps, expand each {expand} times.",
        nodes=nodes,
        edges=[Edge(source=a, target=b) for a, b in pairwise(chain)],
    )


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("question", nargs="?", default="What is 12 + 7?")
    parser.add_argument("--first", type=int, default=4, help="branches of the first step")
    parser.add_argument("--keep", type=int, default=2, help="branches kept per step")
    parser.add_argument("--expand", type=int, default=2, help="children per kept branch")
    parser.add_argument("--steps", type=int, default=3, help="steps in all (>= 2)")
    parser.add_argument("--step-tokens", type=int, default=48)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps must be at least 2 (a first step, then the loop), got {args.steps}")

    strategy = confident_steps(args.first, args.keep, args.expand, args.steps, args.step_tokens)
    print(strategy.to_yaml())
    print("plan:", " -> ".join(node.id for node in strategy.compile().nodes()))
    result = Reasoner(strategy, backend=load_backend(args)).run(args.question)
    kv = result.kv_stats
    print(
        f"answer: {result.answer} votes: {result.votes}\n"
        f"{len(result.branches)} branches in {result.timings['total']:.1f} s; "
        f"tokens computed {kv['tokens_computed']:.0f}, reused {kv['tokens_reused']:.0f}"
    )


if __name__ == "__main__":
    main()
