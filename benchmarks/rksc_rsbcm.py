"""RKSC App. H: the RSBCM stress test (capacity 4 < B = 8 branch blocks).

Each branch's own KV (16-token hint + t decoded tokens) is one block (block size ≥ s + t); the
prompt is pinned, so exactly B − 4 blocks must be evicted per problem. Same run, same problems:
"kv" (no eviction) vs "kv+rsbcm"; reported: observed vs expected evictions, answer agreement of the
verify decision with the no-eviction run, the overhead per problem with a bootstrap 95 % CI over
paired problems, and the KV bytes freed. Paper (Qwen2.5-7B, N=20): 80/80 evictions, +1.5 ms
[−6, +9], 100 % agreement. The JSON's "seconds" is what a run took.

`tracking_only` is the price of RSBCM's bookkeeping alone: the same run with a capacity it never
reaches, so it evicts nothing but still tracks every key's attention mass, which needs the
explicit-softmax attention path instead of the fused kernels (`attention.cascade`). Its overhead
over "kv" is what RSBCM costs a run where it never acts; its agreement shows whether the explicit
path's rounding ever flips a decision.
"""

from __future__ import annotations

import statistics

from _common import BenchParser, load_problems, start
from _rksc import CONDITIONS, add_solve_options, hint_suffixes, padded_prompt, solve

from branchwise.backends.accel import Accel, RSBCMConfig
from branchwise.evals.stats import bootstrap_ci


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(__doc__, {"problems": 2, "prefix": 256})
    add_solve_options(parser, problems=20, paper_problems=20, tokens=8)
    parser.add_argument("--capacity", type=int, default=4, help="blocks (paper's stress test: 4)")
    args = parser.parse_args(argv)

    bench = start("rksc_rsbcm", args)
    backend = bench.backend
    block = args.suffix + args.tokens  # one block per branch
    CONDITIONS["kv+rsbcm"] = (
        "exact",
        Accel(rsbcm=RSBCMConfig(capacity_blocks=args.capacity, block_tokens=block)),
    )
    never = 10_000_000  # the largest capacity allowed: no run here comes near it
    CONDITIONS["kv+rsbcm-track"] = (
        "exact",
        Accel(rsbcm=RSBCMConfig(capacity_blocks=never, block_tokens=block)),
    )
    suffixes = hint_suffixes(backend, args.branches, args.suffix)
    problems = load_problems(args.task, args.problems, seed=0)
    prompts = [padded_prompt(backend, q, args.prefix) for q, _, _ in problems]
    for cond in ("kv", "kv+rsbcm", "kv+rsbcm-track"):
        solve(backend, prompts[0], suffixes, args.tokens, cond)  # warm-up
    rsbcm_conds = ("kv+rsbcm", "kv+rsbcm-track")
    times: dict[str, list[float]] = {c: [] for c in ("kv", *rsbcm_conds)}
    agree: dict[str, list[bool]] = {c: [] for c in rsbcm_conds}
    evictions: dict[str, list[int]] = {c: [] for c in rsbcm_conds}
    freed: dict[str, list[int]] = {c: [] for c in rsbcm_conds}
    for prompt in prompts:
        base = solve(backend, prompt, suffixes, args.tokens, "kv")
        times["kv"].append(base.seconds)
        for cond in rsbcm_conds:
            backend.reset_stats()
            run = solve(backend, prompt, suffixes, args.tokens, cond)
            extra = backend.kv_stats().extra
            evictions[cond].append(int(extra.get("rsbcm_evictions", 0)))
            times[cond].append(run.seconds)
            agree[cond].append(base.answers[base.decision] == run.answers[run.decision])
            freed[cond].append(int(extra.get("rsbcm_evicted_tokens", 0)) * backend.kv_token_bytes)
    diffs, (low, high) = overhead(times["kv"], times["kv+rsbcm"])
    track_diffs, (track_low, track_high) = overhead(times["kv"], times["kv+rsbcm-track"])
    bench.emit(
        {
            "task": args.task,
            "expected_evictions": len(prompts) * max(0, args.branches - args.capacity),
            "observed_evictions": sum(evictions["kv+rsbcm"]),
            "evictions_per_problem": evictions["kv+rsbcm"],
            "answer_agreement_vs_no_eviction": round(statistics.fmean(agree["kv+rsbcm"]), 3),
            "overhead_ms_per_problem": round(statistics.fmean(diffs), 1),
            "overhead_ci95_ms": [round(low, 1), round(high, 1)],
            "kv_bytes_freed_per_problem": round(statistics.fmean(freed["kv+rsbcm"])),
            "tracking_only": {
                "evictions": sum(evictions["kv+rsbcm-track"]),
                "answer_agreement_vs_no_eviction": round(statistics.fmean(agree["kv+rsbcm-track"]), 3),
                "overhead_ms_per_problem": round(statistics.fmean(track_diffs), 1),
                "overhead_ci95_ms": [round(track_low, 1), round(track_high, 1)],
            },
            "latency_s": {k: round(statistics.fmean(v), 4) for k, v in times.items()},
            "paper": {"observed_evictions": 80, "expected": 80, "overhead_ms": 1.5, "agreement": 1.0},
        },
        config={"block_tokens": block},
    )


def overhead(base: list[float], other: list[float]) -> tuple[list[float], tuple[float, float]]:
    """Per-problem extra milliseconds of `other` over `base`, and their mean's bootstrap 95 % CI
    (paired per problem: a resample keeps each problem's two runs together)."""
    diffs = [(b - a) * 1000 for a, b in zip(base, other, strict=True)]
    return diffs, bootstrap_ci([base, other], lambda a, b: float(((b - a) * 1000).mean()))


if __name__ == "__main__":
    main()
