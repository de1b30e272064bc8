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
comparable, the ratios and the overhead share are what this measures. `--quick` (widths 4 and 8,
2 problems, depth 3, 24-token steps) takes about 2 minutes on a busy 2-core machine with
`--threads 1`; the default (widths 16 and 64, 10 problems, depth 6) takes hours there.

Prints progress to stderr and one JSON object as the last line of stdout.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import emit, machine

from branchwise.backends.hf import HFBackend
from branchwise.reasoners import Reasoner, ReasoningResult
from branchwise.reasoners.answers import extract_auto, normalize_answer, register_extractor
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


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def extract_rg_answer(text: str) -> str | None:
    """reasoning-gym's `<answer>` tag when present (the task's format), else the generic extractor."""
    tags = re.findall(r"<answer>\s*(.*?)\s*(?:</answer>|$)", text, re.DOTALL | re.IGNORECASE)
    if tags and tags[-1].strip():
        return normalize_answer(tags[-1].strip())
    return extract_auto(text)


def build(method: str, width: int, args: argparse.Namespace) -> Strategy:
    common: dict[str, Any] = {
        "width": width,
        "depth": args.depth,
        "verifier": args.verifier,
        "temperature": args.temperature,
        "max_step_tokens": args.max_step_tokens,
        "step_delimiter": "\n",
        "aggregate": "weighted_majority",
        "extractor": "rg_answer",
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


def record(result: ReasoningResult, correct: float, wall: float) -> dict[str, Any]:
    generated = sum(len(t.token_ids) for t in result.tree if t.parent is not None)
    steps = result.search_steps
    return {
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
        "fallbacks": sum(s.used_fallback for s in steps),
    }


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
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="hub id or local path (default: the embedded model)")
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
        "--threads", type=int, default=None, help="torch CPU threads (1 is stable on a shared CPU)"
    )
    parser.add_argument(
        "--rg-config",
        nargs="*",
        default=[],
        metavar="KEY=INT",
        help="reasoning-gym generator settings, e.g. max_digits=2 max_terms=4 (default: the generator's)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="widths 4 8, 2 problems, depth 3 (about 2 minutes)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.widths, args.problems, args.depth, args.max_step_tokens = [4, 8], 2, 3, 24
    if args.verifier is None:
        args.verifier = "chain_sum" if args.task == "chain_sum" else "step_judge"
    if "rebase" not in args.methods or "ets" not in args.methods:
        parser.error("--methods must include rebase and ets (the ratios compare them)")

    import reasoning_gym
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    register_extractor("rg_answer", extract_rg_answer, replace=True)
    settings = {k: int(v) for k, v in (item.split("=", 1) for item in args.rg_config)}
    dataset = reasoning_gym.create_dataset(args.task, size=args.problems, seed=args.seed, **settings)
    entries = list(dataset)
    backend = HFBackend(args.model)

    # warm-up (not timed): loads the embedder and the solver, warms the kernels
    warm = build("ets", 4, argparse.Namespace(**{**vars(args), "depth": 2}))
    Reasoner(warm, backend=backend, system_prompt=SYSTEM).run(entries[0]["question"])

    per_width: dict[str, Any] = {}
    for width in args.widths:
        rows: dict[str, list[dict[str, Any]]] = {m: [] for m in args.methods}
        reasoners = {
            m: Reasoner(build(m, width, args), backend=backend, system_prompt=SYSTEM) for m in args.methods
        }
        for i, entry in enumerate(entries):
            for method in args.methods:
                t0 = time.perf_counter()
                result = reasoners[method].run(entry["question"])
                wall = time.perf_counter() - t0
                correct = (
                    float(dataset.score_answer(result.answer, entry)) if result.answer is not None else 0.0
                )
                rows[method].append(record(result, correct, wall))
                log(
                    f"width {width} problem {i + 1}/{len(entries)} {method:11s} answer={result.answer!s:8.8s} "
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

    emit(
        {
            "benchmark": "ets_vs_rebase",
            "model": backend.model_name,
            "device": str(backend.device),
            "dtype": str(backend.dtype).replace("torch.", ""),
            "config": {
                "task": args.task,
                "task_settings": settings,
                "widths": args.widths,
                "problems": args.problems,
                "depth": args.depth,
                "max_step_tokens": args.max_step_tokens,
                "temperature": args.temperature,
                "verifier": args.verifier,
                "embedder": args.embedder,
                "lambda_b": args.lambda_b,
                "lambda_d": args.lambda_d,
                "cluster_distance": args.cluster_distance,
                "rebase_T": 0.2,
                "keep": "sqrt(N) for beam search and DVTS",
                "seed": args.seed,
                "quick": args.quick,
            },
            "per_width": per_width,
            "paper": PAPER,
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    main()
