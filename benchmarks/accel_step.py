"""Every acceleration on the fast step: each one's decode speed on its own workload against the plain
fast step with it off, in one run.

Why: the fixed-shape step (`step.py`; compiled, and captured on CUDA, where the backend does so) is
the decode step of plain runs. An acceleration that sent its steps elsewhere (the per-layer Python
loop, or the uncompiled step where plain steps are compiled) would make decoding slower by
switching it on, and its paper's saving would first have to repay that. This script shows, per
acceleration, where its steps ran (`decode_steps_fixed`, `decode_steps_layer_loop`,
`decode_steps_off_fast` and each reason) and what it costs or buys against the same workload
without it.

Workloads (one question of `--task`, the embedded model by default, exact prefix sharing in every
arm):
- river: a long greedy answer (n = 1, `--long-tokens`), River at its default threshold;
- skipkv: self-consistency, `--n` branches of exactly `--branch-tokens` each, SkipKV at a per-branch budget that
  evicts (`--skipkv-budget`, compressing every `--skipkv-interval` steps);
- rsbcm: the same self-consistency under RSBCM (it evicts between decodes, so inside one decode
  what shows is its tracking cost: dormant far below its capacity at its default `track_from`,
  tracking attention mass from the first batch with `--rsbcm-track-from 0`);
- reasoncache: a beam search (`--width` x `--depth` steps of `--step-tokens`), ReasonCache's
  defaults.
The warm-up runs each arm with each round's seed (the kinds of batch the timed rounds meet: a
round whose branches end but one meets the one-row kind), then waits until every kind met
compiled, so no timed step runs uncompiled (the steps' counters, summed over the rounds, and a
goal say whether one did). Each workload runs `--repeats` rounds, plain then accelerated in odd
rounds and the other way in even ones, the same seed in both arms of a round. Per arm: generated tokens per second of wall time
(the median of the rounds, and each round's), its ratio to plain, where its decode steps ran, the
acceleration's own counters, agreement of its answers with plain's, and the run's notes; for River
also its next-token agreement with the backbone (an untimed run with its audit on).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from _common import (
    Bench,
    BenchParser,
    add_decode_step_option,
    load_problems,
    settle,
    start,
    step_description,
    sync,
)

from branchwise.backends.accel import Accel, ReasonCacheConfig, RiverConfig, RSBCMConfig, SkipKVConfig
from branchwise.reasoners import Reasoner, ReasoningResult
from branchwise.strategies import Strategy, beam_search, self_consistency

STEP_COUNTERS = (
    "decode_steps_fixed",
    "decode_steps_compiled",
    "decode_steps_uncompiled",
    "decode_steps_captured",
    "decode_steps_layer_loop",
    "decode_steps_off_fast",
)
"""Where a run's decode steps ran (`step_notes`): counted whatever the acceleration."""
OWN_COUNTERS = {
    "river": ("river_exits", "river_forwards"),
    "skipkv": ("skipkv_compressions", "skipkv_evicted_tokens", "skipkv_branch_kv_max"),
    "rsbcm": ("rsbcm_evictions", "rsbcm_evicted_tokens"),
    "reasoncache": ("reasoncache_steps", "reasoncache_blocks_reused", "reasoncache_saved_tokens"),
}
"""Each acceleration's own counters shown beside its speed (a counter it never bumped is absent)."""


def workloads(args: Any) -> dict[str, tuple[Callable[[int], Strategy], Accel]]:
    """Each acceleration's workload (a strategy for a round's seed) and its `Accel`."""

    def sc(seed: int) -> Strategy:
        """Every branch exactly `--branch-tokens` long (end of sequence masked until then): where
        branches end by their text, the arms' runs differ in how many rows each step carries (a
        step of one row costs most of a step of eight), which the tokens per second then measure
        instead of the acceleration."""
        return self_consistency(
            n=args.n, max_tokens=args.branch_tokens, min_tokens=args.branch_tokens, seed=seed
        )

    return {
        "river": (
            lambda seed: self_consistency(n=1, temperature=0.0, max_tokens=args.long_tokens, seed=seed),
            Accel(river=RiverConfig(threshold=args.river_threshold)),
        ),
        "skipkv": (sc, Accel(skipkv=SkipKVConfig(budget=args.skipkv_budget, interval=args.skipkv_interval))),
        "rsbcm": (sc, Accel(rsbcm=RSBCMConfig(track_from=args.rsbcm_track_from))),
        "reasoncache": (
            lambda seed: beam_search(
                width=args.width,
                depth=args.depth,
                max_step_tokens=args.step_tokens,
                verifier="confidence",
                step_delimiter=".",
                seed=seed,
            ),
            Accel(reasoncache=ReasonCacheConfig()),
        ),
    }


def generated(result: ReasoningResult) -> list[list[int]]:
    """The token ids each node of the run's tree generated (the root, the prompt, left out)."""
    return [list(node.token_ids) for node in result.tree[1:]]


def run_once(bench: Bench, strategy: Strategy, accel: Accel, question: str) -> tuple[float, ReasoningResult]:
    """Seconds of one run of `strategy` on `question`, and its result."""
    backend = bench.backend
    reasoner = Reasoner(strategy, backend, share="exact", accel=accel)
    sync(backend)
    t0 = time.perf_counter()
    result = reasoner.run(question)
    sync(backend)
    return time.perf_counter() - t0, result


def arm_row(
    name: str, runs: list[tuple[float, ReasoningResult]], plain: list[ReasoningResult] | None
) -> dict[str, Any]:
    """One arm's figures over its rounds (`plain`: the plain arm's results of the same rounds)."""
    speeds = [sum(map(len, generated(r))) / s for s, r in runs]
    stats = runs[-1][1].kv_stats
    row: dict[str, Any] = {
        "tokens_per_s": round(statistics.median(speeds), 2),
        "rounds": [round(v, 2) for v in speeds],
        "steps": {k: n for k in STEP_COUNTERS if (n := int(sum(r.kv_stats.get(k, 0) for _, r in runs)))},
        "off_fast_by": {
            k.removeprefix("off_fast_by "): int(v) for k, v in stats.items() if k.startswith("off_fast_by ")
        },
        "notes": sorted({n for _, r in runs for n in r.notes}),
    }
    if plain is not None:
        row["counters"] = {k: round(stats[k], 2) for k in OWN_COUNTERS.get(name, ()) if k in stats}
        row["answer_agreement"] = round(
            statistics.fmean(float(r.answer == p.answer) for (_, r), p in zip(runs, plain, strict=True)), 3
        )
    return row


def river_audit(bench: Bench, strategy: Strategy, river: RiverConfig, question: str) -> dict[str, Any]:
    """River's next-token agreement (its paper's measure), from an untimed run with its audit on:
    each exited token's river logits against the backbone's own on the same prefix. (Whole greedy
    sequences drift apart after one flipped token, so position-by-position agreement of two runs
    says little about the exit.)"""
    _, result = run_once(bench, strategy, Accel(river=river.model_copy(update={"audit": True})), question)
    stats = result.kv_stats
    rows = stats.get("river_audit_rows", 0.0)
    return {
        "exited_tokens": int(rows),
        "next_token_match": round(stats["river_audit_matches"] / rows, 4) if rows else None,
        "kl": round(stats["river_audit_kl_sum"] / rows, 5) if rows else None,
    }


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(
        __doc__,
        {"long_tokens": 48, "n": 4, "branch_tokens": 48, "skipkv_budget": 16, "skipkv_interval": 8,
         "width": 4, "depth": 2, "step_tokens": 16, "repeats": 1},
    )  # fmt: skip
    parser.add_argument("--task", default="basic_arithmetic", help="the reasoning-gym task of the question")
    parser.add_argument("--seed", type=int, default=0, help="the question's and the first round's seed")
    parser.add_argument("--long-tokens", type=int, default=256, help="River's greedy answer, tokens at most")
    parser.add_argument(
        "--river-threshold",
        type=float,
        default=RiverConfig().threshold,
        help="River's exit threshold (-1: every token exits at the entry layer, River's best case: what "
        "random weights, whose similarities mean nothing, can show)",
    )
    parser.add_argument("--n", type=int, default=8, help="self-consistency branches (SkipKV, RSBCM)")
    parser.add_argument(
        "--branch-tokens",
        type=int,
        default=256,
        help="tokens per branch (SkipKV, RSBCM: every branch this long)",
    )
    parser.add_argument(
        "--skipkv-budget", type=int, default=64, help="SkipKV's per-branch KV budget (tokens)"
    )
    parser.add_argument("--skipkv-interval", type=int, default=16, help="decode steps between compressions")
    parser.add_argument(
        "--rsbcm-track-from",
        type=float,
        default=RSBCMConfig().track_from,
        help="share of RSBCM's capacity from which it tracks attention mass (0: from the first batch, "
        "its tracking's whole cost; the default leaves it dormant on this workload)",
    )
    parser.add_argument("--width", type=int, default=8, help="ReasonCache's beam search: width")
    parser.add_argument("--depth", type=int, default=4, help="ReasonCache's beam search: steps")
    parser.add_argument("--step-tokens", type=int, default=48, help="tokens per search step at most")
    parser.add_argument("--repeats", type=int, default=2, help="rounds per workload, arm order alternated")
    parser.add_argument(
        "--only", nargs="+", choices=("river", "skipkv", "rsbcm", "reasoncache"), help="these workloads only"
    )
    add_decode_step_option(parser, why="; 'layers' shows the layer loop every acceleration left")
    args = parser.parse_args(argv)
    parser.at_least_one(args, "long_tokens", "n", "branch_tokens", "skipkv_budget", "skipkv_interval", "width",
                        "depth", "step_tokens", "repeats")  # fmt: skip
    if not 0.0 <= args.rsbcm_track_from <= 1.0:
        parser.error(f"--rsbcm-track-from must be within 0..1, got {args.rsbcm_track_from}")
    bench = start("accel_step", args, decode_step=args.decode_step)
    question = load_problems(args.task, 1, args.seed)[0][0]
    results: dict[str, Any] = {}
    for name, (strategy_of, accel) in workloads(args).items():
        if args.only and name not in args.only:
            continue
        warm = {"plain": Accel(), name: accel}
        # warm-up outside the timings (plug-in builds, first-call work): every arm with every
        # round's seed, so that every kind of batch a timed round meets (a batch whose rows ended
        # but one, say) compiles before it: where steps compile, none is timed uncompiled (a kind
        # compiles only while the process idles, which a benchmark's timed rounds never do)
        for rnd in range(args.repeats):
            for arm in warm.values():
                run_once(bench, strategy_of(args.seed + rnd), arm, question)
        settle(bench.backend)  # where steps compile, the timed ones are compiled
        runs: dict[str, list[tuple[float, ReasoningResult]]] = {arm: [] for arm in warm}
        for rnd in range(args.repeats):
            order = list(warm) if rnd % 2 == 0 else list(reversed(warm))
            for arm in order:
                runs[arm].append(run_once(bench, strategy_of(args.seed + rnd), warm[arm], question))
                bench.log(f"{name} round {rnd} {arm}: {runs[arm][-1][0]:.1f} s")
        plain = [r for _, r in runs["plain"]]
        rows = {"plain": arm_row("plain", runs["plain"], None), name: arm_row(name, runs[name], plain)}
        ratio = (
            rows[name]["tokens_per_s"] / rows["plain"]["tokens_per_s"]
            if rows["plain"]["tokens_per_s"]
            else None
        )
        if name == "river":
            assert accel.river is not None
            rows[name]["audit"] = river_audit(bench, strategy_of(args.seed), accel.river, question)
        results[name] = {
            **rows,
            "speedup_vs_plain": round(ratio, 3) if ratio is not None else None,
            "layer_loop_steps": rows[name]["steps"].get("decode_steps_layer_loop", 0),
        }
    bench.emit(
        {
            "workloads": results,
            "goals": {
                "every acceleration >= 1.0x plain": {
                    name: (w["speedup_vs_plain"] or 0.0) >= 1.0 for name, w in results.items()
                },
                "no step on the layer loop": {
                    name: w["layer_loop_steps"] == 0 for name, w in results.items()
                },
                # a fair comparison: no timed step of either arm ran uncompiled where steps compile
                "every timed step compiled": {
                    name: all("decode_steps_uncompiled" not in w[arm]["steps"] for arm in ("plain", name))
                    for name, w in results.items()
                },
            },
        },
        config={"decode_step": step_description(bench.backend)},
    )


if __name__ == "__main__":
    main()
