"""RKSC Tables 2 and 3: No-KV vs KV (vLLM-equivalent) vs KV+CGEE over several tasks, t=8.

How the paper measured (RKSC §3.1, §3.3, §3.4): five 7–10B models × four datasets, N=50 problems
each padded to ≈1,024 tokens with a neutral filler, B=8 branches with eight fixed 16-token hints,
t=8 greedy decode steps, an LM-as-judge verify pass; each condition timed 2–3 times per problem
after two warm-up solves, latency = mean over repeats and problems. Table 2 reports per model and
dataset the mean latency of each condition, vLLM↑ (KV vs No-KV), RKSC↑ (KV+CGEE vs No-KV) and the
verify-skip rate; its "overall" row is the mean of the 20 cells' speedups (1.808×, 3.008×, 55 %).
Table 3 counts, over all verify calls, the CGEE-induced errors (0.37 %) and the accuracy delta.

Here: one model (`--model`, default the embedded SmolLM2-135M), reasoning-gym tasks in place of the
datasets (`--tasks`, default `gsm_symbolic basic_arithmetic chain_sum`), the same solve for every
condition (`_rksc.solve`), conditions interleaved per problem. "overall" gives both the paper's mean
of per-task speedups and the pooled ratios. Table 3: one verify call = one solve's verify decision
(skipped by level 1, or run with level-2 exits); an error = the chosen branch's answer differs
from the KV condition's (full-depth judge, never skipped), a decision flip = a different branch was
chosen. On a 135M model accuracy is ≈0 on these tasks, so the agreement numbers are the ones that
say what CGEE costs. CGEE uses the model's saved calibration (θ and l_min; τ_conf and r_gap are the
paper's 0.70 / 0.06 from `CGEEConfig`); the paper fitted θ per dataset (App. C.4).

Cost: the full default (3 tasks × 50 problems, prefix 1,024, B 8, 2 repeats) runs 8 No-KV prefills
of ≈1,040 tokens per problem and repeat; `--quick` is the smoke run. The JSON's "seconds" is what a
run took.

Prints progress to stderr and one JSON object as the last line of stdout.
"""

from __future__ import annotations

import statistics
from typing import Any

from _common import BenchParser, load_problems, start
from _rksc import (
    CONDITIONS,
    GridRun,
    add_calibration_options,
    add_solve_options,
    calibration_for,
    cgee_impact,
    collect_grid,
    summarise_grid,
)

PAPER = {
    "overall": {
        "nokv_ms": 1301,
        "vllm_ms": 719,
        "rksc_ms": 452,
        "vllm_speedup": 1.808,
        "rksc_speedup": 3.008,
        "cgee_skip_rate": 0.55,
    },
    "table3": {
        "verify_calls": 1616,
        "errors": 6,
        "error_rate": 0.0037,
        "delta_accuracy": -0.002,
        "skip_rate": 0.55,
    },
    "setting": "5 models (7-10B) x 4 datasets, N=50 each, A100 bf16, prefix 1,024, B=8, t=8",
}


def table_row(grid: GridRun) -> dict[str, Any]:
    """Table 2 and Table 3 columns of one grid (a task, or all tasks pooled)."""
    s = summarise_grid(grid)
    row: dict[str, Any] = {
        "latency_ms": {c: round(statistics.fmean(grid.per_problem[c]) * 1e3, 1) for c in grid.conditions},
        "speedup_vs_nokv": s.get("speedup_vs_nokv"),
        "speedup_vs_kv": s.get("speedup_vs_kv"),
        "cgee_skip_rate": {c: s["verify_skip_rate"][c] for c in grid.conditions if CONDITIONS[c][1].cgee},
        "mean_verify_exit_layer": s["mean_verify_exit_layer"],
        "accuracy": s["accuracy"],
        "table3": {
            c: cgee_impact(grid, c)
            for c in grid.conditions
            if CONDITIONS[c][1].cgee and "kv" in grid.conditions
        },
        "n_problems": s["n_problems"],
        "prompt_tokens_mean": round(statistics.fmean(grid.prompt_tokens), 1),
    }
    return row


def mean_of_speedups(rows: list[dict[str, Any]], base: str) -> dict[str, float]:
    """The paper's "overall" speedup: the mean over cells (here tasks) of each cell's ratio of means."""
    key = f"speedup_vs_{base}"
    conds = rows[0][key] or {}
    return {c: round(statistics.fmean(r[key][c]["ratio_of_means"] for r in rows), 3) for c in conds}


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(
        __doc__,
        {"problems": 1, "prefix": 256, "branches": 4, "repeats": 1, "warmup": 1, "calibration_problems": 3},
    )
    parser.add_argument("--tasks", nargs="+", default=["gsm_symbolic", "basic_arithmetic", "chain_sum"])
    parser.add_argument(
        "--conditions", nargs="+", default=["nokv", "kv", "kv+cgee"], choices=list(CONDITIONS)
    )
    add_solve_options(parser, problems=50, paper_problems=50, tokens=8, one_task=False, repeats=2)
    parser.add_argument("--warmup", type=int, default=2, help="warm-up solves per condition (paper: 2), once")
    parser.add_argument("--calibration-task", default="gsm_symbolic")
    add_calibration_options(parser)
    args = parser.parse_args(argv)

    bench = start("rksc_table2", args)
    cal = calibration_for(
        bench.backend,
        args.calibration_task,
        args.calibration_problems,
        args.branches,
        args.tokens,
        args.calibrate,
    )
    grids: dict[str, GridRun] = {}
    for i, task in enumerate(args.tasks):
        bench.log(f"task {task} ({i + 1}/{len(args.tasks)}), {args.problems} problems")
        grids[task] = collect_grid(
            bench.backend,
            load_problems(task, args.problems, seed=0),
            args.conditions,
            args,
            warmup=args.warmup if i == 0 else 0,  # the process is warm after the first task
            progress=lambda m, task=task: bench.log(f"{task}: {m}"),
        )
    per_task = {task: table_row(g) for task, g in grids.items()}
    rows = list(per_task.values())
    overall = table_row(GridRun.concat(list(grids.values())))
    for base in ("nokv", "kv"):
        if base in args.conditions:
            overall[f"mean_task_speedup_vs_{base}"] = mean_of_speedups(rows, base)
    bench.emit(
        {"tasks": args.tasks, "calibration": cal, "per_task": per_task, "overall": overall, "paper": PAPER}
    )


if __name__ == "__main__":
    main()
