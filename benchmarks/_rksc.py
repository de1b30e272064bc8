"""The RKSC solve procedure (Alg. 1) on our backend, shared by the RKSC benchmark scripts.

One solve = root prefill of a padded problem prefix, B branches each with its own 16-token reasoning
hint, t decoded tokens, then a verify pass (LM-as-judge P(Yes), one batched pass) unless CGEE level 1
skips it. Conditions: "nokv" (share="none"), "kv" (share="exact"), "kv+cgee" (exact + CGEE), and
"kv+l2" (exact + CGEE level 2 alone).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from branchwise.backends import DecodeParams
from branchwise.backends.accel import Accel, CGEEConfig
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.cgee import EntropyTrace, verify_skip
from branchwise.reasoners.answers import extract_answer
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


def load_problems(task: str, n: int, seed: int) -> list[tuple[str, Any, Any]]:
    """(question, entry, dataset) triples from a seeded reasoning-gym generator."""
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(task, size=n, seed=seed)
    return [(entry["question"], entry, dataset) for entry in dataset]


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
    """Alg. 1 under one condition; the backend's accel is set for the call and restored."""
    share, accel = CONDITIONS[condition]
    judge = judge or JudgeVerifier()
    previous_share, previous_accel = backend.share, backend.accel
    backend.share, backend.accel = share, accel
    try:
        t0 = time.perf_counter()
        root = backend.prefill(prompt)
        kids = backend.fork(root, len(suffixes), share=share)
        backend.release([root])
        try:
            backend.append(kids, suffixes)
            gens = backend.extend(kids, DecodeParams(max_tokens=t, min_tokens=t))
            confidences = [g.confidence for g in gens]
            cgee = accel.cgee
            skipped = cgee is not None and cgee.level1 and verify_skip(confidences, cgee.tau_conf, cgee.r_gap)
            exit_layers: list[int] = []
            tv = time.perf_counter()
            if skipped:
                scores = confidences
            else:
                suffix, tokens, n_yes = judge.probe(backend)
                trace: list[EntropyTrace] = []
                probs = backend.score_next(kids, suffix, tokens, trace=trace)
                scores = [sum(p[:n_yes]) / max(sum(p), 1e-30) for p in probs]
                exit_layers = [tr.exit_layer or backend.parts.n_layers for tr in trace]
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


def run_grid(
    backend: HFBackend,
    problems: list[tuple[str, Any, Any]],
    conditions: list[str],
    *,
    prefix: int,
    branches: int,
    suffix: int,
    t: int,
    repeats: int,
    warmup: int = 1,
) -> dict[str, Any]:
    """Time every condition on every problem (conditions interleaved per problem, after warm-up).

    Returns per-condition latency stats, speedups vs "nokv" and "kv" (ratio of means, and the median
    of per-problem ratios), CGEE skip rate, CGEE-induced decision flips vs "kv", and accuracy.
    """
    suffixes = hint_suffixes(backend, branches, suffix)
    prompts = [padded_prompt(backend, q, prefix) for q, _, _ in problems]
    for _ in range(warmup):
        for cond in conditions:
            solve(backend, prompts[0], suffixes, t, cond)
    times: dict[str, list[float]] = {c: [] for c in conditions}
    per_problem: dict[str, list[float]] = {c: [] for c in conditions}
    outcome: dict[str, list[Solve]] = {c: [] for c in conditions}
    for prompt in prompts:
        runs: dict[str, list[float]] = {c: [] for c in conditions}
        for _ in range(repeats):
            for cond in conditions:
                result = solve(backend, prompt, suffixes, t, cond)
                runs[cond].append(result.seconds)
        for cond in conditions:
            times[cond] += runs[cond]
            per_problem[cond].append(statistics.fmean(runs[cond]))
            outcome[cond].append(
                result if cond == conditions[-1] else solve(backend, prompt, suffixes, t, cond)
            )
    summary: dict[str, Any] = {"latency_s": {c: summarise(v) for c, v in times.items()}}
    for base in ("nokv", "kv"):
        if base not in conditions:
            continue
        summary[f"speedup_vs_{base}"] = {
            c: {
                "ratio_of_means": round(statistics.fmean(times[base]) / statistics.fmean(times[c]), 3),
                "median_per_problem": round(
                    statistics.median(b / x for b, x in zip(per_problem[base], per_problem[c], strict=True)),
                    3,
                ),
            }
            for c in conditions
            if c != base
        }
    accuracy, skip_rate, flips, exit_layer = {}, {}, {}, {}
    for cond in conditions:
        chosen = [s.answers[s.decision] for s in outcome[cond]]
        accuracy[cond] = round(
            statistics.fmean(
                float(ds.score_answer(a, e)) for a, (_, e, ds) in zip(chosen, problems, strict=True)
            ),
            3,
        )
        skip_rate[cond] = round(statistics.fmean(s.skipped for s in outcome[cond]), 3)
        layers = [layer for s in outcome[cond] for layer in s.exit_layers]
        exit_layer[cond] = round(statistics.fmean(layers), 2) if layers else None
        if "kv" in conditions and cond != "kv":
            flips[cond] = sum(
                a.answers[a.decision] != b.answers[b.decision]
                for a, b in zip(outcome[cond], outcome["kv"], strict=True)
            )
    summary.update(
        accuracy=accuracy,
        verify_skip_rate=skip_rate,
        mean_verify_exit_layer=exit_layer,
        decision_flips_vs_kv=flips,
        n_problems=len(problems),
    )
    return summary
