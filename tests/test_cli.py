"""The `branchwise` CLI: --help everywhere, strategy inspection, and `run` on a tiny model."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from branchwise.cli import app
from branchwise.strategies import self_consistency

runner = CliRunner()


def test_help_on_every_command() -> None:
    commands = ([], ["run"], ["strategy"], ["strategy", "show"], ["strategy", "validate"], ["steering"])
    for args in (*commands, ["steering", "build"], ["calibrate"], ["eval"], ["report"]):
        result = runner.invoke(app, [*args, "--help"])
        assert result.exit_code == 0, result.output
        assert "Usage" in result.output


def test_strategy_show_and_validate(tmp_path) -> None:
    result = runner.invoke(app, ["strategy", "show", "best-of-n", "--n", "4"])
    assert result.exit_code == 0, result.output
    assert "verifier: judge" in result.output
    good = tmp_path / "sc.yaml"
    good.write_text(self_consistency(n=3).to_yaml())
    assert runner.invoke(app, ["strategy", "validate", str(good)]).exit_code == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(good.read_text().replace("n: 3", "n: 0"))
    out = runner.invoke(app, ["strategy", "validate", str(bad)])
    assert out.exit_code == 1
    assert "n" in out.output and "greater than or equal to 1" in out.output


def test_run_json_on_tiny_model(tiny_llama_dir) -> None:
    result = runner.invoke(
        app,
        ["run", "What is 12 + 7?", "--n", "3", "--max-tokens", "6", "--model", str(tiny_llama_dir), "--json"],
    )
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout.strip().splitlines()[-1])
    assert row["question"] == "What is 12 + 7?"
    assert len(row["branches"]) == 3


def test_run_rejects_out_of_range_n(tiny_llama_dir) -> None:
    result = runner.invoke(app, ["run", "q", "--n", "0", "--model", str(tiny_llama_dir)])
    assert result.exit_code != 0
    assert "--n" in result.output


def test_run_with_skipkv_reports_in_notes(tiny_llama_dir) -> None:
    args = [
        "run",
        "What is 12 + 7?",
        "--n",
        "2",
        "--max-tokens",
        "6",
        "--model",
        str(tiny_llama_dir),
        "--json",
    ]
    result = runner.invoke(app, [*args, "--skipkv-budget", "16"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout.strip().splitlines()[-1])
    assert any(note.startswith("skipkv: no branch") for note in row["notes"])  # 6 tokens never outgrow 16
    result = runner.invoke(app, [*args, "--steer"])
    assert result.exit_code != 0
    assert "--skipkv-budget" in result.output
