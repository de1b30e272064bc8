"""ReasonCache (the ReasonCache paper, §IV-V): dense KV vs similar-block sharing vs its ablations and
the eviction baselines, on the same problems and sampler seeds, in one run.

How the paper measured (§V): 32B reasoning models on vLLM 0.8.2, block size 16, τ_strict 0.9 /
τ_soft 0.7, PAT p = 80; AMSR 17-21 % with 96-98 % of dense accuracy, and 40-60 % more throughput
under concurrent load (Table I) - the gain comes from fitting more requests into the same KV memory,
not from faster attention. Random sharing at the same AMSR loses about half the accuracy (Table I);
"only Cos" (stage 1 alone) loses a few points (Table III).

Here (one process, the tasks interleaved): every problem is decoded with `--branches` sampled
branches (self-consistency) under
  - `dense`: no sharing (the baseline);
  - `reasoncache`: both filter stages (the paper's method, its defaults);
  - `reasoncache_lexical`: stage 1 only (Table III's "only Cos" with the structural check);
  - `random`: each sealed block shared with a random earlier block, at the rate ReasonCache shared
    blocks (so the AMSR is matched, as the paper matches it);
  - `attention_only`, `rkv` and `window`: SkipKV's eviction baselines (H2O/SnapKV-style attention
    scores, R-KV, and a StreamingLLM-style recency window) at the same memory saving: one
    per-branch budget b whose eviction removes AMSR_reasoncache · Σ len of the dense branches'
    generated KV, with the eviction's schedule simulated on those lengths (checked every few
    tokens, cut down to b), so the budget is one at which the baselines do evict that much.
Each reports AMSR (generated KV tokens not held / dense), agreement of the voted answer with dense,
voted accuracy, tokens/s and the filter's time as a share of the run.

The paper does not state its sampling temperature; at 0.6 SmolLM2-135M's sampled branches rarely
repeat a step (stage 1 passed about 10 % of the blocks on gsm_symbolic), so the default here is 0.3.

**Throughput under a fixed KV budget.** The KV budget is what `--budget-branches` dense branches of
mean length hold. Dense fits that many branches at once; ReasonCache fits budget / ((1 − AMSR) ·
per-branch KV), rounded down (its AMSR measured above, so this is the mean fit, not a worst case).
Both then decode `--budget-waves` waves of their width per problem (`--budget-problems`), timed in
this run; `branches_per_s` and its ratio are the throughput at equal memory. When the AMSR is too
small to fit one more branch (`extra_branches` 0) the ratio measures only the speed difference.

A step search (`--tree-questions` questions, beam search width 4) runs dense and ReasonCache through
the Reasoner, for AMSR and agreement under a tree strategy too.

What the numbers mean on this machine: SmolLM2-135M's accuracy on these tasks is near zero, so
accuracy and agreement are mostly noise at this size; AMSR, shared blocks and the throughput ratio
are the measurable part. Prints progress to stderr and one JSON object as the last line of stdout.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

from _common import BenchParser, load_problems, start, sync
from skipkv import Run, batches, decode_all

from branchwise.backends import DecodeParams
from branchwise.backends.accel import Accel, ReasonCacheConfig, SkipKVConfig
from branchwise.backends.hf import HFBackend
from branchwise.reasoners.answers import extract_answer, majority_vote

PAPER = {
    "amsr": "17-21 % (Table II)",
    "accuracy_vs_dense": "96-98 % of dense (Table I)",
    "throughput_gain": "+40-60 % under concurrent load (Table I)",
    "random_sharing_accuracy": "about half of dense at the same AMSR (Table I)",
    "only_cos_accuracy": "3-9 points below the full filter (Table III)",
}


def summarise(
    run: Run, problems: Sequence[tuple[str, Any, Any]], dense: dict[str, Any] | None
) -> dict[str, Any]:
    """AMSR, sharing counters, voted accuracy, agreement with dense, throughput and filter share."""
    voted, correct = [], []
    tokens = 0
    for gens, (_, entry, ds) in zip(run.gens, problems, strict=True):
        vote = majority_vote([extract_answer(g.text) for g in gens]).answer
        voted.append(vote)
        correct.append(float(ds.score_answer(vote, entry) >= 1.0))
        tokens += sum(len(g.token_ids) for g in gens)
    extra = run.extra
    out: dict[str, Any] = {
        "amsr": round(extra.get("reasoncache_amsr", 0.0), 4),
        "blocks_sealed": int(extra.get("reasoncache_blocks_sealed", 0)),
        "stage1_blocks": int(extra.get("reasoncache_stage1_blocks", 0)),
        "stage2_blocks": int(extra.get("reasoncache_stage2_blocks", 0)),
        "blocks_reused": int(extra.get("reasoncache_blocks_reused", 0)),
        "evicted_tokens": int(extra.get("skipkv_evicted_tokens", 0)),
        "filter_share": round(extra.get("reasoncache_filter_s", 0.0) / run.seconds, 4),
        "accuracy": round(statistics.fmean(correct), 4),
        "tokens_per_s": round(tokens / run.seconds, 2),
        "mean_length": round(tokens / sum(len(g) for g in run.gens), 1),
        "lengths": [len(g.token_ids) for gens in run.gens for g in gens],
        "seconds": round(run.seconds, 2),
        "voted_answers": voted,
    }
    if dense is not None:
        out["agreement_with_dense"] = round(
            statistics.fmean(a == b for a, b in zip(voted, dense["voted_answers"], strict=True)), 4
        )
        out["accuracy_vs_dense"] = round(out["accuracy"] - dense["accuracy"], 4)
    return out


def eviction_interval(budget: int) -> int:
    """The eviction baselines' compression interval for `budget`: a quarter of it, within 4..16."""
    return max(4, min(16, budget // 4))


def evicted_at(lengths: Sequence[int], budget: int) -> int:
    """Tokens SkipKV-style eviction removes from branches of `lengths` generated tokens under
    `budget`: a branch is checked every `eviction_interval(budget)` fed tokens (its last sampled
    token is never fed) and cut down to the budget when it holds more."""
    every = eviction_interval(budget)
    return sum(max(0, ((n - 1) // every) * every - budget) for n in lengths)


def matched_budget(lengths: Sequence[int], saving: float) -> int:
    """The per-branch budget whose eviction removes the share of the branches' generated KV closest
    to `saving` (the larger budget on a tie): eviction at the memory saving of another method.

    The eviction's schedule is simulated (`evicted_at`), not assumed continuous: a budget a few
    tokens under the longest branch evicts nothing when no check falls after it."""
    total = max(1, sum(lengths))
    return min(
        range(2, max(3, *lengths) + 1),
        key=lambda b: (abs(evicted_at(lengths, b) / total - saving), -b),
    )


def waves(
    backend: HFBackend,
    prompts: Sequence[list[int]],
    n_waves: int,
    width: int,
    params: DecodeParams,
    accel: Accel,
) -> float:
    """Seconds to decode `n_waves` waves of `width` branches (as many as fit the budget) per prompt."""
    backend.accel = accel
    try:
        sync(backend)
        t0 = time.perf_counter()
        for p in prompts:
            root = backend.prefill(p)
            for k in range(n_waves):
                kids = backend.fork(root, width)
                try:
                    backend.extend(kids, params.model_copy(update={"seed": (params.seed or 0) + k}))
                finally:
                    backend.release(kids)
            backend.release([root])
        sync(backend)
        return time.perf_counter() - t0
    finally:
        backend.accel = Accel()


def tree_search(backend: HFBackend, questions: Sequence[str], max_tokens: int, seed: int) -> dict[str, Any]:
    """Beam search (width 4) dense vs ReasonCache: AMSR and agreement of the final answers."""
    from branchwise.reasoners import Reasoner
    from branchwise.strategies import beam_search

    strategy = beam_search(width=4, depth=3, max_step_tokens=max_tokens, step_delimiter="\n", seed=seed)
    out: dict[str, Any] = {}
    answers: dict[str, list[str | None]] = {}
    for name, accel in (("dense", None), ("reasoncache", Accel(reasoncache=ReasonCacheConfig()))):
        reasoner = Reasoner(strategy, backend=backend, accel=accel)
        t0 = time.perf_counter()
        results = [reasoner.run(q) for q in questions]
        stats = [r.kv_stats for r in results]
        answers[name] = [r.answer for r in results]
        out[name] = {
            "amsr": round(statistics.fmean(s.get("reasoncache_amsr", 0.0) for s in stats), 4),
            "blocks_reused": int(sum(s.get("reasoncache_blocks_reused", 0) for s in stats)),
            "seconds": round(time.perf_counter() - t0, 2),
        }
    out["reasoncache"]["agreement_with_dense"] = round(
        statistics.fmean(a == b for a, b in zip(answers["reasoncache"], answers["dense"], strict=True)), 4
    )
    return out


def main() -> None:
    parser = BenchParser(
        __doc__,
        quick={
            "tasks": ["gsm_symbolic"],
            "problems": 2,
            "branches": 8,
            "max_tokens": 160,
            "warmup_problems": 4,
            "budget_problems": 1,
            "budget_waves": 1,
            "budget_branches": 8,
            "tree_questions": 1,
            "tree_step_tokens": 32,
        },
    )
    parser.add_argument("--tasks", nargs="+", default=["gsm_symbolic", "basic_arithmetic"])
    parser.add_argument("--problems", "-N", type=int, default=4, help="problems per task")
    parser.add_argument("--branches", "-B", type=int, default=8, help="self-consistency branches")
    parser.add_argument("--batch-problems", type=int, default=2, help="problems decoded together")
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.3,
        help="the paper does not state one; at 0.6 this model's branches rarely repeat a step",
    )
    parser.add_argument("--seed", type=int, default=0, help="problem split and sampler seed")
    parser.add_argument("--block-tokens", type=int, default=16, help="ReasonCache block size (paper: 16)")
    parser.add_argument(
        "--warmup-problems", type=int, default=2, help="held-out problems per task for PAT's warm-up"
    )
    parser.add_argument(
        "--budget-branches",
        type=int,
        default=24,
        help="dense branches the KV budget holds (at an AMSR of a few %%, fewer than ~20 fit no extra branch)",
    )
    parser.add_argument("--budget-problems", type=int, default=1, help="problems of the fixed-budget run")
    parser.add_argument("--budget-waves", type=int, default=2, help="waves of full width per problem there")
    parser.add_argument("--tree-questions", type=int, default=2, help="questions of the beam-search run")
    parser.add_argument("--tree-step-tokens", type=int, default=64, help="tokens per beam step")
    args = parser.parse_args()
    bench = start("reasoncache", args)
    backend = bench.backend
    problems = [p for task in args.tasks for p in load_problems(task, args.problems, seed=args.seed)]
    problems = [problems[i] for i in sorted(range(len(problems)), key=lambda i: i % args.problems)]
    prompts = [backend.chat_prompt([{"role": "user", "content": q}]) for q, _, _ in problems]
    params = DecodeParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    groups = batches(len(problems), args.batch_problems)
    rc_cfg = ReasonCacheConfig(block_tokens=args.block_tokens)
    warm = backend.prefill(prompts[0])
    backend.extend([warm], DecodeParams(max_tokens=4))
    backend.release([warm])
    # PAT's warm-up (distances collected with no reuse) is per backend: pay it on held-out problems,
    # one batch at a time, until the threshold is set (or the held-out problems run out)
    held_out = [
        p for task in args.tasks for p in load_problems(task, args.warmup_problems, seed=args.seed + 10_000)
    ]
    warm_prompts = [backend.chat_prompt([{"role": "user", "content": q}]) for q, _, _ in held_out]
    pat_seen, threshold = 0, 0.0
    for group in batches(len(held_out), args.batch_problems):
        bench.log(f"PAT warm-up: {len(group)} held-out problems")
        warm_run = decode_all(
            backend, warm_prompts, [group], args.branches, params, Accel(reasoncache=rc_cfg)
        )
        pat_seen += int(warm_run.extra.get("reasoncache_stage1_blocks", 0))
        threshold = warm_run.extra.get("reasoncache_threshold", 0.0)
        if threshold:
            break

    def run(name: str, accel: Accel, dense: dict[str, Any] | None) -> dict[str, Any]:
        bench.log(f"{name}: {len(problems)} problems x {args.branches} branches")
        return summarise(decode_all(backend, prompts, groups, args.branches, params, accel), problems, dense)

    methods: dict[str, Any] = {}
    dense = methods["dense"] = run("dense", Accel(), None)
    rc = methods["reasoncache"] = run("reasoncache", Accel(reasoncache=rc_cfg), dense)
    methods["reasoncache_lexical"] = run(
        "reasoncache_lexical", Accel(reasoncache=rc_cfg.model_copy(update={"mode": "lexical"})), dense
    )
    rate = rc["blocks_reused"] / rc["blocks_sealed"] if rc["blocks_sealed"] else 0.0
    methods["random"] = run(
        "random",
        Accel(reasoncache=rc_cfg.model_copy(update={"mode": "random", "random_rate": rate})),
        dense,
    )
    budget = matched_budget(dense["lengths"], rc["amsr"])
    window = min(8, budget - 1)
    interval = eviction_interval(budget)
    for name, cfg in (
        ("attention_only", SkipKVConfig.attention_only(budget, interval=interval, window=window)),
        ("rkv", SkipKVConfig.rkv(budget, interval=interval, window=window)),
        ("window", SkipKVConfig.streaming(budget, interval=interval)),
    ):
        out = run(name, Accel(skipkv=cfg), dense)
        out["amsr"] = round(out["evicted_tokens"] / sum(out["lengths"]), 4)
        methods[name] = out

    # throughput at equal KV memory
    dense_width = args.budget_branches
    rc_width = max(dense_width, math.floor(dense_width / max(1e-9, 1 - rc["amsr"])))
    chosen = prompts[: args.budget_problems]
    bench.log(f"fixed budget: dense {dense_width} vs reasoncache {rc_width} branches at once")
    dense_s = waves(backend, chosen, args.budget_waves, dense_width, params, Accel())
    rc_s = waves(backend, chosen, args.budget_waves, rc_width, params, Accel(reasoncache=rc_cfg))
    dense_rate = dense_width * args.budget_waves * len(chosen) / dense_s
    rc_rate = rc_width * args.budget_waves * len(chosen) / rc_s
    fixed = {
        "budget_bytes_note": "the KV of --budget-branches dense branches of mean length",
        "dense": {"branches_at_once": dense_width, "branches_per_s": round(dense_rate, 4)},
        "reasoncache": {"branches_at_once": rc_width, "branches_per_s": round(rc_rate, 4)},
        "extra_branches": rc_width - dense_width,
        "throughput_ratio": round(rc_rate / dense_rate, 3),
    }
    bench.log("beam search")
    tree = tree_search(
        backend, [q for q, _, _ in problems[: args.tree_questions]], args.tree_step_tokens, args.seed
    )
    for m in methods.values():
        m.pop("voted_answers")
        m.pop("lengths")
    bench.emit(
        {
            "paper": PAPER,
            "methods": methods,
            "fixed_kv_budget": fixed,
            "beam_search": tree,
            "reasoncache": {
                "amsr": rc["amsr"],
                "agreement_with_dense": rc["agreement_with_dense"],
                "filter_share": rc["filter_share"],
            },
            **{
                name: {
                    "amsr": methods[name]["amsr"],
                    "agreement_with_dense": methods[name]["agreement_with_dense"],
                }
                for name in ("reasoncache_lexical", "random", "attention_only", "rkv", "window")
            },
        },
        config={
            "random_rate": round(rate, 4),
            "eviction_budget": budget,
            "eviction_interval": interval,
            "pat_warmup_distances": pat_seen,
            "pat_threshold_after_warmup": round(threshold, 4),
        },
    )


if __name__ == "__main__":
    main()
