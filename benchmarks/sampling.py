"""Top-p sampling without sorting the vocabulary: self-consistency's decode with the nucleus found
among each row's most likely tokens (`sampling.NUCLEUS_CANDIDATES`) against a sort of the whole
vocabulary at every step, in one run.

Both arms keep the same tokens in each row's nucleus and draw with the same uniform numbers, so
they generate the same tokens (checked: `same_tokens`) and the ratio is the sampler's cost alone.
Per arm: generated tokens per second of wall time over `--repeats` rounds (median; the arm order
alternates between rounds, the same seed in both arms of a round), and the sampler's own time per
step on logits of the model's own decode (`pick_ms`: `pick_tokens` on the step's `[n, V]` logits).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from _common import BenchParser, load_problems, start, step_description, sync

from branchwise.backends.hf import sampling
from branchwise.reasoners import Reasoner
from branchwise.strategies import self_consistency

ARMS = {"sorted": 0, "candidates": sampling.NUCLEUS_CANDIDATES}
"""Each arm's `NUCLEUS_CANDIDATES` (0: sort the vocabulary at every step)."""


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(__doc__, {"n": 4, "tokens": 32, "repeats": 1})
    parser.add_argument("--task", default="basic_arithmetic", help="the reasoning-gym task of the question")
    parser.add_argument("--n", type=int, default=8, help="self-consistency branches")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per branch at most")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus mass")
    parser.add_argument("--repeats", type=int, default=3, help="rounds, arm order alternated")
    args = parser.parse_args(argv)
    parser.at_least_one(args, "n", "tokens", "repeats")
    if not 0.0 < args.top_p < 1.0:
        parser.error(f"--top-p must be within (0, 1) for a nucleus to be cut, got {args.top_p}")
    bench = start("sampling", args)
    backend = bench.backend
    question = load_problems(args.task, 1, 0)[0][0]

    def strategy(seed: int) -> Any:
        return self_consistency(
            n=args.n, max_tokens=args.tokens, temperature=args.temperature, top_p=args.top_p, seed=seed
        )  # fmt: skip

    def once(arm: str, seed: int) -> tuple[float, list[list[int]]]:
        sampling.NUCLEUS_CANDIDATES = ARMS[arm]
        sync(backend)
        t0 = time.perf_counter()
        result = Reasoner(strategy(seed), backend, share="exact").run(question)
        sync(backend)
        tokens = [list(node.token_ids) for node in result.tree[1:]]
        return sum(map(len, tokens)) / (time.perf_counter() - t0), tokens

    once("candidates", 0)  # warm-up: first-call work, kinds of batch started
    rates: dict[str, list[float]] = {arm: [] for arm in ARMS}
    same = True
    for rnd in range(args.repeats):
        made = {}
        for arm in list(ARMS) if rnd % 2 == 0 else list(reversed(ARMS)):
            rate, made[arm] = once(arm, rnd)
            rates[arm].append(round(rate, 2))
            bench.log(f"round {rnd} {arm}: {rate:.1f} tok/s")
        same = same and made["sorted"] == made["candidates"]
    logits = _step_logits(backend, question, args.n)
    pick = {}
    for arm, k in ARMS.items():
        sampling.NUCLEUS_CANDIDATES = k
        pick[arm] = _pick_ms(logits, args.temperature, args.top_p)
    sampling.NUCLEUS_CANDIDATES = ARMS["candidates"]
    median = {arm: statistics.median(v) for arm, v in rates.items()}
    bench.emit(
        {
            "arms": {
                arm: {"tokens_per_s": median[arm], "rounds": rates[arm], "pick_ms": pick[arm]} for arm in ARMS
            },
            "candidates_vs_sorted": round(median["candidates"] / median["sorted"], 3),
            "pick_speedup": round(pick["sorted"] / pick["candidates"], 2),
            "same_tokens": same,
        },
        config={"decode_step": step_description(backend), "candidates": ARMS["candidates"]},
    )


def _step_logits(backend: Any, question: str, n: int) -> torch.Tensor:
    """`n` rows of the model's own next-token logits after the question `[n, V]` (one plain
    forward, run after the timed rounds: a thread that computed slows the process's later steps)."""
    ids = torch.tensor([backend.encode(question)])
    with torch.inference_mode():
        out = backend.model(ids)
    return out.logits[0, -1:].float().expand(n, -1).contiguous()


def _pick_ms(logits: torch.Tensor, temperature: float, top_p: float, steps: int = 50) -> float:
    """Milliseconds of one `pick_tokens` call on `logits`, the median of `steps` calls."""
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        sampling.pick_tokens(logits, temperature, top_p, gen)
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times[1:]) * 1e3, 3)


if __name__ == "__main__":
    main()
