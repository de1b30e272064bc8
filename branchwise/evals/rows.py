"""A run directory's files: ``results.jsonl`` (one row per problem run, what each row holds) and
``suite.json`` (the configuration the rows belong to), written so that a run resumes exactly.

Why its own module: the rows file is the harness's contract with everything after it. The runner
appends to it, the report and the CLI read it back, and a resumed run trusts it to say what is done,
so its format and durability rules are kept in one place, apart from how problems get run.

Durability: each row is appended to ``results.jsonl`` as one line and flushed and fsync'ed as soon as
its problem is scored, so an interruption (Ctrl-C, SIGKILL, a crash) loses at most the problem in
flight. On restart the rows already on disk are keyed by ``(cell, problem_id)`` and skipped; a last
line cut off by a kill (no trailing newline, or not valid JSON) is detected and truncated away before
anything is appended, so the final file holds every key exactly once. ``suite.json`` records the
suite's fingerprint, so rows of one configuration are never resumed into another by mistake.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
from pathlib import Path
from typing import Any

from branchwise.evals.datasets import Problem, Task
from branchwise.evals.suite import Cell, SuiteConfig

__all__ = [
    "CONFIG_FILE",
    "ROWS_FILE",
    "RowWriter",
    "SuiteMismatch",
    "read_rows",
    "repair_tail",
    "result_row",
    "write_config",
]

log = logging.getLogger(__name__)

ROWS_FILE = "results.jsonl"
CONFIG_FILE = "suite.json"
_RESULT_SKIP = {
    "question",
    "answer",
    "strategy",
    "share",
    "votes",
    "branches",
    "tree",
    "timings",
    "kv_stats",
    "notes",
}


class SuiteMismatch(RuntimeError):
    """The run directory holds results of a different suite configuration."""


def repair_tail(path: Path) -> bool:
    """Truncate a last line that a kill cut short (no newline, or not JSON); True if it did."""
    if not path.exists() or path.stat().st_size == 0:
        return False
    with path.open("rb+") as f:
        data = f.read()
        end = len(data)
        keep = end
        if not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1  # 0 when the only line is partial
        else:
            last_start = data.rfind(b"\n", 0, end - 1) + 1
            try:
                json.loads(data[last_start:end])
            except ValueError:
                keep = last_start
        if keep == end:
            return False
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    log.warning("dropped a partial last line from %s (%d bytes)", path, end - keep)
    return True


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """All complete rows of a rows file (a partial last line is ignored, not repaired).

    A corrupt line in the middle cannot come from an interrupted append, so it raises.
    """
    p = Path(path)
    if p.is_dir():
        p = p / ROWS_FILE
    if not p.exists():
        return []
    raw = p.read_bytes()
    lines = raw.split(b"\n")
    complete, tail = lines[:-1], lines[-1]
    rows = []
    for i, line in enumerate(complete):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as exc:
            if i == len(complete) - 1 and not tail:
                break  # a newline-terminated but garbled last line: also a partial write
            raise ValueError(f"{p}:{i + 1}: corrupt row ({exc})") from exc
    return rows


class RowWriter:
    """Append-only JSONL writer that makes each row durable before returning."""

    def __init__(self, path: Path) -> None:
        self._f = path.open("a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        self._f.write(json.dumps(row, default=str, ensure_ascii=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def result_row(
    cell: Cell, problem: Problem, task: Task, result: Any | None, error: str | None, wall: float
) -> dict[str, Any]:
    """The row of one run of `problem` in `cell`: its scored answer and costs, or the error that
    stopped it (`result` None), stamped with the time it finished."""
    row: dict[str, Any] = {
        "cell": cell.id,
        "model": cell.model.display_name,
        "dataset": cell.dataset.display_name,
        "strategy": cell.strategy.label,
        "accel": cell.accel.label,
        "problem_id": problem.id,
        "gold": problem.gold,
    }
    if result is None:
        row.update(answer=None, score=0.0, correct=False, error=error, latency_s=None, wall_s=wall)
    else:
        text = next(
            (b.text for b in result.branches if b.selected),
            result.branches[0].text if result.branches else "",
        )
        notes = list(result.notes)
        try:
            score = float(task.score(problem, result.answer, text))
        except Exception as exc:  # a checker that chokes on a malformed answer: wrong, and said so
            score = 0.0
            notes.append(f"scorer raised {type(exc).__name__}: {exc}; scored 0")
        kv = result.kv_stats
        row.update(
            answer=result.answer,
            score=score,
            correct=score >= 1.0,
            error=None,
            latency_s=float(result.timings.get("total", wall)),
            wall_s=wall,
            tokens_generated=sum(len(n.token_ids) for n in result.tree if n.parent is not None),
            tokens_computed=kv.get("tokens_computed"),
            tokens_reused=kv.get("tokens_reused"),
            forward_calls=kv.get("forward_calls"),
            kv_peak_bytes=kv.get("peak_bytes"),
            n_branches=len(result.branches),
            support=result.support,
            votes=result.votes,
            timings=result.timings,
            kv_stats=kv,
            notes=notes,
            text=text[:4000],
        )
        # optional per-acceleration fields of the result (verify_calls, verify_skipped, cgee_flip...)
        for key, value in result:
            if (
                key not in _RESULT_SKIP
                and key not in row
                and (value is None or isinstance(value, int | float | bool | str))
            ):
                row[key] = value
    row["finished_at"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return row


def write_config(out_dir: Path, suite: SuiteConfig, force: bool, expected_rows: int) -> None:
    """Record `suite` (and its fingerprint) in ``suite.json``; a directory holding another
    configuration's rows raises `SuiteMismatch` unless `force`."""
    path = out_dir / CONFIG_FILE
    record = {
        "fingerprint": suite.fingerprint(),
        "expected_rows": expected_rows,
        "suite": suite.model_dump(mode="json", by_alias=True),
    }
    if path.exists():
        old = json.loads(path.read_text())
        if old.get("fingerprint") != record["fingerprint"] and not force:
            raise SuiteMismatch(
                f"{out_dir} holds results of a different configuration of suite "
                f"{old.get('suite', {}).get('name')!r}; use another --out, or --force to add to it "
                "(rows are keyed by cell and problem, so nothing is duplicated)"
            )
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, path)
