"""The README stays true: the paths it names exist, every benchmark is listed, its Python runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_every_path_the_readme_names_exists() -> None:
    named = set(re.findall(r"`((?:branchwise|benchmarks|examples|docs)/[\w/.-]+)`", README))
    named |= {f"benchmarks/{m}" for m in re.findall(r"python benchmarks/(\w+\.py)", README)}
    assert named, "the README names no paths"
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"README names paths that do not exist: {missing}"


def test_every_benchmark_is_listed() -> None:
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_")}
    listed = set(re.findall(r"python benchmarks/(\w+\.py)", README))
    assert scripts == listed, (
        f"unlisted: {sorted(scripts - listed)}; listed but absent: {sorted(listed - scripts)}"
    )


def _python_snippet() -> str:
    section = README.split("## In Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


@pytest.mark.slow
def test_python_snippet_runs_as_a_script_and_prints_its_result(embedded_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(_python_snippet())
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=900, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^answer: .+ votes: \{", proc.stdout, re.M), proc.stdout
    assert re.search(
        r"^8 branches in [\d.]+ s; tokens computed \d+, reused \d+; KV peak", proc.stdout, re.M
    ), proc.stdout


def _agent_snippets() -> list[str]:
    section = README.split("## Agents with tools", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def _run_snippet(code: str, tmp_path: Path) -> str:
    script = tmp_path / "snippet.py"
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=900, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_agents_strategy_snippet_votes_on_a_call_and_types_an_answer(
    embedded_dir: Path, tmp_path: Path
) -> None:
    out = _run_snippet(_agent_snippets()[0], tmp_path)
    assert re.search(r"^action: add \{'a': \d+, 'b': \d+\} votes: \{'add\(", out, re.M), out
    assert re.search(r"^typed answer: Sum\(total=-?\d+\)$", out, re.M), out


@pytest.mark.slow
def test_agents_langgraph_snippet_calls_the_tool(embedded_dir: Path, tmp_path: Path) -> None:
    out = _run_snippet(_agent_snippets()[1], tmp_path)
    assert re.search(r"^\[\{'name': 'calculator', 'args': \{'expression': ", out, re.M), out


@pytest.mark.slow
def test_agents_openai_snippet_round_trips_a_tool_conversation(embedded_dir: Path, tmp_path: Path) -> None:
    """The openai-client snippet as written, against `branchwise serve` on the embedded model (on a
    free port in place of the README's 8000)."""
    from branchwise.backends.hf import HFBackend
    from branchwise.serve import create_app
    from branchwise.serve.runner import serve_in_thread

    code = _agent_snippets()[2]
    assert "http://127.0.0.1:8000/v1" in code
    with serve_in_thread(create_app(HFBackend(embedded_dir))) as url:
        out = _run_snippet(code.replace("http://127.0.0.1:8000", url), tmp_path)
    first, answer = out.splitlines()[:2]
    assert re.fullmatch(r'tool_calls add \{"a": \d+, "b": \d+\}', first), out
    assert answer.strip(), out
