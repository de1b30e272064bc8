"""`examples/compose_graph.py`, the strategy composed from nodes in Python: its graph without a model
(validated, compiled to the plan its docstring describes, round-tripped through the YAML it prints),
then the script end to end on the embedded model (slow)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from branchwise.strategies import LoopStep, Strategy

ROOT = Path(__file__).resolve().parent.parent


def _example() -> ModuleType:
    """Import the script as a module, with `examples/` on the path for its `_cli` import."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        spec = importlib.util.spec_from_file_location("compose_graph", ROOT / "examples" / "compose_graph.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "examples"))


def test_the_composed_graph_compiles_to_a_loop_over_score_keep_expand() -> None:
    strategy = _example().confident_steps(first=4, keep=2, expand=3, steps=3, step_tokens=16)
    plan = strategy.compile()
    assert [step.node.id for step in plan.steps] == ["first", "search", "vote"]
    loop = plan.steps[1]
    assert isinstance(loop, LoopStep) and loop.node.max_iterations == 2
    assert [op.node.id for op in loop.body] == ["score", "keep", "next"]
    counts = {node.id: getattr(node, "k", getattr(node, "n", None)) for node in strategy.nodes}
    assert (counts["first"], counts["keep"], counts["next"]) == (4, 2, 3)
    assert Strategy.from_yaml(strategy.to_yaml()) == strategy


def test_a_bad_setting_is_refused_with_the_field_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    example = _example()
    with pytest.raises(ValueError, match="max_iterations"):
        example.confident_steps(first=4, keep=2, expand=2, steps=1, step_tokens=16)
    monkeypatch.setattr(sys, "argv", ["compose_graph.py", "--steps", "1"])
    with pytest.raises(SystemExit) as exit_info:
        example.main()  # refused before any model loads
    assert exit_info.value.code == 2
    assert "--steps must be at least 2" in capsys.readouterr().err


@pytest.mark.slow
def test_the_script_answers_on_the_embedded_model(embedded_dir: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "examples/compose_graph.py",
            "--steps",
            "2",
            "--step-tokens",
            "16",
            "--threads",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "name: confident_steps" in proc.stdout, proc.stdout  # the YAML
    assert "plan: first -> search -> score -> keep -> next -> vote" in proc.stdout, proc.stdout
    assert re.search(r"^answer: .+ votes: \{", proc.stdout, re.M), proc.stdout
    assert re.search(r"^\d+ branches in [\d.]+ s; tokens computed \d+, reused \d+$", proc.stdout, re.M)
