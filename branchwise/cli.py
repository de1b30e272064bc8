"""The `branchwise` command line.

`branchwise run "QUESTION"` answers on the embedded model (or `--model` any hub id / local path);
`branchwise strategy show|validate` prints or checks strategy graphs without loading a model.
"""

from __future__ import annotations

import difflib
import json
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from branchwise import cli_backend
from branchwise.backends.accel import Accel
from branchwise.cli_accel import AccelCommand, accel_options
from branchwise.cli_params import (
    DeviceOption,
    DtypeOption,
    EndpointOption,
    ModelOption,
    knob,
    one_line,
    ranged,
)
from branchwise.strategies import MAX_SEED, PREBUILT, Strategy
from branchwise.strategies.prebuilt import Knobs

if TYPE_CHECKING:
    from branchwise.backends.base import Backend
    from branchwise.reasoners import Result

app = typer.Typer(
    help="Multi-branch LLM reasoning with shared KV: run strategies, inspect strategy graphs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    # Plain click errors: one "Error: Invalid value for '--n': ..." line a script can grep, never a
    # box that wraps the option name and the allowed range over several lines.
    rich_markup_mode=None,
)
strategy_app = typer.Typer(
    help="Inspect and validate strategy graphs (no model is loaded).",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(strategy_app, name="strategy")
console = Console()
err_console = Console(stderr=True)

STRATEGY_HELP = (
    "A prebuilt strategy ("
    + "; ".join(f"{name}: {p.summary}" for name, p in PREBUILT.items())
    + ") or a JSON/YAML strategy file."
)


COMPILING = "compiling in the background"
"""What a note says of steps that ran uncompiled while their kind compiled (`step_compiler`)."""
COMPILE_HINT = (
    "a short run ends before its decode step compiles: `branchwise models compile` (same --model, "
    "--device, --dtype) compiles it once, for servers and longer runs, which load it while they idle"
)


class Share(str, Enum):
    none = "none"
    exact = "exact"


class Format(str, Enum):
    yaml = "yaml"
    json = "json"


def _verifier_names() -> list[str]:
    from branchwise.reasoners.registry import verifier_names

    return verifier_names()


VERIFIER_HELP = (
    f"{(Knobs.model_fields['verifier'].description or '').rstrip('.')}: {', '.join(_verifier_names())}"
)


def _read_strategy(path: Path) -> Strategy:
    """Load, validate and compile a strategy file; every failure is a ``ValueError`` of one line."""
    from branchwise.reasoners.registry import check_names

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read {path}: {err}") from None
    try:
        strategy = Strategy.from_json(text) if path.suffix == ".json" else Strategy.from_yaml(text)
        strategy.compile()
    except ValidationError as err:
        raise ValueError(f"invalid strategy {path}: {one_line(err)}") from None
    check_names(strategy)
    return strategy


def _load_strategy(name: str, **knobs: Any) -> Strategy:
    """A prebuilt name (the knobs, `strategies.prebuilt.Knobs` fields, set its parameters), or a path
    to a JSON/YAML strategy file."""
    given = {key: value for key, value in knobs.items() if value is not None}
    if name in PREBUILT:
        verifier = given.get("verifier")
        if verifier is not None and verifier not in _verifier_names():
            raise typer.BadParameter(
                f"{verifier!r} is not a verifier; allowed: {', '.join(_verifier_names())}",
                param_hint="--verifier",
            )
        try:
            return PREBUILT[name](**given)
        except ValidationError as err:
            raise typer.BadParameter(f"{name}: {one_line(err)}", param_hint="--strategy") from None
        except ValueError as err:
            raise typer.BadParameter(f"{name}: {err}", param_hint="--strategy") from None
    path = Path(name)
    if not path.is_file():
        close = difflib.get_close_matches(name, list(PREBUILT), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise typer.BadParameter(
            f"{name!r} is neither a prebuilt strategy ({', '.join(PREBUILT)}) nor a file{hint}",
            param_hint="--strategy",
        )
    if set(given) - {"seed"}:
        raise typer.BadParameter(
            "--n, --temperature, --max-tokens, --verifier and --depth set a prebuilt strategy's "
            "parameters; a strategy file carries its own",
            param_hint="--strategy",
        )
    try:
        return _read_strategy(path)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--strategy") from None


@app.command(cls=AccelCommand)
@accel_options()
def run(
    questions: Annotated[
        list[str], typer.Argument(metavar="QUESTION", help="One or more questions to answer.")
    ],
    strategy: Annotated[str, typer.Option(help=STRATEGY_HELP)] = "self-consistency",
    n: Annotated[int | None, knob("branches", None, "--n", "--branches")] = None,
    share: Annotated[
        Share, typer.Option(help="KV sharing: none (No-KV baseline) or exact (prefix reuse).")
    ] = Share.exact,
    temperature: Annotated[float | None, knob("temperature")] = None,
    max_tokens: Annotated[int | None, knob("tokens")] = None,
    depth: Annotated[int | None, knob("depth")] = None,
    seed: Annotated[int, knob("seed")] = 0,
    verifier: Annotated[str | None, knob("verifier", VERIFIER_HELP)] = None,
    model: ModelOption = None,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    endpoint: EndpointOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the full results as JSON lines.")] = False,
    variant: Annotated[
        list[str] | None, typer.Option(help="An alternative phrasing of the question (repeatable).")
    ] = None,
    *,
    accel: Accel,
) -> None:
    """Answer QUESTIONS with a multi-branch strategy and print the answer, the vote and the KV/time summary."""
    from branchwise.reasoners import Reasoner

    _check_questions(questions)
    strat = _load_strategy(
        strategy,
        branches=n,
        temperature=temperature,
        tokens=max_tokens,
        seed=seed,
        verifier=verifier,
        depth=depth,
    )
    backend = _run_backend(endpoint, model, device, dtype, accel)
    reasoner = Reasoner(strat, backend=backend, share=share.value, accel=accel)
    if variant:
        results = [reasoner.run(q, variants=variant) for q in questions]
    else:
        results = reasoner.batch(questions, progress=len(questions) > 1 or not as_json)
    for result in results:
        if as_json:
            print(result.model_dump_json())
        else:
            _print_result(result, cgee=accel.cgee is not None)


#: The acceleration counters the summary table shows when a run has them (River's is a ratio, apart).
SUMMARY_COUNTERS = (
    "asks_reused",
    "asks_rejected",
    "rsbcm_evictions",
    "verify_exits",
    "skipkv_evicted_tokens",
    "reasoncache_blocks_reused",
    "reasoncache_amsr",
)


def _check_questions(questions: list[str]) -> None:
    for i, question in enumerate(questions):
        if not question.strip():
            raise typer.BadParameter(
                f"question {i + 1} is empty; give the text to answer", param_hint="QUESTIONS"
            )


def _run_backend(
    endpoint: list[str] | None, model: str | None, device: str, dtype: str, accel: Accel
) -> Backend:
    """The servers of ``--endpoint`` (which must be able to run ``accel``), else the local model."""
    if endpoint:
        return cli_backend.remote_backend(endpoint, model, accel)
    return cli_backend.load_backend(model, device, dtype)


def _print_result(result: Result, *, cgee: bool) -> None:
    """One question's answer, vote table, KV/time summary and notes, for a person to read (`cgee`:
    whether CGEE was on, the only case in which verify calls can be skipped)."""
    console.rule(result.question)
    console.print(f"[bold]answer:[/bold] {result.answer}   (support {result.support:.0%})")
    votes = Table("answer", "votes", title="vote")
    for ans, count in sorted(result.votes.items(), key=lambda kv: -kv[1]):
        votes.add_row(ans, f"{count:g}")
    console.print(votes)
    console.print(_summary(result, cgee=cgee))
    for note in result.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    if any(COMPILING in note for note in result.notes):
        console.print(f"[yellow]note:[/yellow] {COMPILE_HINT}")


def _summary(result: Result, *, cgee: bool) -> Table:
    kv = result.kv_stats
    summary = Table("metric", "value", title=f"{result.strategy}, share={result.share}")
    summary.add_row("total time", f"{result.timings['total']:.2f} s")
    for op, secs in result.timings.items():
        if op != "total":
            summary.add_row(f"  {op}", f"{secs:.2f} s")
    summary.add_row("KV peak", f"{kv['peak_bytes'] / 2**20:.1f} MiB")
    summary.add_row("tokens computed / reused", f"{kv['tokens_computed']:.0f} / {kv['tokens_reused']:.0f}")
    summary.add_row("branches", str(len(result.branches)))
    if result.verify_calls and cgee:
        summary.add_row("verify skipped (CGEE)", f"{result.verify_skipped} / {result.verify_calls}")
    elif result.verify_calls:
        summary.add_row("verify calls", str(result.verify_calls))
    if kv.get("river_tokens"):
        summary.add_row(
            "River backbone layers / token", f"{kv['river_backbone_layers'] / kv['river_tokens']:.2f}"
        )
    for key in SUMMARY_COUNTERS:
        if key in kv:
            summary.add_row(key.replace("_", " "), f"{kv[key]:g}")
    return summary


@strategy_app.command("show")
def strategy_show(
    name: Annotated[str, typer.Argument(help=STRATEGY_HELP)],
    n: Annotated[int | None, knob("branches", None, "--n", "--branches")] = None,
    fmt: Annotated[Format, typer.Option("--format", help="Output format.")] = Format.yaml,
) -> None:
    """Print a strategy graph (loadable by `strategy validate` and `run --strategy`); the plan goes to stderr."""
    strat = _load_strategy(name, branches=n)
    print(strat.to_json() if fmt is Format.json else strat.to_yaml(), end="" if fmt is Format.yaml else "\n")
    err_console.print("[bold]plan:[/bold] " + " → ".join(node.id for node in strat.compile().nodes()))


@strategy_app.command("validate")
def strategy_validate(path: Annotated[Path, typer.Argument(exists=True, dir_okay=False)]) -> None:
    """Validate a JSON/YAML strategy file (graph, ranges, verifier and extractor names); exit 1 if invalid."""
    try:
        strat = _read_strategy(path)
    except ValueError as err:
        # every problem, not only the first (a YAML/JSON error stays the one line it is)
        problems = _all_problems(path) or [str(err)]
        for problem in problems:
            err_console.print(f"error: {problem}", style="red", soft_wrap=True, highlight=False, markup=False)
        raise typer.Exit(1) from None
    console.print(f"[green]ok[/green] {strat.name}: {json.dumps([n.id for n in strat.compile().nodes()])}")


def _all_problems(path: Path) -> list[str]:
    """`registry.strategy_problems` of the file's document, each prefixed with the file; [] when it
    does not parse (then `_read_strategy`'s own message says why)."""
    import yaml

    from branchwise.reasoners.registry import strategy_problems

    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError):
        return []
    if not isinstance(data, dict):
        return []
    return [f"invalid strategy {path}: {p}" for p in strategy_problems(data)]


def _gym_questions(task: str, size: int, seed: int) -> list[str]:
    """Questions of a reasoning-gym task; an unknown task name is a usage error naming ``--task``."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        raise typer.BadParameter(
            f"{task!r} is not a reasoning-gym task; e.g. {', '.join(sorted(DATASETS)[:8])}, …",
            param_hint="--task",
        )
    return [entry["question"] for entry in reasoning_gym.create_dataset(task, size=size, seed=seed)]


@app.command()
def calibrate(
    model: ModelOption = None,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    task: Annotated[str, typer.Option(help="reasoning-gym task for held-out questions.")] = "gsm_symbolic",
    problems: Annotated[int, ranged("held-out problems (paper: 30).", 1, 10000)] = 30,
    n: Annotated[int, ranged("branches per problem.", 2, 4096)] = 8,
    max_tokens: Annotated[int, ranged("tokens per answer.", 1, 131072)] = 32,
    seed: Annotated[
        int, ranged("seed of the held-out split (keep it apart from evals).", 0, MAX_SEED)
    ] = 10_000,
) -> None:
    """Fit CGEE's thresholds (τ_conf, r_gap, θ, decision-safe l_min) on held-out problems and save them."""
    from branchwise.reasoners.calibrate import calibrate_cgee

    questions = _gym_questions(task, problems, seed)
    backend = cli_backend.load_backend(model, device, dtype)
    calibration = calibrate_cgee(backend, questions, n=n, max_tokens=max_tokens)
    console.print_json(json.dumps(calibration.__dict__))


steering_app = typer.Typer(
    help="SkipKV steering vectors (§4.2): build and inspect them.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(steering_app, name="steering")


@steering_app.command("build")
def steering_build(
    model: ModelOption = None,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    task: Annotated[str, typer.Option(help="reasoning-gym task the traces are sampled on.")] = "gsm_symbolic",
    problems: Annotated[int, ranged("questions (paper: 1,000 MATH train).", 1, 100000)] = 16,
    samples: Annotated[int, ranged("traces sampled per question.", 1, 4096)] = 4,
    layer: Annotated[
        int | None, ranged("layer whose residual input is steered; default ≈70 % depth.", 0)
    ] = None,
    max_tokens: Annotated[int, ranged("tokens per trace.", 1, 131072)] = 256,
    seed: Annotated[
        int, ranged("seed of the question split (keep it apart from evals).", 0, MAX_SEED)
    ] = 20_000,
    out: Annotated[
        Path | None, typer.Option(help="where to save; default: the model's slot in the cache.")
    ] = None,
) -> None:
    """Sample reasoning traces, and save v = mean(execution) − mean(non-execution) delimiter states."""
    from branchwise.reasoners.steering import build_steering

    questions = _gym_questions(task, problems, seed)
    backend = cli_backend.load_backend(model, device, dtype)
    try:
        vector = build_steering(
            backend, questions, layer=layer, samples=samples, max_tokens=max_tokens, save=out is None
        )
    except ValueError as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(1) from err
    if out is not None:
        vector.save(out)
    summary = {
        "model": vector.model,
        "layer": vector.layer,
        "n_exec": vector.n_exec,
        "n_nonexec": vector.n_nonexec,
        "norm": round(float(vector.vector.norm()), 4),
    }
    console.print_json(json.dumps(summary))


models_app = typer.Typer(
    help="Models that come through the package index (list them, build one into the cache), and any "
    "model's decode step compiled ahead.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(models_app, name="models")


@models_app.command("list")
def models_list() -> None:
    """The packaged models, and whether each is built in this cache."""
    from branchwise.backends.hf.packaged import PACKAGED, PackagedModelMissing, packaged_model_dir

    table = Table("name", "built", "what")
    for name, spec in sorted(PACKAGED.items()):
        try:
            folder = str(packaged_model_dir(name))
        except PackagedModelMissing:
            folder = "no"
        table.add_row(name, folder, spec.description)
    console.print(table)


@models_app.command("build")
def models_build(
    name: Annotated[str, typer.Argument(help="a packaged model's name (see `branchwise models list`).")],
    force: Annotated[bool, typer.Option(help="rebuild even if it is built.")] = False,
) -> None:
    """Download a packaged model's chunks from the package index, join them and convert them once
    into the cache; afterwards `--model NAME` loads it anywhere."""
    import logging

    from branchwise.backends.hf.packaged import build

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        folder = build(name, force=force)
    except ValueError as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2) from err
    console.print(f"built: {folder}")


@models_app.command("compile")
def models_compile(
    model: ModelOption = None,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    timeout: Annotated[
        float, typer.Option(min=1.0, max=86_400.0, help="seconds to wait for the compilations at most.")
    ] = 3600.0,
) -> None:
    """Compile a model's decode step now, for the kinds of batch runs meet first (one row, several
    rows, several over a shared prompt, over a prompt under a cached lead-in), into the cache,
    showing progress. Why: a run meets a kind
    not compiled yet by running it uncompiled while a worker compiles it in the background, and
    a short `branchwise run` ends before the worker does (its note says so); compiled here once,
    every later run, eval or server on the same model, device, dtype and torch loads them. Kinds
    met later (an acceleration's inputs, a deeper tree) still compile in the background."""
    import time

    backend = cli_backend.load_backend(model, device, dtype)
    compiler = backend.engine.stepper.compiler
    if compiler is None:
        console.print(
            f"decode steps are not compiled here (decode_step={backend.decode_step!r}): nothing to do"
        )
        return
    started = time.monotonic()
    with console.status("starting: a few tokens of each kind, run uncompiled…") as shown:
        backend.warm_up(wait=0)
        while not compiler.wait(1.0):
            if time.monotonic() - started > timeout:
                break
            done = compiler.status()
            shown.update(
                f"compiling {done['compiling']} kind(s) of batch ({done['compiled']} compiled, "
                f"{done['loaded']} from the cache), {time.monotonic() - started:.0f} s"
            )
    status = compiler.status()
    console.print_json(json.dumps({**status, "seconds": round(time.monotonic() - started, 1)}))
    if status["compiling"] or status["uncompiled"]:
        why = "; ".join(status["uncompiled"]) or f"not done within {timeout:g} s"
        err_console.print(f"[red]some kinds were not compiled: {why}[/red]")
        raise typer.Exit(1)


from branchwise.evals.cli import eval_command, report_command  # noqa: E402 - registered last, kept apart
from branchwise.serve.cli import serve_command  # noqa: E402

app.command("eval")(eval_command)
app.command("report")(report_command)
app.command("serve")(serve_command)


if __name__ == "__main__":
    app()
