"""How invalid input is described to a person: one line per problem, naming where and what.

Strategy files, eval suites and command lines all end in the same two kinds of failure, a YAML
document the parser rejects and a pydantic validation error, so they share these two descriptions
(the strategies layer is the lowest one every front end imports).
"""

from __future__ import annotations

import yaml
from pydantic import ValidationError

__all__ = ["describe_validation_error", "describe_yaml_error", "validation_problems"]


def describe_yaml_error(err: yaml.YAMLError) -> str:
    """``invalid YAML at line L, column C: problem`` (1-based, where the parser stopped)."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "unknown position"
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"invalid YAML at {where}: {problem}"


def validation_problems(err: ValidationError) -> list[str]:
    """Each problem as ``where: what (got value)``, one string each."""
    parts = []
    for e in err.errors():
        where = ".".join(str(x) for x in e["loc"]) or "file"
        shown = where != "file" and not isinstance(e["input"], (dict, list))
        parts.append(f"{where}: {e['msg']}" + (f" (got {e['input']!r})" if shown else ""))
    return parts


def describe_validation_error(err: ValidationError) -> str:
    """Each problem as ``where: what (got value)``, joined by ``;`` on one line."""
    return "; ".join(validation_problems(err))
