"""The RKSC solve procedure (Alg. 1) on our backend, shared by the RKSC benchmark scripts.

One solve = root prefill of a padded problem prefix, B branches each with its own 16-token reasoning
hint, t decoded tokens, then a verify pass (LM-as-judge P(Yes), one batched pass) unless CGEE level 1
skips it. Conditions: "nokv" (share="none"), "kv" (share="exact"), "kv+cgee" (exact + CGEE), and
"kv+l2" (exact + CGEE level 2 alone).

Why the grid is split into `collect_grid` (raw timings and outcomes) and `summarise_grid`: Table 2
pools several tasks into an "overall" row, which needs the raw per-problem data, not summaries.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from _common import load_problems, sync

from branchwise.backends import DecodeParams
from branchwise.backends.accel import Accel, CGEEConfig
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.cgee import Calibration, EntropyTrace
from branchwise.backends.scores import judge_score
from branchwise.reasoners.answers import extract_answer
from branchwise.reasoners.calibrate import calibrate_cgee
from branchwise.reasoners.verifiers import JudgeVerifier

FILLER = "Read the problem carefully and keep every quantity in mind. "
HINTS = [
    "Let's reason step by step and check each number.",
    "First write down what is known, then compute.",
    "Think about the operations needed, one at a time.",
    "Translate the words into arithmetic and solve.",
    "Break the problem into small parts and combine them.",
    "Compute carefully and give the final number.",
    "Start from the question and work backwards.",
    "Estimate first, then compute the exact value.",
]
CONDITIONS = {
    "nokv": ("none", Accel()),
    "kv": ("exact", Accel()),
    "kv+cgee": ("exact", Accel(cgee=CGEEConfig())),
    "kv+l2": ("exact", Accel(cgee=CGEEConfig.lossless())),
}


def add_solve_options(
    parser: argparse.ArgumentParser,
    *,
    problems: int,
    paper_problems: int,
    tokens: int,
    one_task: bool = True,
    prefix: bool = True,
    repeats: int | None = None,
) -> None:
    """The options of the RKSC solve (Alg. 1) the scripts share: the reasoning-gym task (`--tasks`
    for several), N, the padded prefix, B, the hint length s, the decoded tokens t and, for the
    scripts that time whole solves (`collect_grid`), the repeats per problem."""
    if one_task:
        parser.add_argument("--task", default="gsm_symbolic", help="reasoning-gym task")
    parser.add_argument("--problems", "-N", type=int, default=problems, help=f"paper: {paper_problems}")
    if prefix:
        parser.add_argument("--prefix", type=int, default=1024, help="padded prompt tokens (paper: ≈1,024)")
    parser.add_argument("--branches", "-B", type=int, default=8, help="paper: 8")
    parser.add_argument("--suffix", type=int, default=16, help="tokens of each branch hint (paper: 16)")
    parser.add_argument("--tokens", "-t", type=int, default=tokens, help="decoded tokens per branch")
    if repeats is not None:
        parser.add_argument(
            "--repeats", type=int, default=repeats, help="timed solves per problem (paper: 2-3)"
        )


def add_calibration_options(parser: argparse.ArgumentParser) -> None:
    """`--calibrate` refits the model's CGEE calibration first (see `calibration_for`)."""
    parser.add_argument("--calibrate", action="store_true", help="refit the CGEE calibration first")
    parser.add_argument("--calibration-problems", type=int, default=12, help="paper: 30")


def calibration_for(backend: HFBackend, task: str, n: int, branches: int, t: int, fit: bool) -> dict:
    """Fit (if asked or missing) and return the CGEE calibration used by the run.

    Held-out problems come from seed 10,000, disjoint from the evaluation seeds (RKSC §3.1).
    """
    cal = Calibration.load(backend.model_name)
    if fit or cal is None:
        held_out = [q for q, _, _ in load_problems(task, n, seed=10_000)]
        cal = calibrate_cgee(backend, held_out, n=branches, max_tokens=t, progress=False)
    backend.accel = backend.accel  # the setter re-reads the saved thresholds
    return cal.__dict__


def padded_prompt(backend: HFBackend, question: str, n_tokens: int) -> list[int]:
    """Chat prompt of the question with a neutral filler prepended until it is ≈ n_tokens (RKSC §3.1)."""
    filler = ""
    prompt = backend.chat_prompt([{"role": "user", "content": question}])
    step = len(backend.encode(FILLER))
    while len(prompt) + step <= n_tokens:
        filler += FILLER
        prompt = backend.chat_prompt([{"role": "user", "content": filler + "\n\n" + question}])
    return prompt


def hint_suffixes(backend: HFBackend, b: int, length: int) -> list[list[int]]:
    """b hints of exactly `length` tokens, cycling the eight fixed hints (RKSC §3.1)."""
    out = []
    for i in range(b):
        ids = backend.encode(" " + HINTS[i % len(HINTS)])
        while len(ids) < length:
            ids += backend.encode(" Answer:")
        out.append(ids[:length])
    return out


@dataclass
class Solve:
    """Outcome of one solve."""

    seconds: float
    decision: int
    answers: list[str | None]
    skipped: bool
    exit_layers: list[int] = field(default_factory=list)
    verify_seconds: float = 0.0
    scores: list[float] = field(default_factory=list)


def solve(
    backend: HFBackend,
    prompt: list[int],
    suffixes: list[list[int]],
    t: int,
    condition: str,
    judge: JudgeVerifier | None = None,
) -> Solve:
    """Alg. 1 under one condition; the backend's accel is set for the call and restored.

    The entropy trace is requested only when level 2 is on: with a trace and level 2 off the backend
    projects every layer through the LM head (calibration mode), which would slow the baselines'
    verify pass and inflate CGEE's speedup.
    """
    share, accel = CONDITIONS[condition]
    judge = judge or JudgeVerifier()
    previous_share, previous_accel = backend.share, backend.accel
    backend.share, backend.accel = share, accel
    cgee = accel.cgee
    try:
        sync(backend)
        t0 = time.perf_counter()
        root = backend.prefill(prompt)
        kids = backend.fork(root, len(suffixes), share=share)
        backend.release([root])
        try:
            backend.append(kids, suffixes)
            gens = backend.extend(kids, DecodeParams(max_tokens=t, min_tokens=t))
            confidences = [g.confidence for g in gens]
            skipped = backend.skip_verify(confidences)
            exit_layers: list[int] = []
            tv = time.perf_counter()
            if skipped:
                scores = confidences
            else:
                suffix, tokens, n_yes = judge.probe(backend)
                trace: list[EntropyTrace] | None = [] if cgee is not None and cgee.level2 else None
                probs = backend.score_next(kids, suffix, tokens, trace=trace)
                scores = [judge_score(p, n_yes) for p in probs]
                n_layers = backend.parts.n_layers
                exit_layers = (
                    [tr.exit_layer or n_layers for tr in trace]
                    if trace is not None
                    else [n_layers] * len(kids)
                )
            sync(backend)
            verify_seconds = time.perf_counter() - tv
            seconds = time.perf_counter() - t0
        finally:
            backend.release(kids)
    finally:
        backend.share, backend.accel = previous_share, previous_accel
    decision = max(range(len(scores)), key=scores.__getitem__)
    return Solve(
        seconds,
        decision,
        [extract_answer(g.text) for g in gens],
        skipped,
        exit_layers,
        verify_seconds,
        scores,
    )


def summarise(times: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(times), 4), "mean": round(statistics.fmean(times), 4)}


@dataclass
class GridRun:
    """Raw data of a grid: every timed solve, per-problem mean latency and one outcome per problem."""

    conditions: list[str]
    problems: list[tuple[str, Any, Any]]
    times: dict[str, list[float]]
    per_problem: dict[str, list[float]]
    outcome: dict[str, list[Solve]]
    prompt_tokens: list[int]

    @classmethod
    def concat(cls, runs: Sequence[GridRun]) -> GridRun:
        """Pool grids of the same conditions (e.g. several tasks) into one, problems in order."""
        conditions = runs[0].conditions
        return cls(
            conditions,
            [p for r in runs for p in r.problems],
            {c: [x for r in runs for x in r.times[c]] for c in conditions},
            {c: [x for r in runs for x in r.per_problem[c]] for c in conditions},
            {c: [x for r in runs for x in r.outcome[c]] for c in conditions},
            [n for r in runs for n in r.prompt_tokens],
        )


def collect_grid(
    backend: HFBackend,
    problems: list[tuple[str, Any, Any]],
    conditions: list[str],
    options: argparse.Namespace,
    *,
    prefix: int | None = None,
    warmup: int = 1,
    progress: Callable[[str], None] | None = None,
) -> GridRun:
    """Time every condition on every problem (conditions interleaved per problem, after warm-up).

    `options` are the parsed `add_solve_options` (B, s, t, repeats, and the prefix unless `prefix`
    overrides it). The outcome kept per problem and condition is that of its last timed solve:
    decoding is greedy, so every repeat makes the same decision and no extra untimed solve is needed.
    """
    t, repeats = options.tokens, options.repeats
    suffixes = hint_suffixes(backend, options.branches, options.suffix)
    prompts = [padded_prompt(backend, q, prefix or options.prefix) for q, _, _ in problems]
    for _ in range(warmup):
        for cond in conditions:
            solve(backend, prompts[0], suffixes, t, cond)
    times: dict[str, list[float]] = {c: [] for c in conditions}
    per_problem: dict[str, list[float]] = {c: [] for c in conditions}
    outcome: dict[str, list[Solve]] = {c: [] for c in conditions}
    for i, prompt in enumerate(prompts):
        runs: dict[str, list[float]] = {c: [] for c in conditions}
        last: dict[str, Solve] = {}
        for _ in range(repeats):
            for cond in conditions:
                last[cond] = solve(backend, prompt, suffixes, t, cond)
                runs[cond].append(last[cond].seconds)
        for cond in conditions:
            times[cond] += runs[cond]
            per_problem[cond].append(statistics.fmean(runs[cond]))
            outcome[cond].append(last[cond])
        if progress is not None:
            means = " ".join(f"{c}={per_problem[c][-1] * 1e3:.0f}ms" for c in conditions)
            progress(f"problem {i + 1}/{len(prompts)} ({len(prompt)} tok): {means}")
    return GridRun(conditions, problems, times, per_problem, outcome, [len(p) for p in prompts])


def accuracy(grid: GridRun, cond: str) -> float:
    """Fraction of problems whose chosen branch's answer the task's exact checker scores 1.0.

    Not the mean score: some reasoning-gym checkers give partial credit (gsm_symbolic scores any
    wrong number 0.01), which would make a changed wrong answer look like an accuracy change.
    """
    chosen = [s.answers[s.decision] for s in grid.outcome[cond]]
    return statistics.fmean(
        float(ds.score_answer(a, e) >= 1.0) for a, (_, e, ds) in zip(chosen, grid.problems, strict=True)
    )


def speedups(grid: GridRun, base: str) -> dict[str, dict[str, float]]:
    """Speedup of each other condition over `base`: ratio of mean latencies and median per-problem ratio."""
    out = {}
    for c in grid.conditions:
        if c == base:
            continue
        ratios = [b / x for b, x in zip(grid.per_problem[base], grid.per_problem[c], strict=True)]
        out[c] = {
            "ratio_of_means": round(statistics.fmean(grid.times[base]) / statistics.fmean(grid.times[c]), 3),
            "median_per_problem": round(statistics.median(ratios), 3),
        }
    return out


def cgee_impact(grid: GridRun, cond: str, base: str = "kv") -> dict[str, Any]:
    """RKSC Table 3 for one CGEE condition against the full-depth, never-skipping `base`.

    Branches decode identically under both (same greedy path), so any difference in the chosen
    branch is CGEE's doing. One verify call = one solve's verify decision (skipped or run early-
    exited). An error is a changed final answer; a decision flip that picks another branch with the
    same answer is counted separately (`decision_flips`) because it changes nothing downstream.
    """
    ours, ref = grid.outcome[cond], grid.outcome[base]
    pairs = list(zip(ours, ref, strict=True))
    errors = sum(a.answers[a.decision] != b.answers[b.decision] for a, b in pairs)
    calls = len(pairs)
    return {
        "verify_calls": calls,
        "verify_skipped": sum(a.skipped for a in ours),
        "verify_rows_run": sum(len(a.exit_layers) for a in ours),
        "decision_flips": sum(a.decision != b.decision for a, b in pairs),
        "errors": errors,
        "error_rate": round(errors / calls, 4) if calls else None,
        "delta_accuracy": round(accuracy(grid, cond) - accuracy(grid, base), 4),
    }


def summarise_grid(grid: GridRun) -> dict[str, Any]:
    """Per-condition latency stats, speedups vs "nokv" and "kv" (ratio of means, and the median of
    per-problem ratios), CGEE skip rate, CGEE-induced decision flips vs "kv", and accuracy."""
    conditions = grid.conditions
    summary: dict[str, Any] = {"latency_s": {c: summarise(v) for c, v in grid.times.items()}}
    for base in ("nokv", "kv"):
        if base in conditions:
            summary[f"speedup_vs_{base}"] = speedups(grid, base)
    acc, skip_rate, flips, exit_layer = {}, {}, {}, {}
    for cond in conditions:
        acc[cond] = round(accuracy(grid, cond), 3)
        skip_rate[cond] = round(statistics.fmean(s.skipped for s in grid.outcome[cond]), 3)
        layers = [layer for s in grid.outcome[cond] for layer in s.exit_layers]
        exit_layer[cond] = round(statistics.fmean(layers), 2) if layers else None
        if "kv" in conditions and cond != "kv":
            flips[cond] = sum(
                a.answers[a.decision] != b.answers[b.decision]
                for a, b in zip(grid.outcome[cond], grid.outcome["kv"], strict=True)
            )
    summary.update(
        accuracy=acc,
        verify_skip_rate=skip_rate,
        mean_verify_exit_layer=exit_layer,
        decision_flips_vs_kv=flips,
        n_problems=len(grid.problems),
    )
    return summary
