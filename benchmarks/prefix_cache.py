"""The prefix cache across requests: repeated prompts with the cache (`cache_bytes` > 0) vs without
(`cache_bytes=0`), same backend, same run.

Every request is sent the way the request scheduler sends one: `prefill(prompt)`, `fork(root, 1)`,
`extend`, `release` - nothing but the cache knows the requests are related.
- **conversation**: a system document, then `--turns` user turns; each turn sends the whole chat so
  far (system, earlier questions and the assistant's own answers) and decodes an answer, so the
  context grows to ~`--doc-tokens` + turns x (`--turn-tokens` + answer) (~2k by default).
- **candidates**: a DSPy-style loop sending `--candidates` requests one at a time that share a long
  few-shot prompt and differ in a short tail (the candidate's own instruction).
Greedy decoding; each arm's tokens must equal the other's. Prints one JSON object (last line):
`conversation.speedup`, `conversation.tokens_identical` (1 or 0), `candidates.speedup`,
`candidates.tokens_identical`, the wall times, cache hit / miss tokens and the load average.
"""

from __future__ import annotations

import os
import time
from typing import Any

from _common import BenchParser, start, sync

from branchwise.backends import DecodeParams, KVStats
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.backend import DEFAULT_CACHE_BYTES

DOC = (
    "A farmer keeps careful records of every field, every harvest and every sale. In the first "
    "season the north field yielded 124 bushels of wheat and the south field 87 bushels of barley; "
    "a third of the barley was sold at the market in town while the rest was stored for winter. "
    "The farmer's neighbour borrowed 15 bushels of wheat and promised to return twice as much after "
    "the next harvest. In the second season the yields rose by a fifth, prices fell by a tenth, and "
    "the stored barley lost 6 bushels to damp. "
)
QUESTION = (
    "Question {i}: looking again at the records, how many bushels did field {i} hold after the "
    "{i}th sale, and what would the neighbour owe if the loan grew by {i} bushels each season? "
    "Explain the steps briefly and check the arithmetic twice before you answer. "
)
SHOT = (
    "Example: a shop sells {a} apples on Monday and {b} on Tuesday; each costs {c} cents. "
    "Reasoning: {a} + {b} = {s} apples, {s} x {c} = {t} cents. Answer: {t}.\n"
)


def text_of(backend: HFBackend, text: str, n: int) -> str:
    """The text of exactly the first `n` tokens of `text` repeated as often as needed."""
    ids: list[int] = []
    while len(ids) < n:
        ids += backend.encode(text)
    return backend.decode(ids[:n])


def request(run: Any, ids: list[int], params: DecodeParams) -> list[int]:
    """One request as the scheduler sends it."""
    root = run.prefill(ids)
    kids = run.fork(root, 1)
    tokens = run.extend(kids, params)[0].token_ids
    run.release([*kids, root])
    return tokens


def conversation(backend: HFBackend, args: Any) -> tuple[list[list[int]], int, KVStats]:
    run = backend.session()
    params = DecodeParams(max_tokens=args.answer_tokens)
    messages = [{"role": "system", "content": text_of(backend, DOC, args.doc_tokens)}]
    answers, context = [], 0
    for turn in range(args.turns):
        messages.append(
            {"role": "user", "content": text_of(backend, QUESTION.format(i=turn + 1), args.turn_tokens)}
        )
        ids = backend.chat_prompt(messages)
        context = len(ids)
        answers.append(request(run, ids, params))
        messages.append({"role": "assistant", "content": backend.decode(answers[-1])})
    return answers, context, run.kv_stats()


def candidates(backend: HFBackend, args: Any) -> tuple[list[list[int]], int, KVStats]:
    run = backend.session()
    params = DecodeParams(max_tokens=args.answer_tokens)
    shots = "".join(
        SHOT.format(a=a, b=a + 7, c=a % 9 + 2, s=2 * a + 7, t=(2 * a + 7) * (a % 9 + 2)) for a in range(3, 80)
    )
    instructions = text_of(backend, shots, args.shot_tokens)
    outs, context = [], 0
    for i in range(args.candidates):
        tail = f"Candidate {i + 1}: a shop sells {i + 12} pears and {i + 5} plums at 3 cents each. Reasoning:"
        ids = backend.chat_prompt(
            [{"role": "system", "content": instructions}, {"role": "user", "content": tail}]
        )
        context = len(ids)
        outs.append(request(run, ids, params))
    return outs, context, run.kv_stats()


def compare(bench: Any, name: str, workload: Any) -> dict[str, Any]:
    """Run `workload` without the cache, then with it (starting empty), and compare."""
    backend, args = bench.backend, bench.args
    arms: dict[str, Any] = {}
    for arm, budget in (("off", 0), ("on", args.cache_bytes)):
        backend.cache_bytes = 0  # empties the cache: each arm starts cold
        backend.cache_bytes = budget
        sync(backend)
        t0 = time.perf_counter()
        tokens, context, stats = workload(backend, args)
        sync(backend)
        seconds = time.perf_counter() - t0
        arms[arm] = {"seconds": round(seconds, 3), "tokens": tokens, "context": context}
        arms[arm]["stats"] = {
            "tokens_computed": stats.tokens_computed,
            "forward_calls": stats.forward_calls,
            "cache_hit_tokens": stats.cache_hit_tokens,
            "cache_miss_tokens": stats.cache_miss_tokens,
            "cache_evictions": stats.cache_evictions,
            "cache_bytes": stats.cache_bytes,
        }
        bench.log(f"{name} cache {arm}: {seconds:.2f}s, context {context} tokens, {arms[arm]['stats']}")
    backend.cache_bytes = 0
    return {
        "speedup": round(arms["off"]["seconds"] / arms["on"]["seconds"], 3),
        "tokens_identical": int(arms["off"]["tokens"] == arms["on"]["tokens"]),
        "computed_ratio": round(
            arms["off"]["stats"]["tokens_computed"] / max(1, arms["on"]["stats"]["tokens_computed"]), 3
        ),
        "seconds": {arm: a["seconds"] for arm, a in arms.items()},
        "context_tokens": arms["on"]["context"],
        "generated_tokens": sum(len(t) for t in arms["on"]["tokens"]),
        "stats": {arm: a["stats"] for arm, a in arms.items()},
    }


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(
        __doc__,
        {"turns": 4, "doc_tokens": 320, "turn_tokens": 32, "answer_tokens": 4, "shot_tokens": 320},
        threads=1,
    )
    parser.add_argument("--turns", type=int, default=10, help="user turns of the conversation")
    parser.add_argument("--doc-tokens", type=int, default=800, help="tokens of the system document")
    parser.add_argument("--turn-tokens", type=int, default=100, help="tokens of each user message")
    parser.add_argument(
        "--answer-tokens",
        type=int,
        default=8,
        help="max tokens of each answer (decode steps cost the same with or without the cache)",
    )
    parser.add_argument("--candidates", type=int, default=8, help="candidate requests n (DSPy-style)")
    parser.add_argument("--shot-tokens", type=int, default=1024, help="tokens of the few-shot prompt")
    parser.add_argument("--cache-bytes", type=int, default=DEFAULT_CACHE_BYTES, help="cache budget when on")
    args = parser.parse_args(argv)

    bench = start("prefix_cache", args)  # cache off; each arm sets its budget
    backend = bench.backend
    request(backend, backend.encode(DOC), DecodeParams(max_tokens=2))  # warm-up
    results = {
        "conversation": compare(bench, "conversation", conversation),
        "candidates": compare(bench, "candidates", candidates),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    bench.emit(results)


if __name__ == "__main__":
    main()
