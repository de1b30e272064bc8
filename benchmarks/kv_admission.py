"""Rows decoding at once and throughput at one fixed KV budget, measured: the rows' own KV in tails
(admission prices each row at its worst case) against pages (each row priced by what it holds and a
page ahead, rows that outgrow the budget preempted), `HFBackend(kv_layout=...)`.

Why: the memory a paged layout saves is worth rows, and rows are worth throughput only where the
budget binds. Tails must price every row at its `max_tokens` (their rectangle gives each row the
longest row's room, and a row may always reach its cap), so rows that stop early, as most sampled
branches do, tie up room they never use. Pages hold each row's own length, so admission can price
what a row holds and preempt when rows outgrow the budget, as vLLM does. `paged_admission.py`
replays that on a model of the bytes; this script runs it.

Two workloads, each under one budget for both layouts (exact sharing, no acceleration, the decode
step a user gets, `--decode-step auto`):

* ``self_consistency``: `--questions` reasoning-gym problems behind `kv_budget.py`'s few-shot prompt,
  each one `Job(prompt, n=--n, DecodeParams(--temperature, max_tokens=--max-tokens))`, all enqueued at
  once on a fresh scheduler. Branches stop at the model's end of turn, at lengths that spread well
  below `--max-tokens`. The budget is `--budget-fraction` of the worst case of every question at once
  under tails (what `kv_budget.py` binds by).
* ``beam``: `kv_budget_search.py`'s beam search (`--width` rows per step, `--depth` steps of at most
  `--step-tokens`), one question after the other, under `--beam-budget-fraction` of the tails' worst
  case for one step's rows.

Protocol: one warm-up per layout (the paged kernel is built before timing), then `--repeats` rounds,
the layouts alternating and the first one swapped per round; round r samples with seed `--seed` + r
in both. Reported per layout: the median and individual seconds and generated tokens/s; rows at once
(self-consistency: the most rows that had produced a token and not finished, read at every decode
step; both workloads: generated tokens per decode step, the rows an average step decodes); rows
deferred (waited before their first step), preemptions, overruns (steps over the budget: must be 0)
and the peak of counted KV against the budget; the lengths the branches stopped at; pages / tails
ratios of the medians.

Prints progress to stderr and one JSON object as the last line of stdout.
"""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

from _common import Bench, BenchParser, load_problems, start
from kv_budget import TASKS, few_shot, run_arm
from kv_budget_search import run_arm as run_search
from kv_budget_search import search_of

from branchwise.backends.accel import Accel
from branchwise.backends.base import DecodeParams
from branchwise.backends.hf import cpu_kernels
from branchwise.strategies import beam_search

LAYOUTS = ("tails", "pages")


def steps_of(stats: dict[str, float]) -> float:
    """Decode steps a run took, over every step kind (its statistics' `decode_steps_*` counters)."""
    return sum(v for k, v in stats.items() if k.startswith("decode_steps"))


def summary(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    values = [r[key] for r in runs]
    return {"median": round(statistics.median(values), 3), "values": [round(v, 3) for v in values]}


def self_consistency(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    backend = bench.backend
    pool = backend.engine.pool
    problems = load_problems(args.task, args.questions, args.seed, **TASKS.get(args.task, {}))
    shots = few_shot(args, backend)
    prompts = [backend.chat_prompt([*shots, {"role": "user", "content": q}]) for q, _, _ in problems]
    backend.kv_layout = "tails"
    worst = sum(backend.kv_cost(len(p), args.n, args.max_tokens, "exact") for p in prompts)
    budget = math.ceil(args.budget_fraction * worst / (1.0 - pool.watermark))
    backend.kv_budget = budget
    bench.log(
        f"self-consistency: {len(prompts)} x n={args.n}, prompts {min(map(len, prompts))}-"
        f"{max(map(len, prompts))} tokens, budget {budget / 2**20:.1f} MiB"
    )
    for layout in LAYOUTS:  # warm-up outside the timings
        backend.kv_layout = layout
        run_arm(bench, Accel(), "exact", [prompts[0][-48:]], 2, DecodeParams(max_tokens=4))
    runs: dict[str, list[dict[str, Any]]] = {layout: [] for layout in LAYOUTS}
    lengths: dict[str, list[int]] = {layout: [] for layout in LAYOUTS}
    for rnd in range(args.repeats):
        params = DecodeParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed + rnd)
        for layout in LAYOUTS if rnd % 2 == 0 else LAYOUTS[::-1]:
            backend.kv_layout = layout
            run, gens = run_arm(bench, Accel(), "exact", prompts, args.n, params)
            run["tokens_per_step"] = run["generated_tokens"] / max(steps_of(run["extra"]), 1.0)
            run["deferred_rows"] = run["extra"].get("deferred_rows", 0.0)
            run["peak_bytes"] = run["peak_used_bytes"]
            runs[layout].append(run)
            lengths[layout] += [len(g.token_ids) for gs in gens for g in gs]
            bench.log(
                f"round {rnd} {layout}: {run['seconds']:.1f} s, {run['tokens_per_s']:.1f} tok/s, "
                f"{run['max_rows_at_once']} rows at once, {run['tokens_per_step']:.1f} tokens/step, "
                f"preemptions {run['preemptions']}, overruns {run['overruns']}"
            )
    out: dict[str, Any] = {"budget_bytes": budget, "tails_worst_case_all_bytes": worst}
    for layout in LAYOUTS:
        out[layout] = {
            **layout_row(runs[layout], budget),
            "max_rows_at_once": summary(runs[layout], "max_rows_at_once"),
            "branch_tokens": quantiles(lengths[layout]),
        }
    out["pages_vs_tails"] = ratios(out)
    return out


def beam(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    backend = bench.backend
    pool = backend.engine.pool
    problems = load_problems(args.task, args.beam_questions, args.seed, **TASKS.get(args.task, {}))
    shots = few_shot(args, backend)
    questions = [q for q, _, _ in problems]
    longest = max(len(backend.chat_prompt([*shots, {"role": "user", "content": q}])) for q in questions)
    backend.kv_layout = "tails"
    one_step = backend.kv_cost(longest, args.width, args.step_tokens, "exact")
    budget = math.ceil(args.beam_budget_fraction * one_step / (1.0 - pool.watermark))
    backend.kv_budget = budget
    bench.log(
        f"beam: {len(questions)} questions, width {args.width} x depth {args.depth} x {args.step_tokens} "
        f"tokens, budget {budget / 2**20:.1f} MiB"
    )

    warm = beam_search(width=2, depth=1, max_step_tokens=4, verifier=args.verifier, seed=0)
    for layout in LAYOUTS:
        backend.kv_layout = layout
        run_search(bench, warm, Accel(), "exact", questions[:1], shots)
    runs: dict[str, list[dict[str, Any]]] = {layout: [] for layout in LAYOUTS}
    for rnd in range(args.repeats):
        for layout in LAYOUTS if rnd % 2 == 0 else LAYOUTS[::-1]:
            backend.kv_layout = layout
            run, results = run_search(
                bench, search_of(args, args.seed + rnd), Accel(), "exact", questions, shots
            )
            steps = sum(steps_of(r.kv_stats) for r in results)  # each search's own session counts its steps
            run["tokens_per_step"] = run["generated_tokens"] / max(steps, 1.0)
            runs[layout].append(run)
            bench.log(
                f"round {rnd} {layout}: {run['seconds']:.1f} s, {run['tokens_per_s']:.1f} tok/s, "
                f"{run['tokens_per_step']:.1f} tokens/step, deferred {run['deferred_rows']:g}, "
                f"preemptions {run['preemptions']}, overruns {run['overruns']}"
            )
    out: dict[str, Any] = {"budget_bytes": budget, "tails_worst_case_one_step_bytes": one_step}
    for layout in LAYOUTS:
        out[layout] = layout_row(runs[layout], budget)
    out["pages_vs_tails"] = ratios(out)
    return out


def layout_row(runs: list[dict[str, Any]], budget: int) -> dict[str, Any]:
    """One layout's figures over its rounds (each run's `deferred_rows` and `peak_bytes` set)."""
    return {
        "seconds": summary(runs, "seconds"),
        "tokens_per_s": summary(runs, "tokens_per_s"),
        "tokens_per_step": summary(runs, "tokens_per_step"),
        "deferred_rows": [r["deferred_rows"] for r in runs],
        "preemptions": [r["preemptions"] for r in runs],
        "overruns": [r["overruns"] for r in runs],
        "peak_fraction_of_budget": round(max(r["peak_bytes"] for r in runs) / budget, 3),
    }


def quantiles(values: list[int]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [float(values[0])] * 3
    return {"min": min(values), "q1": q[0], "median": q[1], "q3": q[2], "max": max(values)}


def ratios(out: dict[str, Any]) -> dict[str, float]:
    """Pages over tails, of each median (seconds as tails / pages: higher is better everywhere)."""
    tails, pages = out["tails"], out["pages"]
    got = {
        key: round(pages[key]["median"] / tails[key]["median"], 3)
        for key in ("tokens_per_s", "tokens_per_step", "max_rows_at_once")
        if key in tails
    }
    got["speed"] = round(tails["seconds"]["median"] / pages["seconds"]["median"], 3)
    return got


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(
        __doc__,
        {
            "questions": 4,
            "n": 4,
            "max_tokens": 24,
            "prompt_tokens": 100,
            "beam_questions": 1,
            "width": 4,
            "depth": 2,
            "step_tokens": 8,
            "beam_budget_fraction": 1.0,
            "repeats": 1,
        },
    )
    parser.add_argument("--task", default="basic_arithmetic", help="reasoning-gym generator of the questions")
    parser.add_argument("--seed", type=int, default=0, help="problem split; round r samples with seed + r")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="few-shot prompt length to reach")
    parser.add_argument("--questions", type=int, default=16, help="self-consistency requests, all at once")
    parser.add_argument("--n", type=int, default=8, help="branches per self-consistency request")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per branch at most")
    parser.add_argument(
        "--budget-fraction",
        type=float,
        default=0.25,
        help="self-consistency's budget, a fraction of the tails' worst case for every request at once",
    )
    parser.add_argument("--beam-questions", type=int, default=2, help="beam searches, one after the other")
    parser.add_argument("--width", type=int, default=16, help="the beam's width (rows per step)")
    parser.add_argument("--depth", type=int, default=3, help="search steps")
    parser.add_argument("--step-tokens", type=int, default=64, help="tokens per step at most")
    parser.add_argument("--verifier", default="confidence", help="the beam's step scorer (a verifier name)")
    parser.add_argument(
        "--beam-budget-fraction",
        type=float,
        default=0.4,
        help="the beam's budget, a fraction of the tails' worst case for one step's rows",
    )
    parser.add_argument(
        "--workloads", nargs="+", default=["self_consistency", "beam"], choices=["self_consistency", "beam"]
    )
    parser.add_argument("--repeats", type=int, default=2, help="rounds, the layouts alternating")
    parser.add_argument(
        "--stall-s", type=float, default=300.0, help="fail a run after this long without progress"
    )
    parser.set_defaults(alloc_every=1 << 30)  # `kv_budget.run_arm`'s allocation walks: once per run
    args = parser.parse_args(argv)
    parser.at_least_one(
        args, "questions", "n", "max_tokens", "beam_questions", "width", "depth", "step_tokens", "repeats"
    )
    for name in ("budget_fraction", "beam_budget_fraction"):
        if not 0.0 < getattr(args, name) <= 1.0:
            parser.error(f"--{name.replace('_', '-')} must be in (0, 1], got {getattr(args, name)}")
    bench = start("kv_admission", args, kv_budget=None, prefill_chunk=0)
    kernel = cpu_kernels.build() if bench.backend.device.type == "cpu" else "not a CPU"
    if kernel is not None:
        bench.log(f"the paged kernel is not used ({kernel}): pages read a copy, said in the notes")
    results = {}
    if "self_consistency" in args.workloads:
        results["self_consistency"] = self_consistency(bench, args)
    if "beam" in args.workloads:
        results["beam"] = beam(bench, args)
    bench.emit(
        {"workloads": results, "decode_step": bench.backend.decode_step, "paged_kernel": kernel or "in place"}
    )


if __name__ == "__main__":
    main()
