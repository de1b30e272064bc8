"""Smoke tests of the RKSC benchmark scripts: `--quick` runs end to end and its JSON has the keys.

Why subprocesses: the scripts are run as users run them (argument parsing, `sys.path` set-up,
output on stdout with progress on stderr), and a benchmark's last stdout line must parse as JSON.
No speed is asserted (DESIGN §8: a benchmark measures, a test asserts behaviour). They load the
embedded model and, when no CGEE calibration is saved yet, fit one on 3 held-out problems first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_quick(script: str) -> dict[str, Any]:
    """Run `benchmarks/<script> --quick --threads 1` (stable on a shared CPU) and return the JSON object on its last stdout line."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--threads", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no stdout; stderr: {proc.stderr[-2000:]}"
    return json.loads(lines[-1])


@pytest.fixture
def rksc_ready(embedded_dir: Path) -> None:
    """Skip unless the embedded model and reasoning-gym (the problems) are installed."""
    pytest.importorskip("reasoning_gym")


@pytest.mark.slow
@pytest.mark.usefixtures("rksc_ready")
def test_rksc_table2_quick() -> None:
    out = run_quick("rksc_table2.py")
    assert out["benchmark"] == "rksc_table2"
    assert set(out["per_task"]) == set(out["tasks"]) == {"gsm_symbolic", "basic_arithmetic", "chain_sum"}
    for row in [*out["per_task"].values(), out["overall"]]:
        assert set(row["latency_ms"]) == {"nokv", "kv", "kv+cgee"}
        assert {"kv", "kv+cgee"} <= set(row["speedup_vs_nokv"])
        assert "kv+cgee" in row["speedup_vs_kv"]
        assert 0.0 <= row["cgee_skip_rate"]["kv+cgee"] <= 1.0
        t3 = row["table3"]["kv+cgee"]
        assert {"verify_calls", "errors", "error_rate", "delta_accuracy", "decision_flips"} <= set(t3)
        assert t3["errors"] <= t3["verify_calls"] == row["n_problems"]
        assert set(row["accuracy"]) == {"nokv", "kv", "kv+cgee"}
    assert set(out["overall"]["mean_task_speedup_vs_nokv"]) == {"kv", "kv+cgee"}
    assert out["paper"]["overall"]["rksc_speedup"] == 3.008
    assert out["overall"]["n_problems"] == 3 * out["config"]["problems"]


@pytest.mark.slow
@pytest.mark.usefixtures("rksc_ready")
def test_rksc_verify_quick() -> None:
    out = run_quick("rksc_verify.py")
    assert out["benchmark"] == "rksc_verify"
    assert {"full", "l2"} == set(out["verify_ms"])
    assert out["verify_speedup"] > 0
    lo, hi = out["verify_speedup_ci95"]
    assert lo <= hi
    assert 1 <= out["mean_exit_layer"] <= out["n_layers"]
    assert 0.0 <= out["exit_fire_rate"] <= 1.0
    assert 0 <= out["decision_flips"] <= out["config"]["problems"]
    assert out["rows"] == out["config"]["problems"] * out["config"]["branches"]
    # the live level-2 exits are the ones Alg. 3 picks on the recorded full-depth trace
    assert out["live_exits_match_replay"] is True
    assert {"calibrated", "paper_defaults", "flips_by_l_min"} <= set(out["replay"])
    assert len(out["per_problem"]) == out["config"]["problems"]


@pytest.mark.slow
@pytest.mark.usefixtures("rksc_ready")
def test_rksc_prefix_sweep_quick() -> None:
    out = run_quick("rksc_prefix_sweep.py")
    assert out["benchmark"] == "rksc_prefix_sweep"
    assert set(out["sweep"]) == {"128", "256"}
    for row in out["sweep"].values():
        assert set(row["latency_ms"]) == {"nokv", "kv"}
        assert {"median_per_problem", "ci95", "ratio_of_means", "cv"} <= set(row["speedup"])
        assert row["speedup"]["ci95"][0] <= row["speedup"]["ci95"][1]
    assert out["paper"]["speedup"]["1024"] == 1.452


@pytest.mark.slow
@pytest.mark.usefixtures("rksc_ready")
def test_skipkv_quick() -> None:
    out = run_quick("skipkv.py")
    assert out["benchmark"] == "skipkv"
    cfg = out["config"]
    assert cfg["quick"] and cfg["n_problems"] == cfg["problems"] * len(cfg["tasks"])
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
        assert set(methods) == {"attention_only", "rkv", "skipkv_ungrouped", "skipkv", "skipkv+steer"}
        if not steer["available"]:
            assert methods.pop("skipkv+steer") == {"skipped": steer["reason"]}
        assert methods["rkv"]["throughput_vs_rkv"] == 1.0
        for row in methods.values():
            assert 0 < row["mean_length"] <= row["max_length"] <= cfg["max_tokens"]
            assert 0.0 <= row["accuracy_vote"] <= 1.0 and 0.0 <= row["agreement_with_fullkv"] <= 1.0
            assert row["length_ratio_vs_fullkv"] > 0 and row["tokens_per_s"] > 0
            # a compression evicts at least one token (it runs only above budget)
            assert row["evicted_tokens"] >= row["compressions"] >= 0
            assert (row["evicted_tokens"] == 0) == ("note" in row)  # a note says why nothing went
        assert methods["skipkv"]["order"] == "grouped"
        assert methods["rkv"]["order"] == methods["skipkv_ungrouped"]["order"] == "original"
    for row in budgets[0]["methods"].values():  # the smallest budget evicts (or says why not)
        if "skipped" not in row:
            assert row["evicted_tokens"] > 0 or "note" in row
    grouping = out["grouping"]
    lengths = grouping["prefill_lengths"]
    assert len(lengths) == cfg["n_problems"]
    assert sorted(i for g in grouping["batches_grouped"] for i in g) == list(range(len(lengths)))
    assert grouping["padding_tokens"]["grouped"] <= grouping["padding_tokens"]["original"]
    assert grouping["effective_budget"]["equals_budget"] is True
    assert out["paper"]["throughput_vs_rkv"]["max"] == 1.7


@pytest.mark.slow
@pytest.mark.usefixtures("rksc_ready")
def test_river_quick() -> None:
    out = run_quick("river.py")
    assert out["benchmark"] == "river"
    conds = out["conditions"]
    thresholds = out["config"]["thresholds"].split(",")
    assert set(conds) == {"backbone", "full_quant", *(f"river@{t}" for t in thresholds)}
    n_layers = out["config"]["n_layers"]
    for name, row in conds.items():
        assert row["tokens_per_s"] > 0 and 0.0 <= row["accuracy"] <= 1.0
        if name == "backbone":
            continue
        assert 1.0 <= row["mean_backbone_layers_per_token"] <= n_layers
        assert 0.0 <= row["exit_rate"] <= 1.0 and "speedup_vs_backbone" in row
        audit = row["audit"]
        if audit["exited_tokens"]:
            assert 0.0 <= audit["next_token_match"] <= 1.0 and audit["kl"] >= 0.0
    # full_quant leaves after the entry layer on every forward
    assert conds["full_quant"]["exit_rate"] == 1.0
    assert conds["full_quant"]["mean_backbone_layers_per_token"] == out["config"]["entry_layer"] + 1
    assert out["river_build"]["river_bytes"] > 0
