"""RKSC App. H: the RSBCM stress test (capacity 4 < B = 8 branch blocks).

Each branch's own KV (16-token hint + t decoded tokens) is one block (block size ≥ s + t); the
prompt is pinned, so exactly B − 4 blocks must be evicted per problem. Same run, same problems:
"kv" (no eviction) vs "kv+rsbcm"; reported: observed vs expected evictions, answer agreement of the
verify decision with the no-eviction run, the overhead per problem with a bootstrap 95 % CI over
paired problems, and the KV bytes freed. Paper (Qwen2.5-7B, N=20): 80/80 evictions, +1.5 ms
[−6, +9], 100 % agreement. Full defaults take roughly 5-10 minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import emit, machine
from _rksc import CONDITIONS, bootstrap_ci, hint_suffixes, load_problems, padded_prompt, solve

from branchwise.backends.accel import Accel, RSBCMConfig
from branchwise.backends.hf import HFBackend


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--task", default="gsm_symbolic")
    parser.add_argument("--problems", "-N", type=int, default=20, help="paper: 20")
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--branches", "-B", type=int, default=8)
    parser.add_argument("--suffix", type=int, default=16)
    parser.add_argument("--tokens", "-t", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=4, help="blocks (paper's stress test: 4)")
    parser.add_argument("--quick", action="store_true", help="2 problems, prefix 256")
    args = parser.parse_args(argv)
    if args.quick:
        args.problems, args.prefix = 2, 256

    backend = HFBackend(args.model)
    block = args.suffix + args.tokens  # one block per branch
    CONDITIONS["kv+rsbcm"] = (
        "exact",
        Accel(rsbcm=RSBCMConfig(capacity_blocks=args.capacity, block_tokens=block)),
    )
    suffixes = hint_suffixes(backend, args.branches, args.suffix)
    problems = load_problems(args.task, args.problems, seed=0)
    prompts = [padded_prompt(backend, q, args.prefix) for q, _, _ in problems]
    for cond in ("kv", "kv+rsbcm"):
        solve(backend, prompts[0], suffixes, args.tokens, cond)  # warm-up
    times: dict[str, list[float]] = {"kv": [], "kv+rsbcm": []}
    agree, evictions, freed = [], [], []
    for prompt in prompts:
        base = solve(backend, prompt, suffixes, args.tokens, "kv")
        backend.reset_stats()
        evicting = solve(backend, prompt, suffixes, args.tokens, "kv+rsbcm")
        extra = backend.kv_stats().extra
        evictions.append(int(extra.get("rsbcm_evictions", 0)))
        freed.append(int(extra.get("rsbcm_evicted_tokens", 0)) * backend.kv_token_bytes)
        times["kv"].append(base.seconds)
        times["kv+rsbcm"].append(evicting.seconds)
        agree.append(base.answers[base.decision] == evicting.answers[evicting.decision])
    diffs = [(b - a) * 1000 for a, b in zip(times["kv"], times["kv+rsbcm"], strict=True)]
    # paired per problem: resample problems, keep each (kv, kv+rsbcm) pair together
    low, high = bootstrap_ci([times["kv"], times["kv+rsbcm"]], lambda a, b: float(((b - a) * 1000).mean()))
    emit(
        {
            "benchmark": "rksc_rsbcm",
            "model": backend.model_name,
            "task": args.task,
            "config": {k: v for k, v in vars(args).items() if k != "model"} | {"block_tokens": block},
            "expected_evictions": len(prompts) * max(0, args.branches - args.capacity),
            "observed_evictions": sum(evictions),
            "evictions_per_problem": evictions,
            "answer_agreement_vs_no_eviction": round(statistics.fmean(agree), 3),
            "overhead_ms_per_problem": round(statistics.fmean(diffs), 1),
            "overhead_ci95_ms": [round(low, 1), round(high, 1)],
            "kv_bytes_freed_per_problem": round(statistics.fmean(freed)),
            "latency_s": {k: round(statistics.fmean(v), 4) for k, v in times.items()},
            "paper": {"observed_evictions": 80, "expected": 80, "overhead_ms": 1.5, "agreement": 1.0},
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    main()
