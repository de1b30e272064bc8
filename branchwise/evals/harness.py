"""Run an eval suite: every problem in every cell, one JSONL row each, resumable after a kill.

What a row holds and how the rows file stays exact across kills (durable appends, a cut-off last
line repaired, resume keyed by ``(cell, problem_id)``) is `rows.py`; this module decides what to run,
in which order and where, and hands each finished row to it.

Order: problems run model → dataset → strategy → problem → acceleration, so a problem's baseline
and accelerated runs are adjacent in time. These machines are noisy; adjacent runs share the noise,
which is what the paired speedup in the report assumes.

Scale-out: with endpoints (``--endpoint URL`` or a model's ``endpoints:``), a model's problems are
spread over OpenAI-compatible servers by a bounded pool of workers (`_spread`); a problem whose
server dies is run by another, and rows are written only for finished problems, so resume stays
exact. Rows then land in completion order, not in the order above.
"""

from __future__ import annotations

import inspect
import itertools
import json
import logging
import threading
import time
import typing
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout
from pydantic import BaseModel

from branchwise.backends.remote import RemoteUnavailable
from branchwise.evals.datasets import Problem, Task
from branchwise.evals.rows import (
    CONFIG_FILE,
    ROWS_FILE,
    RowWriter,
    SuiteMismatch,
    read_rows,
    repair_tail,
    result_row,
    write_config,
)
from branchwise.evals.suite import AccelSpec, Cell, ModelSpec, StrategySpec, SuiteConfig

__all__ = [
    "CONFIG_FILE",
    "ROWS_FILE",
    "EndpointsUnavailable",
    "RunSummary",
    "SuiteMismatch",
    "read_rows",
    "run_suite",
]

log = logging.getLogger(__name__)


class EndpointsUnavailable(RuntimeError):
    """Every endpoint failed before the suite finished; the rows written are kept (rerun to resume)."""


@dataclass
class RunSummary:
    """What one `run_suite` call did."""

    out_dir: Path
    rows_total: int
    rows_written: int
    rows_skipped: int
    dropped_partial_line: bool
    errors: int
    seconds: float
    cells: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------
# Option plumbing
# --------------------------------------------------------------------------------------------------


def _annotations(fn: Callable[..., Any]) -> dict[str, Any]:
    """Resolved parameter annotations of `fn`, skipping ones that cannot be resolved at run time."""
    try:
        return typing.get_type_hints(fn)
    except Exception:
        pass
    out: dict[str, Any] = {}
    module = inspect.getmodule(fn)
    namespace = vars(module) if module else {}
    for name, param in inspect.signature(fn).parameters.items():
        ann = param.annotation
        if isinstance(ann, str):
            try:
                # what get_type_hints does, one parameter at a time (annotations of our constructors)
                ann = eval(ann, namespace)
            except Exception:
                continue
        out[name] = ann
    return out


def _pydantic_target(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        target = _pydantic_target(arg)
        if target is not None:
            return target
    return None


def coerce_options(fn: Callable[..., Any], options: dict[str, Any], where: str) -> dict[str, Any]:
    """Check option names against `fn`'s signature and turn dicts into the pydantic configs it
    annotates (``accel: {cgee: {...}}`` -> ``Accel``), so suites stay plain YAML."""
    sig = inspect.signature(fn)
    params = sig.parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [k for k in options if k not in params and not takes_kwargs]
    if unknown:
        allowed = [n for n in params if n not in ("self", "strategy", "backend")]
        raise ValueError(f"{where}: unknown option(s) {unknown}; {fn.__qualname__} accepts {allowed}")
    hints = _annotations(fn)
    out = {}
    for key, value in options.items():
        target = _pydantic_target(hints.get(key))
        out[key] = target.model_validate(value) if target is not None and isinstance(value, dict) else value
    return out


# --------------------------------------------------------------------------------------------------
# Runner
# --------------------------------------------------------------------------------------------------


@dataclass
class _Plan:
    model: ModelSpec
    task: Task
    strategy: StrategySpec
    problem: Problem
    accel: AccelSpec
    cell: Cell


def run_suite(
    suite: SuiteConfig,
    out_dir: str | Path,
    *,
    base_dir: str | Path | None = None,
    limit: int | None = None,
    progress: bool = True,
    force: bool = False,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    endpoints: Sequence[str] = (),
    workers_per_endpoint: int = 4,
) -> RunSummary:
    """Run (or resume) `suite`, appending rows to ``OUT_DIR/results.jsonl``.

    Args:
        base_dir: folder that relative strategy paths are resolved against (the suite file's).
        limit: cap on problems per dataset (on top of the suite's own caps).
        force: resume into a run directory made by a different suite configuration.
        on_row: called after each row is durable (tests, live dashboards).
        endpoints: OpenAI-compatible servers to spread problems over (every model of the suite is
            served by them), overriding the models' own ``endpoints``; see `_spread`.
        workers_per_endpoint: concurrent problems per endpoint.
    """
    if workers_per_endpoint < 1:
        raise ValueError(f"workers_per_endpoint={workers_per_endpoint} must be >= 1")
    out = Path(out_dir)
    caps = [c for c in (suite.limit, limit) if c is not None]
    cap = min(caps) if caps else None
    base = Path(base_dir) if base_dir is not None else None
    strategies = {s.label: s.build(base) for s in suite.strategies}

    # validate acceleration options before any model is loaded
    from branchwise.reasoners.reasoner import Reasoner

    backend_cls = _backend_class()
    for accel in suite.accelerations:
        coerce_options(Reasoner.__init__, accel.reasoner, f"acceleration {accel.label!r} reasoner")
        coerce_options(backend_cls.__init__, accel.backend, f"acceleration {accel.label!r} backend")
    for model in suite.models:
        coerce_options(backend_cls.__init__, model.backend, f"model {model.display_name!r} backend")

    tasks: dict[str, Task] = {}
    plans = list(_plans(suite, tasks, cap))
    out.mkdir(parents=True, exist_ok=True)
    # two runners appending to one file would duplicate rows: the second one is refused
    lock = FileLock(str(out / ".lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout as exc:
        raise SuiteMismatch(f"another `branchwise eval` is writing to {out}") from exc
    try:
        return _run_locked(
            suite, out, plans, strategies, force, progress, on_row, endpoints, workers_per_endpoint
        )
    finally:
        lock.release()


def _run_locked(
    suite: SuiteConfig,
    out: Path,
    plans: list[_Plan],
    strategies: dict[str, Any],
    force: bool,
    progress: bool,
    on_row: Callable[[dict[str, Any]], None] | None,
    endpoints: Sequence[str],
    workers_per_endpoint: int,
) -> RunSummary:
    from tqdm.auto import tqdm

    from branchwise.reasoners.reasoner import Reasoner

    backend_cls = _backend_class()
    write_config(out, suite, force, len(plans))
    rows_path = out / ROWS_FILE
    dropped = repair_tail(rows_path)
    existing = read_rows(rows_path)
    done = {(r["cell"], r["problem_id"]) for r in existing}
    todo = [plan for plan in plans if (plan.cell.id, plan.problem.id) not in done]

    start = time.perf_counter()
    writer = RowWriter(rows_path)
    counts = {"written": 0, "errors": 0}
    voting: dict[tuple[str, str], Any] = {}
    accel_options: dict[str, dict[str, Any]] = {}
    lock = threading.Lock()  # remote workers share the writer, the counters and the caches
    bar = tqdm(total=len(todo), desc=suite.name, unit="run", disable=not progress, dynamic_ncols=True)

    def run_plan(plan: _Plan, backend: Any) -> dict[str, Any]:
        """Run one problem; any failure but an unreachable server becomes an error row."""
        with lock:
            if plan.accel.label not in accel_options:
                accel_options[plan.accel.label] = coerce_options(
                    Reasoner.__init__, plan.accel.reasoner, plan.accel.label
                )
            key = (plan.strategy.label, plan.task.extractor)
            if key not in voting:
                voting[key] = _with_extractor(strategies[plan.strategy.label], plan.task.extractor)
        t0 = time.perf_counter()
        result, error = None, None
        try:
            reasoner = Reasoner(
                voting[key],
                backend=backend,
                system_prompt=plan.task.system_prompt,
                **accel_options[plan.accel.label],
            )
            result = reasoner.run(plan.task.prompt(plan.problem))
        except RemoteUnavailable:
            raise  # not this problem's fault: another server runs it (see `_spread`)
        except Exception as exc:  # one failing problem must not end the suite
            error = f"{type(exc).__name__}: {exc}"
            log.warning("%s %s failed: %s", plan.cell.id, plan.problem.id, error)
        return result_row(plan.cell, plan.problem, plan.task, result, error, time.perf_counter() - t0)

    def emit(row: dict[str, Any]) -> None:
        with lock:
            writer.write(row)
            counts["written"] += 1
            counts["errors"] += row["error"] is not None
            if on_row is not None:
                on_row(row)
            bar.set_postfix_str(row["cell"], refresh=False)
            bar.update(1)

    left = 0
    try:
        for model, group in itertools.groupby(todo, key=lambda plan: plan.model):
            plans_of_model = list(group)
            urls = list(endpoints) or model.endpoints
            if urls:
                left += _spread(plans_of_model, urls, workers_per_endpoint, run_plan, emit)
                continue
            backends: dict[int, tuple[Any, str]] = {}  # this model's, dropped before the next model loads
            for plan in plans_of_model:
                emit(run_plan(plan, _backend(backends, backend_cls, plan.model, plan.accel)))
    finally:
        bar.close()
        writer.close()
    if left:
        raise EndpointsUnavailable(
            f"every endpoint failed; {left} problems were not run. The {counts['written']} rows written "
            f"are kept: rerun the same command (with a reachable --endpoint) to finish them"
        )
    return RunSummary(
        out_dir=out,
        rows_total=len(existing) + counts["written"],
        rows_written=counts["written"],
        rows_skipped=len(existing),
        dropped_partial_line=dropped,
        errors=counts["errors"],
        seconds=time.perf_counter() - start,
        cells=[c.id for c in suite.cells()],
    )


def _spread(
    plans: list[_Plan],
    endpoints: Sequence[str],
    workers_per_endpoint: int,
    run_plan: Callable[[_Plan, Any], dict[str, Any]],
    emit: Callable[[dict[str, Any]], None],
) -> int:
    """Run `plans` on several servers; return how many were left unrun because every server failed.

    Each endpoint gets `workers_per_endpoint` threads, each with its own `RemoteBackend` (the server
    batches their concurrent requests). Workers take problems from one shared queue; a problem whose
    server becomes unavailable (`RemoteUnavailable`: retries exhausted) goes back to the queue for
    the other servers and that worker stops. A row is emitted only for a finished problem, once,
    so the rows file never loses or duplicates one, whichever servers die and when.
    """
    from branchwise.backends.remote import RemoteBackend

    pending = deque(plans)
    in_flight = [0]
    cv = threading.Condition()
    _check_remote_options(plans)

    def take() -> _Plan | None:
        """The next problem; None once none is left or running (a running one may come back)."""
        with cv:
            while not pending and in_flight[0]:
                cv.wait()
            if not pending:
                return None
            in_flight[0] += 1
            return pending.popleft()

    def settle(plan: _Plan | None) -> None:
        """A problem left this worker: finished (None) or handed back for another endpoint."""
        with cv:
            if plan is not None:
                pending.appendleft(plan)
            in_flight[0] -= 1
            cv.notify_all()

    def worker(url: str) -> None:
        try:
            backend = RemoteBackend(url)
        except RemoteUnavailable as err:
            log.warning("endpoint %s is unavailable: %s", url, err)
            return
        try:
            while (plan := take()) is not None:
                try:
                    emit(run_plan(plan, backend))
                except RemoteUnavailable as err:
                    settle(plan)
                    log.warning("endpoint %s failed (%s); its problems go to the other endpoints", url, err)
                    return
                except BaseException:
                    settle(None)
                    raise
                settle(None)
        finally:
            backend.close()

    threads = [
        threading.Thread(target=worker, args=(url,), name=f"eval-{url}", daemon=True)
        for url in endpoints
        for _ in range(workers_per_endpoint)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(pending)


def _check_remote_options(plans: list[_Plan]) -> None:
    """Backend options configure a local model; on a server only the model's own settings apply."""
    for plan in plans:
        options = {**plan.model.backend, **plan.accel.backend}
        if options:
            raise ValueError(
                f"model {plan.model.display_name!r} / acceleration {plan.accel.label!r}: backend options "
                f"{sorted(options)} configure a local model and cannot apply on an endpoint"
            )


def _plans(suite: SuiteConfig, tasks: dict[str, Task], cap: int | None) -> Iterator[_Plan]:
    for model in suite.models:
        for dataset in suite.datasets:
            key = dataset.display_name
            if key not in tasks:
                tasks[key] = dataset.load(cap)
            task = tasks[key]
            problems = task.problems()
            for strategy in suite.strategies:
                for problem in problems:
                    for accel in suite.accelerations:
                        cell = Cell(model, dataset, strategy, accel)
                        yield _Plan(model, task, strategy, problem, accel, cell)


def _backend_class() -> Any:
    from branchwise.backends.hf import HFBackend

    return HFBackend


LOAD_OPTIONS = ("device", "dtype", "prepack")
"""The backend options that change the loaded weights (the registry's key, `registry.model_key`);
every other backend option is a setting of the loaded backend, applied per run."""


def _backend(loaded: dict[int, tuple[Any, str]], cls: Any, model: ModelSpec, accel: AccelSpec) -> Any:
    """The process's one loaded copy of `model` (per device, dtype and prepacking, from the registry
    `shared_backend`), with this run's backend options set on it: the ones the model and the
    acceleration give, and the backend's defaults for the rest, so no run inherits another's.

    Why not one backend per option set: each was a copy of the weights, held for the whole run
    (a suite with three option sets held three models). `loaded` holds this model's backends so far
    (by id: one, unless options load other weights) with the option set last applied to each; it
    keeps them loaded while the model's problems run, and each is warmed up once."""
    from branchwise.backends.accel import Accel
    from branchwise.backends.hf.registry import shared_backend

    options = {**model.backend, **accel.backend}
    coerced = coerce_options(cls.__init__, options, f"model {model.display_name!r} backend")
    load = {name: coerced.pop(name) for name in LOAD_OPTIONS if name in coerced}
    backend = shared_backend(model.load_name, **load)
    applied = json.dumps(coerced, sort_keys=True, default=str)
    first = id(backend) not in loaded
    if first or loaded[id(backend)][1] != applied:
        for name, param in inspect.signature(cls.__init__).parameters.items():
            if name in ("self", "model", *LOAD_OPTIONS) or param.default is inspect.Parameter.empty:
                continue
            value = coerced.get(name, param.default)
            setattr(backend, name, Accel() if name == "accel" and value is None else value)  # None: all off
        loaded[id(backend)] = (backend, applied)
    if first:
        _warm_up(backend)
    return backend


def _warm_up(backend: Any) -> None:
    """One throwaway batched decode, so one-time costs (allocator, kernel selection) are not billed
    to whichever cell happens to run first."""
    from branchwise.backends.base import DecodeParams

    root = backend.prefill(backend.encode("Warm up: 1 2 3"))
    kids = backend.fork(root, 2)
    backend.release([root])
    try:
        backend.extend(kids, DecodeParams(temperature=0.0, max_tokens=4))
    finally:
        backend.release(kids)


def _with_extractor(strategy: Any, extractor: str) -> Any:
    """The strategy with its aggregate votes on the dataset's extractor (when it uses 'auto')."""
    from branchwise.strategies import AggregateNode, Strategy

    nodes = [
        n.model_copy(update={"extractor": extractor})
        if isinstance(n, AggregateNode) and n.extractor == "auto"
        else n
        for n in strategy.nodes
    ]
    return Strategy(
        name=strategy.name, description=strategy.description, nodes=nodes, edges=list(strategy.edges)
    )
