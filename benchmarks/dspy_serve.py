"""Unchanged DSPy programs against `branchwise serve`: does every reply parse, and how long each takes.

What a user does: ``dspy.LM("openai/<served name>", api_base=<serve>/v1, max_tokens=256)``, then
`dspy.ChainOfThought("question -> answer")`, `dspy.Predict("question -> answer")` and
`dspy.ReAct("question -> answer", tools=[add])`, with DSPy's defaults (its `ChatAdapter`, falling
back to its `JSONAdapter`; ReAct's 20 iterations). The server runs in this process on the backend
(`serve_in_thread`), with its DSPy field format on, or off with `--no-dspy-fields` (the before).
`--adapter lenient` changes one line of the program's setup, ``dspy.configure(adapter=
LenientChatAdapter())`` (branchwise's adapter, which works with any LM): it ends a ReAct loop at a
repeated identical tool call, which the server cannot see (it answers single requests).

Per program: `parsed` (runs that returned a prediction) of `runs`, the seconds of each run and
their median, the error of each run that raised, and for ReAct the tool calls each run made.
DSPy's cache is off, so every run reaches the server. Greedy (temperature 0), so a run is the same
each time on one machine.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import BenchParser, start

QUESTIONS = [
    "What is 12 + 7?",
    "What is the capital of France?",
    "How many days are in a week?",
    "What is 44 + 44?",
    "What is 3 times 4?",
]

QUICK = {"runs": 1, "programs": ["Predict"], "max_tokens": 64}


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def main() -> None:
    parser = BenchParser(__doc__, QUICK)
    parser.add_argument("--runs", type=int, default=5, help="questions asked of each program (at most 5)")
    parser.add_argument(
        "--programs",
        nargs="+",
        default=["ChainOfThought", "Predict", "ReAct"],
        choices=["ChainOfThought", "Predict", "ReAct"],
    )
    parser.add_argument("--max-tokens", type=int, default=256, help="dspy.LM's max_tokens")
    parser.add_argument("--no-dspy-fields", action="store_true", help="serve with its DSPy field format off")
    parser.add_argument(
        "--adapter",
        choices=["default", "lenient"],
        default="default",
        help="DSPy's default adapter, or branchwise's LenientChatAdapter (dspy.configure(adapter=...))",
    )
    args = parser.parse_args()
    if not 1 <= args.runs <= len(QUESTIONS):
        parser.error(f"--runs={args.runs}: between 1 and {len(QUESTIONS)}")
    import dspy

    from branchwise.backends.hf.backend import DEFAULT_CACHE_BYTES
    from branchwise.serve import create_app
    from branchwise.serve.runner import serve_in_thread

    bench = start("dspy_serve", args, cache_bytes=DEFAULT_CACHE_BYTES)  # a server's default
    app = create_app(bench.backend, model_name="served", dspy_fields=not args.no_dspy_fields)
    results: dict[str, Any] = {}
    adapter = None
    if args.adapter == "lenient":
        from branchwise.integrations.dspy import LenientChatAdapter

        adapter = LenientChatAdapter()
    with serve_in_thread(app) as url:
        lm = dspy.LM(
            "openai/served", api_base=f"{url}/v1", api_key="unused", max_tokens=args.max_tokens,
            temperature=0.0, cache=False,
        )  # fmt: skip
        for name in args.programs:
            program = (
                dspy.ReAct("question -> answer", tools=[add])
                if name == "ReAct"
                else getattr(dspy, name)("question -> answer")
            )
            seconds, errors, calls = [], [], []
            for question in QUESTIONS[: args.runs]:
                bench.log(f"{name}: {question}")
                t = time.perf_counter()
                try:
                    with dspy.context(lm=lm, adapter=adapter):
                        prediction = program(question=question)
                    errors.append(None)
                    if name == "ReAct":
                        calls.append(sum(1 for k in prediction.trajectory if k.startswith("tool_name_")))
                except Exception as err:  # what the run raised is the result: counted, not hidden
                    errors.append(f"{type(err).__name__}: {str(err)[:300]}")
                seconds.append(round(time.perf_counter() - t, 2))
            results[name] = {
                "runs": len(seconds),
                "parsed": sum(e is None for e in errors),
                "seconds": {"median": round(statistics.median(seconds), 2), "values": seconds},
                "errors": [e for e in errors if e is not None],
                **({"tool_calls": calls} if name == "ReAct" else {}),
            }
    bench.emit({"programs": results, "dspy": dspy.__version__})


if __name__ == "__main__":
    main()
