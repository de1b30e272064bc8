"""The whole decode step over a batch's own KV in tails against the same KV in pages read in place.

Why: `paged_attention.py` measures attention alone on the model's shapes; this is what a user
gets, the model's whole decode step (`HFBackend(kv_layout=...)`), for rows whose KV is their own
(each row a separate request's prompt, so nothing is read as a shared segment): B rows of
`--context` tokens each (`--ragged on`: spread evenly between a quarter of it and all of it, the
mixed lengths where pages hold less), decoding `--tokens` greedy tokens.

With `--decode-step compiled`, each layout's kind of batch is compiled (in the background worker)
and loaded before any timed call. The two layouts run alternately, `--repeats` times each, on one backend (the prefix cache off, the
prompts prefilled before each timed call, outside the clock). Per batch size: decode tokens per
second of each layout, pages / tails (> 1: pages faster), whether every row's tokens are the same
under both, the largest KV storage each held while decoding (`peak_own_kv_bytes`, from the
engine's own accounting of a batch's storage) and the off-fast-step reasons the run counted (a
paged step that read a copy says why). The load average before and after goes in the JSON: the
machine may be shared, so read ratios, not times.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from _common import BenchParser, settle, start

from branchwise.backends.base import DecodeParams
from branchwise.backends.hf import HFBackend, cpu_kernels
from branchwise.backends.step_notes import off_fast_counts

LAYOUTS = ("tails", "pages")


def prompts(backend: HFBackend, rows: int, context: int, ragged: bool) -> list[list[int]]:
    """`rows` distinct prompts of `context` tokens (ragged: from a quarter of it up to all of it)."""
    text = " ".join(f"item {i} weighs {i * 7 % 13} grams" for i in range(context))
    ids = backend.encode(text)
    out = []
    for r in range(rows):
        n = context if not ragged or rows == 1 else context // 4 + (context - context // 4) * r // (rows - 1)
        out.append([*backend.encode(f"Row {r}:"), *ids[: max(n - 4, 1)]])
    return out


def timed(backend: HFBackend, layout: str, batch: list[list[int]], tokens: int) -> dict[str, Any]:
    """One greedy decode of every row of `batch` under `layout`: seconds, tokens, the largest own-KV
    storage of its batches, the run's off-fast reasons."""
    backend.kv_layout = layout  # type: ignore[assignment]
    roots = [backend.prefill(p) for p in batch]
    backend.extend(roots, DecodeParams(max_tokens=1))  # the prompts' KV computed outside the clock
    backend.reset_stats()
    peak = [0]
    pool = backend.engine.pool

    def watch(_: Any) -> None:
        peak[0] = max(peak[0], pool.tails)

    t0 = time.perf_counter()
    gens = backend.extend(roots, DecodeParams(max_tokens=tokens, min_tokens=tokens), on_step=watch)
    seconds = time.perf_counter() - t0
    stats = backend.kv_stats().as_dict()
    backend.release(roots)
    return {
        "seconds": seconds,
        "tokens": [g.token_ids for g in gens],
        "peak": peak[0],
        "off_fast": off_fast_counts(stats),
    }


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(__doc__, {"batch": [1, 4], "context": 128, "tokens": 8, "repeats": 1})
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="rows per batch")
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens per row")
    parser.add_argument("--ragged", choices=("on", "off"), default="off", help="mixed row lengths")
    parser.add_argument("--tokens", type=int, default=32, help="decode tokens per row")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-step", default="eager", help="the backend's decode_step (default eager)")
    args = parser.parse_args(argv)
    bench = start("kv_layout", args, decode_step=args.decode_step)
    backend = bench.backend
    bench.log("the paged kernel: built or loaded before timing, as a backend in pages starts it at load")
    kernel = cpu_kernels.build()
    load_before = os.getloadavg()[0]
    results: dict[str, Any] = {}
    for b in args.batch:
        batch = prompts(backend, b, args.context, args.ragged == "on")
        bench.log(f"B={b}: warm-up")
        for layout in LAYOUTS:  # compiled: each layout's kind of this batch compiled before timing
            timed(backend, layout, batch if args.decode_step == "compiled" else batch[:1], 2)
        settle(backend)
        runs: dict[str, list[dict[str, Any]]] = {layout: [] for layout in LAYOUTS}
        for rep in range(args.repeats):
            order = LAYOUTS if rep % 2 == 0 else LAYOUTS[::-1]
            for layout in order:
                runs[layout].append(timed(backend, layout, batch, args.tokens))
                bench.log(f"B={b} {layout} repeat {rep + 1}: {runs[layout][-1]['seconds']:.2f} s")
        tok_s = {
            layout: round(b * args.tokens / statistics.median(r["seconds"] for r in runs[layout]), 2)
            for layout in LAYOUTS
        }
        results[f"B={b}"] = {
            "tok_s": tok_s,
            "pages_vs_tails": round(tok_s["pages"] / tok_s["tails"], 3),
            "same_tokens": all(
                r["tokens"] == runs["tails"][0]["tokens"] for layout in LAYOUTS for r in runs[layout]
            ),
            "peak_own_kv_bytes": {layout: max(r["peak"] for r in runs[layout]) for layout in LAYOUTS},
            "off_fast": {layout: runs[layout][-1]["off_fast"] for layout in LAYOUTS},
        }
    results["paged_kernel_unavailable"] = kernel
    results["load_avg"] = {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)}
    bench.emit(results)


if __name__ == "__main__":
    main()
