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
say what CGEE costs (DESIGN §8). CGEE uses the model's saved calibration (θ and l_min; τ_conf and
r_gap are the paper's 0.70 / 0.06 from `CGEEConfig`); the paper fitted θ per dataset (App. C.4).

Cost on the 2-core CPU machines (SmolLM2-135M, fp32): `--quick` (3 tasks × 2 problems, prefix 256,
B 4, 1 repeat) takes ≈40 s on an idle machine and ≈90 s with `--threads 1` beside busy neighbours
(measured: No-KV 6.9 s, KV 2.1 s, KV+CGEE 1.9 s per solve there, ≈2.5× the idle times). The full
default (3 tasks × 50 problems, prefix 1,024, B 8, 2 repeats) costs per problem and repeat ≈12.5 s
No-KV (8 prefills of 1,040 tokens) + ≈3 s KV + ≈3 s KV+CGEE, i.e. 150 × 2 × 18 s ≈ 1.5 h idle,
3–4 h on a busy machine.

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

from _common import emit, machine
from _rksc import (
    CONDITIONS,
    THREADS_HELP,
    GridRun,
    calibration_for,
    cgee_impact,
    collect_grid,
    load_problems,
    set_threads,
    summarise_grid,
)

from branchwise.backends.hf import HFBackend

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


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="hub id or local path; default: embedded SmolLM2-135M")
    parser.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    parser.add_argument("--tasks", nargs="+", default=["gsm_symbolic", "basic_arithmetic", "chain_sum"])
    parser.add_argument(
        "--conditions", nargs="+", default=["nokv", "kv", "kv+cgee"], choices=list(CONDITIONS)
    )
    parser.add_argument("--problems", "-N", type=int, default=50, help="per task; paper: 50")
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--branches", "-B", type=int, default=8)
    parser.add_argument("--suffix", type=int, default=16)
    parser.add_argument("--tokens", "-t", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="paper: 2-3 per problem")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up solves per condition (paper: 2), once")
    parser.add_argument("--calibrate", action="store_true", help="refit the CGEE calibration first")
    parser.add_argument("--calibration-task", default="gsm_symbolic")
    parser.add_argument("--calibration-problems", type=int, default=12, help="paper: 30")
    parser.add_argument(
        "--quick", action="store_true", help="2 problems per task, prefix 256, B 4, 1 repeat, 1 warm-up"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.problems, args.prefix, args.branches, args.repeats, args.warmup = 2, 256, 4, 1, 1
        args.calibration_problems = 3

    set_threads(args.threads)
    started = time.perf_counter()
    backend = HFBackend(args.model)
    cal = calibration_for(
        backend, args.calibration_task, args.calibration_problems, args.branches, args.tokens, args.calibrate
    )
    grids: dict[str, GridRun] = {}
    for i, task in enumerate(args.tasks):
        log(f"[rksc_table2] task {task} ({i + 1}/{len(args.tasks)}), {args.problems} problems")
        grids[task] = collect_grid(
            backend,
            load_problems(task, args.problems, seed=0),
            args.conditions,
            prefix=args.prefix,
            branches=args.branches,
            suffix=args.suffix,
            t=args.tokens,
            repeats=args.repeats,
            warmup=args.warmup if i == 0 else 0,  # the process is warm after the first task
            progress=lambda m, task=task: log(f"[rksc_table2] {task}: {m}"),
        )
    per_task = {task: table_row(g) for task, g in grids.items()}
    rows = list(per_task.values())
    overall = table_row(GridRun.concat(list(grids.values())))
    for base in ("nokv", "kv"):
        if base in args.conditions:
            overall[f"mean_task_speedup_vs_{base}"] = mean_of_speedups(rows, base)
    emit(
        {
            "benchmark": "rksc_table2",
            "model": backend.model_name,
            "tasks": args.tasks,
            "config": {k: v for k, v in vars(args).items() if k not in ("model", "tasks")},
            "calibration": cal,
            "per_task": per_task,
            "overall": overall,
            "paper": PAPER,
            "seconds": round(time.perf_counter() - started, 1),
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    main()
