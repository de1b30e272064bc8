"""Run a profile of benchmarks and keep their results; render results as a Markdown table.

    python benchmarks/run_all.py run --profile full --device cuda --out results-h100.jsonl
    python benchmarks/run_all.py table results-h100.jsonl results-cpu.jsonl > benchmarks/RESULTS.md

`run` starts each benchmark of the profile as its own process (a crash or a timeout loses that run
only), and appends one line per run to `--out`: its id, command line, exit status and the JSON the
script printed. It resumes: a run whose id already succeeded in `--out` is skipped, so a long
profile can be spread over several sittings (or machines with a time limit per command). `--only`
picks runs by id.

`table` reads such files and prints one row per run: the device (GPU name, or CPU threads), dtype,
torch and transformers versions, wall seconds, and the run's headline figures (`HEADLINES`: the
ratios against the baselines and the fidelity figures of each benchmark; the whole JSON stays in
the results file).

Profiles. `quick`: every benchmark's `--quick` smoke settings (minutes on a CPU). `full`: the
settings of the papers' tables and of the GPU checklist (prefix sharing at B = 8/32/64 and a 4k
prefix, RKSC Tables 1-2 and verify isolation, ETS vs REBASE at widths 64 and 256, SkipKV, River,
ReasonCache, decode at B = 1/8 on the model and on a random ~1B Llama, throughput at a fixed KV
budget, the decode attention over the step's tails against a paged pool read in place by our kernel
and by FlexAttention); hours on a CPU. `gpu-check`: the runs of `gpu_check.sh` (decode at B = 1/8/64 and the
1,024-token prefix at 8 and 64 branches, 64 tokens each, against transformers' compiled static
cache; `kv_budget-gpu`, throughput of every KV-saving arm at a budget of a quarter of what exact
sharing needs; `kv_budget_search-gpu`, the same arms on a beam search; `paged_attention-gpu`, the
decode attention over the step's tails against a paged pool, gathered or read by FlashInfer, without
the FlexAttention arm, whose compilation per batch size the stage's minute cannot afford;
`accel_step-gpu`, each acceleration against the plain captured step, River's exits forced), sized to finish in minutes
on one H100/H200 with `--model` the random ~1.2B Llama of `random_checkpoint.py`.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Run:
    """One benchmark invocation: an id unique in its profile, the script and its own options."""

    id: str
    script: str
    args: list[str] = field(default_factory=list)


SCRIPTS = [
    "prefix_sharing",
    "rksc_table1",
    "rksc_table2",
    "rksc_verify",
    "rksc_asks",
    "rksc_rsbcm",
    "rksc_prefix_sweep",
    "ets_vs_rebase",
    "skipkv",
    "river",
    "reasoncache",
    "batch",
    "prefix_cache",
    "agent",
    "decode",
    "structured",
    "serve_load",
    "kv_budget",
    "kv_budget_search",
    "paged_attention",
    "paged_admission",
    "kv_layout",
    "kv_admission",
    "compile_ahead",
    "accel_step",
    "sampling",
]

PROFILES: dict[str, list[Run]] = {
    "quick": [Run(name, name, ["--quick"]) for name in SCRIPTS],
    "full": [
        Run("prefix_sharing", "prefix_sharing"),
        Run("prefix_sharing-B32", "prefix_sharing", ["--branches", "32"]),
        Run("prefix_sharing-B64", "prefix_sharing", ["--branches", "64"]),
        Run("prefix_sharing-4k", "prefix_sharing", ["--prefix", "4096"]),
        Run("prefix_sharing-4k-B64", "prefix_sharing", ["--prefix", "4096", "--branches", "64"]),
        Run("rksc_table1", "rksc_table1"),
        Run("rksc_table2", "rksc_table2"),
        Run("rksc_verify", "rksc_verify"),
        Run("rksc_asks", "rksc_asks"),
        Run("rksc_rsbcm", "rksc_rsbcm"),
        Run("rksc_prefix_sweep", "rksc_prefix_sweep"),
        Run("ets_vs_rebase-64-256", "ets_vs_rebase", ["--widths", "64", "256"]),
        Run("skipkv", "skipkv"),
        Run("river", "river"),
        Run("reasoncache", "reasoncache"),
        Run("batch", "batch"),
        Run("prefix_cache", "prefix_cache"),
        Run("agent", "agent"),
        Run("decode", "decode"),
        Run("decode-random-1b", "decode", ["--random-config", "1b"]),
        Run("structured", "structured"),
        Run("serve_load", "serve_load"),
        Run("kv_budget", "kv_budget"),
        Run("kv_budget_search", "kv_budget_search"),
        Run("paged_attention", "paged_attention"),
        Run("paged_attention-random-1b", "paged_attention", ["--random-config", "1b", "--batches", "1", "8"]),
        Run("paged_admission", "paged_admission"),
        Run("kv_layout", "kv_layout"),
        Run("kv_layout-ragged", "kv_layout", ["--ragged", "on", "--batch", "8", "32"]),
        Run("kv_admission", "kv_admission"),
        Run("compile_ahead", "compile_ahead"),
        Run("accel_step", "accel_step"),
        Run("sampling", "sampling"),
    ],
    "gpu-check": [
        Run(
            "decode",
            "decode",
            ["--batches", "1", "8", "64", "--tokens", "64", "--prompt", "128", "--repeats", "2"],
        ),
        Run("prefix_sharing", "prefix_sharing", ["--prefix", "1024", "--tokens", "64", "--repeats", "2"]),
        Run(
            "prefix_sharing-B64",
            "prefix_sharing",
            ["--prefix", "1024", "--tokens", "64", "--branches", "64", "--repeats", "2"],
        ),
        Run("kv_budget-gpu", "kv_budget", ["--max-tokens", "96", "--repeats", "2"]),
        Run("kv_budget_search-gpu", "kv_budget_search", ["--questions", "4", "--repeats", "1"]),
        # random weights: River's exits forced (threshold -1: every token leaves at its entry layer,
        # River's best case), ReasonCache finds nothing similar; each acceleration's cost on the
        # captured step is what this measures
        Run("accel_step-gpu", "accel_step", ["--river-threshold", "-1", "--repeats", "1"]),
        Run(
            "paged_attention-gpu",
            "paged_attention",
            ["--batches", "1", "8", "64", "--context", "1024", "--flex", "off"],
        ),
    ],
}

HEADLINES: dict[str, list[str]] = {
    # per benchmark, the figures its table row shows (fnmatch patterns over the flattened JSON keys)
    "prefix_sharing": [
        "speedup_exact_vs_none",
        "speedup_exact_vs_hf_generate",
        "speedup_exact_vs_hf_static",
        "hf_static.compiled",
        "speedup_cascade_vs_copy_broadcast",
        "speedup_exact_vs_layer_loop",
        "speedup_compiled_vs_uncompiled",
        "decode_step",
        "kv_ratio_exact_vs_none",
        "greedy_agreement.*.match_up_to_ties",
        "greedy_agreement.*.rows_differing",
    ],
    "rksc_table1": [
        "speedup_vs_nokv.*.ratio_of_means",
        "speedup_vs_kv.kv+cgee.ratio_of_means",
        "verify_skip_rate.kv+cgee",
        "decision_flips_vs_kv.kv+cgee",
    ],
    "rksc_table2": [
        "overall.speedup_vs_nokv.*.ratio_of_means",
        "overall.speedup_vs_kv.kv+cgee.ratio_of_means",
        "overall.cgee_skip_rate.kv+cgee",
        "overall.table3.kv+cgee.error_rate",
    ],
    "rksc_verify": ["verify_speedup", "mean_exit_layer", "decision_flips", "live_exits_match_replay"],
    "rksc_asks": ["conditions.*.speedup_vs_nokv", "conditions.*.answer_agreement_vs_nokv"],
    "rksc_rsbcm": ["observed_evictions", "answer_agreement_vs_no_eviction", "overhead_ms_per_problem"],
    "rksc_prefix_sweep": ["sweep.*.speedup.ratio_of_means"],
    "ets_vs_rebase": [
        "per_width.*.ets_vs_rebase.kv_reduction",
        "per_width.*.ets_vs_rebase.peak_kv_reduction",
        "per_width.*.ets_vs_rebase.accuracy_delta_points",
    ],
    "skipkv": [
        "budgets.*.methods.skipkv.peak_kv_ratio_vs_fullkv",
        "budgets.*.methods.skipkv.agreement_with_fullkv",
        "budgets.*.methods.skipkv.throughput_vs_fullkv",
    ],
    "river": [
        "conditions.*.speedup_vs_backbone",
        "conditions.*.token_agreement_vs_backbone",
        "conditions.*.sequence_identical_vs_backbone",
        "conditions.*.mean_backbone_layers_per_token",
    ],
    "reasoncache": [
        "methods.*.amsr",
        "methods.reasoncache.agreement_with_dense",
        "fixed_kv_budget.throughput_ratio",
    ],
    "batch": ["speedup_batch_vs_serial", "same_tokens"],
    "prefix_cache": ["*.speedup", "*.computed_ratio", "*.tokens_identical"],
    "agent": ["tokens_computed_ratio", "latency_ratio", "trajectories_identical"],
    "decode": [
        "rows.*.branchwise.tokens_per_s",
        "rows.*.hf_generate.tokens_per_s",
        "rows.*.hf_static.tokens_per_s",
        "rows.*.speedup_vs_hf_generate",
        "rows.*.speedup_vs_hf_static",
        "rows.*.speedup_vs_layer_loop",
        "rows.*.speedup_vs_uncompiled",
        "rows.*.same_tokens_as_layer_loop",
        "rows.*.same_tokens_as_uncompiled",
        "decode_step",
        "rows.*.*.fraction_of_peak",
        "rows.*.greedy_agreement_vs_hf_*.match_up_to_ties",
        "hf_static.compiled",
    ],
    "structured": [
        "per_token_cost.*.overhead",
        "compile.*.cold_ms",
        "validity.*.rate",
        "action_vote.vote_correct",
        "action_vote.single_sample_correct",
    ],
    "serve_load": [
        "speedup_concurrent_vs_serial",
        "throughput_rps.concurrent",
        "latency_ms.p99",
        "errors",
        "long_request.p99_ratio_*_vs_no_long",
        "kv_burst.errors_other_than_429",
        "kv_burst.rss_mb.peak_within_bound",
        "sigterm.all_in_flight_answered",
        "sigterm.exit_code",
        "sigterm.seconds_to_exit",
    ],
    "kv_budget": [
        "every_arm_bound",
        "arms.*.throughput_vs_exact",
        "arms.*.max_requests_at_once",
        "arms.*.agreement_greedy.value",
        "arms.*.accuracy_branch.value",
        "goals.*.met",
    ],
    "kv_admission": ["workloads.*.pages_vs_tails.*", "workloads.*.*.preemptions", "workloads.*.*.overruns"],
    "kv_layout": ["B=*.pages_vs_tails", "B=*.same_tokens", "B=*.peak_own_kv_bytes.*", "B=*.off_fast.*"],
    "paged_attention": [
        "batches.*.paged_inplace.vs_tails",
        "batches.*.cascade.paged_inplace.vs_tails",
        "batches.*.paged_flex.vs_tails",
        "batches.*.paged_gather.vs_tails",
        "batches.*.flashinfer.vs_tails",
        "batches.*.flashinfer.skipped",
        "batches.*.*.same_output",
        "batches.*.paged_vs_tails_bytes",
    ],
    "compile_ahead": [
        "*.rows.*.first_vs_eager",
        "*.rows.*.compiled_vs_eager",
        "*.preload_s",
        "*.ready_s",
    ],
    "accel_step": [
        "workloads.*.speedup_vs_plain",
        "workloads.*.layer_loop_steps",
        "workloads.river.river.audit.next_token_match",
        "decode_step",
    ],
    "sampling": ["candidates_vs_sorted", "pick_speedup", "same_tokens"],
    "paged_admission": [
        "workloads.*.*.paged_vs_tails.tokens_per_step",
        "workloads.*.*.paged_vs_tails.max_rows_at_once",
        "workloads.*.*.*.preemptions",
    ],
}
FALLBACK = re.compile(r"speedup|ratio|reduction|agreement|accuracy")
"""For a benchmark without `HEADLINES`: leaves whose name says they are a ratio or a quality."""


def run_profile(args: argparse.Namespace) -> int:
    runs = PROFILES[args.profile]
    if args.only:
        unknown = sorted(set(args.only) - {r.id for r in runs})
        if unknown:
            raise SystemExit(
                f"--only: no run {unknown} in profile {args.profile!r}; ids: {[r.id for r in runs]}"
            )
        runs = [r for r in runs if r.id in args.only]
    out = Path(args.out)
    done = {entry["id"] for entry in read_results([out]) if entry.get("ok")} if out.exists() else set()
    common = ["--device", args.device, "--dtype", args.dtype]
    if args.model is not None:
        common += ["--model", args.model]
    if args.threads is not None:
        common += ["--threads", str(args.threads)]
    failed = 0
    for run in runs:
        if run.id in done:
            print(f"[run_all] {run.id}: done already in {out}", file=sys.stderr)
            continue
        argv = [sys.executable, str(HERE / f"{run.script}.py"), *run.args, *common]
        print(f"[run_all] {run.id}: {' '.join(argv[1:])}", file=sys.stderr, flush=True)
        started = time.perf_counter()
        entry: dict[str, Any] = {"id": run.id, "argv": argv[1:]}
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout, cwd=HERE.parent)
            entry["returncode"] = proc.returncode
            lines = proc.stdout.strip().splitlines()
            entry["ok"] = proc.returncode == 0 and bool(lines)
            if entry["ok"]:
                entry["result"] = json.loads(lines[-1])
            else:
                entry["error"] = proc.stderr[-3000:]
        except subprocess.TimeoutExpired:
            entry.update(ok=False, error=f"timed out after {args.timeout} s")
        entry["wall_s"] = round(time.perf_counter() - started, 1)
        failed += not entry["ok"]
        with out.open("a") as f:
            f.write(json.dumps(entry) + "\n")
        print(
            f"[run_all] {run.id}: {'ok' if entry['ok'] else 'FAILED'} in {entry['wall_s']} s", file=sys.stderr
        )
    return 1 if failed else 0


def read_results(paths: list[Path]) -> list[dict[str, Any]]:
    """The entries of results files, the last one of each id per file winning (a rerun replaces)."""
    entries: list[dict[str, Any]] = []
    for path in paths:
        latest: dict[str, dict[str, Any]] = {}
        for line in path.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                latest[entry["id"]] = entry
        entries.extend(latest.values())
    return entries


def flatten(result: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Numeric and boolean leaves by dotted key (list items by index); config and machine left out."""
    out: dict[str, Any] = {}
    for key, value in result.items():
        if key in ("config", "machine") and not prefix:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, item in enumerate(value):
                out.update(flatten(item, f"{name}.{i}."))
        elif isinstance(value, bool | int | float):
            out[name] = value
    return out


def headlines(result: dict[str, Any]) -> dict[str, Any]:
    """The figures of `result` its table row shows (`HEADLINES`, else `FALLBACK`)."""
    leaves = flatten(result)
    patterns = HEADLINES.get(result.get("benchmark", ""))
    if patterns is None:
        return {k: v for k, v in leaves.items() if FALLBACK.search(k)}
    return {k: v for k, v in leaves.items() if any(fnmatch.fnmatchcase(k, p) for p in patterns)}


def device_of(result: dict[str, Any]) -> str:
    gpu = result.get("machine", {}).get("cuda")
    if result.get("device") == "cuda" and isinstance(gpu, dict):
        return str(gpu.get("name"))
    return f"cpu ×{result.get('machine', {}).get('threads', '?')}"


def table(paths: list[Path]) -> str:
    """The Markdown table of every run in `paths` (failed runs listed with their error's last line)."""
    rows = [
        "| run | device | dtype | torch | transformers | seconds | headline figures |",
        "|---|---|---|---|---|---|---|",
    ]
    for entry in read_results(paths):
        if not entry.get("ok"):
            last = (entry.get("error") or "").strip().splitlines()[-1:] or ["?"]
            rows.append(f"| {entry['id']} | | | | | | FAILED: {last[0][:200]} |")
            continue
        res = entry["result"]
        machine = res.get("machine", {})
        figures = ", ".join(f"{k} {_fmt(v)}" for k, v in headlines(res).items())
        rows.append(
            f"| {entry['id']} | {device_of(res)} | {res.get('dtype')} | {machine.get('torch')} | "
            f"{machine.get('transformers', '?')} | {res.get('seconds')} | {figures} |"
        )
    return "\n".join(rows) + "\n"


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:g}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a profile, appending to --out (resumes)")
    run.add_argument("--profile", choices=sorted(PROFILES), default="quick")
    run.add_argument("--out", required=True, help="JSON-lines file to append to (and resume from)")
    run.add_argument("--only", nargs="+", default=None, help="run ids to run (default: the whole profile)")
    run.add_argument("--device", default="auto", help="passed to every benchmark")
    run.add_argument("--dtype", default="auto", help="passed to every benchmark")
    run.add_argument("--threads", type=int, default=None, help="passed to every benchmark")
    run.add_argument("--model", default=None, help="passed to every benchmark (default: each one's own)")
    run.add_argument("--timeout", type=float, default=3600.0, help="seconds per run before it is stopped")
    show = sub.add_parser("table", help="print the Markdown table of results files")
    show.add_argument("paths", nargs="+", type=Path)
    sub.add_parser("list", help="print every profile's run ids and command lines")
    args = parser.parse_args(argv)
    if args.command == "run":
        return run_profile(args)
    if args.command == "table":
        print(table(args.paths), end="")
        return 0
    for name, runs in PROFILES.items():
        for r in runs:
            print(f"{name}\t{r.id}\t{r.script}.py {' '.join(r.args)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
