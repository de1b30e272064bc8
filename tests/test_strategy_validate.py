"""`branchwise strategy validate` reports every problem of a file, not only the first.

Why: a file with a wrong range, a dangling edge and an unknown verifier used to take three runs to
fix, one message each (a wrong field kept the graph from being checked, a graph error kept the
names from being checked).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip("typer")

from typer.testing import CliRunner

from branchwise.cli import app
from branchwise.reasoners.registry import strategy_problems
from branchwise.strategies import self_consistency

runner = CliRunner()

BAD = {
    "name": "bad",
    "nodes": [
        {"kind": "generate", "id": "generate", "n": 0, "temperature": 9},
        {"kind": "score", "id": "score", "verifier": "nope"},
        {"kind": "aggregate", "id": "aggregate", "extractor": "nada"},
    ],
    "edges": [
        {"source": "generate", "target": "missing"},
        {"source": "generate", "target": "score"},
        {"source": "score", "target": "aggregate"},
    ],
}


def test_every_problem_is_listed() -> None:
    problems = strategy_problems(BAD)
    assert [p.split(":")[0] for p in problems] == [
        "nodes.0.generate.n",
        "nodes.0.generate.temperature",
        "graph",
        "nodes[1].verifier 'nope' (score 'score') is not a known verifier; allowed",
        "nodes[2].extractor 'nada' (aggregate 'aggregate') is not a known extractor; allowed",
    ]
    assert "edges[0].target 'missing' is not a node id" in problems[2]
    assert BAD["nodes"][0]["n"] == 0  # the caller's document is left as it was


def test_a_valid_document_has_no_problem() -> None:
    assert strategy_problems(yaml.safe_load(self_consistency(n=2).to_yaml())) == []


def test_validate_prints_each_problem_and_exits_1(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(BAD))
    out = runner.invoke(app, ["strategy", "validate", str(path)])
    assert out.exit_code == 1 and "Traceback" not in out.output
    lines = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 5, out.stderr
    assert all(f"invalid strategy {path}: " in line for line in lines)
