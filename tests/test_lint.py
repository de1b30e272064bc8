"""The code base stays ruff-clean, ruff-formatted and mypy-clean: the test command checks it, so CI does too."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
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


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is installed by the [test] extra")
def test_mypy_clean() -> None:
    """The package type-checks under pyproject.toml's [tool.mypy] (its pydantic plugin included).

    Run with this interpreter so mypy sees the same packages (and plugin) as the tests; its cache
    (`.mypy_cache`, git-ignored) makes a rerun take seconds instead of minutes."""
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "pyproject.toml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
