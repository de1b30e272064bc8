"""Tree of Thoughts on Game of 24 (Yao et al., 2023) with the embedded model, on the shared KV tree.

Each thought combines two of the remaining numbers ("4 + 8 = 12 (left: 6 12)"); a value prompt on
each state's own KV rates whether the numbers left can still make 24 (sure/likely/impossible), BFS
keeps the best `--breadth` states per step (or DFS backtracks below `--threshold`), and the best
finished state's expression is checked exactly. The puzzles come from the `tree-of-thoughts-llm`
package's `24.csv` (install with `pip install --no-deps tree-of-thoughts-llm`). A 135M model rarely
solves one; the point is the search running end to end with its KV accounting.

Run: python examples/tot_game24.py --puzzles 2 --breadth 3 --n-generate 3 --threads 1
"""

from __future__ import annotations

from _cli import example_parser, load_backend

from branchwise import Reasoner
from branchwise.reasoners.tasks import check_game24, game24_numbers, game24_puzzles
from branchwise.reasoners.verifiers import ToTValueVerifier
from branchwise.strategies import tree_of_thoughts

INSTRUCTIONS = """Use the four numbers and + - * / to make exactly 24. Each step combines two of the \
numbers that are left into one, written as "a op b = c (left: numbers now left)". After three steps, \
write "Answer: <one expression with the four original numbers> = 24".
Example for 2 3 4 6:
3 - 2 = 1 (left: 1 4 6)
1 * 4 = 4 (left: 4 6)
4 * 6 = 24 (left: 24)
Answer: (3 - 2) * 4 * 6 = 24"""

VALUE_PROMPT = (
    '\nLook at the numbers in the last "(left: ...)" above. Can they still make exactly 24? '
    "Reply with one word: sure, likely or impossible.\nVerdict:"
)


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--puzzles", type=int, default=2, help="how many puzzles")
    parser.add_argument("--start", type=int, default=900, help="first CSV row (ToT evaluated rows 900-999)")
    parser.add_argument("--breadth", type=int, default=3, help="states kept per step (ToT: 5)")
    parser.add_argument("--n-generate", type=int, default=3, help="thoughts sampled per state")
    parser.add_argument("--search", choices=["bfs", "dfs"], default="bfs")
    parser.add_argument("--evaluator", choices=["value", "vote"], default="value")
    parser.add_argument("--threshold", type=float, default=0.05, help="DFS: prune states valued below this")
    args = parser.parse_args()

    backend = load_backend(args)
    strategy = tree_of_thoughts(
        breadth=args.breadth,
        depth=4,
        n_generate=args.n_generate,
        evaluator=args.evaluator,
        search=args.search,
        threshold=args.threshold,
        max_step_tokens=32,
        step_delimiter="\n",
        extractor="expression",
        seed=0,
    )
    reasoner = Reasoner(
        strategy,
        backend=backend,
        verifiers={"tot_value": ToTValueVerifier(prompt=VALUE_PROMPT)},
        prompt_template=lambda puzzle: f"{INSTRUCTIONS}\nInput: {puzzle}",
    )
    solved = 0
    for puzzle in game24_puzzles(start=args.start, limit=args.puzzles):
        result = reasoner.run(puzzle)
        ok = check_game24(game24_numbers(puzzle), result.answer)
        solved += ok
        best = max(result.branches, key=lambda b: b.scores.get("tot_value", 0.0), default=None)
        print(f"puzzle {puzzle}: answer={result.answer!r} solved={ok}")
        if best is not None:
            print("  best state:", best.text.strip().replace("\n", " | ")[:160])
        print(
            f"  KV metric {result.kv_metric_tokens} tokens over {len(result.kv_per_step)} steps, "
            f"peak {result.kv_stats['peak_bytes'] / 2**20:.1f} MiB, computed {result.kv_stats['tokens_computed']:.0f} "
            f"reused {result.kv_stats['tokens_reused']:.0f}, {result.timings['total']:.1f} s"
        )
    print(f"solved {solved}/{args.puzzles}")


if __name__ == "__main__":
    main()
