"""RKSC §3.2 "CGEE verify-only isolation": the verify pass alone, full depth vs level-2 entropy exit.

How the paper measured: Qwen2.5-7B, N=15 problems, B=8 branches decoded for t=128 tokens (a
decode-dominated regime), then only the verification pass timed, full depth vs CGEE level 2:
315.3 ms vs 250.7 ms, a verify-pass speedup of 1.258× (bootstrap 95 % CI [1.225, 1.293]), the exit
firing on 100 % of branches at a mean layer of 18.4 of 28.

Here, per problem: prefill the padded prompt, fork B branches with the RKSC hints, decode t tokens
greedily (`min_tokens=t`, so every branch has the same length), then time `backend.score_next` with
the LM-as-judge probe on the *same* nodes, alternating full depth (accel off) and level 2 alone
(`CGEEConfig.lossless()`: the saved calibration's θ and decision-safe l_min unless `--theta` /
`--l-min` override them; `--theta 8 --l-min 2` are the paper's uncalibrated defaults), after one
untimed pass of each (which also computes the branches' last decoded token). Reported: the min and
median of the repeats per problem, the verify speedup as the ratio of the problems' median
latencies with a bootstrap 95 % CI over problems (numpy, fixed seed), mean exit layer / n_layers,
exit fire rate, decision flips (argmax judge score differs from full depth) and per-row yes/no flips
(P(Yes) on the other side of 0.5). One more untimed full-depth pass records every layer's judge
distribution, so `replay` shows what the calibrated and the paper's thresholds would each do to
the same rows (offline, `EntropyTrace.exit_at`), and checks the live exits against that replay.

Cost: the full default (15 problems, prefix 1,024, B 8, t 128, 5 repeats) decodes 128 steps at B 8
and runs 13 verify passes per problem; `--quick` is the smoke run. The JSON's "seconds" is what a
run took.

Prints progress to stderr and one JSON object as the last line of stdout.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
from _common import BenchParser, load_problems, start, sync
from _rksc import add_calibration_options, add_solve_options, calibration_for, hint_suffixes, padded_prompt

from branchwise.backends import DecodeParams
from branchwise.backends.accel import Accel, CGEEConfig
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.cgee import CGEE, EntropyTrace, count_flips
from branchwise.backends.scores import judge_score
from branchwise.evals.stats import bootstrap_ci
from branchwise.reasoners.verifiers import JudgeVerifier

PAPER = {
    "full_ms": 315.3,
    "cgee_ms": 250.7,
    "verify_speedup": 1.258,
    "ci95": [1.225, 1.293],
    "mean_exit_layer": 18.4,
    "n_layers": 28,
    "exit_fire_rate": 1.0,
    "setting": "Qwen2.5-7B, N=15, B=8, t=128, A100 bf16",
}


def timed_verify(
    backend: HFBackend, kids: list[int], probe: tuple[list[int], list[int], int], accel: Accel
) -> tuple[float, list[float], list[EntropyTrace] | None]:
    """One verify pass under `accel`: (seconds, judge scores, level-2 traces or None).

    The accel is set before the clock starts (its setter reads the calibration file), and a trace
    is requested only with level 2 on: with level 2 off a trace would make the backend project
    every layer through the LM head, slowing the full-depth baseline.
    """
    suffix, tokens, n_yes = probe
    backend.accel = accel
    trace: list[EntropyTrace] | None = [] if accel.cgee is not None else None
    sync(backend)
    t0 = time.perf_counter()
    probs = backend.score_next(kids, suffix, tokens, trace=trace)
    sync(backend)
    seconds = time.perf_counter() - t0
    return seconds, [judge_score(p, n_yes) for p in probs], trace


def replay(
    traces: list[list[EntropyTrace]], theta: float, epsilon: float, l_min: int, n_layers: int, n_yes: int
) -> dict[str, Any]:
    """What these thresholds would do to the recorded full-depth traces (no timing): decision flips
    as CGEE's own `count_flips` counts them, plus the exit layers and per-row yes/no flips."""
    layers, row_flips = [], 0
    for t in (t for group in traces for t in group):
        layer = t.exit_at(theta, epsilon, l_min) or n_layers
        layers.append(layer)
        full = judge_score(t.probs[n_layers], n_yes)
        early = judge_score(t.probs.get(layer, t.probs[n_layers]), n_yes)
        row_flips += (full > 0.5) != (early > 0.5)
    return {
        "theta": round(theta, 4),
        "l_min": l_min,
        "mean_exit_layer": round(statistics.fmean(layers), 2),
        "exit_fire_rate": round(statistics.fmean(layer < n_layers for layer in layers), 3),
        "decision_flips": count_flips(traces, theta, epsilon, l_min, n_layers, n_yes),
        "row_yes_no_flips": row_flips,
        "rows": len(layers),
    }


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(
        __doc__,
        {"problems": 2, "prefix": 256, "branches": 4, "tokens": 32, "repeats": 3, "calibration_problems": 3},
    )
    add_solve_options(parser, problems=15, paper_problems=15, tokens=128)
    parser.add_argument("--repeats", type=int, default=5, help="timed verify passes per depth and problem")
    parser.add_argument(
        "--theta", type=float, default=None, help=f"override θ (paper default: {CGEEConfig.PAPER_THETA})"
    )
    parser.add_argument(
        "--l-min", type=int, default=None, help=f"override l_min (paper default: {CGEEConfig.PAPER_L_MIN})"
    )
    parser.add_argument(
        "--epsilon",
        type=float,
        default=CGEEConfig.PAPER_EPSILON,
        help=f"ε (paper: {CGEEConfig.PAPER_EPSILON})",
    )
    parser.add_argument(
        "--schedule",
        choices=["cost", "paper"],
        default="cost",
        help="level-2 checks: cost-aware with the verdict gate (default) or every layer (Alg. 3)",
    )
    parser.add_argument("--check-every", type=int, default=None, help="inspect every k-th layer from l_min")
    add_calibration_options(parser)
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples for the CI")
    args = parser.parse_args(argv)

    bench = start("rksc_verify", args)
    backend = bench.backend
    cal = calibration_for(backend, args.task, args.calibration_problems, args.branches, 32, args.calibrate)
    n_layers = backend.parts.n_layers
    full_accel = Accel()
    paper = args.schedule == "paper"
    l2_accel = Accel(
        cgee=CGEEConfig.lossless(
            theta=args.theta,
            l_min=args.l_min,
            epsilon=args.epsilon,
            cost_aware=not paper,
            verdict_gate=not paper,
            check_every=args.check_every,
        )
    )
    backend.accel = l2_accel
    cgee = backend.acceleration(CGEE)
    assert cgee is not None
    theta, l_min = cgee.thresholds.theta, cgee.thresholds.l_min  # resolved: override > calibration
    judge = JudgeVerifier()
    probe = judge.probe(backend)
    n_yes = probe[2]
    suffixes = hint_suffixes(backend, args.branches, args.suffix)
    backend.share = "exact"

    per_problem: list[dict[str, Any]] = []
    recorded: list[list[EntropyTrace]] = []
    live_exit_layers: list[int] = []
    live_matches_replay = True
    for i, (question, _, _) in enumerate(load_problems(args.task, args.problems, seed=0)):
        backend.accel = full_accel
        root = backend.prefill(padded_prompt(backend, question, args.prefix))
        kids = backend.fork(root, args.branches, share="exact")
        backend.release([root])
        try:
            backend.append(kids, suffixes)
            backend.extend(kids, DecodeParams(max_tokens=args.tokens, min_tokens=args.tokens))
            # untimed: warm both paths (and compute the last decoded token), and record every layer
            timed_verify(backend, kids, probe, full_accel)
            timed_verify(backend, kids, probe, l2_accel)
            backend.accel = full_accel
            traces: list[EntropyTrace] = []
            backend.score_next(kids, probe[0], probe[1], trace=traces)
            recorded.append(traces)
            full_t, l2_t = [], []
            for _ in range(args.repeats):
                seconds, full_scores, _ = timed_verify(backend, kids, probe, full_accel)
                full_t.append(seconds)
                seconds, l2_scores, l2_trace = timed_verify(backend, kids, probe, l2_accel)
                l2_t.append(seconds)
        finally:
            backend.release(kids)
            backend.accel = full_accel
        assert l2_trace is not None
        exits = [t.exit_layer or n_layers for t in l2_trace]
        live_exit_layers += exits
        live_matches_replay &= exits == [t.exit_at(theta, args.epsilon, l_min) or n_layers for t in traces]
        row = {
            "full_ms": {
                "min": round(min(full_t) * 1e3, 2),
                "median": round(statistics.median(full_t) * 1e3, 2),
            },
            "l2_ms": {"min": round(min(l2_t) * 1e3, 2), "median": round(statistics.median(l2_t) * 1e3, 2)},
            "exit_layers": exits,
            "decision_full": int(np.argmax(full_scores)),
            "decision_l2": int(np.argmax(l2_scores)),
            "row_yes_no_flips": sum(
                (f > 0.5) != (e > 0.5) for f, e in zip(full_scores, l2_scores, strict=True)
            ),
            "max_abs_score_diff": round(
                max(abs(f - e) for f, e in zip(full_scores, l2_scores, strict=True)), 4
            ),
        }
        per_problem.append(row)
        bench.log(
            f"problem {i + 1}/{args.problems}: full {row['full_ms']['median']} ms, "
            f"l2 {row['l2_ms']['median']} ms, exits {exits}"
        )

    full_med = [p["full_ms"]["median"] for p in per_problem]
    l2_med = [p["l2_ms"]["median"] for p in per_problem]
    full_min = [p["full_ms"]["min"] for p in per_problem]
    l2_min = [p["l2_ms"]["min"] for p in per_problem]

    def ratio_of_medians(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.median(a) / np.median(b))

    paper_theta, paper_l_min = CGEEConfig.PAPER_THETA, CGEEConfig.PAPER_L_MIN
    flips_by_l_min = [
        count_flips(recorded, theta, args.epsilon, candidate, n_layers, n_yes)
        for candidate in range(1, n_layers + 1)
    ]
    bench.emit(
        {
            "task": args.task,
            "calibration": cal,
            "thresholds": {"theta": round(theta, 4), "l_min": l_min, "epsilon": args.epsilon},
            "schedule": args.schedule,
            "check_every": args.check_every,
            "n_layers": n_layers,
            "verify_ms": {
                "full": {"median": round(statistics.median(full_med), 2), "min": round(min(full_min), 2)},
                "l2": {"median": round(statistics.median(l2_med), 2), "min": round(min(l2_min), 2)},
            },
            "verify_speedup": round(ratio_of_medians(np.array(full_med), np.array(l2_med)), 3),
            "verify_speedup_ci95": [
                round(x, 3)
                for x in bootstrap_ci([full_med, l2_med], ratio_of_medians, n_resamples=args.bootstrap)
            ],
            "verify_speedup_of_mins": round(ratio_of_medians(np.array(full_min), np.array(l2_min)), 3),
            "mean_exit_layer": round(statistics.fmean(live_exit_layers), 2),
            "exit_fire_rate": round(statistics.fmean(x < n_layers for x in live_exit_layers), 3),
            "decision_flips": sum(p["decision_full"] != p["decision_l2"] for p in per_problem),
            "row_yes_no_flips": sum(p["row_yes_no_flips"] for p in per_problem),
            "rows": len(live_exit_layers),
            "live_exits_match_replay": live_matches_replay,
            "replay": {
                "used": replay(recorded, theta, args.epsilon, l_min, n_layers, n_yes),
                "calibrated": replay(recorded, cal["theta"], args.epsilon, cal["l_min"], n_layers, n_yes),
                "paper_defaults": replay(recorded, paper_theta, args.epsilon, paper_l_min, n_layers, n_yes),
                # diagnostic on the evaluation problems themselves (not a calibration): decision
                # flips at θ used for every l_min, and the smallest l_min that flips none here
                "flips_by_l_min": flips_by_l_min,
                "smallest_flip_free_l_min": next(
                    (layer for layer, f in enumerate(flips_by_l_min, start=1) if f == 0), None
                ),
            },
            "per_problem": per_problem,
            "paper": PAPER,
        }
    )


if __name__ == "__main__":
    main()
