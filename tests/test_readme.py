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
