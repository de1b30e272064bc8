"""Decode efficiency: tokens/s of branchwise's decode loop against `model.generate()`, and the memory
bandwidth that implies.

B independent prompts of equal length (no shared prefix: this measures the decode engine, not
sharing) decode `--tokens` greedy tokens each, B = each of `--batches`. Four arms: branchwise (its
fixed-shape decode step, captured as CUDA graphs on a GPU: `step.py`), branchwise with every step
through its layer loop (`decode_step="layers"`, the step before), `model.generate()` (dynamic cache, eager) and `model.generate(cache_implementation="static")`, which
transformers compiles with CUDA graphs on a GPU (`--hf-static`: on the CPU it runs uncompiled unless
asked, and the JSON's `hf_static` says how it ran). Prefill is excluded the same way on every side:
the time of a 1-token decode from the same prompts is subtracted from the time of a `--tokens`
decode, so tokens/s = B·(tokens − 1) / (t_tokens − t_1). The arms alternate repeat by repeat, so a
machine that drifts during the run weighs on all alike; the first (warm-up) call of the static arm
at each B is where transformers compiles it.

Bandwidth. A decode step streams every weight the step uses once (all parameters except an untied
input embedding, of which only B rows are read) plus the KV each row attends to. So
bytes/step = weight bytes + B · mean context · KV bytes/token, and achieved GB/s = bytes/step ×
steps/s. `--peak-gbps` (default: the datasheet figure of a known GPU, else none) turns that into the
fraction of peak; at B = 1 that fraction is how close the loop is to the memory roofline.

`--random-config 1b` replaces the model with a randomly initialised ~1.2B Llama (TinyLlama's shape
with the embedded tokenizer's vocabulary; `random_checkpoint.py`), built in-process: what a 1B-class
checkpoint costs per token without downloading one.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import (
    Bench,
    BenchParser,
    StaticGenerate,
    add_decode_step_option,
    add_hf_static_option,
    set_threads,
    settle,
    step_description,
)
from prefix_sharing import PASSAGE, exact_tokens
from random_checkpoint import RANDOM_CONFIGS, random_backend

from branchwise.backends import DecodeParams
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.arch import linear_params
from branchwise.backends.hf.backend import resolve_device, resolve_dtype
from branchwise.backends.hf.fidelity import greedy_agreement
from branchwise.backends.hf.prepack import PackedLinear

PEAK_GBPS = {  # HBM bandwidth from the vendors' datasheets, by a substring of the device name
    "H200": 4800.0,
    "H100 SXM": 3350.0,
    "H100 80GB HBM3": 3350.0,
    "H100 PCIe": 2000.0,
    "H100 NVL": 3900.0,
    "A100-SXM4-80GB": 2039.0,
    "A100-SXM4-40GB": 1555.0,
    "A100 80GB PCIe": 1935.0,
    "L40S": 864.0,
    "A10G": 600.0,
    "L4": 300.0,
}


def peak_gbps(given: float | None) -> float | None:
    if given is not None or not torch.cuda.is_available():
        return given
    name = torch.cuda.get_device_name(0)
    return next((gbps for key, gbps in PEAK_GBPS.items() if key in name), None)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads of the weights: every linear layer (plain or packed for the CPU),
    the norms, and the LM head; of the input embedding only B rows (not counted) unless it is the
    head itself."""
    packed = sum(m.nbytes for m in model.modules() if isinstance(m, PackedLinear))
    total = packed + sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = isinstance(head, torch.nn.Linear) and head.weight is embed
    return total if tied else total - embed.numel() * embed.element_size()


def parameter_count(backend: HFBackend) -> int:
    """Parameters of the model as loaded: a packed linear counts once, and the packed copy of a
    tied head (`prepacked.extra_bytes`) not at all."""
    model = backend.model
    count = sum(p.numel() for p in model.parameters())
    count += sum(linear_params(m) for m in model.modules() if isinstance(m, PackedLinear))
    return count - backend.prepacked.extra_bytes // backend.dtype.itemsize


Arm = Callable[[list[list[int]], int], list[list[int]]]


def interleaved(
    arms: dict[str, Arm], prompts: list[list[int]], tokens: int, repeats: int
) -> tuple[dict[str, float], dict[str, list[list[int]]]]:
    """Decode steps per second of each arm, (tokens − 1) / (median t(tokens) − median t(1)), and its
    last tokens. Repeat-major with the arms' order reversed every other repeat, after one warm-up
    each, so a machine that drifts during the run weighs on every arm alike."""
    full: dict[str, list[float]] = {name: [] for name in arms}
    one: dict[str, list[float]] = {name: [] for name in arms}
    out: dict[str, list[list[int]]] = {}
    for fn in arms.values():
        fn(prompts, tokens)
    for r in range(repeats):
        for name, fn in arms.items() if r % 2 == 0 else reversed(arms.items()):
            for n, times in ((tokens, full[name]), (1, one[name])):
                start = time.perf_counter()
                got = fn(prompts, n)  # token lists: waits for the device's queued work
                times.append(time.perf_counter() - start)
                if n == tokens:
                    out[name] = got
    rates = {
        name: (tokens - 1) / (statistics.median(full[name]) - statistics.median(one[name])) for name in arms
    }
    return rates, out


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(__doc__, {"batches": [1, 2], "tokens": 8, "prompt": 32, "repeats": 1})
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="rows decoded together")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per row")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per row")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median) after one warm-up")
    parser.add_argument("--random-config", choices=sorted(RANDOM_CONFIGS), default=None)
    parser.add_argument("--peak-gbps", type=float, default=None, help="memory bandwidth to compare with")
    add_decode_step_option(parser, why="; where it compiles, the same step uncompiled is an arm too")
    add_hf_static_option(parser)
    args = parser.parse_args(argv)
    if args.tokens < 2:
        parser.error(f"--tokens must be at least 2 (got {args.tokens}): one token is the subtracted prefill")

    set_threads(args.threads)
    started = time.perf_counter()
    if args.random_config:
        device = resolve_device(args.device)
        backend = random_backend(args.random_config, device, resolve_dtype(args.dtype, device))
    else:
        backend = HFBackend(args.model, device=args.device, dtype=args.dtype, cache_bytes=0)
    backend.decode_step = args.decode_step
    bench = Bench("decode", args, backend, started)
    passage = exact_tokens(backend, PASSAGE, args.prompt + max(args.batches))

    step_mode = backend.decode_step  # "auto": CUDA graphs on a GPU, the fixed-shape step eagerly elsewhere

    def decoder(mode: str) -> Arm:
        def ours(prompts: list[list[int]], tokens: int) -> list[list[int]]:
            backend.decode_step = mode  # type: ignore[assignment]
            roots = [backend.prefill(p) for p in prompts]
            gens = backend.extend(roots, DecodeParams(max_tokens=tokens, min_tokens=tokens))
            backend.release(roots)
            settle(backend)  # a warm-up that met a new kind of batch: its compiled step, before timing
            return [g.token_ids for g in gens]

        return ours

    def generate(prompts: list[list[int]], tokens: int) -> list[list[int]]:
        return backend.hf_generate(prompts, tokens, exact_length=True)  # type: ignore[return-value]

    weights = weight_bytes(backend.model)
    peak = peak_gbps(args.peak_gbps)
    arms: dict[str, Arm] = {
        "branchwise": decoder(step_mode),
        "branchwise_layer_loop": decoder("layers"),
        "hf_generate": generate,
    }
    compiles = backend.engine.stepper.compiler is not None
    if compiles:  # what compiling adds: the same step uncompiled (captured on CUDA, eager elsewhere)
        arms["branchwise_uncompiled"] = decoder("graphs" if backend.engine.stepper.recorder else "eager")
    static = StaticGenerate(backend, args.hf_static)
    if static.skipped is None:
        arms["hf_static"] = static
    rows = []
    for b in args.batches:
        prompts = [passage[i : i + args.prompt] for i in range(b)]  # equal lengths, all different
        bench.log(f"B={b}")
        result: dict[str, Any] = {"batch": b}
        steps_per_s, tokens = interleaved(arms, prompts, args.tokens, args.repeats)
        for name, rate in steps_per_s.items():
            context = args.prompt + args.tokens / 2
            step_bytes = weights + b * context * backend.kv_token_bytes
            gbps = step_bytes * rate / 1e9
            result[name] = {
                "tokens_per_s": round(b * rate, 2),
                "ms_per_step": round(1000 / rate, 3),
                "achieved_gbps": round(gbps, 2),
                "fraction_of_peak": None if peak is None else round(gbps / peak, 4),
            }
        result["speedup_vs_hf_generate"] = round(
            result["branchwise"]["tokens_per_s"] / result["hf_generate"]["tokens_per_s"], 3
        )
        result["speedup_vs_layer_loop"] = round(
            result["branchwise"]["tokens_per_s"] / result["branchwise_layer_loop"]["tokens_per_s"], 3
        )
        result["same_tokens_as_layer_loop"] = tokens["branchwise"] == tokens["branchwise_layer_loop"]
        if compiles:
            result["speedup_vs_uncompiled"] = round(
                result["branchwise"]["tokens_per_s"] / result["branchwise_uncompiled"]["tokens_per_s"], 3
            )
            result["same_tokens_as_uncompiled"] = tokens["branchwise"] == tokens["branchwise_uncompiled"]
        agreement = greedy_agreement(backend.model, prompts, tokens["hf_generate"], tokens["branchwise"])
        result["greedy_agreement_vs_hf_generate"] = agreement.as_dict()
        if static.skipped is None:
            result["speedup_vs_hf_static"] = round(
                result["branchwise"]["tokens_per_s"] / result["hf_static"]["tokens_per_s"], 3
            )
            agreement = greedy_agreement(backend.model, prompts, tokens["hf_static"], tokens["branchwise"])
            result["greedy_agreement_vs_hf_static"] = agreement.as_dict()
        rows.append(result)
    backend.decode_step = step_mode  # the arms switched it: the JSON describes the branchwise arm's
    bench.emit(
        {
            "parameters": parameter_count(backend),
            "weight_bytes_per_step": weights,
            "kv_bytes_per_token": backend.kv_token_bytes,
            "peak_gbps": peak,
            "decode_step": step_description(backend),
            "hf_static": static.report(),
            "rows": rows,
        },
        config={"model_source": args.random_config or "checkpoint"},
    )


if __name__ == "__main__":
    main()
