"""RKSC Table 1: No-KV vs KV-only vs KV+CGEE latency at prefix ≈1,024, B=8, t=32.

Problems: reasoning-gym `gsm_symbolic` (seeded), padded with a neutral filler as in RKSC §3.1.
CGEE uses the model's saved calibration (`--calibrate` fits one first on held-out problems).
Prints one JSON object (last line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import emit, machine
from _rksc import calibration_for, load_problems, run_grid

from branchwise.backends.hf import HFBackend


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--task", default="gsm_symbolic")
    parser.add_argument("--problems", "-N", type=int, default=30, help="paper: 30")
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--branches", "-B", type=int, default=8)
    parser.add_argument("--suffix", type=int, default=16)
    parser.add_argument("--tokens", "-t", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="paper: 2-3 per problem")
    parser.add_argument("--calibrate", action="store_true", help="refit the CGEE calibration first")
    parser.add_argument("--calibration-problems", type=int, default=12, help="paper: 30")
    parser.add_argument("--quick", action="store_true", help="prefix 256, B 4, t 8, 2 problems, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.prefix, args.branches, args.tokens, args.problems, args.repeats = 256, 4, 8, 2, 1
        args.calibration_problems = 3

    backend = HFBackend(args.model)
    cal = calibration_for(
        backend, args.task, args.calibration_problems, args.branches, args.tokens, args.calibrate
    )
    problems = load_problems(args.task, args.problems, seed=0)
    summary = run_grid(
        backend,
        problems,
        ["nokv", "kv", "kv+cgee"],
        prefix=args.prefix,
        branches=args.branches,
        suffix=args.suffix,
        t=args.tokens,
        repeats=args.repeats,
    )
    emit(
        {
            "benchmark": "rksc_table1",
            "model": backend.model_name,
            "task": args.task,
            "config": {k: v for k, v in vars(args).items() if k != "model"},
            "calibration": cal,
            **summary,
            "paper": {"kv_only_speedup": 1.343, "rksc_speedup": 1.622},
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    main()
