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
