"""`branchwise eval SUITE.yaml --out RUN_DIR` and `branchwise report RUN_DIR`.

Plain functions registered on the main typer app by `branchwise/cli.py`; they import the harness
(and through it torch) only when run, so `branchwise --help` stays instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from branchwise.cli_params import ranged

__all__ = ["eval_command", "report_command"]

console = Console()


def eval_command(
    suite: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="Suite YAML/JSON file.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Run directory (created; resumed if it exists).")],
    limit: Annotated[int | None, ranged("At most this many problems per dataset (smoke runs).", 1)] = None,
    force: Annotated[
        bool, typer.Option(help="Resume into a run directory made by a different suite configuration.")
    ] = False,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    report: Annotated[bool, typer.Option(help="Write the report and plots when the run ends.")] = True,
    endpoint: Annotated[
        list[str] | None,
        typer.Option(
            help="OpenAI-compatible server (vLLM, SGLang, branchwise serve) to spread problems over "
            "instead of loading models locally (repeatable; overrides the suite's endpoints)."
        ),
    ] = None,
    endpoint_workers: Annotated[int, ranged("Concurrent problems per endpoint.", 1, 1024)] = 4,
) -> None:
    """Run an eval suite (datasets × strategies × accelerations × models), one JSONL row per problem.

    Rows are durable as soon as each problem is scored; run the same command again after an
    interruption to resume where it stopped (no duplicated or missing rows).
    """
    from branchwise.evals.datasets import DatasetUnavailable
    from branchwise.evals.harness import ROWS_FILE, EndpointsUnavailable, SuiteMismatch, read_rows, run_suite
    from branchwise.evals.suite import SuiteError, load_suite

    try:
        config = load_suite(suite)
    except SuiteError as err:
        raise typer.BadParameter(str(err), param_hint="SUITE") from None
    try:
        summary = run_suite(
            config,
            out,
            base_dir=suite.parent,
            limit=limit,
            progress=progress,
            force=force,
            endpoints=endpoint or (),
            workers_per_endpoint=endpoint_workers,
        )
    except KeyboardInterrupt:
        # Why not let it propagate: a traceback (or, under typer, nothing at all) leaves the user
        # wondering whether hours of rows are lost. They are not: every row was made durable as it
        # was scored, so say how many and how to go on.
        try:
            kept = f"{len(read_rows(out))} rows kept"
        except (OSError, ValueError):
            kept = "the rows written so far are kept"
        console.print(
            f"[yellow]interrupted: {kept} in {out / ROWS_FILE}; run the same command again to resume "
            "(rows already there are skipped).[/yellow]"
        )
        raise typer.Exit(130) from None  # 128 + SIGINT, what a shell reports for Ctrl-C
    except EndpointsUnavailable as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(1) from err
    except (SuiteMismatch, DatasetUnavailable) as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2) from err
    except ValueError as err:  # bad acceleration/backend options, datasets that cannot load
        console.print(f"[red]{type(err).__name__}: {err}[/red]")
        raise typer.Exit(2) from err
    resumed = f", {summary.rows_skipped} already done" if summary.rows_skipped else ""
    dropped = " (dropped a partial last line left by an interruption)" if summary.dropped_partial_line else ""
    console.print(
        f"[green]{summary.rows_written} rows written[/green]{resumed}{dropped} in {summary.seconds:.1f} s; "
        f"{summary.errors} errors -> {summary.out_dir}"
    )
    if report:
        report_command(out)


def report_command(
    run_dir: Annotated[Path, typer.Argument(exists=True, file_okay=False, help="A run directory of `eval`.")],
    baseline: Annotated[
        str | None, typer.Option(help="Acceleration label to compare against (default: the suite's).")
    ] = None,
) -> None:
    """(Re)generate a run's report: summary table (markdown), summary.json and PNG plots."""
    from branchwise.evals.report import write_report

    try:
        paths = write_report(run_dir, baseline=baseline)
    except ValueError as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(1) from err
    typer.echo(paths.markdown.read_text())
    console.print(f"report: {paths.markdown}; plots: {', '.join(str(p) for p in paths.plots)}")
