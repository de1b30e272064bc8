"""Constrained decoding: what the grammar costs per token, how long a grammar takes to compile, how
often the model's tool calls are valid with and without it, and what voting over actions adds.

* **Per-token cost** (grammar on vs off, B = each of `--batches`): the decode loop's listener stamps
  the end of every step; a step's time is the interval between two stamps (one forward plus the
  sampling stage, where the mask acts), and the median over the steps before any row of the batch
  ends is compared between a run under a tool-call grammar and a free run of the same prompt
  (`min_tokens` keeps it going). Interleaved repeats, so drift hits both arms alike.
* **Compile time**: the tokenizer table (once per backend), each schema cold, and the same schema
  again (a cache hit).
* **Validity**: `--prompts` arithmetic requests with two tools shown (the same prompt both ways),
  decoded greedily in one batch without and with the grammar (``tool_choice="required"``): the share
  of replies holding at least one call whose arguments validate against the tool's schema.
* **Action vote**: self-consistency over tool calls (`--n` samples at temperature 0.7 in one
  shared-prefix batch, voted on the canonical call) against the first sample alone: how often each
  picks the expected call (the right tool with the right numbers), and how often they agree.
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from typing import Any

from _common import BenchParser, start

from branchwise.backends import DecodeParams
from branchwise.backends.hf.grammar import Grammars
from branchwise.constraints import Constraint
from branchwise.reasoners import Reasoner
from branchwise.strategies import self_consistency
from branchwise.toolcalls import normalize_tools, parse_tool_calls, valid_arguments

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
"""An OpenAI tool definition (also `first_constrained.py`'s tool call)."""
TOOLS = normalize_tools(
    [
        ADD_TOOL,
        {
            "type": "function",
            "function": {
                "name": "multiply",
                "description": "Multiply two integers.",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                },
            },
        },
    ]
)
NOTE = {
    "type": "function",
    "function": {
        "name": "write_note",
        "description": "Write a note about the user's request.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
}
SCHEMAS: dict[str, dict[str, Any]] = {
    "tool_calls(2 tools)": {},
    "json_schema(nested)": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city"],
            },
        },
        "required": ["name", "age"],
    },
    "json_object": {},
}


def problems(n: int, seed: int) -> list[tuple[str, str, int, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        op = rng.choice(["add", "multiply"])
        word = "sum" if op == "add" else "product"
        out.append((f"What is the {word} of {a} and {b}? Use a tool.", op, a, b))
    return out


def step_intervals(backend: Any, prompt: list[int], rows: int, params: DecodeParams) -> list[float]:
    """Seconds of each decode step before the first row of the batch ends."""
    root = backend.prefill(prompt)
    kids = backend.fork(root, rows)
    stamps: list[float] = []
    first_end: list[int] = []

    def listen(step: Any) -> None:
        stamps.append(time.perf_counter())
        if step.finished and not first_end:
            first_end.append(len(stamps))

    backend.extend(kids, params, on_step=listen)
    backend.release([*kids, root])
    cut = first_end[0] if first_end else len(stamps)
    return [b - a for a, b in itertools.pairwise(stamps[:cut])]


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(
        __doc__, {"batches": [1, 2], "tokens": 12, "repeats": 1, "prompts": 6, "n": 3, "votes": 2}
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="rows decoded together")
    parser.add_argument("--tokens", type=int, default=48, help="decode steps per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timed repeats per arm")
    parser.add_argument("--prompts", type=int, default=50, help="requests of the validity test")
    parser.add_argument("--n", type=int, default=8, help="samples per action vote")
    parser.add_argument("--votes", type=int, default=16, help="requests of the action-vote test")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    bench = start("structured", args)
    backend = bench.backend

    # ---- compile time
    bench.log("compile")
    fresh = Grammars(backend.engine.tokenizer, backend.engine.grammars.vocab_size, backend.engine.eos_ids)
    t0 = time.perf_counter()
    fresh.compiler()
    table_s = time.perf_counter() - t0
    compile_rows = {}
    for name, schema in SCHEMAS.items():
        if name.startswith("tool_calls"):
            c = Constraint.of_tools(TOOLS, "auto")
        elif name == "json_object":
            c = Constraint.of_json_object()
        else:
            c = Constraint.of_json_schema(schema)
        t0 = time.perf_counter()
        first = fresh.compile(c)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = fresh.compile(c)
        cached = time.perf_counter() - t0
        compile_rows[name] = {
            "cold_ms": round(cold * 1e3, 3),
            "cached_ms": round(cached * 1e3, 4),
            # the second compile must be answered by the cache (the same compiled grammar object)
            "cache_hit": again is first,
        }

    # ---- per-token cost
    note_tools = normalize_tools([NOTE])
    prompt = backend.chat_prompt(
        [{"role": "user", "content": "Write a long, detailed note about the history of Rome."}], note_tools
    )
    grammar = Constraint.of_tools(note_tools, "required", parallel_tool_calls=False)
    cost_rows = []
    for b in args.batches:
        bench.log(f"per-token cost, B={b}")
        arms: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(args.repeats + 1):  # the first round warms up
            for arm in ("off", "on"):
                params = DecodeParams(
                    temperature=0.0,
                    max_tokens=args.tokens,
                    min_tokens=args.tokens if arm == "off" else 0,
                    constraint=grammar if arm == "on" else None,
                )
                arms[arm].append(step_intervals(backend, prompt, b, params))
        off = [x for run in arms["off"][1:] for x in run]
        on = [x for run in arms["on"][1:] for x in run]
        ms_off, ms_on = statistics.median(off) * 1e3, statistics.median(on) * 1e3
        cost_rows.append(
            {
                "batch": b,
                "ms_per_step_off": round(ms_off, 3),
                "ms_per_step_on": round(ms_on, 3),
                "steps_timed_off": len(off),
                "steps_timed_on": len(on),
                "overhead": round(ms_on / ms_off - 1, 4),
            }
        )

    # ---- validity with vs without the grammar
    bench.log("validity")
    asks = problems(args.prompts, args.seed)
    required = Constraint.of_tools(TOOLS, "required", parallel_tool_calls=False)
    validity: dict[str, Any] = {}
    for arm, constraint in (("without_grammar", None), ("with_grammar", required)):
        roots = [
            backend.prefill(backend.chat_prompt([{"role": "user", "content": q}], TOOLS)) for q, *_ in asks
        ]
        gens = backend.extend(roots, DecodeParams(temperature=0.0, max_tokens=64, constraint=constraint))
        backend.release(roots)
        valid = 0
        for g in gens:
            _, calls = parse_tool_calls(g.text, TOOLS)
            valid += bool(calls) and all(valid_arguments(c, TOOLS) for c in calls)
        validity[arm] = {"valid_calls": valid, "prompts": len(asks), "rate": round(valid / len(asks), 4)}

    # ---- action vote vs a single sample
    bench.log("action vote")
    voted_right = single_right = agree = 0
    reasoner = Reasoner(
        self_consistency(n=args.n, temperature=0.7, max_tokens=64, seed=args.seed),
        backend=backend,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
    )
    vote_t = time.perf_counter()
    for q, op, a, b in problems(args.votes, args.seed + 1):
        result = reasoner.run(q)
        expected = f'{op}({{"a":{a},"b":{b}}})'
        first = result.branches[0].answer
        voted_right += result.answer == expected
        single_right += first == expected
        agree += result.answer == first
    vote_s = time.perf_counter() - vote_t
    bench.emit(
        {
            "grammar_engine": "xgrammar",
            "tokenizer_table_s": round(table_s, 3),
            "compile": compile_rows,
            "per_token_cost": cost_rows,
            "validity": validity,
            "action_vote": {
                "requests": args.votes,
                "samples": args.n,
                "vote_correct": voted_right,
                "single_sample_correct": single_right,
                "vote_agrees_with_single": agree,
                "seconds": round(vote_s, 1),
            },
        }
    )


if __name__ == "__main__":
    main()
