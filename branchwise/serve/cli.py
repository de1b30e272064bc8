"""The `branchwise serve` command (registered on the main app in `branchwise/cli.py`).

Why the order of its steps: everything that can be wrong with the command line (a bad option, a
model path that does not exist, a port that is taken) fails at once with one line naming the
option, before a model is loaded — loading takes seconds to minutes, and a taken port found after
it wastes them. So the socket is bound first and handed to uvicorn, which listens at once: while
the model loads (and the decode steps are prepared) `/health` answers 503 "starting" with the stage
and every other route 503 with Retry-After (`starting.py`); each stage is printed as it begins.
An option only the loaded backend can check (`--decode-step`, `--kv-budget`) stops the server
with the same one line.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer

from branchwise.backends.base import check_share
from branchwise.cli_params import DeviceOption, DtypeOption, EndpointOption, ModelOption, ranged

if TYPE_CHECKING:
    from branchwise.backends.hf.backend import HFBackend
    from branchwise.backends.hf.step import StepMode


def serve_command(
    model: ModelOption = None,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    endpoint: EndpointOption = None,
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
    max_strategy_branches: Annotated[
        int, ranged("Branches one strategy request may ask for; beyond, HTTP 400.", 1, 4096)
    ] = 64,
    max_strategy_tokens: Annotated[
        int,
        ranged(
            "Branches x tokens per generate one strategy request may ask for; beyond, HTTP 400.", 1, 2**31
        ),
    ] = 64 * 2048,
    strategy_timeout: Annotated[
        float,
        ranged(
            "Seconds a strategy run may take (queueing included); then it stops, HTTP 504.", 1.0, 86_400.0
        ),
    ] = 600.0,
    drain_timeout: Annotated[
        float,
        ranged(
            "Seconds in-flight requests may take to finish on SIGTERM; then they get HTTP 503.", 0.0, 3600.0
        ),
    ] = 30.0,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="BRANCHWISE_API_KEY",
            show_default=False,
            help="Clients must send 'Authorization: Bearer <key>' (/health stays open); default: no key.",
        ),
    ] = None,
    allow_host: Annotated[
        list[str] | None,
        typer.Option(
            help="Host header to accept besides the bound address (name, or name:port; repeatable; "
            "* accepts any). Others get HTTP 400: a guard against DNS rebinding."
        ),
    ] = None,
    cors_origin: Annotated[
        list[str] | None,
        typer.Option(help="Origin whose web pages may call the API (CORS; repeatable); default: none."),
    ] = None,
    docs: Annotated[
        bool, typer.Option(help="Serve the API docs at /docs, /redoc and /openapi.json.")
    ] = False,
    max_body_bytes: Annotated[
        int, ranged("Largest request body in bytes; beyond, HTTP 413.", 1024, 2**31)
    ] = 8 * 2**20,
    body_timeout: Annotated[
        float, ranged("Seconds a client may take to send its request body; then HTTP 408.", 0.1, 3600.0)
    ] = 30.0,
    kv_budget: Annotated[
        str | None,
        typer.Option(
            help="Memory for KV: bytes like 4GiB, or a fraction of free memory like 0.5; default auto."
        ),
    ] = None,
    prefill_chunk: Annotated[
        int,
        ranged(
            "Prompt tokens computed per decode step of the requests running beside it (0: whole prompts).",
            0,
            1_000_000,
        ),
    ] = 128,
    prefill_share: Annotated[
        float,
        ranged(
            "How long a prefill chunk beside running requests may take, as a fraction of their decode "
            "step's time (0: every chunk is --prefill-chunk tokens).",
            0.0,
            100.0,
        ),
    ] = 1.0,
    grammar_timeout: Annotated[
        float,
        ranged(
            "Seconds one request's grammar (a schema, regex or tools) may take to compile; then HTTP 400.",
            0.1,
            3600.0,
        ),
    ] = 10.0,
    decode_step: Annotated[
        str,
        typer.Option(
            help="How decode steps run: auto (compiled, and captured as CUDA graphs on a GPU), "
            "compiled, graphs, eager or layers. Compiled steps are compiled by a worker process in the "
            "background while the same steps run uncompiled, so no request waits; /health shows the progress."
        ),
    ] = "auto",
    dspy_fields: Annotated[
        bool,
        typer.Option(
            help="A chat request whose prompt asks for DSPy's output fields (its adapters' words) and "
            "sends no constraint is decoded under a JSON Schema of those fields, so an unchanged DSPy "
            "program's replies always parse; the reply's notes say so."
        ),
    ] = True,
    kv_layout: Annotated[
        str | None,
        typer.Option(
            help="How decode batches hold their rows' own KV: tails (one rectangle per batch) or pages "
            "(16-token pages read in place; less memory, faster for rows of mixed lengths, and admitted "
            "under --kv-budget by what they hold). Default: $BRANCHWISE_KV_LAYOUT, else pages on a CPU that can build their kernel (a C++ compiler "
            "and ninja), tails elsewhere."
        ),
    ] = None,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /health)."""
    try:
        from branchwise.serve import create_app
        from branchwise.serve.guard import is_loopback
        from branchwise.serve.runner import bind, serve
        from branchwise.serve.starting import Starting
    except ImportError as err:
        raise typer.BadParameter(
            f"serving needs the serve extra: pip install 'branchwise[serve]' ({err})", param_hint="serve"
        ) from None
    from branchwise import cli_backend

    try:
        check_share(share)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--share") from None
    if kv_layout is not None:
        from branchwise.backends.hf.own_kv import check_layout

        try:
            check_layout(kv_layout)
        except ValueError as err:
            raise typer.BadParameter(str(err), param_hint="--kv-layout") from None
    if endpoint:
        _local_only(
            device=device != "auto",
            dtype=dtype != "auto",
            kv_budget=kv_budget is not None,
            decode_step=decode_step != "auto",
            kv_layout=kv_layout is not None,
            grammar_timeout=grammar_timeout != 10.0,
        )
    else:
        _check_model_path(model)
    try:
        sock = bind(host, port)
    except OSError as err:
        raise typer.BadParameter(
            f"cannot listen on {host}:{port} ({err.strerror or err})", param_hint="--port"
        ) from None
    try:
        if not api_key and not is_loopback(host):
            typer.echo(
                f"warning: serving on {host} without an API key: anyone who can reach this port can use "
                "the model (set --api-key or BRANCHWISE_API_KEY)",
                err=True,
            )
        _log_to_stderr()

        def build(starting: Starting) -> Any:
            """The real app, stage by stage (`starting.Starting` answers 503 meanwhile)."""
            starting.begin("connecting to the endpoint" if endpoint else "loading the model")
            local = None  # the local model, whose settings the options set (the servers own theirs)
            if endpoint:
                backend: Any = cli_backend.remote_backend(endpoint, model)
            else:
                backend = local = cli_backend.load_backend(model, device, dtype)
                if kv_budget is not None and kv_budget != "auto":
                    _set_kv_budget(local, kv_budget)
                local.grammar_timeout = grammar_timeout
                local.prefill_chunk, local.prefill_share = prefill_chunk, prefill_share
                try:
                    local.decode_step = cast("StepMode", decode_step)  # the setter checks it
                except ValueError as err:
                    raise typer.BadParameter(str(err), param_hint="--decode-step") from None
                if kv_layout is not None:
                    local.kv_layout = check_layout(kv_layout)  # (checked before listening: it passes)
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
                api_key=api_key or None,
                allowed_hosts=[*_host_names(host), *(allow_host or [])],
                cors_origins=cors_origin or [],
                docs=docs,
                max_body_bytes=max_body_bytes,
                body_timeout_s=body_timeout,
                max_strategy_branches=max_strategy_branches,
                max_strategy_tokens=max_strategy_tokens,
                strategy_timeout_s=strategy_timeout,
                dspy_fields=dspy_fields,
            )
            if local is not None:  # starts compiling the first kinds of batch, without waiting
                starting.begin("preparing the decode steps (loading compiled ones, warming up)")
                warmed = local.warm_up()
                if warmed["compiling"]:
                    logging.getLogger("branchwise.serve").info(
                        "compiling the decode step for %d kinds of batch in a worker process; steps "
                        "run uncompiled until then (progress: /health)",
                        warmed["compiling"],
                    )
            return app

        address, bound = sock.getsockname()[:2]
        shown = f"[{address}]" if ":" in address else address
        logging.getLogger("branchwise.serve").info(
            "listening on http://%s:%d (Ctrl-C to stop); /health answers 503 until the model is ready",
            shown,
            bound,
        )
        # SIGTERM/SIGINT: no new connections, in-flight requests finish (up to --drain-timeout), the
        # rest get a JSON 503, and the process exits 0 (`runner.DrainingServer`).
        serve(Starting(drain_timeout), sock, drain_timeout, build=build)
    finally:
        sock.close()


def _local_only(**given: bool) -> None:
    """Refuse options of a local model given beside ``--endpoint`` (the servers own those)."""
    named = [f"--{name.replace('_', '-')}" for name, on in given.items() if on]
    if named:
        raise typer.BadParameter(
            f"{', '.join(named)} set the local model; with --endpoint the servers decide them",
            param_hint="--endpoint",
        )


def _check_model_path(model: str | None) -> None:
    """Fail at once on a --model that is a path (not a hub id) to nothing, or to no model folder,
    rather than after a hub lookup named after a path."""
    if model is None:
        return
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise typer.BadParameter(
                f"{model!r} is not a model folder (it holds no config.json)", param_hint="--model"
            )
        return
    separators = "/" + (os.sep if os.sep != "/" else "") + (os.altsep or "")
    looks_like_a_path = (
        model.startswith((".", "~", *separators))
        or sum(model.count(s) for s in separators) > 1
        or ":" in model
    )
    if looks_like_a_path:
        raise typer.BadParameter(
            f"{model!r}: no such folder (a hub id has the form 'org/name')", param_hint="--model"
        )


def _host_names(host: str) -> list[str]:
    """A --host given as a name (not an address) is what clients put in their Host header."""
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return [host]
    return []


def _set_kv_budget(backend: HFBackend, value: str) -> None:
    """Hand --kv-budget to the backend, which parses and checks it (bytes, a fraction or 'auto')."""
    try:
        backend.kv_budget = value
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--kv-budget") from None


def _log_to_stderr() -> None:
    """The server's own log lines (a dropped request, a client that left) in uvicorn's format."""
    from uvicorn.logging import DefaultFormatter

    logger = logging.getLogger("branchwise.serve")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
