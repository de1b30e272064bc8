"""The README stays true, and so do the pages it sends a newcomer to: the paths they name exist, every
benchmark is listed (docs/PERFORMANCE.md), and their Python runs and prints what the text says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
STRATEGIES = (ROOT / "docs" / "STRATEGIES.md").read_text()
PERFORMANCE = (ROOT / "docs" / "PERFORMANCE.md").read_text()
DOCS = {"README.md": README} | {f"docs/{p.name}": p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}


def named_paths(text: str) -> set[str]:
    """The repository paths `text` names: in backticks, as a Markdown link, or as a benchmark run."""
    named = set(re.findall(r"`((?:branchwise|benchmarks|examples|docs)/[\w/.-]+)`", text))
    named |= set(re.findall(r"\]\(((?:branchwise|benchmarks|examples|docs)/[\w/.-]+)\)", text))
    return named | {f"benchmarks/{m}" for m in re.findall(r"python benchmarks/(\w+\.py)", text)}


def test_every_path_the_readme_and_docs_name_exists() -> None:
    assert named_paths(README), "the README names no paths"
    missing = sorted(
        f"{doc}: {p}" for doc, text in DOCS.items() for p in named_paths(text) if not (ROOT / p).exists()
    )
    assert not missing, f"paths named that do not exist: {missing}"


def test_the_readme_links_every_doc() -> None:
    """The README's last section is the way into docs/: a page it does not name is a page nobody finds."""
    unlinked = sorted(doc for doc in DOCS if doc != "README.md" and doc not in named_paths(README))
    assert not unlinked, f"docs the README does not name: {unlinked}"


def test_every_benchmark_is_listed() -> None:
    """docs/PERFORMANCE.md lists every benchmark script (the README links it)."""
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_")}
    listed = set(re.findall(r"python benchmarks/(\w+\.py)", PERFORMANCE))
    assert scripts == listed, (
        f"unlisted: {sorted(scripts - listed)}; listed but absent: {sorted(listed - scripts)}"
    )


def _section_snippets(text: str, heading: str) -> list[str]:
    """The ```python blocks of `text`'s section `heading` (up to the next `## ` heading)."""
    assert heading in text, f"no section {heading!r}"
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def _python_snippet() -> str:
    return _section_snippets(README, "## A strategy, from Python")[0]


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
    """docs/STRATEGIES.md's strategy over actions (moved there from the README's agents section)."""
    out = _run_snippet(_section_snippets(STRATEGIES, "## Typed answers and actions")[0], tmp_path)
    assert re.search(r"^action: add \{'a': \d+, 'b': \d+\} votes: \{'add\(", out, re.M), out
    assert re.search(r"^typed answer: Sum\(total=-?\d+\)$", out, re.M), out


@pytest.mark.slow
def test_agents_langgraph_snippet_calls_the_tool(embedded_dir: Path, tmp_path: Path) -> None:
    out = _run_snippet(_section_snippets(README, "## An agent with a tool")[0], tmp_path)
    assert re.search(r"^\[\{'name': 'calculator', 'args': \{'expression': ", out, re.M), out


@pytest.mark.slow
def test_agents_openai_snippet_round_trips_a_tool_conversation(embedded_dir: Path, tmp_path: Path) -> None:
    """The openai-client snippet as written, against `branchwise serve` on the embedded model (on a
    free port in place of the README's 8000)."""
    from branchwise.backends.hf import HFBackend
    from branchwise.serve import create_app
    from branchwise.serve.runner import serve_in_thread

    code = _section_snippets(README, "## Serving: `branchwise serve` and the openai client")[0]
    assert "http://127.0.0.1:8000/v1" in code
    with serve_in_thread(create_app(HFBackend(embedded_dir))) as url:
        out = _run_snippet(code.replace("http://127.0.0.1:8000", url), tmp_path)
    first, answer = out.splitlines()[:2]
    assert re.fullmatch(r'tool_calls add \{"a": \d+, "b": \d+\}', first), out
    assert answer.strip(), out
