"""The acceleration options of `branchwise run`, generated from the acceleration registry.

Why generated: the fields of `Accel` are the registry of accelerations, and each config declares its
settings with their descriptions and ranges (`backends/accel.py`, no torch). Listing the options by
hand in the CLI made a new acceleration one module, one registration line *and* a CLI edit; with
`accel_options`, every registered acceleration gets, with no CLI edit:

- ``--NAME/--no-NAME``: turn it on with its defaults (not for one with a required setting, such
  as SkipKV's budget: its options turn it on);
- ``--NAME-FIELD`` for each setting (``--NAME-SUB/--no-NAME-SUB`` and ``--NAME-SUB-FIELD`` for a
  nested config, such as SkipKV's steering): the field's description, default and range are the
  help, and a value out of range is one usage error naming the option and the range. Any of them
  turns the acceleration on. A config's `cli_names` keeps a shorter name (``--rsbcm-capacity``).

The options are plain typer options added to the command function's signature, so typer parses
and documents them like any other; `AccelCommand` lists them in one help section per acceleration.
The command function itself receives the built `Accel`, with "cannot run together" and missing
settings already turned into usage errors naming the options.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import annotated_types
import typer
from pydantic import ValidationError
from pydantic.fields import FieldInfo
from typer.core import TyperCommand

from branchwise.backends.accel import Accel, AccelConfig
from branchwise.cli_params import one_line

__all__ = ["AccelCommand", "accel_options", "bounds_text"]

F = TypeVar("F", bound=Callable[..., Any])
_PREFIX = "accel__"  # the generated parameters' names: accel__skipkv__steering__alpha0
_PANEL = "Acceleration "


@dataclass(frozen=True)
class _Setting:
    """One generated option: the setting's path in `Accel` (``("skipkv", "budget")``; a switch's
    path is its config's), its flag, and whether it is an on/off switch of a whole config."""

    path: tuple[str, ...]
    flag: str
    switch: bool
    annotation: Any

    @property
    def param(self) -> str:
        return _PREFIX + "__".join(self.path)


def bounds_text(info: FieldInfo) -> str | None:
    """A field's range as the CLI prints it (``0.0<=x<=1.0``, ``x>=1``, ``0.0<x<=100.0``), or None."""
    lo: tuple[str, object] | None = None
    hi: tuple[str, object] | None = None
    for meta in info.metadata:
        if isinstance(meta, annotated_types.Ge):
            lo = ("<=", meta.ge)
        elif isinstance(meta, annotated_types.Gt):
            lo = ("<", meta.gt)
        elif isinstance(meta, annotated_types.Le):
            hi = ("<=", meta.le)
        elif isinstance(meta, annotated_types.Lt):
            hi = ("<", meta.lt)
    if lo is None and hi is None:
        return None
    if hi is None:
        assert lo is not None
        return f"x{lo[0].replace('<', '>')}{lo[1]}"
    if lo is None:
        return f"x{hi[0]}{hi[1]}"
    return f"{lo[1]}{lo[0]}x{hi[0]}{hi[1]}"


def _in_bounds(info: FieldInfo, value: Any) -> bool:
    for meta in info.metadata:
        if (
            (isinstance(meta, annotated_types.Ge) and not value >= meta.ge)
            or (isinstance(meta, annotated_types.Gt) and not value > meta.gt)
            or (isinstance(meta, annotated_types.Le) and not value <= meta.le)
            or (isinstance(meta, annotated_types.Lt) and not value < meta.lt)
        ):
            return False
    return True


def _strip_none(annotation: Any) -> Any:
    """``X | None`` -> ``X`` (an unset option already means "the config's default")."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _config_of(annotation: Any) -> type[AccelConfig] | None:
    inner = _strip_none(annotation)
    return inner if inspect.isclass(inner) and issubclass(inner, AccelConfig) else None


def _option_type(annotation: Any, where: str) -> Any:
    """The type typer parses a field's option as: the field's own for scalars and Literals, a
    repeatable list for a tuple of scalars; anything else cannot be typed on a command line."""
    if annotation in (bool, int, float, str) or typing.get_origin(annotation) is Literal:
        return annotation
    if typing.get_origin(annotation) in (tuple, list):
        item, *rest = typing.get_args(annotation)
        if item in (str, int, float) and rest in ([], [Ellipsis]):
            return list[item]  # type: ignore[valid-type]
    raise TypeError(
        f"{where}: the command line cannot set a field of type {annotation!r}; give it a scalar, "
        "Literal or tuple type, or a nested AccelConfig"
    )


def _field_help(info: FieldInfo) -> str:
    """The field's description, then its range and default: ``similarity threshold τ [0.0<=x<=1.0; default 0.82]``."""
    facts = [allowed] if (allowed := bounds_text(info)) else []
    if not info.is_required() and info.default is not None:
        facts.append(
            f"default {info.default!r}" if isinstance(info.default, str) else f"default {info.default}"
        )
    return (info.description or "").strip() + (f" [{'; '.join(facts)}]" if facts else "")


def _range_check(info: FieldInfo) -> Callable[[Any], Any] | None:
    allowed = bounds_text(info)
    if allowed is None:
        return None

    def check(value: Any) -> Any:
        if value is not None and not _in_bounds(info, value):
            raise typer.BadParameter(f"{value} is not in the range {allowed}")
        return value

    return check


def _settings(config: type[AccelConfig], path: tuple[str, ...], flag: str, help: str) -> Iterator[_Setting]:
    """The on/off switch (if the config builds with no settings) and one option per field, nested
    configs recursively, each as an annotated parameter typer turns into an option."""
    panel = _PANEL + path[0]
    if not any(info.is_required() for info in config.model_fields.values()):
        name = flag.removeprefix("--")
        option = typer.Option(f"--{name}/--no-{name}", help=help, rich_help_panel=panel)
        yield _Setting(path, flag, True, Annotated[bool | None, option])
    for field, info in config.model_fields.items():
        sub = config.cli_names.get(field, f"{flag}-{field.replace('_', '-')}")
        nested = _config_of(info.annotation)
        if nested is not None:
            yield from _settings(nested, (*path, field), sub, (info.description or "").strip())
            continue
        kind = _option_type(_strip_none(info.annotation), f"{config.__name__}.{field}")
        decl = f"{sub}/--no-{sub.removeprefix('--')}" if kind is bool else sub
        option = typer.Option(
            decl, help=_field_help(info), callback=_range_check(info), rich_help_panel=panel
        )
        yield _Setting((*path, field), sub, False, Annotated[kind | None, option])


def _registry_settings(registry: type[Accel]) -> list[_Setting]:
    out: list[_Setting] = []
    for name, config in registry.configs().items():
        title = (inspect.getdoc(config) or config.__name__).split("\n\n")[0].replace("\n", " ")
        flag = f"--{name.replace('_', '-')}"
        out.extend(
            _settings(
                config, (name,), flag, f"{title} Turn it on with its defaults (or with any {flag}-* option)."
            )
        )
    return out


def accel_options(registry: type[Accel] = Accel) -> Callable[[F], F]:
    """Give a typer command function every acceleration's options (see the module docstring).

    The function declares ``accel: Accel`` and receives the `Accel` the options build (all off when
    none is given); the options themselves never reach it. ``registry`` is the class whose fields
    are the accelerations: `Accel`, or in a test a subclass that registers one more.
    """

    def decorate(func: F) -> F:
        settings = _registry_settings(registry)
        own = [p for p in inspect.signature(func, eval_str=True).parameters.values() if p.name != "accel"]
        added = [
            inspect.Parameter(s.param, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=s.annotation)
            for s in settings
        ]

        @functools.wraps(func)
        def command(*args: Any, **kwargs: Any) -> Any:
            given = [(s, value) for s in settings if (value := kwargs.pop(s.param, None)) not in (None, [])]
            return func(*args, accel=_build(registry, settings, given), **kwargs)

        parameters = [*own, *added]
        command.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in parameters}
        return typing.cast(F, command)

    return decorate


def _nest(given: Sequence[tuple[_Setting, Any]]) -> dict[str, Any]:
    """The settings tree of the given options: ``{"skipkv": {"budget": 6, "steering": {}}}``."""
    off = {s.path: s.flag for s, value in given if s.switch and value is False}
    tree: dict[str, Any] = {}
    for s, value in sorted(given, key=lambda item: len(item[0].path)):
        for depth in range(1, len(s.path)):
            if s.path[:depth] in off:
                raise typer.BadParameter(
                    f"--no-{off[s.path[:depth]].removeprefix('--')} turns it off, but {s.flag} sets it"
                )
        if s.switch and value is False:
            continue
        node = tree
        for part in s.path[:-1]:
            node = node.setdefault(part, {})
        if s.switch:
            node.setdefault(s.path[-1], {})
        else:
            node[s.path[-1]] = tuple(value) if isinstance(value, list) else value
    return tree


def _flag_of(settings: Sequence[_Setting], path: tuple[str | int, ...]) -> str:
    """The flag of the longest generated option whose path starts ``path`` (for error messages)."""
    for length in range(len(path), 0, -1):
        for s in settings:
            if s.path == path[:length]:
                return s.flag
    return "--" + str(path[0])


def _build(
    registry: type[Accel], settings: Sequence[_Setting], given: Sequence[tuple[_Setting, Any]]
) -> Accel:
    """The `Accel` of the given options; a setting the config requires but nobody gave ("--steer
    needs --skipkv-budget"), a value the config rejects, and accelerations that cannot run together
    are usage errors naming the options."""
    configs = registry.configs()
    on: dict[str, AccelConfig] = {}
    for name, values in _nest(given).items():
        flags = [s.flag for s, _ in given if s.path[0] == name]
        try:
            on[name] = configs[name].model_validate(values)
        except ValidationError as err:
            first = err.errors()[0]
            if first["type"] == "missing":
                needed = _flag_of(settings, (name, *first["loc"]))
                raise typer.BadParameter(
                    f"{', '.join(flags)} {'needs' if len(flags) == 1 else 'need'} {needed}"
                ) from None
            raise typer.BadParameter(one_line(err), param_hint=", ".join(flags)) from None
    try:
        return registry(**on)
    except ValidationError as err:
        raise typer.BadParameter(f"these accelerations cannot run together: {one_line(err)}") from None


class AccelCommand(TyperCommand):
    """A typer command that lists its acceleration options (`accel_options`) in one help section
    per acceleration, after its own options, instead of one list of seventy."""

    def format_options(self, ctx: Any, formatter: Any) -> None:
        everything = self.params
        own = [p for p in everything if not (p.name or "").startswith(_PREFIX)]
        self.params = own
        try:
            super().format_options(ctx, formatter)
        finally:
            self.params = everything
        panels: dict[str, list[tuple[str, str]]] = {}
        for param in everything:
            panel = getattr(param, "rich_help_panel", None)
            if param in own or panel is None or (record := param.get_help_record(ctx)) is None:
                continue
            panels.setdefault(panel, []).append(record)
        for panel, records in panels.items():
            with formatter.section(panel):
                formatter.write_dl(records)
