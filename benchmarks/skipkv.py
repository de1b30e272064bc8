"""SkipKV (the SkipKV paper, §4-5): FullKV vs H2O-style vs R-KV vs SkipKV at budgets set from FullKV.

How the paper measured (§5.1, App. A.2, Tables 1-3): R1-distilled 7-14B models, MATH-500 / AIME-24
/ GSM8K / LiveCodeBench, batch size 10, budget ratio = KV budget / mean FullKV generation length,
compression every 128 decode steps, σ 0.1, τ 0.95-0.99, steering α0 1-1.25, γ 0.02 at ≈70 % depth.
Anchors: SkipKV keeps FullKV accuracy at 15 % budget on AIME-24 (Fig. 9) and beats it at 20-27 %
(Table 2: 50.0 / 53.3 vs 46.7, i.e. 107-114 %), generates up to 28 % fewer tokens than FullKV
(Fig. 10) and reaches up to 1.7× R-KV's throughput at the same batch size (Table 1, GSM8K, KV budget 512).

Here, in one process and on the same problems (the tasks interleaved, a mixed stream): (1) FullKV
decodes every problem with B sampled branches, `--batch-problems` problems per `extend` (one decode
batch of problems × B rows); the mean generated length L̄ sets the budgets round(ratio·L̄).
(2) Per budget, `attention_only` (H2O/SnapKV), `rkv` (R-KV), `skipkv_ungrouped` (+ sentence
scoring, Table 2's second row), `skipkv` (+ batch grouping: problems ordered by `group_by_length`,
§4.3) and `skipkv+steer` (+ adaptive steering, grouped: the paper's full SkipKV; only when a vector
is saved or `--build-steering` manages to build one) decode with the same sampler seeds (seed +
batch index). One seed draws for a whole batch, so the grouped conditions sample differently from
the ungrouped ones even before any eviction: `skipkv_ungrouped` vs `rkv` is the clean comparison
(identical until their evictions differ); grouped vs ungrouped compares means, not problems.
Every SkipKV condition selects per KV head (`per_head`, the paper's Eq. 4-6 selection);
`skipkv_all_heads` is `skipkv_ungrouped` with one slot set for all layers and heads, and each
budget's `head_selection` puts the two side by side: agreement with FullKV (voted answers, and
`token_agreement_with_fullkv`, the share of FullKV's tokens reproduced before the first difference)
and accuracy.
(3) Batch grouping: Eq. 12 padding of the problems' prefill lengths in `--batch-problems` batches,
original order vs grouped, and the timed batched root prefills of both orders (a batch's prefill
is padded to its longest prompt, so grouping removes real compute).

Why the interval defaults to min(128, max(8, budget // 2)): the paper's 128 steps (App. A.2) is
meant for budgets in the thousands; with this model's few-hundred-token outputs a 128-step interval
would let the cache overshoot a 50-token budget almost 4× between compressions.

What the numbers mean on this machine: accuracy of SmolLM2-135M on these tasks is near zero, so the
accuracy columns (and agreement with FullKV) are mostly noise; lengths, evictions, KV bytes and the
throughput ratios (within one run) are the measurable part. `peak_kv_bytes` is the backend's
allocated KV (shared prompts + decode buffers, which grow in ≥128-slot steps), so it only separates
methods once FullKV outgrows the first buffer; `final_kv_bytes` is the KV held right after decoding
(largest batch), which shows the budget directly.

Cost: after FullKV, every budget ratio decodes all problems again under six methods (five without a
steering vector), so a run costs about 1 + 6·R FullKV decodes for R ratios, plus the steering build
with `--build-steering` (`--steering-questions` × 4 traces). The JSON's "seconds" is what a run took.

Prints progress to stderr and one JSON object as the last line of stdout.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from _common import Bench, BenchParser, load_problems, start, sync

from branchwise.backends import DecodeParams
from branchwise.backends.accel import Accel, SkipKVConfig, SteeringConfig
from branchwise.backends.base import Generation
from branchwise.backends.grouping import group_by_length, padding_tokens
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.skipkv_sentences import SentenceTracker, delimiter_token_ids
from branchwise.backends.hf.skipkv_steering import SteeringVector, steering_path
from branchwise.reasoners.answers import extract_answer, majority_vote

PAPER = {
    "accuracy_vs_fullkv": {
        "fig9": "SkipKV keeps FullKV accuracy at 15 % KV budget on AIME-24 (R1-Qwen-7B/14B)",
        "table2_budget_ratio": {"0.20": 50.0, "0.27": 53.3, "0.37": 50.0},
        "table2_fullkv": 46.7,
        "table2_relative": {"0.20": 1.07, "0.27": 1.14, "0.37": 1.07},
        "anchor": "15-25 % budget: 100-114 % of FullKV accuracy",
    },
    "length_vs_fullkv": "up to 28 % fewer generated tokens than FullKV (Fig. 10); R-KV generates more",
    "table2_total_tokens": {"fullkv": 11132, "rkv_0.20": 12000, "skipkv_0.20": 9228},
    "throughput_vs_rkv": {
        "max": 1.7,
        "table1_samples_per_min_bs10": {"fullkv": 4.07, "rkv": 5.81, "skipkv": 9.70},
    },
    "setting": "R1-Qwen-7B, A100-40GB, batch 10, interval 128, σ 0.1, budget 512 for Table 1 (GSM8K)",
}
EFFECTIVE_BUDGET_NOTE = (
    "B' = B by construction: this backend keeps each branch's generated KV in its own row with its "
    "own length (prompts live in shared segments, never padded into a row), so padding never takes "
    "budget slots. Eq. 12 padding is reported as what a left-padded cache would lose, and grouping's "
    "effect here is the prefill compute it saves."
)
KV_BYTES_NOTE = (
    "peak_kv_bytes is allocated KV (shared prompts + per-row decode buffers that start at "
    "min(max_tokens, 128) slots and grow in >=128-slot steps), so it ties with FullKV until FullKV "
    "outgrows the first buffer; final_kv_bytes is the KV held right after decoding (largest batch). "
    "Both include the batch's prompts, so the grouped order (its last batch holds the longest "
    "prompts) reads higher at the same budget."
)


@dataclass
class Run:
    """One decode pass over all problems under one configuration."""

    gens: list[list[Generation]]  # per problem (original index), B generations
    seconds: float
    peak_bytes: int
    final_bytes: int
    extra: dict[str, float]


def batches(n: int, size: int) -> list[list[int]]:
    """Problem indices in original order, cut into batches of `size`."""
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def decode_all(
    backend: HFBackend,
    prompts: Sequence[list[int]],
    groups: Sequence[Sequence[int]],
    branches: int,
    params: DecodeParams,
    accel: Accel,
) -> Run:
    """Decode every problem's B branches, one `extend` per group of problems, under `accel`.

    Batch k samples with seed params.seed + k. Timing covers prefill, fork, decode and release
    (the accel is set before the clock: building SkipKV's delimiter table is set-up, not decode).
    """
    backend.accel = accel
    backend.reset_stats()
    gens: list[list[Generation]] = [[] for _ in prompts]
    final_bytes = 0
    try:
        sync(backend)
        t0 = time.perf_counter()
        for k, group in enumerate(groups):
            roots = [backend.prefill(prompts[i]) for i in group]
            kids = [kid for root in roots for kid in backend.fork(root, branches)]
            backend.release(roots)
            try:
                seed = None if params.seed is None else params.seed + k
                out = backend.extend(kids, params.model_copy(update={"seed": seed}))
                final_bytes = max(final_bytes, backend.kv_stats().bytes_held)
            finally:
                backend.release(kids)
            for j, i in enumerate(group):
                gens[i] = out[j * branches : (j + 1) * branches]
        sync(backend)
        seconds = time.perf_counter() - t0
    finally:
        backend.accel = Accel()
    stats = backend.kv_stats()
    return Run(gens, seconds, stats.peak_bytes, final_bytes, dict(stats.extra))


def time_prefills(backend: HFBackend, prompts: Sequence[list[int]], groups: Sequence[Sequence[int]]) -> float:
    """Seconds to prefill every group's roots as one padded batch (extend by 1 token = the prefill)."""
    sync(backend)
    t0 = time.perf_counter()
    for group in groups:
        roots = [backend.prefill(prompts[i]) for i in group]
        try:
            backend.extend(roots, DecodeParams(max_tokens=1))
        finally:
            backend.release(roots)
    sync(backend)
    return time.perf_counter() - t0


def steering_status(bench: Bench, build: bool, task: str, n: int, max_tokens: int, seed: int) -> dict:
    """Whether a steering vector is available, building one first if asked and none is saved.

    Held-out questions come from seed 20,000 (the CLI's default split), apart from the eval problems.
    A ValueError from the build (the traces held no non-execution sentence) makes steering
    unavailable with that reason; it is reported, never faked.
    """
    from branchwise.reasoners.steering import build_steering

    backend = bench.backend
    path = steering_path(backend.model_name)
    built = False
    if not path.exists():
        if not build:
            return {"available": False, "reason": f"no vector at {path}; pass --build-steering"}
        questions = [q for q, _, _ in load_problems(task, n, seed=20_000)]
        bench.log(f"building a steering vector from {len(questions)} {task} questions")
        try:
            build_steering(backend, questions, max_tokens=max_tokens, seed=seed, progress=False)
        except ValueError as err:
            return {"available": False, "reason": f"build_steering failed: {err}"}
        built = True
    vector = SteeringVector.load(path)
    return {
        "available": True,
        "built_now": built,
        "path": str(path),
        "layer": vector.layer,
        "n_exec": vector.n_exec,
        "n_nonexec": vector.n_nonexec,
    }


def summarise(
    run: Run,
    problems: Sequence[tuple[str, Any, Any]],
    tracker_args: tuple[frozenset[int], tuple[str, ...], Any],
    reference: dict[str, Any] | None,
) -> dict[str, Any]:
    """Accuracy, lengths, KV bytes, throughput, evictions and (with `reference`) agreement with FullKV.

    Accuracy counts a score ≥ 1.0 as correct: some reasoning-gym checkers give partial credit to any
    wrong number (gsm_symbolic scores 0.01), which would make a changed wrong answer look like a gain.
    """
    voted, vote_ok, branch_ok, lengths, nonexec = [], [], [], [], []
    for gens, (_, entry, ds) in zip(run.gens, problems, strict=True):
        answers = [extract_answer(g.text) for g in gens]
        vote = majority_vote(answers).answer
        voted.append(vote)
        vote_ok.append(float(ds.score_answer(vote, entry) >= 1.0))
        branch_ok += [float(ds.score_answer(a, entry) >= 1.0) for a in answers]
        for g in gens:
            lengths.append(len(g.token_ids))
            tracker = SentenceTracker(*tracker_args)
            tracker.append(g.token_ids)
            nonexec.append(tracker.n_nonexec)
    tokens = sum(lengths)
    out: dict[str, Any] = {
        "accuracy_vote": round(statistics.fmean(vote_ok), 4),
        "accuracy_branch": round(statistics.fmean(branch_ok), 4),
        "mean_length": round(statistics.fmean(lengths), 1),
        "max_length": max(lengths),
        "nonexec_per_branch": round(statistics.fmean(nonexec), 3),
        "peak_kv_bytes": run.peak_bytes,
        "final_kv_bytes": run.final_bytes,
        "seconds": round(run.seconds, 2),
        "tokens_per_s": round(tokens / run.seconds, 2),
        "problems_per_min": round(60 * len(problems) / run.seconds, 3),
        "compressions": int(run.extra.get("skipkv_compressions", 0)),
        "evicted_tokens": int(run.extra.get("skipkv_evicted_tokens", 0)),
        "voted_answers": voted,
    }
    if reference is not None:
        out["length_ratio_vs_fullkv"] = round(out["mean_length"] / reference["mean_length"], 3)
        out["peak_kv_ratio_vs_fullkv"] = round(run.peak_bytes / reference["peak_kv_bytes"], 3)
        out["final_kv_ratio_vs_fullkv"] = round(run.final_bytes / reference["final_kv_bytes"], 3)
        out["agreement_with_fullkv"] = round(
            statistics.fmean(a == b for a, b in zip(voted, reference["voted_answers"], strict=True)), 4
        )
        out["accuracy_vote_vs_fullkv"] = round(out["accuracy_vote"] - reference["accuracy_vote"], 4)
    return out


def token_agreement(run: Run, full: Run) -> float:
    """Mean over branches of the share of FullKV's tokens a branch reproduced before it first
    differed (same sampler seed and batch order, so any difference comes from the evicted KV)."""
    shares = []
    for gens, refs in zip(run.gens, full.gens, strict=True):
        for g, ref in zip(gens, refs, strict=True):
            same = next(
                (i for i, (a, b) in enumerate(zip(g.token_ids, ref.token_ids, strict=False)) if a != b), None
            )
            same = min(len(g.token_ids), len(ref.token_ids)) if same is None else same
            shares.append(same / max(1, len(ref.token_ids)))
    return round(statistics.fmean(shares), 4)


def head_selection(methods: dict[str, Any]) -> dict[str, Any]:
    """Per-head (the paper's Eq. 4-6 selection) vs one slot set for all heads, both ungrouped SkipKV
    with the same seeds and order: agreement with FullKV and accuracy side by side."""
    keys = ("agreement_with_fullkv", "token_agreement_with_fullkv", "accuracy_vote", "accuracy_branch")
    keys += ("mean_length", "evicted_tokens")
    out: dict[str, Any] = {
        mode: {k: methods[name][k] for k in keys}
        for mode, name in (("per_head", "skipkv_ungrouped"), ("all_heads", "skipkv_all_heads"))
    }
    for k in ("agreement_with_fullkv", "token_agreement_with_fullkv", "accuracy_vote"):
        out[f"{k}_per_head_minus_all_heads"] = round(out["per_head"][k] - out["all_heads"][k], 4)
    return out


def tree_strategies(bench: Bench, args: argparse.Namespace, question: str) -> dict[str, Any]:
    """SkipKV under step-level tree search: steps shorter than the interval, budget below the steps'
    total. The interval counts each branch's tokens along its path (across `extend` calls), so
    compressions happen; the budget covers a branch's own steps and its earlier steps no live sibling
    reads. `branch_kv_max` is the most generated KV a branch held right after a compression (≤ the
    budget), `branch_kv_peak` the most at any step (≤ budget + interval)."""
    from branchwise.reasoners import Reasoner
    from branchwise.strategies import beam_search, ets

    cfg = SkipKVConfig(budget=args.tree_budget, interval=128)
    step = {"max_step_tokens": args.tree_step_tokens, "seed": args.seed}
    step |= {"temperature": args.temperature, "verifier": "confidence"}
    width, depth = args.tree_width, args.tree_depth
    out: dict[str, Any] = {
        "budget": cfg.budget,
        "interval": cfg.interval,
        "step_tokens": args.tree_step_tokens,
    }
    for name, strategy in (
        # one child per kept beam (k = width): with more, a beam's last step is shared by its children
        ("beam_search", beam_search(width=width, keep="fixed", k=width, depth=depth, **step)),
        ("ets", ets(width=width, depth=depth, embedder="hidden", **step)),
    ):
        bench.log(f"tree strategy {name}")
        result = Reasoner(strategy, backend=bench.backend, accel=Accel(skipkv=cfg)).run(question)
        kv = result.kv_stats
        out[name] = {
            "generated_per_branch": max(b.n_tokens for b in result.branches) if result.branches else 0,
            "compressions": int(kv.get("skipkv_compressions", 0)),
            "evicted_tokens": int(kv.get("skipkv_evicted_tokens", 0)),
            "ancestor_evicted_tokens": int(kv.get("skipkv_ancestor_evicted_tokens", 0)),
            "branch_kv_max": int(kv.get("skipkv_branch_kv_max", 0)),
            "branch_kv_peak": int(kv.get("skipkv_branch_kv_peak", 0)),
            "budget_held": kv.get("skipkv_branch_kv_max", 0) <= cfg.budget,
            "notes": result.notes,
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(
        __doc__,
        {
            "tasks": ["gsm_symbolic"],
            "problems": 2,
            "branches": 2,
            "batch_problems": 2,
            "max_tokens": 64,
            "ratios": "0.2,0.3,0.5",
            "prefill_repeats": 1,
        },
        threads=1,
    )
    parser.add_argument("--tasks", nargs="+", default=["gsm_symbolic", "basic_arithmetic"])
    parser.add_argument("--problems", "-N", type=int, default=4, help="problems per task")
    parser.add_argument("--branches", "-B", type=int, default=4, help="sampled branches per problem")
    parser.add_argument("--batch-problems", type=int, default=4, help="problems decoded together (bs)")
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument(
        "--ratios", default="0.2,0.3,0.5", help="budget / FullKV mean length, comma-separated"
    )
    parser.add_argument("--interval", type=int, default=None, help="Δt; default min(128, max(8, budget//2))")
    parser.add_argument("--temperature", type=float, default=0.6, help="paper: 0.6 (R1 default)")
    parser.add_argument("--seed", type=int, default=0, help="problem split and sampler seed")
    parser.add_argument("--prefill-repeats", type=int, default=3, help="timed repeats of the prefill orders")
    parser.add_argument("--build-steering", action="store_true", help="build a vector first if none is saved")
    parser.add_argument(
        "--steering-questions",
        type=int,
        default=16,
        help="held-out questions (4 traces each) for --build-steering; 16 = the CLI's default. With 4 "
        "the embedded model wrote no non-execution sentence at all",
    )
    parser.add_argument("--tree-only", action="store_true", help="only the tree-search section")
    parser.add_argument("--tree-width", type=int, default=4, help="tree search width")
    parser.add_argument("--tree-depth", type=int, default=4, help="tree search steps")
    parser.add_argument("--tree-step-tokens", type=int, default=64, help="tokens per tree step")
    parser.add_argument("--tree-budget", type=int, default=96, help="SkipKV budget under tree search")
    args = parser.parse_args(argv)
    ratios = [float(r) for r in args.ratios.split(",")]

    bench = start("skipkv", args)
    backend = bench.backend
    per_task = [load_problems(task, args.problems, seed=args.seed) for task in args.tasks]
    tree = tree_strategies(bench, args, per_task[0][0][0])
    if args.tree_only:
        bench.emit({"tree_strategies": tree})
        return
    # tasks interleaved (a mixed stream, as a server sees): task-by-task order would already be
    # grouped by length, leaving batch grouping nothing to do
    problems = [p for row in zip(*per_task, strict=True) for p in row]
    prompts = [backend.chat_prompt([{"role": "user", "content": q}]) for q, _, _ in problems]
    lengths = [len(p) for p in prompts]
    n = len(problems)
    original = batches(n, args.batch_problems)
    grouped = group_by_length(lengths, args.batch_problems)
    params = DecodeParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    delims = delimiter_token_ids(backend.tokenizer)
    tracker_args = (delims, SkipKVConfig.model_fields["keywords"].default, backend.decode)
    window = SkipKVConfig.model_fields["window"].default

    steering = steering_status(
        bench, args.build_steering, args.tasks[0], args.steering_questions, args.max_tokens, args.seed
    )
    bench.log(f"steering: {steering}")

    # warm-up (lazy init, allocator) outside every timing
    warm = backend.prefill(prompts[0])
    kids = backend.fork(warm, 2)
    backend.release([warm])
    backend.extend(kids, DecodeParams(max_tokens=4))
    backend.release(kids)

    bench.log(f"FullKV: {n} problems × B={args.branches}, batches of {args.batch_problems}")
    full_run = decode_all(backend, prompts, original, args.branches, params, Accel())
    fullkv = summarise(full_run, problems, tracker_args, None)
    mean_len = fullkv["mean_length"]
    bench.log(f"FullKV: L̄={mean_len} in {fullkv['seconds']} s")

    budgets: dict[str, Any] = {}
    for ratio in ratios:
        budget = max(window + 1, round(ratio * mean_len))
        interval = args.interval or min(128, max(8, budget // 2))
        configs: dict[str, tuple[SkipKVConfig, Sequence[Sequence[int]]]] = {
            "attention_only": (SkipKVConfig.attention_only(budget, interval=interval), original),
            "rkv": (SkipKVConfig.rkv(budget, interval=interval), original),
            "skipkv_ungrouped": (SkipKVConfig(budget=budget, interval=interval, per_head=True), original),
            "skipkv_all_heads": (SkipKVConfig(budget=budget, interval=interval, per_head=False), original),
            "skipkv": (SkipKVConfig(budget=budget, interval=interval), grouped),
        }
        if steering["available"]:
            configs["skipkv+steer"] = (
                SkipKVConfig(budget=budget, interval=interval, steering=SteeringConfig()),
                grouped,
            )
        methods: dict[str, Any] = {}
        for name, (cfg, order) in configs.items():
            run = decode_all(backend, prompts, order, args.branches, params, Accel(skipkv=cfg))
            row = summarise(run, problems, tracker_args, fullkv)
            row["token_agreement_with_fullkv"] = token_agreement(run, full_run)
            row["order"] = "grouped" if order is grouped else "original"
            if row["evicted_tokens"] == 0:
                row["note"] = (
                    f"nothing evicted: no branch held more than {budget} generated tokens at a "
                    f"compression step (every {interval} steps); longest branch {row['max_length']}"
                )
            methods[name] = row
            bench.log(
                f"budget {budget} ({ratio}) {name}: L={row['mean_length']} "
                f"evicted={row['evicted_tokens']} {row['seconds']} s"
            )
        rkv = methods["rkv"]
        for row in methods.values():
            row["throughput_vs_rkv"] = round(row["problems_per_min"] / rkv["problems_per_min"], 3)
            row["throughput_vs_fullkv"] = round(row["problems_per_min"] / fullkv["problems_per_min"], 3)
            row["tokens_per_s_vs_rkv"] = round(row["tokens_per_s"] / rkv["tokens_per_s"], 3)
        if not steering["available"]:
            methods["skipkv+steer"] = {"skipped": steering["reason"]}
        budgets[str(ratio)] = {
            "budget": budget,
            "interval": interval,
            "head_selection": head_selection(methods),
            "methods": methods,
        }

    times = {"original": [], "grouped": []}
    for _ in range(args.prefill_repeats):  # interleaved, so drift hits both orders alike
        times["original"].append(time_prefills(backend, prompts, original))
        times["grouped"].append(time_prefills(backend, prompts, grouped))
    pad_orig, pad_grouped = padding_tokens(original, lengths), padding_tokens(grouped, lengths)
    prefill_orig, prefill_grouped = statistics.median(times["original"]), statistics.median(times["grouped"])
    grouping = {
        "prefill_lengths": lengths,
        "batches_original": original,
        "batches_grouped": grouped,
        "padding_tokens": {"original": pad_orig, "grouped": pad_grouped},
        "mean_padding_per_problem": {
            "original": round(pad_orig / n, 2),
            "grouped": round(pad_grouped / n, 2),
        },
        "padded_prefill_tokens": {
            "original": sum(lengths) + pad_orig,
            "grouped": sum(lengths) + pad_grouped,
        },
        "prefill_seconds": {"original": round(prefill_orig, 4), "grouped": round(prefill_grouped, 4)},
        "prefill_speedup": round(prefill_orig / prefill_grouped, 3),
        "effective_budget": {"equals_budget": True, "note": EFFECTIVE_BUDGET_NOTE},
    }

    bench.emit(
        {
            "fullkv": fullkv,
            "budgets": budgets,
            "tree_strategies": tree,
            "grouping": grouping,
            "steering": steering,
            "paper": PAPER,
            "note": (
                "skipkv and skipkv+steer decode in group_by_length order, the others in the original "
                "order; one sampler seed per batch, so batch composition changes the samples. "
                + EFFECTIVE_BUDGET_NOTE
                + " "
                + KV_BYTES_NOTE
            ),
        },
        config={"n_problems": n, "ratios": ratios, "window": window},
    )


if __name__ == "__main__":
    main()
