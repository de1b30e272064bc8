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


def test_river_and_skipkv_under_strategies_on_embedded(embedded) -> None:
    """Both accelerations act under self-consistency and beam search on the real model, and the
    accel-free greedy path is untouched afterwards (River at a threshold nothing passes is exact)."""
    from branchwise.backends.accel import Accel, RiverConfig, SkipKVConfig
    from branchwise.reasoners import Reasoner
    from branchwise.strategies import beam_search, self_consistency

    question = "What is 12 + 7?"
    sc = self_consistency(n=4, max_tokens=48, seed=0)
    tree = beam_search(
        width=4, depth=2, verifier="confidence", max_step_tokens=24, step_delimiter="\n", seed=0
    )
    skip = Accel(skipkv=SkipKVConfig(budget=12, interval=8, window=4))
    for strategy in (sc, tree):
        result = Reasoner(strategy, backend=embedded, accel=skip).run(question)
        assert result.kv_stats["skipkv_evicted_tokens"] > 0 and all(b.text for b in result.branches)
        result = Reasoner(strategy, backend=embedded, accel=Accel(river=RiverConfig())).run(question)
        assert result.kv_stats["river_exits"] > 0
        assert result.kv_stats["river_decode_backbone_layers"] < 30 * result.kv_stats["river_decode_tokens"]
    greedy = Reasoner(self_consistency(n=2, max_tokens=16, temperature=0.0), backend=embedded, accel=Accel())
    plain = greedy.run(question)
    strict = Reasoner(greedy.strategy, backend=embedded, accel=Accel(river=RiverConfig(threshold=1.0))).run(
        question
    )
    assert [b.text for b in strict.branches] == [b.text for b in plain.branches]
    assert embedded.kv_stats().live_nodes == 0
    embedded.accel = Accel()


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
