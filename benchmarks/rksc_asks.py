"""RKSC §4.1 and §4.3: ASKS reuse beyond token-exact matching (diverse phrasings) and the τ sweep.

Each problem is asked in 8 phrasings at four divergence levels (identical ×2, minor rewording ×2,
structural reframing ×2, very different register ×2): a short lead-in that differs from the first
token of the user turn, followed by the same padded problem text (≈512 tokens, as in §4.1). The root
is the first phrasing. Conditions, same run, greedy t tokens per branch:
- "nokv": every phrasing recomputed (`fork_prompts(share="none")`);
- "exact": token-exact reuse of the longest common prefix (here: only the chat template's system turn);
- "asks": exact plus the Eq. 2 gate at τ, reusing the root's KV for phrasings whose states stay close.
Reported: latency and speedups, reuse beyond exact (share of non-identical phrasings that reused the
root), mean σ, and answer agreement with "nokv" (reused branches see the root's phrasing: lossy).
The τ sweep repeats "asks" at τ ∈ {0.70, 0.82, 0.90, 0.95} (§4.3; paper: ~1.16× at every τ in the
identical-prefix regime, where the gate is non-binding by construction here: identical prompts are
exact matches). Paper §4.1: 28.6 % additional reuse, 1.131× over No-KV at n≈512 (GPU).
The JSON's "seconds" is what a run took.
"""

from __future__ import annotations

import statistics
import time

from _common import BenchParser, load_problems, start
from _rksc import FILLER

from branchwise.backends import DecodeParams
from branchwise.backends.accel import Accel, ASKSConfig
from branchwise.backends.hf import HFBackend
from branchwise.reasoners.answers import extract_answer

LEAD_INS = [
    ("identical", "Solve the following problem."),
    ("identical", "Solve the following problem."),
    ("minor", "Please solve the following problem."),
    ("minor", "Solve the problem below."),
    ("structural", "Below is a problem; read it and then solve it."),
    ("structural", "Here is a word problem for you to work out."),
    ("register", "The subsequent exposition delineates a quantitative inquiry warranting resolution."),
    ("register", "Herewith a numerical conundrum, formally posed, awaiting its definitive answer."),
]


def phrasings(backend: HFBackend, question: str, n_tokens: int) -> list[list[int]]:
    """The 8 phrased prompts: lead-in, then filler padding to ≈ n_tokens, then the problem."""
    body = ""
    while len(backend.encode(body + question)) + 40 < n_tokens:
        body += FILLER
    body += "\n\n" + question
    return [backend.chat_prompt([{"role": "user", "content": f"{lead}\n\n{body}"}]) for _, lead in LEAD_INS]


def solve(backend: HFBackend, prompts: list[list[int]], share: str, accel: Accel, t: int) -> dict:
    backend.accel = accel
    backend.reset_stats()
    t0 = time.perf_counter()
    root = backend.prefill(prompts[0])
    kids = backend.fork_prompts(root, prompts, share=share)
    backend.release([root])
    gens = backend.extend(kids, DecodeParams(max_tokens=t, min_tokens=t))
    seconds = time.perf_counter() - t0
    extra = backend.kv_stats().extra
    backend.release(kids)
    backend.accel = Accel()
    return {
        "seconds": seconds,
        "tokens": [g.token_ids for g in gens],
        "answers": [extract_answer(g.text) for g in gens],
        "reused": extra.get("asks_reused", 0.0),
        "gated": extra.get("asks_reused", 0.0) + extra.get("asks_rejected", 0.0),
        "sigma_sum": extra.get("asks_sigma_sum", 0.0),
    }


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(__doc__, {"problems": 2, "prefix": 160, "taus": [0.82, 0.95]})
    parser.add_argument("--task", default="gsm_symbolic", help="reasoning-gym task")
    parser.add_argument("--problems", "-N", type=int, default=15, help="paper: 15")
    parser.add_argument("--prefix", type=int, default=512, help="padded prompt length (paper: ≈512)")
    parser.add_argument("--tokens", "-t", type=int, default=8)
    parser.add_argument("--tau", type=float, default=0.82)
    parser.add_argument("--taus", type=float, nargs="*", default=[0.70, 0.82, 0.90, 0.95])
    args = parser.parse_args(argv)

    bench = start("rksc_asks", args)
    backend = bench.backend
    problems = load_problems(args.task, args.problems, seed=0)
    conditions = {
        "nokv": ("none", Accel()),
        "exact": ("exact", Accel()),
        "asks": ("exact", Accel(asks=ASKSConfig(tau=args.tau))),
    }
    conditions.update({f"asks@{tau}": ("exact", Accel(asks=ASKSConfig(tau=tau))) for tau in args.taus})
    prompts_all = [phrasings(backend, q, args.prefix) for q, _, _ in problems]
    for share, accel in conditions.values():  # warm-up
        solve(backend, prompts_all[0], share, accel, args.tokens)
    rows: dict[str, list[dict]] = {name: [] for name in conditions}
    for prompts in prompts_all:
        for name, (share, accel) in conditions.items():
            rows[name].append(solve(backend, prompts, share, accel, args.tokens))
    base = rows["nokv"]
    non_identical = sum(1 for kind, _ in LEAD_INS if kind != "identical")
    report = {}
    for name, runs in rows.items():
        mean_s = statistics.fmean(r["seconds"] for r in runs)
        agree = [
            a == b
            for r, ref in zip(runs, base, strict=True)
            for a, b in zip(r["answers"], ref["answers"], strict=True)
        ]
        same_tokens = [
            a == b
            for r, ref in zip(runs, base, strict=True)
            for a, b in zip(r["tokens"], ref["tokens"], strict=True)
        ]
        gated = sum(r["gated"] for r in runs)
        report[name] = {
            "mean_s": round(mean_s, 4),
            "speedup_vs_nokv": round(statistics.fmean(r["seconds"] for r in base) / mean_s, 3),
            "median_ratio_vs_nokv": round(
                statistics.median(b["seconds"] / r["seconds"] for r, b in zip(runs, base, strict=True)), 3
            ),
            "reuse_beyond_exact": round(sum(r["reused"] for r in runs) / (non_identical * len(runs)), 3),
            "mean_sigma": round(sum(r["sigma_sum"] for r in runs) / gated, 4) if gated else None,
            "answer_agreement_vs_nokv": round(statistics.fmean(agree), 3),
            "token_agreement_vs_nokv": round(statistics.fmean(same_tokens), 3),
        }
    bench.emit(
        {
            "task": args.task,
            "levels": [kind for kind, _ in LEAD_INS],
            "conditions": report,
            "paper": {"reuse_beyond_exact": 0.286, "asks_speedup_vs_nokv": 1.131, "tau_sweep_speedup": 1.16},
        }
    )


if __name__ == "__main__":
    main()
