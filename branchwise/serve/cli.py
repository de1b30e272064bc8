"""The `branchwise serve` command (registered on the main app in `branchwise/cli.py`)."""

from __future__ import annotations

from typing import Annotated

import typer

from branchwise.cli_params import DeviceOption, DtypeOption, ranged


def serve_command(
    model: Annotated[
        str | None, typer.Option(help="HF hub id or local path; default: the embedded model.")
    ] = None,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0 exposes it to the network).")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, ranged("Port to listen on (0: any free port).", 0, 65535)] = 8000,
    served_model_name: Annotated[
        str | None, typer.Option(help="Model id that /v1/models lists; default: --model's.")
    ] = None,
    share: Annotated[
        str, typer.Option(help="KV sharing of a request's n samples: exact (prompt held once) or none.")
    ] = "exact",
    max_batch_rows: Annotated[int, ranged("Branches decoded together in one batch.", 1, 4096)] = 64,
    max_queued_rows: Annotated[
        int, ranged("Branches (sum of n) that may wait; beyond, requests get HTTP 429.", 1, 10_000_000)
    ] = 1024,
    batch_window_ms: Annotated[
        float, ranged("How long the scheduler waits for more requests before a batch.", 0.0, 1000.0)
    ] = 10.0,
    continuous: Annotated[
        bool,
        typer.Option(
            help="Continuous batching: requests join a running decode at the next step instead of "
            "waiting for its batch to end."
        ),
    ] = True,
    max_strategy_queue: Annotated[
        int, ranged("Strategy runs (branchwise.strategy) that may wait; beyond, HTTP 429.", 1, 100_000)
    ] = 16,
    drain_timeout: Annotated[
        float, ranged("Seconds in-flight requests may take to finish on SIGTERM.", 0.0, 3600.0)
    ] = 30.0,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /health)."""
    try:
        import uvicorn

        from branchwise.serve import create_app
    except ImportError as err:
        raise typer.BadParameter(
            f"serving needs the serve extra: pip install 'branchwise[serve]' ({err})", param_hint="serve"
        ) from None
    from branchwise.cli import _load_backend

    if share not in ("exact", "none"):
        raise typer.BadParameter(f"{share!r} is not one of 'exact', 'none'", param_hint="--share")
    backend = _load_backend(model, device, dtype)
    app = create_app(
        backend,
        model_name=served_model_name or model,
        share=share,  # type: ignore[arg-type]
        max_batch_rows=max_batch_rows,
        max_queued_rows=max_queued_rows,
        window_s=batch_window_ms / 1000,
        continuous=continuous,
        max_strategy_queue=max_strategy_queue,
        drain_timeout_s=drain_timeout,
    )
    # uvicorn turns SIGTERM/SIGINT into a graceful shutdown: no new connections, in-flight requests
    # finish (up to --drain-timeout), then the app's lifespan closes the scheduler.
    uvicorn.run(app, host=host, port=port, timeout_graceful_shutdown=drain_timeout, log_level="info")
