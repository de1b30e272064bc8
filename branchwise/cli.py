"""The `branchwise` command line.

`branchwise run "QUESTION"` answers on the embedded model (or `--model` any hub id / local path);
`branchwise strategy show|validate` prints or checks strategy graphs without loading a model.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from branchwise.strategies import Strategy, best_of_n, self_consistency

app = typer.Typer(
    help="Multi-branch LLM reasoning with shared KV: run strategies, inspect strategy graphs.",
    no_args_is_help=True,
    add_completion=False,
)
strategy_app = typer.Typer(
    help="Inspect and validate strategy graphs (no model is loaded).", no_args_is_help=True
)
app.add_typer(strategy_app, name="strategy")
console = Console()


class Prebuilt(str, Enum):
    self_consistency = "self-consistency"
    best_of_n = "best-of-n"


class Share(str, Enum):
    none = "none"
    exact = "exact"


def _load_strategy(
    name: str, n: int, temperature: float, max_tokens: int, seed: int | None, verifier: str
) -> Strategy:
    """A prebuilt name, or a path to a JSON/YAML strategy file."""
    if name == Prebuilt.self_consistency.value:
        return self_consistency(n=n, temperature=temperature, max_tokens=max_tokens, seed=seed)
    if name == Prebuilt.best_of_n.value:
        return best_of_n(n=n, temperature=temperature, max_tokens=max_tokens, seed=seed, verifier=verifier)
    path = Path(name)
    if not path.is_file():
        raise typer.BadParameter(
            f"{name!r} is neither a prebuilt strategy ({', '.join(p.value for p in Prebuilt)}) nor a file",
            param_hint="--strategy",
        )
    text = path.read_text()
    return Strategy.from_json(text) if path.suffix == ".json" else Strategy.from_yaml(text)


@app.command()
def run(
    questions: Annotated[list[str], typer.Argument(help="One or more questions to answer.")],
    strategy: Annotated[
        str, typer.Option(help="self-consistency, best-of-n, or a JSON/YAML strategy file.")
    ] = Prebuilt.self_consistency.value,
    n: Annotated[int, typer.Option(min=1, max=4096, help="Branches per question.")] = 8,
    share: Annotated[
        Share, typer.Option(help="KV sharing: none (No-KV baseline) or exact (prefix reuse).")
    ] = Share.exact,
    temperature: Annotated[float, typer.Option(min=0.0, max=5.0)] = 0.7,
    max_tokens: Annotated[int, typer.Option(min=1, max=131072)] = 256,
    seed: Annotated[int | None, typer.Option(min=0, help="Sampling seed (reproducible runs).")] = 0,
    verifier: Annotated[
        str, typer.Option(help="Verifier for best-of-n: judge, confidence, logprob.")
    ] = "judge",
    model: Annotated[
        str | None, typer.Option(help="HF hub id or local path; default: the embedded model.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the full results as JSON lines.")] = False,
    cgee: Annotated[bool, typer.Option(help="CGEE verify skip + entropy exit (RKSC §2.3).")] = False,
    asks_tau: Annotated[
        float | None, typer.Option(min=0.0, max=1.0, help="ASKS similarity gate τ (off if unset).")
    ] = None,
    rsbcm_capacity: Annotated[
        int | None, typer.Option(min=1, help="RSBCM capacity in KV blocks (off if unset).")
    ] = None,
    probe: Annotated[
        bool, typer.Option(help="KV probe: time share vs recompute per 64-token bucket.")
    ] = False,
    variant: Annotated[
        list[str] | None, typer.Option(help="An alternative phrasing of the question (repeatable).")
    ] = None,
    river_threshold: Annotated[
        float | None,
        typer.Option(
            min=-1.0,
            max=1.0,
            help="River early exit onto quantized layers at this similarity (off if unset).",
        ),
    ] = None,
    skipkv_budget: Annotated[
        int | None,
        typer.Option(min=2, help="SkipKV: KV tokens each branch's generation may keep (off if unset)."),
    ] = None,
    steer: Annotated[
        bool, typer.Option(help="SkipKV adaptive steering (needs `branchwise steering build` first).")
    ] = False,
) -> None:
    """Answer QUESTIONS with a multi-branch strategy and print the answer, the vote and the KV/time summary."""
    from branchwise.backends.accel import (
        Accel,
        ASKSConfig,
        CGEEConfig,
        ProbeConfig,
        RiverConfig,
        RSBCMConfig,
        SkipKVConfig,
        SteeringConfig,
    )
    from branchwise.backends.hf import HFBackend
    from branchwise.reasoners import Reasoner

    strat = _load_strategy(strategy, n, temperature, max_tokens, seed, verifier)
    accel = Accel(
        asks=ASKSConfig(tau=asks_tau) if asks_tau is not None else None,
        cgee=CGEEConfig() if cgee else None,
        rsbcm=RSBCMConfig(capacity_blocks=rsbcm_capacity) if rsbcm_capacity else None,
        probe=ProbeConfig() if probe else None,
        river=RiverConfig(threshold=river_threshold) if river_threshold is not None else None,
        skipkv=SkipKVConfig(budget=skipkv_budget, steering=SteeringConfig() if steer else None)
        if skipkv_budget
        else None,
    )
    if steer and not skipkv_budget:
        raise typer.BadParameter("--steer needs --skipkv-budget (steering is part of SkipKV)")
    with console.status(f"loading {model or 'the embedded model'}…"):
        backend = HFBackend(model)
    reasoner = Reasoner(strat, backend=backend, share=share.value, accel=accel)
    if variant:
        results = [reasoner.run(q, variants=variant) for q in questions]
    else:
        results = reasoner.batch(questions, progress=len(questions) > 1 or not as_json)
    for result in results:
        if as_json:
            print(result.model_dump_json())
            continue
        console.rule(result.question)
        console.print(f"[bold]answer:[/bold] {result.answer}   (support {result.support:.0%})")
        votes = Table("answer", "votes", title="vote")
        for ans, count in sorted(result.votes.items(), key=lambda kv: -kv[1]):
            votes.add_row(ans, f"{count:g}")
        console.print(votes)
        kv = result.kv_stats
        summary = Table("metric", "value", title=f"{result.strategy}, share={result.share}")
        summary.add_row("total time", f"{result.timings['total']:.2f} s")
        for op, secs in result.timings.items():
            if op != "total":
                summary.add_row(f"  {op}", f"{secs:.2f} s")
        summary.add_row("KV peak", f"{kv['peak_bytes'] / 2**20:.1f} MiB")
        summary.add_row(
            "tokens computed / reused", f"{kv['tokens_computed']:.0f} / {kv['tokens_reused']:.0f}"
        )
        summary.add_row("branches", str(len(result.branches)))
        if result.verify_calls:
            summary.add_row("verify skipped (CGEE)", f"{result.verify_skipped} / {result.verify_calls}")
        if kv.get("river_tokens"):
            summary.add_row(
                "River backbone layers / token", f"{kv['river_backbone_layers'] / kv['river_tokens']:.2f}"
            )
        for key in (
            "asks_reused",
            "asks_rejected",
            "rsbcm_evictions",
            "verify_exits",
            "skipkv_evicted_tokens",
        ):
            if key in kv:
                summary.add_row(key.replace("_", " "), f"{kv[key]:g}")
        console.print(summary)
        for note in result.notes:
            console.print(f"[yellow]note:[/yellow] {note}")


@strategy_app.command("show")
def strategy_show(
    name: Annotated[str, typer.Argument(help="self-consistency, best-of-n, or a JSON/YAML file.")],
    n: Annotated[int, typer.Option(min=1, max=4096)] = 8,
    fmt: Annotated[str, typer.Option("--format", help="yaml or json")] = "yaml",
) -> None:
    """Print a strategy graph and its compiled plan."""
    strat = _load_strategy(name, n, 0.7, 256, None, "judge")
    print(strat.to_json() if fmt == "json" else strat.to_yaml())
    plan = strat.compile()
    console.print("[bold]plan:[/bold] " + " → ".join(node.id for node in plan.nodes()))


@strategy_app.command("validate")
def strategy_validate(path: Annotated[Path, typer.Argument(exists=True, dir_okay=False)]) -> None:
    """Validate a JSON/YAML strategy file; exit 1 with the errors if it is invalid."""
    from pydantic import ValidationError

    text = path.read_text()
    try:
        strat = Strategy.from_json(text) if path.suffix == ".json" else Strategy.from_yaml(text)
        strat.compile()
    except ValidationError as err:
        console.print(f"[red]invalid strategy[/red] {path}:\n{err}")
        raise typer.Exit(1) from err
    console.print(f"[green]ok[/green] {strat.name}: {json.dumps([n.id for n in strat.compile().nodes()])}")


@app.command()
def calibrate(
    model: Annotated[
        str | None, typer.Option(help="HF hub id or local path; default: the embedded model.")
    ] = None,
    task: Annotated[str, typer.Option(help="reasoning-gym task for held-out questions.")] = "gsm_symbolic",
    problems: Annotated[int, typer.Option(min=1, max=10000, help="held-out problems (paper: 30).")] = 30,
    n: Annotated[int, typer.Option(min=2, max=4096, help="branches per problem.")] = 8,
    max_tokens: Annotated[int, typer.Option(min=1, max=131072)] = 32,
    seed: Annotated[
        int, typer.Option(min=0, help="seed of the held-out split (keep it apart from evals).")
    ] = 10_000,
) -> None:
    """Fit CGEE's thresholds (τ_conf, r_gap, θ, decision-safe l_min) on held-out problems and save them."""
    import reasoning_gym

    from branchwise.backends.hf import HFBackend
    from branchwise.reasoners.calibrate import calibrate_cgee

    questions = [entry["question"] for entry in reasoning_gym.create_dataset(task, size=problems, seed=seed)]
    with console.status(f"loading {model or 'the embedded model'}…"):
        backend = HFBackend(model)
    calibration = calibrate_cgee(backend, questions, n=n, max_tokens=max_tokens)
    console.print_json(json.dumps(calibration.__dict__))


steering_app = typer.Typer(
    help="SkipKV steering vectors (§4.2): build and inspect them.", no_args_is_help=True
)
app.add_typer(steering_app, name="steering")


@steering_app.command("build")
def steering_build(
    model: Annotated[
        str | None, typer.Option(help="HF hub id or local path; default: the embedded model.")
    ] = None,
    task: Annotated[str, typer.Option(help="reasoning-gym task the traces are sampled on.")] = "gsm_symbolic",
    problems: Annotated[
        int, typer.Option(min=1, max=100000, help="questions (paper: 1,000 MATH train).")
    ] = 16,
    samples: Annotated[int, typer.Option(min=1, max=4096, help="traces sampled per question.")] = 4,
    layer: Annotated[
        int | None, typer.Option(min=0, help="layer whose residual input is steered; default ≈70 % depth.")
    ] = None,
    max_tokens: Annotated[int, typer.Option(min=1, max=131072)] = 256,
    seed: Annotated[
        int, typer.Option(min=0, help="seed of the question split (keep it apart from evals).")
    ] = 20_000,
    out: Annotated[
        Path | None, typer.Option(help="where to save; default: the model's slot in the cache.")
    ] = None,
) -> None:
    """Sample reasoning traces, and save v = mean(execution) − mean(non-execution) delimiter states."""
    import reasoning_gym

    from branchwise.backends.hf import HFBackend
    from branchwise.reasoners.steering import build_steering

    questions = [entry["question"] for entry in reasoning_gym.create_dataset(task, size=problems, seed=seed)]
    with console.status(f"loading {model or 'the embedded model'}…"):
        backend = HFBackend(model)
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


from branchwise.evals.cli import eval_command, report_command  # noqa: E402 - registered last, kept apart

app.command("eval")(eval_command)
app.command("report")(report_command)


if __name__ == "__main__":
    app()
