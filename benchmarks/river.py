"""River-LLM (§5, Table 3, Fig. 7): tokens/s and fidelity of the exit river, in one run.

Conditions, on the same reasoning-gym problems, greedy, batch size 1 as in the paper's Table 3
(`--batch 8`: eight problems decoded together; River exits a forward only when every row passes):
- `backbone`: River off (the full-precision model, same decode loop);
- `full_quant`: every token leaves after the entry layer (threshold −1): all later layers run
  quantized — the "fully quantized model" of §5.3 except for the layers up to the entry layer;
- `river@T` for two thresholds T.
Reported per condition: decode tokens/s and its ratio to the backbone, answer accuracy and answer /
token agreement with the backbone, whole-sequence agreement with the backbone's greedy tokens (the
fraction of sequences identical to it, and the mean common-prefix length as a fraction of the
sequence), and the mean backbone layers per decoded token (the paper's mean exit layer). A second, untimed pass with `audit=True` measures the paper's Fig. 7 quantities on
every exited token: next-token match and KL(backbone ‖ river). Paper (Llama-3.1-8B, GPU): 1.71–2.16×
over the backbone at near-lossless quality; GSM8K match 98.03 %, KL 0.0045 at 3.79 layers.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from _common import BenchParser, add_decode_step_option, load_problems, start, step_description, sync

from branchwise.backends.accel import Accel, RiverConfig
from branchwise.backends.base import DecodeParams
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.river import River
from branchwise.reasoners.answers import extract_answer

PAPER = {
    "speedup_vs_backbone": [1.71, 2.16],
    "gsm8k_next_token_match": 0.9803,
    "gsm8k_kl": 0.0045,
    "gsm8k_mean_exit_layers": 3.79,
    "setting": "Llama-3.1-8B / Llama-3.2-1B, 4-bit HQQ river, GPU, batch 1",
}


def decode_all(
    backend: HFBackend, prompts: list[list[int]], max_tokens: int, batch: int = 1
) -> tuple[list[list[int]], list[str], float, dict[str, float]]:
    """Greedy-decode the prompts `batch` at a time (one decode batch of different problems); return
    tokens, texts, decode seconds and River counters.

    The prompts are prefilled (with one token) before the clock starts, so tokens/s is decode speed.
    Rows that finish early leave the batch, so the last steps of a group may run fewer rows.
    """
    tokens, texts, seconds = [], [], 0.0
    backend.reset_stats()
    for start_at in range(0, len(prompts), batch):
        roots = [backend.prefill(prompt) for prompt in prompts[start_at : start_at + batch]]
        kids = [backend.fork(root, 1)[0] for root in roots]
        firsts = backend.extend(kids, DecodeParams(temperature=0.0, max_tokens=1))
        going = [kid for kid, first in zip(kids, firsts, strict=True) if first.finish_reason == "length"]
        sync(backend)
        t0 = time.perf_counter()
        rests = backend.extend(going, DecodeParams(temperature=0.0, max_tokens=max_tokens - 1))
        sync(backend)
        seconds += time.perf_counter() - t0
        rest_of = dict(zip(going, rests, strict=True))
        for kid, first in zip(kids, firsts, strict=True):
            ids = first.token_ids + (rest_of[kid].token_ids if kid in rest_of else [])
            tokens.append(ids)
            texts.append(backend.decode(ids))
        backend.release([*roots, *kids])
    return tokens, texts, seconds, dict(backend.kv_stats().extra)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean fraction of positions where two greedy decodes agree (up to the shorter one)."""
    fractions = []
    for x, y in zip(a, b, strict=True):
        n = max(len(x), len(y))
        same = sum(1 for i in range(min(len(x), len(y))) if x[i] == y[i])
        fractions.append(same / n if n else 1.0)
    return statistics.fmean(fractions)


def sequence_agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """Whole-sequence agreement of decodes `a` with the reference decodes `b`, pairwise.

    Why beside the per-token rates: a next-token match (the audit) is judged on the backbone's own
    context, and positional agreement still counts positions that line up again after a
    divergence, so both can be high while every generated sequence differs from the backbone's.
    Greedy decoding makes the first divergence permanent in practice; what a user sees is whether
    the sequence is the backbone's, and up to where it is.

    Returns ``identical``: the fraction of sequences equal to their reference token for token
    (same length included); ``common_prefix``: the mean length of the common prefix as a fraction
    of the longer of the two (a decode that stops early, or runs on, is not counted as agreeing).
    """
    same, prefixes = [], []
    for x, y in zip(a, b, strict=True):
        n = max(len(x), len(y))
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        same.append(float(x == y))
        prefixes.append(k / n if n else 1.0)
    return {"identical": statistics.fmean(same), "common_prefix": statistics.fmean(prefixes)}


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(__doc__, {"tasks": "gsm_symbolic", "problems": 2, "max_tokens": 24, "batch": 2})
    parser.add_argument("--tasks", default="gsm_symbolic,basic_arithmetic")
    parser.add_argument("--problems", "-N", type=int, default=6, help="per task")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--thresholds", default="0.95,0.97", help="two (or more) exit thresholds")
    parser.add_argument("--entry-layer", type=int, default=None, help="default: RiverConfig's")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=8)
    parser.add_argument("--group-size", type=int, default=None, help="4-bit groups; default: RiverConfig's")
    parser.add_argument(
        "--head", default=None, choices=("refined", "quantized", "backbone"), help="default: RiverConfig's"
    )
    parser.add_argument("--head-top-k", type=int, default=None, help="default: RiverConfig's")
    parser.add_argument(
        "--batch", type=int, default=1, help="problems decoded together in one batch (the paper's Table 3: 1)"
    )
    parser.add_argument("--kernel", default="auto", choices=("auto", "dynamic_int8", "weight_only"))
    parser.add_argument("--seed", type=int, default=0)
    add_decode_step_option(
        parser, why="; 'layers': every condition on the layer loop, as before River ran on the step"
    )
    args = parser.parse_args(argv)
    thresholds = [float(t) for t in args.thresholds.split(",")]
    bench = start("river", args)
    backend = bench.backend
    backend.decode_step = args.decode_step
    chosen = {
        "entry_layer": args.entry_layer,
        "group_size": args.group_size,
        "head": args.head,
        "head_top_k": args.head_top_k,
    }
    base = RiverConfig(
        bits=args.bits, kernel=args.kernel, **{k: v for k, v in chosen.items() if v is not None}
    )
    problems = [p for task in args.tasks.split(",") for p in load_problems(task, args.problems, args.seed)]
    prompts = [backend.chat_prompt([{"role": "user", "content": q}]) for q, _, _ in problems]
    conditions: dict[str, RiverConfig | None] = {
        "backbone": None,
        "full_quant": base.model_copy(update={"threshold": -1.0}),
        **{f"river@{t}": base.model_copy(update={"threshold": t}) for t in thresholds},
    }
    results: dict[str, dict[str, Any]] = {}
    reference: list[list[int]] = []
    reference_answers: list[str | None] = []
    build: dict[str, Any] = {}
    for name, cfg in conditions.items():
        bench.log(name)
        backend.accel = Accel(river=cfg)
        if cfg is not None and not build:
            plugin = backend.acceleration(River)
            assert plugin is not None
            river = plugin.path
            build = {
                "kernel": river.kernel,
                "execution": river.execution,
                "quantized_head": river.head is not None,
                "head": base.head,
                "seconds": round(river.build_s, 2),
                "river_bytes": river.nbytes,
            }
        # warm-up (first-call allocations, kernel selection)
        decode_all(backend, prompts[: args.batch], 4, args.batch)
        tokens, texts, seconds, extra = decode_all(backend, prompts, args.max_tokens, args.batch)
        answers = [extract_answer(t) for t in texts]
        correct = [
            float(ds.score_answer(a, e) >= 1.0) for a, (_, e, ds) in zip(answers, problems, strict=True)
        ]
        generated = sum(len(t) - 1 for t in tokens)  # the first token was decoded before the clock
        row: dict[str, Any] = {
            "tokens_per_s": round(generated / seconds, 2) if seconds else None,
            "decode_s": round(seconds, 3),
            "generated_tokens": generated,
            "accuracy": round(statistics.fmean(correct), 3),
            # where its decode steps ran: the fixed-shape step, or the layer loop (and why)
            "decode_steps_fixed": int(
                extra.get("decode_steps_fixed", 0) + extra.get("decode_steps_captured", 0)
            ),
            "decode_steps_layer_loop": int(extra.get("decode_steps_layer_loop", 0)),
        }
        if cfg is None:
            reference, reference_answers = tokens, answers
        else:
            decoded = extra.get("river_decode_tokens", 0.0)
            row["mean_backbone_layers_per_token"] = (
                round(extra["river_decode_backbone_layers"] / decoded, 2) if decoded else None
            )
            row["exit_rate"] = round(extra.get("river_exits", 0.0) / extra["river_forwards"], 3)
            row["token_agreement_vs_backbone"] = round(agreement(tokens, reference), 3)
            whole = sequence_agreement(tokens, reference)
            row["sequence_identical_vs_backbone"] = round(whole["identical"], 3)
            row["common_prefix_fraction_vs_backbone"] = round(whole["common_prefix"], 3)
            row["answer_agreement_vs_backbone"] = round(
                statistics.fmean(float(a == b) for a, b in zip(answers, reference_answers, strict=True)), 3
            )
            backend.accel = Accel(river=cfg.model_copy(update={"audit": True}))
            _, _, _, audited = decode_all(backend, prompts, args.max_tokens, args.batch)
            rows = audited.get("river_audit_rows", 0.0)
            row["audit"] = {  # over the exited forwards' last tokens; the others ran the whole backbone
                "exited_tokens": int(rows),
                "next_token_match": round(audited["river_audit_matches"] / rows, 4) if rows else None,
                "kl": round(audited["river_audit_kl_sum"] / rows, 5) if rows else None,
            }
        results[name] = row
    backbone_speed = results["backbone"]["tokens_per_s"]
    for name, row in results.items():
        if name != "backbone" and backbone_speed and row["tokens_per_s"]:
            row["speedup_vs_backbone"] = round(row["tokens_per_s"] / backbone_speed, 3)
    bench.emit(
        {"river_build": build, "conditions": results, "paper": PAPER},
        config={
            "entry_layer": base.entry_layer,
            "group_size": base.group_size,
            "head": base.head,
            "head_top_k": base.head_top_k,
            "n_layers": backend.parts.n_layers,
            "decode_step": step_description(backend),
        },
    )


if __name__ == "__main__":
    main()
