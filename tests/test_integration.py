"""Integration tests on the embedded SmolLM2-135M-Instruct (slow: run in CI, skip with -m 'not slow')."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from branchwise.backends import DecodeParams

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def embedded(embedded_dir):
    from branchwise.backends.hf import HFBackend

    return HFBackend()


def test_embedded_fidelity_exact_none_generate(embedded) -> None:
    """Greedy tokens: share='exact' == share='none' == model.generate() on the real model, B=1 and B=8."""
    params = DecodeParams(max_tokens=12, min_tokens=12)
    for question in ["What is 12 + 7?", "Name a prime number larger than 10."]:
        prompt = embedded.chat_prompt([{"role": "user", "content": question}])
        for b in (1, 8):
            hints = [embedded.encode(f" (attempt {i})") if i % 2 else [] for i in range(b)]
            outs = {}
            for share in ("exact", "none"):
                root = embedded.prefill(prompt)
                kids = embedded.fork(root, b, share=share)
                embedded.release([root])
                embedded.append(kids, hints)
                outs[share] = [g.token_ids for g in embedded.extend(kids, params)]
                embedded.release(kids)
            ref = [embedded.hf_generate([prompt + h], 12, exact_length=True)[0] for h in hints]
            assert outs["exact"] == outs["none"] == ref


def test_self_consistency_answers_on_embedded(embedded) -> None:
    from branchwise.reasoners import Reasoner
    from branchwise.strategies import self_consistency

    result = Reasoner(self_consistency(n=4, max_tokens=48, seed=0), backend=embedded).run("What is 12 + 7?")
    assert len(result.branches) == 4
    assert all(b.text for b in result.branches)
    assert result.kv_stats["tokens_reused"] > 0
    assert embedded.kv_stats().live_nodes == 0


def test_cli_run_on_embedded_model() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "branchwise.cli",
            "run",
            "What is 12 + 7?",
            "--n",
            "4",
            "--max-tokens",
            "32",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(row["branches"]) == 4
    assert row["kv_stats"]["tokens_reused"] > 0


def test_prefix_sharing_benchmark_quick() -> None:
    proc = subprocess.run(
        [sys.executable, "benchmarks/prefix_sharing.py", "--quick"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["benchmark"] == "prefix_sharing"
    assert out["greedy_tokens_match"] == {
        "exact_vs_none": True,
        "exact_vs_hf_generate": True,
        "copy_vs_none": True,
    }
    assert out["kv_peak_bytes"]["exact"] < out["kv_peak_bytes"]["none"]
