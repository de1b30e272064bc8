"""The `branchwise` CLI: --help everywhere, strategy inspection, and `run` on a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from branchwise.backends.accel import (
    Accel,
    ASKSConfig,
    CGEEConfig,
    ProbeConfig,
    RiverConfig,
    SkipKVConfig,
    SteeringConfig,
)
from branchwise.cli import app
from branchwise.cli_accel import AccelCommand, accel_options, bounds_text
from branchwise.strategies import PREBUILT, Strategy, best_of_n, self_consistency

runner = CliRunner()


def test_help_on_every_command() -> None:
    commands = ([], ["run"], ["strategy"], ["strategy", "show"], ["strategy", "validate"], ["steering"])
    for args in (*commands, ["steering", "build"], ["calibrate"], ["eval"], ["report"], ["serve"]):
        result = runner.invoke(app, [*args, "--help"])
        assert result.exit_code == 0, result.output
        assert "Usage" in result.output


def test_python_dash_m_runs_the_cli() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "branchwise", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Usage: branchwise")


@pytest.mark.parametrize("name", list(PREBUILT))
@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_strategy_show_loads_back(name: str, fmt: str, tmp_path: Path) -> None:
    """What `show` prints on stdout is a strategy file (the plan goes to stderr)."""
    result = runner.invoke(app, ["strategy", "show", name, "--n", "4", "--format", fmt])
    assert result.exit_code == 0, result.output
    path = tmp_path / f"s.{fmt}"
    path.write_text(result.stdout)
    loaded = Strategy.from_json(result.stdout) if fmt == "json" else Strategy.from_yaml(result.stdout)
    assert loaded == PREBUILT[name](branches=4)
    assert "plan:" in result.stderr and "plan:" not in result.stdout
    check = runner.invoke(app, ["strategy", "validate", str(path)])
    assert check.exit_code == 0, check.output


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


def test_depth_sets_the_steps_of_a_step_search(tiny_llama_dir) -> None:
    """`--depth 2` gives two generate levels (one loop iteration after the first step)."""
    from branchwise.cli import _load_strategy

    for name in ("beam-search", "rebase", "ets", "dvts"):
        loops = [n for n in _load_strategy(name, depth=2).compile().nodes() if n.kind == "loop"]
        assert [n.max_iterations for n in loops] == [1], name
    result = runner.invoke(
        app,
        [
            *("run", "What is 12 + 7?", "--strategy", "beam-search", "--n", "2", "--depth", "2"),
            *("--max-tokens", "4", "--model", str(tiny_llama_dir), "--json"),
        ],
    )
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout.strip().splitlines()[-1])
    assert row["question"] == "What is 12 + 7?"


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


def test_validate_rejects_what_would_fail_at_run_time(tmp_path: Path) -> None:
    """Unknown verifier and extractor names, negative seeds, broken YAML: exit 1, one line each, no traceback."""
    doc = yaml.safe_load(best_of_n(n=2).to_yaml())
    cases = {
        "verifier.yaml": ("nodes", 1, "verifier", "nope", "nodes[1].verifier 'nope'"),
        "extractor.yaml": ("nodes", 3, "extractor", "nope", "nodes[3].extractor 'nope'"),
        "seed.yaml": (
            "nodes",
            0,
            "seed",
            -1,
            "nodes.0.generate.seed: Input should be greater than or equal to 0",
        ),
    }
    for file, (_, index, key, value, expected) in cases.items():
        bad = json.loads(json.dumps(doc))
        bad["nodes"][index][key] = value
        path = tmp_path / file
        path.write_text(yaml.safe_dump(bad))
        out = runner.invoke(app, ["strategy", "validate", str(path)])
        assert out.exit_code == 1, out.output
        assert expected in out.stderr and "Traceback" not in out.output
    for text, expected in [("name: x\nnodes: [\n", "invalid YAML at line 3"), ("", "empty document")]:
        path = tmp_path / "broken.yaml"
        path.write_text(text)
        out = runner.invoke(app, ["strategy", "validate", str(path)])
        assert out.exit_code == 1 and expected in out.stderr and "Traceback" not in out.output


@pytest.fixture
def strategy_files(tmp_path: Path) -> dict[str, str]:
    good = self_consistency(n=2).to_yaml()
    files = {
        "malformed": "name: x\nnodes: [\n",
        "empty": "",
        "invalid": good.replace("n: 2", "n: 0"),
        "verifier": best_of_n(n=2).to_yaml().replace("verifier: judge", "verifier: nope"),
        "good": good,
    }
    paths = {}
    for name, text in files.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        paths[name] = str(path)
    paths["dir"] = str(tmp_path)
    return paths


#: Bad command lines and the words their one-line error must contain (the option and what is wrong).
BAD_COMMAND_LINES: list[tuple[list[str], str]] = [
    (["run"], "Missing argument"),
    (["run", ""], "question 1 is empty"),
    (["run", "   "], "question 1 is empty"),
    (["run", "q", "--n", "0"], "'--n' / '--branches': 0 is not in the range 1<=x<=4096"),
    (["run", "q", "--n", "5000"], "'--n' / '--branches': 5000 is not in the range"),
    (["run", "q", "--n", "abc"], "'--n' / '--branches': Input should be a valid integer"),
    (["run", "q", "--temperature", "-1"], "'--temperature': -1.0 is not in the range 0.0<=x<=5.0"),
    (["run", "q", "--max-tokens", "0"], "'--max-tokens': 0 is not in the range"),
    (["run", "q", "--seed", "-1"], "'--seed': -1 is not in the range"),
    (["run", "q", "--seed", str(10**30)], f"'--seed': {10**30} is not in the range 0<=x<={2**64 - 1}"),
    (["run", "q", "--share", "fuzzy"], "'--share': Value error, 'fuzzy' is not one of 'none', 'exact'"),
    (["run", "q", "--strategy", "nope"], "--strategy: 'nope' is neither a prebuilt strategy"),
    (["run", "q", "--strategy", "{malformed}"], "invalid YAML at line 3, column 1"),
    (["run", "q", "--strategy", "{empty}"], "found an empty document"),
    (
        ["run", "q", "--strategy", "{invalid}"],
        "nodes.0.generate.n: Input should be greater than or equal to 1",
    ),
    (
        ["run", "q", "--strategy", "{verifier}"],
        "nodes[1].verifier 'nope' (score 'score') is not a known verifier",
    ),
    (["run", "q", "--strategy", "best-of-n", "--verifier", "nope"], "'nope' is not a verifier; allowed: "),
    (["run", "q", "--verifier", "judge"], "self_consistency chooses its own verifier"),
    (["run", "q", "--strategy", "{good}", "--n", "3"], "a strategy file carries its own"),
    (
        ["run", "q", "--strategy", "beam-search", "--n", "70000"],
        "'--n' / '--branches': 70000 is not in the range",
    ),
    (["run", "q", "--asks-tau", "2"], "'--asks-tau': 2.0 is not in the range 0.0<=x<=1.0"),
    (["run", "q", "--rsbcm-capacity", "0"], "'--rsbcm-capacity': 0 is not in the range 1<=x<=10000000"),
    (["run", "q", "--river-threshold", "1.5"], "'--river-threshold': 1.5 is not in the range"),
    (["run", "q", "--skipkv-budget", "1"], "'--skipkv-budget': 1 is not in the range 2<=x<=10000000"),
    (["run", "q", "--steer"], "--steer needs --skipkv-budget"),
    (
        ["run", "q", "--model", "/nonexistent/model"],
        "--model: '/nonexistent/model' is neither a local model folder",
    ),
    (["run", "q", "--bogus"], "No such option: --bogus"),
    (["run", "q", "--device", "gpu"], "--device: device='gpu' is not one of 'auto', 'cpu', 'cuda', 'cuda:N'"),
    (["run", "q", "--device", "cuda:99"], "--device: device='cuda:99': "),  # no CUDA, or no 100th GPU
    (["run", "q", "--dtype", "fp8"], "--dtype: dtype='fp8' is not one of 'auto', 'float32'"),
    (["calibrate", "--dtype", "int4"], "--dtype: dtype='int4' is not one of"),
    (["steering", "build", "--device", "tpu"], "--device: device='tpu' is not one of"),
    (["strategy", "show", "nope"], "'nope' is neither a prebuilt strategy"),
    (["run", "q", "--strategy", "beam-serch"], "did you mean 'beam-search'?"),
    (["run", "q", "--depth", "3"], "self_consistency answers in one step; it takes no depth"),
    (["run", "q", "--strategy", "beam-search", "--depth", "0"], "'--depth': 0 is not in the range"),
    (
        ["strategy", "show", "best-of-n", "--format", "xml"],
        "'--format': Value error, 'xml' is not one of 'yaml', 'json'",
    ),
    (["strategy", "show", "best-of-n", "--n", "0"], "'--n' / '--branches': 0 is not in the range"),
    (["strategy", "validate", "/nonexistent.yaml"], "'path': file '/nonexistent.yaml' does not exist"),
    (["strategy", "validate", "{dir}"], "is a directory"),
    (["strategy", "nope"], "No such command 'nope'"),
    (["calibrate", "--task", "nope"], "--task: 'nope' is not a reasoning-gym task"),
    (["calibrate", "--n", "1"], "'--n': 1 is not in the range"),
    (["steering", "build", "--task", "nope"], "--task: 'nope' is not a reasoning-gym task"),
    (["steering", "build", "--samples", "0"], "'--samples': 0 is not in the range"),
    (["eval", "/nonexistent.yaml", "--out", "{dir}"], "'suite': file '/nonexistent.yaml' does not exist"),
    (["eval", "{malformed}", "--out", "{dir}"], "SUITE: suite {malformed}: invalid YAML at line 3, column 1"),
    (
        ["eval", "{empty}", "--out", "{dir}"],
        "must be a mapping with name, datasets, strategies...; found an empty document",
    ),
    (["eval", "{good}", "--out", "{dir}", "--limit", "0"], "'--limit': 0 is not in the range x>=1"),
    (["eval", "{good}"], "Missing option '--out'"),
    (["report", "/nonexistent"], "'run_dir': dir '/nonexistent' does not exist"),
    (["serve", "--port", "99999"], "'--port': 99999 is not in the range 0<=x<=65535"),
    (["serve", "--kv-layout", "heap"], "--kv-layout: kv_layout='heap' is not one of 'tails', 'pages'"),
]


@pytest.mark.parametrize(
    ("args", "expected"), BAD_COMMAND_LINES, ids=lambda v: " ".join(v) if isinstance(v, list) else ""
)
def test_bad_command_line_exits_2_with_one_line(
    args: list[str], expected: str, strategy_files: dict[str, str]
) -> None:
    args = [a.format(**strategy_files) for a in args]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), result.exception  # no traceback
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    assert expected.format(**strategy_files) in errors[0], errors[0]


def _capture_accel(*args: str) -> tuple[int, str, list[Accel]]:
    """Parse ``args`` with the generated acceleration options and return the `Accel` they build."""
    seen: list[Accel] = []

    def command(accel: Accel) -> None:
        seen.append(accel)

    app = typer.Typer(rich_markup_mode=None)
    app.command(cls=AccelCommand)(accel_options()(command))
    result = runner.invoke(app, list(args))
    return result.exit_code, result.output, seen


def test_run_help_lists_every_setting_of_every_acceleration_with_its_range() -> None:
    """The options come from the registry: each acceleration a section, each field an option whose
    help carries the field's range (nothing in the CLI names an acceleration)."""
    out = runner.invoke(app, ["run", "--help"], terminal_width=400).output
    records: dict[str, str] = {}  # each option's help, by its first flag
    for line in out.splitlines():
        if line.startswith("  --"):
            flag, _, text = line.strip().partition(" ")
            records[flag] = text
        elif line.startswith("    ") and records:
            records[flag] += " " + line.strip()
    for name, config in Accel.configs().items():
        assert f"Acceleration {name}:" in out
        for field, info in config.model_fields.items():
            flag = config.cli_names.get(field, f"--{name}-{field.replace('_', '-')}")
            assert flag in records, flag
            if (allowed := bounds_text(info)) is not None:
                assert f"[{allowed}" in records[flag], (flag, records[flag])


def test_acceleration_options_build_the_accel() -> None:
    code, output, seen = _capture_accel(
        *("--cgee-level2", "--no-cgee-level1", "--river-bits", "4", "--river-head", "backbone"),
        *("--skipkv-budget", "16", "--steer", "--steer-gamma", "0.5", "--skipkv-keywords", "Hmm"),
        *("--asks", "--probe-override", "share"),
    )
    assert code == 0, output
    assert seen == [
        Accel(
            asks=ASKSConfig(),
            probe=ProbeConfig(override="share"),
            cgee=CGEEConfig(level1=False, level2=True),
            river=RiverConfig(bits=4, head="backbone"),
            skipkv=SkipKVConfig(budget=16, keywords=("Hmm",), steering=SteeringConfig(gamma=0.5)),
        )
    ]
    assert _capture_accel()[2] == [Accel()]
    assert _capture_accel("--no-cgee")[2] == [Accel()]


ACCEL_ERRORS: list[tuple[list[str], str]] = [
    (["--no-cgee", "--cgee-level2"], "--no-cgee turns it off, but --cgee-level2 sets it"),
    (["--steer-gamma", "0.5"], "--steer-gamma needs --skipkv-budget"),
    (["--skipkv-budget", "6", "--skipkv-window", "10"], "window=10 must not exceed budget=6"),
    (["--rsbcm", "--skipkv-budget", "8"], "these accelerations cannot run together: "),
    (["--cgee-theta", "0"], "'--cgee-theta': 0.0 is not in the range 0.0<x<=100.0"),
    (["--river-bits", "2"], "'--river-bits'"),
]


@pytest.mark.parametrize(
    ("args", "expected"), ACCEL_ERRORS, ids=lambda v: " ".join(v) if isinstance(v, list) else ""
)
def test_bad_acceleration_options_name_the_option(args: list[str], expected: str) -> None:
    code, output, seen = _capture_accel(*args)
    assert code == 2 and not seen, output
    errors = [line for line in output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and expected in errors[0], output


def test_run_prints_the_answer_the_vote_the_summary_and_the_notes(tiny_llama_dir) -> None:
    args = ["run", "What is 12 + 7?", "--n", "2", "--max-tokens", "4", "--model", str(tiny_llama_dir)]
    result = runner.invoke(app, [*args, "--skipkv-budget", "16"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for shown in ("answer:", "vote", "total time", "KV peak", "tokens computed / reused", "branches"):
        assert shown in result.output, shown
    assert "note: skipkv: no branch held more than 16" in result.output


def test_a_guessed_branches_option_is_pointed_at_branches() -> None:
    """``--branches`` (the knob's name, and the server's ``branchwise.branches``) is ``--n``'s other
    name, so a guess like ``--n-branches`` is told about it first, not about an acceleration flag."""
    out = runner.invoke(app, ["run", "x", "--n-branches", "3"])
    assert out.exit_code == 2
    assert "Possible options: --branches" in out.output
    shown = runner.invoke(app, ["strategy", "show", "self-consistency", "--branches", "4"])
    assert shown.exit_code == 0 and "  n: 4" in shown.stdout


def _rows(table: object) -> list[str]:
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text().splitlines()


@pytest.mark.parametrize("cgee", [False, True])
def test_the_cgee_row_shows_only_when_cgee_is_on(cgee: bool) -> None:
    """A verifier's calls are shown either way; the CGEE skip count only where CGEE could skip."""
    from branchwise.cli import _summary
    from branchwise.reasoners.result import ReasoningResult

    result = ReasoningResult(
        question="q",
        answer="1",
        strategy="beam",
        share="exact",
        branches=[],
        tree=[],
        timings={"total": 1.0},
        kv_stats={"peak_bytes": 0, "tokens_computed": 5, "tokens_reused": 0},
        verify_calls=2,
    )
    text = "\n".join(_rows(_summary(result, cgee=cgee)))
    assert ("verify skipped (CGEE)" in text) is cgee
    assert ("verify calls" in text) is not cgee
