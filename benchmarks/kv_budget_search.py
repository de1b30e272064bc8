"""A beam search at a KV memory budget that binds every arm: dense, exact sharing, SkipKV at two
budgets, ReasonCache, RSBCM and the accelerations composed (the arms of `kv_budget.py`).

Why a second workload: `kv_budget.py` measures many self-consistency requests decoding together,
where the budget decides how many requests run at once. A step-level search holds memory
differently: between steps its kept leaves (and, dense, every leaf's whole path) stay held, and in
each step `--width` rows decode from them. Under a budget smaller than one step's rows, a call
without a scheduler starts only the rows its budget holds and lets the others join as rows end
(`Intake.start`), so the budget decides how many of a step's rows decode at once, and an arm that
saves KV runs more of them together.

The workload: `--questions` problems of a reasoning-gym task behind the few-shot prompt of
`kv_budget.py` (grown to about `--prompt-tokens`), each answered by
`beam_search(width=--width, depth=--depth, max_step_tokens=--step-tokens)` scored by `--verifier`
(default `confidence`: the branch's own mean top-1 probability, no extra forward), one question after
the other on one backend (`Reasoner.run`: `Reasoner.batch` runs accelerated runs one after another
too, so every arm gets the same schedule). The budget: `--budget-fraction` of exact sharing's worst
case for one step's rows at once (`kv_cost` of the longest prompt and `--width` rows of
`--step-tokens` tokens), printed in the JSON. Dense cannot stay within such a budget: every leaf it
keeps between steps holds its whole path, prompt included (its steps over the budget are counted and
its notes say so).

Protocol as in `kv_budget.py`: one warm-up per arm, then `--repeats` rounds running every arm once
in an order rotated per round, round r sampling with seed `--seed` + r. Reported per arm: searches/s
and generated tokens/s (median and per round), ratios vs dense and vs exact; rows that waited for
room (`deferred_rows`), preemptions, steps over the budget (`kv_overruns`: what the run held, its
live leaves and the one row a decode always goes on with, did not fit; its result says so in its
notes), the peak KV each search held (the run's ledger: its nodes and its batches' tails); accuracy
of the voted answer (reasoning-gym's `score_answer`, all rounds) with a 95 % bootstrap CI, and its
agreement with dense's answer on the same question and seed.

Prints progress to stderr and one JSON object as the last line of stdout.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any, Literal

from _common import Bench, BenchParser, load_problems, start, sync
from kv_budget import (
    ARMS,
    COMPOSED_LEFT_OUT,
    TASKS,
    add_arm_options,
    check_arm_options,
    correct,
    few_shot,
    make_arms,
    mean_ci,
    rotated,
    share_of,
    spread,
)

from branchwise.backends.accel import Accel
from branchwise.reasoners import Reasoner, ReasoningResult
from branchwise.strategies import Strategy, beam_search


def search_of(args: argparse.Namespace, seed: int) -> Strategy:
    """The timed beam search (`--width`, `--depth`, `--step-tokens`, `--verifier`, `--temperature`),
    sampling with `seed`; sentences are its steps."""
    return beam_search(
        width=args.width,
        depth=args.depth,
        max_step_tokens=args.step_tokens,
        verifier=args.verifier,
        temperature=args.temperature,
        step_delimiter=".",
        seed=seed,
    )


def run_arm(
    bench: Bench,
    strategy: Strategy,
    accel: Accel,
    share: Literal["none", "exact"],
    questions: list[str],
    shots: list[dict[str, str]],
) -> tuple[dict[str, Any], list[ReasoningResult]]:
    """Every question's search, one after the other, timed together."""
    backend = bench.backend
    pool = backend.engine.pool
    reasoner = Reasoner(
        strategy,
        backend,
        share=share,
        accel=accel,
        system_prompt=shots[0]["content"],
        history=shots[1:],
    )
    overruns0, preemptions0 = pool.overruns, pool.preemptions
    sync(backend)
    t0 = time.perf_counter()
    results = [reasoner.run(q) for q in questions]
    sync(backend)
    seconds = time.perf_counter() - t0
    tokens = sum(len(node.token_ids) for r in results for node in r.tree[1:])
    run = {
        "seconds": seconds,
        "searches_per_s": len(questions) / seconds,
        "tokens_per_s": tokens / seconds,
        "generated_tokens": tokens,
        "deferred_rows": sum(r.kv_stats.get("deferred_rows", 0.0) for r in results),
        "preemptions": pool.preemptions - preemptions0,
        "overruns": pool.overruns - overruns0,
        "peak_bytes": max(r.kv_stats["peak_bytes"] for r in results),
        "notes": sorted({n for r in results for n in r.notes}),
    }
    return run, results


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(
        __doc__,
        {
            "questions": 2,
            "width": 8,
            "depth": 2,
            "step_tokens": 8,
            "prompt_tokens": 100,
            "budget_fraction": 0.95,
            "skipkv_budgets": [4, 8],
            "skipkv_interval": 4,
            "repeats": 1,
        },
    )
    add_arm_options(parser, budget_fraction=0.4, budget_of="one step's rows at once", skipkv_budgets=[8, 16])
    parser.add_argument("--questions", type=int, default=4, help="questions, one search each")
    parser.add_argument("--width", type=int, default=16, help="the beam's width (rows per step)")
    parser.add_argument("--depth", type=int, default=3, help="search steps")
    parser.add_argument("--step-tokens", type=int, default=32, help="tokens per step at most")
    parser.add_argument("--verifier", default="confidence", help="the step scorer (a verifier name)")
    parser.add_argument("--prompt-tokens", type=int, default=160, help="few-shot prompt length to reach")
    args = parser.parse_args(argv)
    check_arm_options(parser, args, ("questions", "width", "depth", "step_tokens"))

    bench = start(
        "kv_budget_search", args, kv_budget=None, decode_step=args.decode_step, kv_layout=args.kv_layout
    )
    backend = bench.backend
    pool = backend.engine.pool
    problems = load_problems(args.task, args.questions, args.seed, **TASKS.get(args.task, {}))
    shots = few_shot(args, backend)
    questions = [q for q, _, _ in problems]
    lengths = [len(backend.chat_prompt([*shots, {"role": "user", "content": q}])) for q in questions]
    one_step = backend.kv_cost(max(lengths), args.width, args.step_tokens, "exact")
    budget = math.ceil(args.budget_fraction * one_step / (1.0 - pool.watermark))
    # one dense row's tail holds its whole path and its free slots: a budget below that cannot even
    # assemble it (dense goes over a larger budget too, from the leaves it keeps: counted and noted)
    dense_tail = backend.kv_cost(max(lengths), 1, args.step_tokens, "none")
    least = dense_tail / one_step
    if args.budget_fraction < least:
        parser.error(
            f"--budget-fraction {args.budget_fraction} is below one dense row's tail ({dense_tail} bytes of "
            f"the {one_step} one step's rows need under exact sharing): the minimum is {least:.4f}"
        )
    backend.kv_budget = budget
    arms = make_arms(args, budget, pool.token_bytes)
    bench.log(
        f"{len(questions)} questions, beam width {args.width} x depth {args.depth} x {args.step_tokens} tokens, "
        f"prompts {min(lengths)}-{max(lengths)} tokens, budget {budget / 2**20:.1f} MiB = "
        f"{args.budget_fraction} of exact's {one_step / 2**20:.1f} MiB for one step's rows"
    )

    def strategy(seed: int) -> Strategy:
        return search_of(args, seed)

    warm = beam_search(width=2, depth=1, max_step_tokens=4, verifier=args.verifier, seed=0)
    for name, accel in arms.items():  # warm-up outside the timings: lazy init, plug-in builds
        run_arm(bench, warm, accel, share_of(name), questions[:1], shots)

    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ARMS}
    answers: dict[str, list[list[str | None]]] = {name: [] for name in ARMS}
    orders = []
    for rnd in range(args.repeats):
        order = rotated(rnd)
        orders.append(order)
        for name in order:
            run, results = run_arm(
                bench, strategy(args.seed + rnd), arms[name], share_of(name), questions, shots
            )
            runs[name].append(run)
            answers[name].append([r.answer for r in results])
            bench.log(
                f"round {rnd} {name}: {run['seconds']:.1f} s, {run['searches_per_s']:.3f} searches/s, "
                f"deferred rows {run['deferred_rows']:g}, preemptions {run['preemptions']}, overruns "
                f"{run['overruns']}, peak {run['peak_bytes'] / 2**20:.1f} MiB"
            )

    rows: dict[str, Any] = {}
    for name in ARMS:
        rs = runs[name]
        right = [
            statistics.fmean(correct(rnd[q], e, ds) for rnd in answers[name])
            for q, (_, e, ds) in enumerate(problems)
        ]
        same = [
            statistics.fmean(
                float(a[q] == d[q]) for a, d in zip(answers[name], answers["dense"], strict=True)
            )
            for q in range(len(problems))
        ]
        rows[name] = {
            "share": share_of(name),
            "accel": arms[name].model_dump(exclude_defaults=True),
            "searches_per_s": spread([r["searches_per_s"] for r in rs]),
            "tokens_per_s": spread([r["tokens_per_s"] for r in rs], 2),
            "seconds": spread([r["seconds"] for r in rs], 2),
            "generated_tokens": [r["generated_tokens"] for r in rs],
            "deferred_rows": [r["deferred_rows"] for r in rs],
            "preemptions": [r["preemptions"] for r in rs],
            "overruns": [r["overruns"] for r in rs],
            "peak_bytes": max(r["peak_bytes"] for r in rs),
            "peak_vs_budget": round(max(r["peak_bytes"] for r in rs) / budget, 4),
            "accuracy_vote": mean_ci(right),
            "agreement_with_dense": mean_ci(same),
            "notes": sorted({n for r in rs for n in r["notes"]}),
        }
    for row in rows.values():
        for base in ("dense", "exact"):
            ref = rows[base]["searches_per_s"]
            row[f"throughput_vs_{base}"] = round(row["searches_per_s"]["median"] / ref["median"], 3)
    bench.emit(
        {
            "budget_bytes": budget,
            "budget_fraction": args.budget_fraction,
            "exact_one_step_bytes": one_step,
            "every_arm_bound": all(sum(r["deferred_rows"]) > 0 for r in rows.values()),
            "arms": rows,
        },
        config={
            "arms": list(ARMS),
            "orders": orders,
            "task_settings": TASKS.get(args.task, {}),
            "prompt_lengths": lengths,
            "shots": (len(shots) - 1) // 2,
            "token_bytes": pool.token_bytes,
            "composed_left_out": COMPOSED_LEFT_OUT,
        },
    )


if __name__ == "__main__":
    main()
