"""`Reasoner.batch` (the questions' generate steps decode through one scheduler: the branches of every
question that is generating decode as one batch) against a serial loop of `Reasoner.run`, in one run.

Same questions (reasoning-gym), same strategy (self-consistency, n branches each, greedy so both
give the same tokens), same backend. Reported: wall seconds of each, the speed-up (serial / batch),
whether every question got the same answer and tokens, and the mean rows per merged decode batch.
Greedy makes the comparison exact: a sampled run would also draw different tokens in the batch.
"""

from __future__ import annotations

import time

from _common import BenchParser, load_problems, start

from branchwise.reasoners import Reasoner
from branchwise.strategies import self_consistency


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(__doc__, {"questions": 4, "n": 2, "max_tokens": 24})
    parser.add_argument("--task", default="basic_arithmetic")
    parser.add_argument("--questions", "-Q", type=int, default=8)
    parser.add_argument("--n", type=int, default=4, help="branches per question")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    bench = start("batch", args)
    questions = [q for q, _, _ in load_problems(args.task, args.questions, args.seed)]
    reasoner = Reasoner(
        self_consistency(n=args.n, max_tokens=args.max_tokens, temperature=0.0), backend=bench.backend
    )
    reasoner.run(questions[0])  # warm-up (not timed)
    bench.log("serial")
    t0 = time.perf_counter()
    serial = [reasoner.run(q) for q in questions]
    serial_s = time.perf_counter() - t0
    bench.log("batch")
    t0 = time.perf_counter()
    batched = reasoner.batch(questions, progress=False)
    batch_s = time.perf_counter() - t0
    same_tokens = all(
        [t.token_ids for t in a.tree] == [t.token_ids for t in b.tree]
        for a, b in zip(serial, batched, strict=True)
    )
    merged = sum(r.kv_stats.get("batch_shared_extends", 0.0) for r in batched)
    generated = sum(len(t.token_ids) for r in batched for t in r.tree if t.parent is not None)
    bench.emit(
        {
            "serial_s": round(serial_s, 3),
            "batch_s": round(batch_s, 3),
            "speedup_batch_vs_serial": round(serial_s / batch_s, 3),
            "same_answers": all(a.answer == b.answer for a, b in zip(serial, batched, strict=True)),
            "same_tokens": same_tokens,
            "generated_tokens": generated,
            "rows": args.questions * args.n,
            "merged_extends_per_question": round(merged / len(batched), 2),
            "notes": sorted({note for r in batched for note in r.notes}),
        }
    )


if __name__ == "__main__":
    main()
