"""ETS vs REBASE (and beam search, DVTS) on a reasoning-gym task with the embedded model.

Every method solves the same problems with the same sampling seed (so their first steps coincide)
on one backend; the process reward is the programmatic running-total checker for `chain_sum`
(exact and free) or the LM-as-judge step scorer for other tasks, and the answer is checked with
reasoning-gym's own `score_answer`. Printed per method: accuracy, ETS's KV metric (tokens of all
candidates plus their unique ancestors, prompt included, summed over steps), the peak KV bytes the
backend actually held, tokens computed vs reused, wall time, and for ETS the time in clustering
and the ILP. `benchmarks/ets_vs_rebase.py` is the measured version (widths 16 and 64, JSON out).

Run: python examples/ets_vs_rebase.py --task chain_sum --problems 2 --width 8 --threads 1
"""

from __future__ import annotations

import reasoning_gym
from _cli import example_parser, load_backend

from branchwise import Reasoner
from branchwise.reasoners.verifiers import ReasoningGymVerifier
from branchwise.strategies import beam_search, dvts, ets, rebase

SYSTEM = (
    "Solve the problem step by step, one calculation per line. Then give only the final answer "
    "inside <answer></answer> tags, for example <answer>42</answer>."
)


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument(
        "--task", default="chain_sum", help="reasoning-gym task: chain_sum, gsm_symbolic, countdown"
    )
    parser.add_argument("--problems", type=int, default=2)
    parser.add_argument("--width", type=int, default=8, help="search width N")
    parser.add_argument("--depth", type=int, default=4, help="max reasoning steps")
    parser.add_argument(
        "--embedder", choices=["minilm", "hidden"], default="minilm", help="ETS step embedder"
    )
    parser.add_argument("--all", action="store_true", help="also run beam search and DVTS")
    args = parser.parse_args()

    dataset = reasoning_gym.create_dataset(args.task, size=args.problems, seed=0)
    checker = ReasoningGymVerifier(dataset)
    common = {
        "width": args.width,
        "depth": args.depth,
        "verifier": "chain_sum" if args.task == "chain_sum" else "step_judge",
        "max_step_tokens": 48,
        "step_delimiter": "\n",
        "seed": 0,
    }
    strategies = {"rebase": rebase(**common), "ets": ets(embedder=args.embedder, **common)}
    if args.all:
        strategies = {"beam_search": beam_search(**common), "dvts": dvts(**common), **strategies}
    backend = load_backend(args)
    for name, strategy in strategies.items():
        reasoner = Reasoner(strategy, backend=backend, system_prompt=SYSTEM)
        correct, kv, peak, computed, reused, total, overhead = 0, 0, 0, 0, 0, 0.0, 0.0
        for entry in dataset:
            result = reasoner.run(entry["question"])
            winner = next((b for b in result.branches if b.selected), None)
            text = winner.text if winner else ""
            correct += checker.check(entry["question"], result.answer, text) >= 1.0
            kv += result.kv_metric_tokens
            peak = max(peak, int(result.kv_stats["peak_bytes"]))
            computed += int(result.kv_stats["tokens_computed"])
            reused += int(result.kv_stats["tokens_reused"])
            total += result.timings["total"]
            overhead += result.timings.get("ets_cluster", 0.0) + result.timings.get("ets_ilp", 0.0)
        n = args.problems
        line = (
            f"{name:11s} accuracy {correct}/{n}  KV metric {kv / n:.0f} tokens  peak {peak / 2**20:.1f} MiB  "
            f"computed {computed / n:.0f} reused {reused / n:.0f}  {total / n:.1f} s/problem"
        )
        if name == "ets":
            line += f"  (clustering + ILP: {100 * overhead / total:.1f} % of the time)"
        print(line)


if __name__ == "__main__":
    main()
