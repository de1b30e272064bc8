"""Every Python snippet of README.md and docs/*.md is run, or is listed here (`NOT_RUN`) with why not.

Why: a snippet that fails as written is the first thing a newcomer meets (the DSPy one once raised
`AdapterParseError` on the embedded model). The fast test only checks that each snippet is
accounted for, so a new one cannot slip in untested; the slow tests run them on the embedded
model, each document's snippets in order as one script (later snippets use names earlier ones
define, as a reader would), after a preamble defining what the text leaves to the reader.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def snippets(doc: str) -> list[str]:
    """The ```python blocks of `doc` (a path under the repo), dedented (some sit in bullets)."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    return [
        textwrap.dedent(m.group(2)) for m in re.finditer(r"^( *)```python\n(.*?)^\1```", text, re.M | re.S)
    ]


# README.md's snippets 0-3 run in tests/test_readme.py (with checks of what they print).
README_ELSEWHERE = {0, 1, 2, 3}

# Names a snippet uses that its document leaves to the reader, defined just before it runs.
PREAMBLES: dict[tuple[str, int], str] = {
    ("README.md", 5): """
from branchwise import HFBackend, Reasoner
from branchwise.strategies import best_of_n

backend = HFBackend()
""",
    ("docs/INTEGRATIONS.md", 2): '''
from typing import Literal

import pydantic


def search(query: str) -> str:
    """Search the web for `query`."""
    return "no results"
''',
    ("docs/INTEGRATIONS.md", 9): '''
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as '12 * 7'."""
    return str(eval(expression, {"__builtins__": {}}))


def lookup(title: str) -> str:
    """The first sentence of the corpus entry `title`."""
    return ""
''',
}

# Where a snippet is shrunk for the test only (the README's accel snippet runs 8 branches of the
# default 256 tokens twice over: its point is the settings, not the run).
EDITS: dict[tuple[str, int], tuple[str, str]] = {
    ("README.md", 5): ("best_of_n(n=8)", "best_of_n(n=2, max_tokens=16)"),
}

# Snippets not run yet, each with why. SERVING.md's talk to `branchwise serve` at 127.0.0.1:8000 (a
# gpu-box for one): running them means a server in the test and a rewritten URL, as
# tests/test_readme.py does for the README's openai snippet; its tool snippet also assumes the
# model calls under tool_choice="auto", which the embedded one rarely does.
NOT_RUN: dict[str, str] = {"docs/SERVING.md": "client snippets of a running server"}

# Every document's snippet count (a new snippet fails the fast test until
# it is counted here, which is when someone looks at whether it runs). README.md and
# INTEGRATIONS.md run all of theirs.
COUNTS = {"README.md": 6, "docs/INTEGRATIONS.md": 10, "docs/SERVING.md": 7, "docs/ARCHITECTURE.md": 0}


def test_every_snippet_is_accounted_for() -> None:
    docs = {"README.md", *(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))}
    assert {d: len(snippets(d)) for d in sorted(docs)} == dict(sorted(COUNTS.items()))


def script(doc: str, skip: set[int] = frozenset()) -> str:  # type: ignore[assignment]
    """One script of `doc`'s snippets in order (less `skip`), with preambles and edits applied."""
    parts = []
    for i, code in enumerate(snippets(doc)):
        if i in skip:
            continue
        old, new = EDITS.get((doc, i), ("", ""))
        if old:
            assert old in code, f"{doc} snippet {i} no longer holds {old!r}"
            code = code.replace(old, new)
        parts.append(f"# --- {doc} snippet {i}\n{textwrap.dedent(PREAMBLES.get((doc, i), ''))}\n{code}")
    return "\n".join(parts)


def run_script(code: str, tmp_path: Path) -> str:
    """Run `code` as a script in a fresh interpreter; its stdout, after asserting it succeeded."""
    path = tmp_path / "snippets.py"
    path.write_text(code)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=1800, cwd=tmp_path
    )
    print(f"{time.perf_counter() - start:.0f} s")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
def test_readme_rest_runs(embedded_dir: Path, tmp_path: Path) -> None:
    run_script(script("README.md", README_ELSEWHERE), tmp_path)


@pytest.mark.slow
def test_integrations_snippets_run(embedded_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("dspy")
    pytest.importorskip("langgraph")
    out = run_script(script("docs/INTEGRATIONS.md"), tmp_path)
    assert out.strip(), out
