"""Self-consistency on the embedded model, with and without prefix sharing.

Run: python examples/self_consistency.py "What is 12 + 7?" --n 8
"""

from __future__ import annotations

from _cli import example_parser, load_backend

from branchwise import Reasoner
from branchwise.strategies import self_consistency


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("question", nargs="?", default="What is 12 + 7?")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    backend = load_backend(args)
    strategy = self_consistency(n=args.n, temperature=0.7, max_tokens=args.max_tokens, seed=0)
    for share in ("none", "exact"):
        result = Reasoner(strategy, backend=backend, share=share).run(args.question)
        kv = result.kv_stats
        print(
            f"share={share:5s} answer={result.answer!s:8s} support={result.support:.0%} "
            f"time={result.timings['total']:.2f}s peak_kv={kv['peak_bytes'] / 2**20:.1f}MiB "
            f"computed={kv['tokens_computed']:.0f} reused={kv['tokens_reused']:.0f}"
        )


if __name__ == "__main__":
    main()
