"""Solver -> critic -> reviser: three branchwise `Reasoner`s with different prebuilt strategies,
composed in plain Python and sharing one backend.

- **solver**: self-consistency — `--n` sampled solutions, majority vote on the answer;
- **critic**: best-of-n — `--n` critiques of the voted solution, the most confident one kept
  (the `confidence` verifier: the model's own mean token probability);
- **reviser**: PRM-guided beam search — a corrected solution written step by step, `--n` candidate
  steps per beam scored by the LM-as-judge step verifier (`step_judge`), the best kept.

Every stage's prompt starts with the same system text and ``Question: ...`` line, so the backend's
prefix cache computes that once and later stages reuse it. Each stage prints its answer and cost
(tokens computed vs reused, prefix-cache hits, latency), then the totals.

The embedded SmolLM2-135M shows the mechanics, not good critiques; pass ``--model`` for a real one.

    python examples/agents/solver_critic.py
    python examples/agents/solver_critic.py "A book costs 8 dollars. How much do 5 books cost?" --n 3
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # examples/: the shared options

from _cli import example_parser, load_backend

from branchwise import Reasoner
from branchwise.backends.base import Backend
from branchwise.reasoners.result import ReasoningResult
from branchwise.strategies import beam_search, best_of_n, self_consistency

QUESTION = "Sara has 3 boxes with 6 pencils each. How many pencils does she have?"
SYSTEM = "You are a careful math tutor. Keep every reply short."


def chosen_text(result: ReasoningResult) -> str:
    """The text of the branch the strategy chose (the first branch when none is marked)."""
    branch = next((b for b in result.branches if b.selected), result.branches[0] if result.branches else None)
    return branch.text.strip() if branch is not None else ""


def stage_summary(stage: str, result: ReasoningResult, seconds: float) -> dict[str, Any]:
    kv = result.kv_stats
    return {
        "stage": stage,
        "strategy": result.strategy,
        "answer": result.answer,
        "text": chosen_text(result),
        "votes": dict(result.votes),
        "branches": len(result.branches),
        "seconds": round(seconds, 3),
        "tokens_computed": int(kv.get("tokens_computed", 0)),
        "tokens_reused": int(kv.get("tokens_reused", 0)),
        "cache_hit_tokens": int(kv.get("cache_hit_tokens", 0)),
    }


class SolverCritic:
    """The three stages over one backend; `__call__` runs them in order and returns every stage."""

    def __init__(self, backend: Backend, *, n: int = 4, max_tokens: int = 96, seed: int = 0) -> None:
        def reasoner(strategy: Any) -> Reasoner:
            return Reasoner(strategy, backend=backend, system_prompt=SYSTEM)

        self.solver = reasoner(self_consistency(n=n, temperature=0.7, max_tokens=max_tokens, seed=seed))
        self.critic = reasoner(
            best_of_n(n=n, verifier="confidence", temperature=0.7, max_tokens=max_tokens, seed=seed)
        )
        self.reviser = reasoner(
            beam_search(
                width=n,
                keep="fixed",
                k=max(1, n // 2),
                depth=2,
                max_step_tokens=max(8, max_tokens // 2),
                temperature=0.7,
                seed=seed,
            )
        )

    def __call__(self, question: str) -> dict[str, Any]:
        stages: list[dict[str, Any]] = []
        start = time.perf_counter()

        def run(stage: str, reasoner: Reasoner, prompt: str) -> ReasoningResult:
            t0 = time.perf_counter()
            result = reasoner.run(prompt)
            stages.append(stage_summary(stage, result, time.perf_counter() - t0))
            return result

        head = f"Question: {question}\n"
        solved = run("solver", self.solver, head + "Solve it step by step and end with 'The answer is N.'")
        solution = chosen_text(solved)
        critique = chosen_text(
            run(
                "critic",
                self.critic,
                head + f"Proposed solution: {solution}\n"
                "Check the proposed solution. Is its answer right? Say briefly what is wrong, if anything.",
            )
        )
        revised = run(
            "reviser",
            self.reviser,
            head + f"Proposed solution: {solution}\nCritique: {critique}\n"
            "Write a corrected solution step by step and end with 'The answer is N.'",
        )
        seconds = time.perf_counter() - start
        return {
            "question": question,
            "answer": revised.answer if revised.answer is not None else solved.answer,
            "stages": stages,
            "cost": {
                "tokens_computed": sum(s["tokens_computed"] for s in stages),
                "tokens_reused": sum(s["tokens_reused"] for s in stages),
                "cache_hit_tokens": sum(s["cache_hit_tokens"] for s in stages),
                "seconds": round(seconds, 3),
            },
        }


def show(out: dict[str, Any]) -> None:
    print(f"\nQuestion: {out['question']}")
    for s in out["stages"]:
        text = " ".join(s["text"].split())
        print(f"\n[{s['stage']}] {s['strategy']} over {s['branches']} branches -> answer {s['answer']}")
        print(f"  {text[:300]}{'...' if len(text) > 300 else ''}")
        print(
            f"  {s['seconds']:.2f}s, tokens computed {s['tokens_computed']}, reused {s['tokens_reused']}, "
            f"prefix-cache hits {s['cache_hit_tokens']}"
        )
    c = out["cost"]
    print(
        f"\nanswer: {out['answer']}   | {c['seconds']:.1f} s, tokens computed {c['tokens_computed']}, "
        f"reused {c['tokens_reused']} (prefix-cache hits {c['cache_hit_tokens']}) over {len(out['stages'])} stages"
    )


def main(argv: list[str] | None = None, backend: Backend | None = None) -> dict[str, Any]:
    parser = example_parser(__doc__)
    parser.add_argument("question", nargs="?", default=QUESTION)
    parser.add_argument(
        "--n", type=int, default=4, help="branches per stage (samples, critiques, beam width)"
    )
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per solution or critique")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    backend = backend if backend is not None else load_backend(args)
    out = SolverCritic(backend, n=args.n, max_tokens=args.max_tokens, seed=args.seed)(args.question)
    show(out)
    return out


if __name__ == "__main__":
    main()
