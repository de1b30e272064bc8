"""The backend the `branchwise` commands run on, loaded or connected with usage errors naming the option.

Why a module of its own: `branchwise run`, `calibrate`, `steering build` (`cli.py`) and
`branchwise serve` (`serve/cli.py`) all load a model from the same three options (or connect to
the servers of ``--endpoint``) and must refuse a bad one the same way. It used to be a private helper of `cli.py` that `serve/cli.py` imported back,
an import cycle between the two command modules; both now import it from here. Tests and
`benchmarks/serve_load.py` replace `load_backend` on this module to stub or tune the loading.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer
from rich.console import Console

if TYPE_CHECKING:
    from branchwise.backends.accel import Accel
    from branchwise.backends.hf import HFBackend
    from branchwise.backends.remote import RemoteBackend

__all__ = ["load_backend", "remote_backend"]

console = Console()


def load_backend(model: str | None, device: str = "auto", dtype: str = "auto") -> HFBackend:
    """Load the model, turning "no such model" (or device, or dtype) into a usage error naming the option.

    The model is the process's shared one (`backends.hf.registry`): a command run in-process
    beside a chat model or DSPy engine of the same name (a notebook, a test) loads it once."""
    from branchwise.backends.hf.backend import resolve_device, resolve_dtype
    from branchwise.backends.hf.embedded import EmbeddedModelMissing
    from branchwise.backends.hf.registry import shared_backend

    try:
        dev = resolve_device(device)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--device") from None
    try:
        resolve_dtype(dtype, dev)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--dtype") from None
    with console.status(f"loading {model or 'the embedded model'} ({device}, {dtype})…"):
        try:
            return shared_backend(model, device=device, dtype=dtype)
        except EmbeddedModelMissing as err:
            raise typer.BadParameter(str(err), param_hint="--model") from None
        except (OSError, ValueError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise typer.BadParameter(
                f"{model!r} is neither a local model folder nor a reachable hub id ({first})",
                param_hint="--model",
            ) from None


def remote_backend(endpoints: list[str], model: str | None, accel: Accel | None = None) -> RemoteBackend:
    """Connect to the servers (several: each branch tree goes to one of them, for its prefix
    cache); an unreachable one or an acceleration they cannot run names ``--endpoint``."""
    from branchwise.backends.remote import RemoteBackend, RemoteError, UnsupportedOnRemote

    try:
        if accel is not None:
            RemoteBackend.check_accel(accel)
        with console.status(f"connecting to {', '.join(endpoints)}…"):
            return RemoteBackend(endpoints, model=model)
    except (RemoteError, UnsupportedOnRemote) as err:
        raise typer.BadParameter(str(err), param_hint="--endpoint") from None
