"""Options shared by the `branchwise` commands (`cli.py`, `serve/cli.py` and `evals/cli.py`): the
model, device, dtype and endpoint options, declared once, and the prebuilt-strategy knobs (`knob`).

Why not typer's own ``min=``/``max=``: its range error says "Input should be greater than or equal
to 1" without the value the user typed, and its help does not show the range. A bad command line
must get one line that names the option, the value and what is allowed, so numeric options take
their bounds from :func:`ranged`, which checks in a callback and writes the range into the help.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import typer

from branchwise.strategies.errors import describe_validation_error as one_line
from branchwise.strategies.prebuilt import Knobs

# one_line: a pydantic error on one line, for usage errors
__all__ = ["DeviceOption", "DtypeOption", "EndpointOption", "ModelOption", "knob", "one_line", "ranged"]

N = TypeVar("N", int, float)


def ranged(help: str, lo: N, hi: N | None = None, *names: str, **option: Any) -> Any:
    """A ``typer.Option`` accepting ``lo <= x <= hi`` (``hi=None``: no upper bound); ``None`` passes.
    `names`: the option's names when not the parameter's own (``"--n", "--branches"``)."""
    allowed = f"{lo}<=x<={hi}" if hi is not None else f"x>={lo}"

    def check(value: N | None) -> N | None:
        if value is not None and (value < lo or (hi is not None and value > hi)):
            raise typer.BadParameter(f"{value} is not in the range {allowed}")
        return value

    return typer.Option(*names, help=f"{help} [{allowed}]", callback=check, **option)


DeviceOption = Annotated[
    str, typer.Option(help="Device to run on: auto (cuda when present, else cpu), cpu, cuda or cuda:N.")
]
DtypeOption = Annotated[
    str,
    typer.Option(
        help="Weights' number format: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16."
    ),
]
# The options every command that loads a model or reaches a server shares (`run`, `serve`,
# `calibrate`, `steering build`), declared once so their names and help never drift apart.
ModelOption = Annotated[
    str | None, typer.Option(help="HF hub id or local path; default: the embedded model.")
]
EndpointOption = Annotated[
    list[str] | None,
    typer.Option(
        help="URL of an OpenAI-compatible server (vLLM, SGLang, branchwise serve) to run on instead of a "
        "local model; --model names its model. Repeatable: servers of one model, each branch tree on one "
        "of them."
    ),
]


def knob(name: str, help: str | None = None, *names: str) -> Any:
    """The option of one prebuilt-strategy knob (`strategies.prebuilt.Knobs`): its help and range are
    the field's, so the knobs are declared once, beside the builders that take them. `names`: the
    option's names when not the parameter's own."""
    info = Knobs.model_fields[name]
    text = help or info.description or name
    bounds = {type(m).__name__: m for m in info.metadata}
    if "Ge" not in bounds:
        return typer.Option(*names, help=text)
    high = bounds.get("Le")
    return ranged(text, bounds["Ge"].ge, None if high is None else high.le, *names)
