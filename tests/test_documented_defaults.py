"""The defaults docs/SERVING.md states for `branchwise serve`'s options are the command's defaults.

Why a test: the page said ``--prefill-chunk`` defaults to 512 while the command used 128; a default
changes in one place and the sentence describing it stays. Every "`--option` (N unit)" and
"`--option` seconds (N)" of the page is read and compared with the option's default in the command.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

typer = pytest.importorskip("typer")

ROOT = Path(__file__).resolve().parent.parent
UNITS = {"": 1, "s": 1, "tokens": 1, "MiB": 2**20, "GiB": 2**30}
STATED = re.compile(r"`(--[a-z-]+)`(?: [a-z]+)? \((\d+)(?: (MiB|GiB|s|tokens)\b)?")
"""`--opt` (N), `--opt` (N unit), `--opt` seconds (N): a default the page states."""


def stated_defaults(text: str) -> list[tuple[str, float]]:
    return [(opt, int(n) * UNITS[unit]) for opt, n, unit in STATED.findall(text)]


def serve_defaults() -> dict[str, object]:
    from branchwise.cli import app

    serve = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    return {opt: p.default for p in serve.params for opt in p.opts}


def test_serving_md_states_the_serve_command_defaults() -> None:
    stated = stated_defaults((ROOT / "docs" / "SERVING.md").read_text(encoding="utf-8"))
    assert {opt for opt, _ in stated} >= {"--prefill-chunk", "--drain-timeout", "--max-body-bytes"}
    defaults = serve_defaults()
    wrong = [
        f"{opt}: the page says {n}, the command {defaults[opt]}" for opt, n in stated if defaults[opt] != n
    ]
    assert not wrong, "\n".join(wrong)


def test_the_reader_sees_units_and_a_wrong_default() -> None:
    """The reader itself can fail: units scale, and a changed number no longer matches."""
    assert stated_defaults("`--max-body-bytes` (8 MiB) and `--drain-timeout` seconds (30)") == [
        ("--max-body-bytes", 8 * 2**20),
        ("--drain-timeout", 30),
    ]
    assert ("--prefill-chunk", 512) not in serve_defaults().items()
