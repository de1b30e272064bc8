"""Prefix sharing vs. the No-KV baseline and `model.generate` (RKSC's setting, §2.1 / Table 1).

B branches share an n-token problem prefix, each appends its own s-token hint and decodes t tokens
greedily. Three paths, same model, same run:
- `share="none"`: every branch recomputes prefix + hint (batched; logits at each row's last token);
- `share="exact"`: the prefix is computed once and held once; all branches read it per step
  (each decode step the fixed-shape step of `step.py`, captured as CUDA graphs on a GPU; the arm
  `exact_layer_loop` runs every step through the layer loop instead, `decode_step="layers"`);
- `hf_generate`: `model.generate` on the B left-padded prompts (what users do today);
- `hf_static`: the same with `cache_implementation="static"`, which transformers compiles with CUDA
  graphs on a GPU (the baseline a user picks for speed; `--hf-static`, and the JSON's `hf_static`
  says whether it was compiled: on the CPU it is not unless asked). The same work as `generate` with
  `num_return_sequences=B` on one prompt, but with each branch's own hint, so its tokens compare.
Prints one JSON object (last line): median latencies, ratios, KV bytes, and whether the greedy
tokens of the three paths agree: identical, or up to near-ties (`fidelity.py`; what bf16 can promise).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from _common import (
    BenchParser,
    StaticGenerate,
    add_decode_step_option,
    add_hf_static_option,
    settle,
    start,
    step_description,
)
from _rksc import hint_suffixes

from branchwise.backends import DecodeParams
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.fidelity import greedy_agreement

PASSAGE = (
    "A farmer keeps careful records of every field, every harvest and every sale. In the first "
    "season the north field yielded 124 bushels of wheat and the south field 87 bushels of barley; "
    "a third of the barley was sold at the market in town while the rest was stored for winter. "
    "The farmer's neighbour borrowed 15 bushels of wheat and promised to return twice as much after "
    "the next harvest. In the second season the yields rose by a fifth, prices fell by a tenth, and "
    "the stored barley lost 6 bushels to damp. "
)


def exact_tokens(backend: HFBackend, text: str, n: int) -> list[int]:
    """Exactly `n` token ids of `text` repeated as often as needed."""
    ids: list[int] = []
    while len(ids) < n:
        ids += backend.encode(text)
    return ids[:n]


def median_time(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> tuple[float, Any]:
    """Median wall time of `fn` over `repeats` runs after `warmup` runs; returns (median, last output)."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(__doc__, {"prefix": 256, "branches": 4, "repeats": 2})
    parser.add_argument("--prefix", type=int, default=1024, help="shared prefix tokens (paper: ~1,024)")
    parser.add_argument("--branches", "-B", type=int, default=8, help="branches B (paper: 8)")
    parser.add_argument("--suffix", type=int, default=16, help="tokens of each branch hint (paper: 16)")
    parser.add_argument("--tokens", "-t", type=int, default=8, help="decoded tokens per branch (paper: 8)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats after one warm-up")
    add_decode_step_option(parser, why="; where it compiles, exact sharing uncompiled is an arm too")
    add_hf_static_option(parser)
    args = parser.parse_args(argv)

    bench = start("prefix_sharing", args, decode_step=args.decode_step)
    backend = bench.backend
    prefix = exact_tokens(backend, PASSAGE, args.prefix)
    suffixes = hint_suffixes(backend, args.branches, args.suffix)
    params = DecodeParams(max_tokens=args.tokens, min_tokens=args.tokens)

    def ours(share: str) -> tuple[list[list[int]], dict[str, float]]:
        backend.reset_stats()
        root = backend.prefill(prefix)
        kids = backend.fork(root, args.branches, share=share)
        backend.release([root])
        backend.append(kids, suffixes)
        gens = backend.extend(kids, params)
        stats = backend.kv_stats().as_dict()
        backend.release(kids)
        settle(backend)  # a warm-up that met a new kind of batch: its compiled step, before timing
        return [g.token_ids for g in gens], stats

    def hf() -> tuple[list[list[int]], dict[str, float]]:
        out, cache_bytes = backend.hf_generate(
            [prefix + s for s in suffixes], args.tokens, exact_length=True, return_cache_bytes=True
        )
        return out, {"peak_bytes": cache_bytes}

    t_none, (tok_none, kv_none) = median_time(lambda: ours("none"), args.repeats)
    t_exact, (tok_exact, kv_exact) = median_time(lambda: ours("exact"), args.repeats)
    step_mode = backend.decode_step
    stepper = backend.engine.stepper
    uncompiled_mode = None if stepper.compiler is None else "graphs" if stepper.recorder else "eager"
    backend.decode_step = "layers"  # every decode step through the layer loop: the step before
    t_loop, (tok_loop, _) = median_time(lambda: ours("exact"), args.repeats)
    uncompiled: dict[str, float] = {}
    if uncompiled_mode is not None:  # what compiling adds: the same step uncompiled
        backend.decode_step = uncompiled_mode  # type: ignore[assignment]
        uncompiled["exact_uncompiled"], (tok_unc, _) = median_time(lambda: ours("exact"), args.repeats)
    backend.decode_step = step_mode
    backend.broadcast = "copy"  # RKSC notebook's repeat_interleave(...).clone() path
    t_copy, (tok_copy, kv_copy) = median_time(lambda: ours("exact"), args.repeats)
    backend.broadcast = "cascade"
    t_hf, (tok_hf, kv_hf) = median_time(hf, args.repeats)
    prompts = [prefix + s for s in suffixes]
    static = StaticGenerate(backend, args.hf_static)
    latency = {
        "none": t_none,
        "exact": t_exact,
        "exact_layer_loop": t_loop,
        "exact_copy_broadcast": t_copy,
        "hf_generate": t_hf,
    }
    agreements = [
        ("exact_vs_none", tok_none, tok_exact),
        ("exact_vs_hf_generate", tok_hf, tok_exact),
        ("copy_vs_none", tok_none, tok_copy),
        ("exact_vs_layer_loop", tok_loop, tok_exact),
    ]
    static_results: dict[str, Any] = {}
    if uncompiled:
        latency.update(uncompiled)
        agreements.append(("exact_vs_uncompiled", tok_unc, tok_exact))
        static_results["speedup_compiled_vs_uncompiled"] = round(uncompiled["exact_uncompiled"] / t_exact, 3)
    if static.skipped is None:  # its warm-up call is where transformers compiles it
        latency["hf_static"], tok_static = median_time(lambda: static(prompts, args.tokens), args.repeats)
        agreements.append(("exact_vs_hf_static", tok_static, tok_exact))
        static_results["speedup_exact_vs_hf_static"] = round(latency["hf_static"] / t_exact, 3)
    one_branch = (args.prefix + args.suffix + args.tokens) * backend.kv_token_bytes
    bench.emit(
        {
            "latency_s": {name: round(t, 4) for name, t in latency.items()},
            "speedup_exact_vs_none": round(t_none / t_exact, 3),
            "speedup_exact_vs_hf_generate": round(t_hf / t_exact, 3),
            "speedup_cascade_vs_copy_broadcast": round(t_copy / t_exact, 3),
            "speedup_exact_vs_layer_loop": round(t_loop / t_exact, 3),
            "decode_step": step_description(backend),
            "kv_peak_bytes": {
                "none": kv_none["peak_bytes"],
                "exact": kv_exact["peak_bytes"],
                "exact_copy_broadcast": kv_copy["peak_bytes"],
                "hf_generate": kv_hf["peak_bytes"],
            },
            "kv_ratio_exact_vs_none": round(kv_exact["peak_bytes"] / kv_none["peak_bytes"], 4),
            "kv_exact_vs_one_branch": round(kv_exact["peak_bytes"] / one_branch, 3),
            "tokens_computed": {"none": kv_none["tokens_computed"], "exact": kv_exact["tokens_computed"]},
            "greedy_agreement": {
                name: greedy_agreement(backend.model, prompts, ref, cand).as_dict()
                for name, ref, cand in agreements
            },
            "hf_static": static.report(),
            **static_results,
        }
    )


if __name__ == "__main__":
    main()
