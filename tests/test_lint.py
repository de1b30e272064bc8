"""The code base stays ruff-clean and ruff-formatted: the test command checks it, so CI does too."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is installed by the [test] extra")
def test_ruff_clean() -> None:
    proc = subprocess.run(
        ["ruff", "check", "branchwise", "tests", "benchmarks", "examples"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is installed by the [test] extra")
def test_ruff_formatted() -> None:
    """Formatting too (README's code blocks included), so a diff never mixes style with substance."""
    proc = subprocess.run(["ruff", "format", "--check", "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
