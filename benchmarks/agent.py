"""A ReAct agent's episode with the prefix cache across requests on (`cache_bytes` > 0) vs off
(`cache_bytes=0`), same backend, same run.

The agent is `examples/agents/react_tools.py`'s: DSPy's `dspy.ReAct` loop over a calculator and a
lookup tool, each action chosen by self-consistency over `--n` sampled candidates and the answer
likewise (branchwise `Reason` modules). Every step re-sends the whole prompt: the system text with the
tools, the few-shot demos and the trajectory so far. Without the cache each step computes all of it;
with it, a step computes only what the previous one did not hold (its new trajectory lines and the
chat template's tail) plus its candidates' tokens. Both arms start with an empty cache and use the same
seeds, so they should take the same actions (`trajectories_identical`).

Reports per arm the action steps taken, tool calls, tokens computed, tokens reused, prefix-cache hit
tokens and latency, and the ratios `tokens_computed_ratio` (off / on) and `latency_ratio` (off / on),
measured in this run. Prints one JSON object (last line).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from _common import BenchParser, start, sync

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "agents"))

from react_tools import Agent  # the example's agent, unchanged

from branchwise.backends.hf.backend import DEFAULT_CACHE_BYTES

QUESTION = "How many people live in Quito and Lima together?"


def episode(bench: Any, budget: int) -> dict[str, Any]:
    """One episode from an empty cache with `budget` bytes of prefix cache (0 = off)."""
    backend, args = bench.backend, bench.args
    backend.cache_bytes = 0  # empties the cache: each arm starts cold
    backend.cache_bytes = budget
    agent = Agent(
        backend,
        n=args.n,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        max_iters=args.steps,
    )
    sync(backend)
    t0 = time.perf_counter()
    out = agent(args.question)
    sync(backend)
    out["cost"]["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(__doc__, {"n": 2, "max_tokens": 32}, threads=1)
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--steps", type=int, default=6, help="the episode's action steps at most (max_iters)")
    parser.add_argument("--n", type=int, default=4, help="candidates sampled per action (self-consistency)")
    parser.add_argument("--max-tokens", type=int, default=40, help="tokens per candidate action")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-bytes", type=int, default=DEFAULT_CACHE_BYTES, help="cache budget when on")
    args = parser.parse_args(argv)

    bench = start("agent", args)  # cache off; each arm sets its budget
    backend = bench.backend
    Agent(backend, n=1, max_tokens=4, max_iters=1)("Warm up.")  # allocator, kernels
    arms: dict[str, Any] = {}
    for arm, budget in (("off", 0), ("on", args.cache_bytes)):
        out = episode(bench, budget)
        arms[arm] = out
        bench.log(
            f"cache {arm}: {len(out['tool_calls'])} tool calls in {len(out['steps']) - 1} actions, "
            f"answer {out['answer']!r}, {out['cost']}"
        )
    backend.cache_bytes = 0

    def per_arm(key: str) -> dict[str, Any]:
        return {arm: out["cost"][key] for arm, out in arms.items()}

    computed, seconds = per_arm("tokens_computed"), per_arm("seconds")
    results = {
        "tokens_computed_ratio": round(computed["off"] / max(1, computed["on"]), 3),
        "latency_ratio": round(seconds["off"] / seconds["on"], 3),
        "trajectories_identical": int(arms["off"]["trajectory"] == arms["on"]["trajectory"]),
        "actions": {arm: sum(s["step"] == "action" for s in out["steps"]) for arm, out in arms.items()},
        "tool_calls": {
            arm: [f"{c['tool']}[{c['argument']}]" for c in out["tool_calls"]] for arm, out in arms.items()
        },
        "answer": {arm: out["answer"] for arm, out in arms.items()},
        "tokens_computed": computed,
        "tokens_reused": per_arm("tokens_reused"),
        "cache_hit_tokens": per_arm("cache_hit_tokens"),
        "latency_s": seconds,
        "strategy_runs": per_arm("strategy_runs"),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    bench.emit(results)


if __name__ == "__main__":
    main()
