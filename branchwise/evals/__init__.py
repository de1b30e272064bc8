"""Eval harness: datasets with answer extraction and scoring, suite configs, a resumable runner
that writes one JSONL row per (cell, problem), and reports (markdown + PNG plots).

Submodules import their heavy dependencies (torch, matplotlib, reasoning-gym, HF `datasets`) lazily,
so `branchwise eval --help` and suite validation stay fast and work without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["SuiteConfig", "load_suite", "run_suite", "write_report"]

if TYPE_CHECKING:
    from branchwise.evals.harness import run_suite
    from branchwise.evals.report import write_report
    from branchwise.evals.suite import SuiteConfig, load_suite


def __getattr__(name: str) -> Any:
    if name in ("SuiteConfig", "load_suite"):
        from branchwise.evals import suite

        return getattr(suite, name)
    if name == "run_suite":
        from branchwise.evals.harness import run_suite

        return run_suite
    if name == "write_report":
        from branchwise.evals.report import write_report

        return write_report
    raise AttributeError(f"module 'branchwise.evals' has no attribute {name!r}")
