"""RKSC Table 1: No-KV vs KV-only vs KV+CGEE latency at prefix ≈1,024, B=8, t=32.

Problems: reasoning-gym `gsm_symbolic` (seeded), padded with a neutral filler as in RKSC §3.1.
CGEE uses the model's saved calibration (`--calibrate` fits one first on held-out problems).
Prints one JSON object (last line).
"""

from __future__ import annotations

from _common import BenchParser, load_problems, start
from _rksc import add_calibration_options, add_solve_options, calibration_for, collect_grid, summarise_grid


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(
        __doc__,
        {"prefix": 256, "branches": 4, "tokens": 8, "problems": 2, "repeats": 1, "calibration_problems": 3},
    )
    add_solve_options(parser, problems=30, paper_problems=30, tokens=32, repeats=2)
    add_calibration_options(parser)
    args = parser.parse_args(argv)

    bench = start("rksc_table1", args)
    cal = calibration_for(
        bench.backend, args.task, args.calibration_problems, args.branches, args.tokens, args.calibrate
    )
    grid = collect_grid(
        bench.backend,
        load_problems(args.task, args.problems, seed=0),
        ["nokv", "kv", "kv+cgee"],
        args,
        progress=bench.log,
    )
    bench.emit(
        {
            "task": args.task,
            "calibration": cal,
            **summarise_grid(grid),
            "paper": {"kv_only_speedup": 1.343, "rksc_speedup": 1.622},
        }
    )


if __name__ == "__main__":
    main()
