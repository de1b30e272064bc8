"""RKSC Table 5 / §4.2: KV prefix sharing vs No-KV end-to-end speedup as the prefix grows.

How the paper measured: Qwen2.5-7B on an A100, B=8 branches, N=20 problems, the full solve (padded
prefix, 16-token hints, t=8 decode, verify) under token-exact sharing and under No-KV (prefix
recomputed per branch), at prefix n ∈ {128, 256, 512, 1024}: 0.993× [0.909, 1.103], 0.999×
[0.951, 1.061], 1.127× [1.081, 1.224], 1.452× [1.301, 1.681] (95 % CI, 100 % reuse). It places the
break-even between 256 and 512 tokens, above the analytical n* ≈ 90 (kernel-launch overhead).

Here: `_rksc.solve` under "kv" (share="exact") and "nokv" (share="none") with every acceleration
off, conditions interleaved per problem after warm-up, per prefix length (`--prefixes`). This
times the *raw* paths: the backend's KV probe (`ProbeConfig`, RKSC §2.2), which would pick the
faster path per 64-token bucket, is off here. Reported per prefix: the actual mean prompt length
(a question longer than the target makes the prompt longer), mean latencies, the ratio of means,
the median of per-problem ratios with a bootstrap 95 % CI over problems (numpy, fixed seed) and
the CV of the per-problem ratios.

Cost: the full default (prefixes 128–1024, 20 problems, B 8, 3 repeats) is dominated by No-KV at
1,024 (8 prefills of the whole prompt per solve); `--quick` is the smoke run. The JSON's "seconds"
is what a run took.

Prints progress to stderr and one JSON object as the last line of stdout.
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np
from _common import BenchParser, load_problems, start
from _rksc import add_solve_options, collect_grid

from branchwise.evals.stats import bootstrap_ci

PAPER = {
    "speedup": {"128": 0.993, "256": 0.999, "512": 1.127, "1024": 1.452},
    "ci95": {"128": [0.909, 1.103], "256": [0.951, 1.061], "512": [1.081, 1.224], "1024": [1.301, 1.681]},
    "cv": {"128": 0.05, "256": 0.02, "512": 0.01, "1024": 0.0},
    "setting": "Qwen2.5-7B, N=20, B=8, t=8, A100 bf16",
}


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(
        __doc__, {"prefixes": [128, 256], "problems": 2, "branches": 4, "repeats": 1, "warmup": 1}
    )
    add_solve_options(parser, problems=20, paper_problems=20, tokens=8, prefix=False, repeats=3)
    parser.add_argument("--prefixes", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--warmup", type=int, default=2, help="warm-up solves per condition (paper: 2), once")
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples for the CI")
    args = parser.parse_args(argv)

    bench = start("rksc_prefix_sweep", args)
    problems = load_problems(args.task, args.problems, seed=0)
    sweep: dict[str, dict[str, Any]] = {}
    for i, prefix in enumerate(args.prefixes):
        bench.log(f"prefix {prefix} ({i + 1}/{len(args.prefixes)})")
        grid = collect_grid(
            bench.backend,
            problems,
            ["nokv", "kv"],
            args,
            prefix=prefix,
            warmup=args.warmup if i == 0 else 0,  # the process is warm after the first prefix
            progress=lambda m, prefix=prefix: bench.log(f"prefix {prefix}: {m}"),
        )
        nokv, kv = grid.per_problem["nokv"], grid.per_problem["kv"]
        ratios = [a / b for a, b in zip(nokv, kv, strict=True)]

        def median_ratio(a: np.ndarray, b: np.ndarray) -> float:
            return float(np.median(a / b))

        sweep[str(prefix)] = {
            "prompt_tokens_mean": round(statistics.fmean(grid.prompt_tokens), 1),
            "latency_ms": {
                "nokv": round(statistics.fmean(nokv) * 1e3, 1),
                "kv": round(statistics.fmean(kv) * 1e3, 1),
            },
            "speedup": {
                "median_per_problem": round(statistics.median(ratios), 3),
                "ci95": [
                    round(x, 3) for x in bootstrap_ci([nokv, kv], median_ratio, n_resamples=args.bootstrap)
                ],
                "ratio_of_means": round(
                    statistics.fmean(grid.times["nokv"]) / statistics.fmean(grid.times["kv"]), 3
                ),
                "cv": round(statistics.pstdev(ratios) / statistics.fmean(ratios), 3),
            },
        }
    bench.emit({"task": args.task, "sweep": sweep, "paper": PAPER})


if __name__ == "__main__":
    main()
