"""Option helpers shared by the `branchwise` commands (`cli.py` and `evals/cli.py`).

Why not typer's own ``min=``/``max=``: its range error says "Input should be greater than or equal
to 1" without the value the user typed, and its help does not show the range. A bad command line
must get one line that names the option, the value and what is allowed, so numeric options take
their bounds from :func:`ranged`, which checks in a callback and writes the range into the help.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import typer

from branchwise.strategies.errors import describe_validation_error as one_line

# one_line: a pydantic error on one line, for usage errors
__all__ = ["DeviceOption", "DtypeOption", "one_line", "ranged"]

N = TypeVar("N", int, float)


def ranged(help: str, lo: N, hi: N | None = None, **option: Any) -> Any:
    """A ``typer.Option`` accepting ``lo <= x <= hi`` (``hi=None``: no upper bound); ``None`` passes."""
    allowed = f"{lo}<=x<={hi}" if hi is not None else f"x>={lo}"

    def check(value: N | None) -> N | None:
        if value is not None and (value < lo or (hi is not None and value > hi)):
            raise typer.BadParameter(f"{value} is not in the range {allowed}")
        return value

    return typer.Option(help=f"{help} [{allowed}]", callback=check, **option)


DeviceOption = Annotated[
    str, typer.Option(help="Device to run on: auto (cuda when present, else cpu), cpu, cuda or cuda:N.")
]
DtypeOption = Annotated[
    str,
    typer.Option(
        help="Weights' number format: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16."
    ),
]
