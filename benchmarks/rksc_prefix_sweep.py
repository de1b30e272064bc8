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

Cost on the 2-core CPU machines (SmolLM2-135M, fp32): `--quick` (prefixes 128 256, 2 problems,
B 4, 1 repeat) takes ≈25 s idle, ≈45 s with `--threads 1` beside busy neighbours. The full default
(prefixes 128–1024, 20 problems, B 8, 3 repeats) costs ≈32 s of solves per problem and repeat over
the four prefixes (No-KV at 1,024 alone ≈12.5 s; measured at B 8 with `--threads 1` on a busy
machine: No-KV 9.0 / 17.6 s, KV 2.8 / 4.0 s at 128 / 256), i.e. ≈32 min idle, ≈1.5 h busy.

Prints progress to stderr and one JSON object as the last line of stdout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
from _common import emit, machine
from _rksc import THREADS_HELP, bootstrap_ci, collect_grid, load_problems, set_threads

from branchwise.backends.hf import HFBackend

PAPER = {
    "speedup": {"128": 0.993, "256": 0.999, "512": 1.127, "1024": 1.452},
    "ci95": {"128": [0.909, 1.103], "256": [0.951, 1.061], "512": [1.081, 1.224], "1024": [1.301, 1.681]},
    "cv": {"128": 0.05, "256": 0.02, "512": 0.01, "1024": 0.0},
    "setting": "Qwen2.5-7B, N=20, B=8, t=8, A100 bf16",
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="hub id or local path; default: embedded SmolLM2-135M")
    parser.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    parser.add_argument("--task", default="gsm_symbolic")
    parser.add_argument("--prefixes", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--problems", "-N", type=int, default=20, help="paper: 20")
    parser.add_argument("--branches", "-B", type=int, default=8)
    parser.add_argument("--suffix", type=int, default=16)
    parser.add_argument("--tokens", "-t", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="paper: 2-3 per problem")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up solves per condition (paper: 2), once")
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples for the CI")
    parser.add_argument(
        "--quick", action="store_true", help="prefixes 128 256, 2 problems, B 4, 1 repeat, 1 warm-up"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.prefixes, args.problems, args.branches, args.repeats, args.warmup = [128, 256], 2, 4, 1, 1

    set_threads(args.threads)
    started = time.perf_counter()
    backend = HFBackend(args.model)
    problems = load_problems(args.task, args.problems, seed=0)
    sweep: dict[str, dict[str, Any]] = {}
    for i, prefix in enumerate(args.prefixes):
        log(f"[rksc_prefix_sweep] prefix {prefix} ({i + 1}/{len(args.prefixes)})")
        grid = collect_grid(
            backend,
            problems,
            ["nokv", "kv"],
            prefix=prefix,
            branches=args.branches,
            suffix=args.suffix,
            t=args.tokens,
            repeats=args.repeats,
            warmup=args.warmup if i == 0 else 0,  # the process is warm after the first prefix
            progress=lambda m, prefix=prefix: log(f"[rksc_prefix_sweep] prefix {prefix}: {m}"),
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
                "ci95": bootstrap_ci([nokv, kv], median_ratio, n_boot=args.bootstrap),
                "ratio_of_means": round(
                    statistics.fmean(grid.times["nokv"]) / statistics.fmean(grid.times["kv"]), 3
                ),
                "cv": round(statistics.pstdev(ratios) / statistics.fmean(ratios), 3),
            },
        }
    emit(
        {
            "benchmark": "rksc_prefix_sweep",
            "model": backend.model_name,
            "task": args.task,
            "config": {k: v for k, v in vars(args).items() if k != "model"},
            "sweep": sweep,
            "paper": PAPER,
            "seconds": round(time.perf_counter() - started, 1),
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    main()
