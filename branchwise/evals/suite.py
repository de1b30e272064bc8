"""Eval suite configs: models × datasets × strategies × acceleration configs, validated by pydantic.

A suite is a YAML (or JSON) file; `load_suite` validates it and every mistake names its place
(``strategies.1.prebuilt``). A *cell* is one (model, dataset, strategy, acceleration) combination;
the harness runs every problem of the dataset in every cell and the report compares each cell with
its baseline cell (same model, dataset and strategy; the suite's ``baseline`` acceleration).

Why accelerations are two free-form dicts (``backend:`` options for the backend constructor,
``reasoner:`` options for `Reasoner`) rather than fixed fields: each new acceleration (ASKS, CGEE,
RSBCM, ...) adds options to those constructors, and a suite then uses them without any change to
this schema. The harness checks the option names against the constructors before loading a model,
and converts dict values into the pydantic config objects the constructors annotate (``accel:``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from branchwise.evals.datasets import DatasetConfig
from branchwise.strategies import Strategy
from branchwise.strategies.errors import describe_validation_error, describe_yaml_error

__all__ = ["AccelSpec", "Cell", "ModelSpec", "StrategySpec", "SuiteConfig", "SuiteError", "load_suite"]

_LABEL = r"^[A-Za-z0-9_.+\-]+$"


class SuiteError(ValueError):
    """A suite file that cannot be read or does not validate (the message says where)."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Spec):
    """A model: HF hub id or local path; ``null`` (or ``embedded``) = the embedded SmolLM2-135M."""

    name: str | None = None
    label: str | None = Field(None, pattern=_LABEL)
    backend: dict[str, Any] = Field(default_factory=dict, description="backend options (dtype, device...)")
    endpoints: list[str] = Field(
        default_factory=list,
        exclude=True,  # where a model runs is not what a run measures: resuming elsewhere is fine
        description="OpenAI-compatible servers of this model (vLLM, SGLang, branchwise serve); "
        "problems are spread over them instead of loading the model locally",
    )

    @property
    def display_name(self) -> str:
        if self.label:
            return self.label
        if self.name in (None, "embedded"):
            return "smollm2-135m"
        return Path(self.name).name or self.name.replace("/", "_")

    @property
    def load_name(self) -> str | None:
        return None if self.name in (None, "embedded") else self.name


def _prebuilt_names() -> dict[str, Any]:
    """Strategy factories exported by `branchwise.strategies` (new ones plug in automatically)."""
    import inspect

    import branchwise.strategies as strategies

    out = {}
    for name in getattr(strategies, "__all__", []):
        obj = getattr(strategies, name, None)
        if inspect.isfunction(obj) and name[0].islower():
            out[name] = obj
    return out


class StrategySpec(_Spec):
    """A strategy: a prebuilt factory with parameters, an inline graph, or a JSON/YAML file."""

    label: str = Field(pattern=_LABEL)
    prebuilt: str | None = Field(None, description="factory in branchwise.strategies, e.g. self_consistency")
    params: dict[str, Any] = Field(default_factory=dict, description="arguments of the prebuilt factory")
    strategy: dict[str, Any] | None = Field(None, description="an inline strategy graph")
    path: str | None = Field(None, description="a JSON/YAML strategy file (relative to the suite file)")

    @model_validator(mode="after")
    def _one_source(self) -> StrategySpec:
        given = [k for k in ("prebuilt", "strategy", "path") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of prebuilt, strategy, path (got {given or 'none'})")
        if self.params and self.prebuilt is None:
            raise ValueError("params only apply to a prebuilt strategy")
        if self.prebuilt is not None:
            names = _prebuilt_names()
            if self.prebuilt not in names:
                raise ValueError(f"unknown prebuilt {self.prebuilt!r}; known: {', '.join(sorted(names))}")
        return self

    def build(self, base_dir: Path | None = None) -> Strategy:
        """The validated `Strategy` (raises pydantic's `ValidationError` naming the bad field)."""
        if self.prebuilt is not None:
            return _prebuilt_names()[self.prebuilt](**self.params)
        if self.strategy is not None:
            return Strategy.model_validate(self.strategy)
        path = Path(self.path or "")
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        text = path.read_text()
        return Strategy.from_json(text) if path.suffix == ".json" else Strategy.from_yaml(text)


class AccelSpec(_Spec):
    """An acceleration config: options for the backend constructor and for `Reasoner`.

    ``{label: no-kv, reasoner: {share: none}}`` is the No-KV baseline, ``{label: exact, reasoner:
    {share: exact}}`` token-exact prefix reuse; later accelerations add their own options, e.g.
    ``reasoner: {accel: {cgee: {level1: true}}}``.
    """

    label: str = Field(pattern=_LABEL)
    backend: dict[str, Any] = Field(default_factory=dict)
    reasoner: dict[str, Any] = Field(default_factory=dict)

    @field_validator("reasoner")
    @classmethod
    def _no_owned_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        owned = {"strategy", "backend", "system_prompt"} & set(value)
        if owned:
            raise ValueError(f"{sorted(owned)} are set by the harness, not by an acceleration config")
        return value


def _default_accels() -> list[AccelSpec]:
    return [
        AccelSpec(label="no-kv", reasoner={"share": "none"}),
        AccelSpec(label="exact", reasoner={"share": "exact"}),
    ]


@dataclass(frozen=True)
class Cell:
    """One (model, dataset, strategy, acceleration) combination of a suite."""

    model: ModelSpec
    dataset: Any
    strategy: StrategySpec
    accel: AccelSpec

    @property
    def id(self) -> str:
        return "/".join(
            (self.model.display_name, self.dataset.display_name, self.strategy.label, self.accel.label)
        )


class SuiteConfig(_Spec):
    """A whole eval suite. See `examples/suites/quick.yaml` for a commented example."""

    name: str = Field(min_length=1)
    description: str = ""
    models: list[ModelSpec] = Field(default_factory=lambda: [ModelSpec()], min_length=1)
    datasets: list[DatasetConfig] = Field(min_length=1)
    strategies: list[StrategySpec] = Field(min_length=1)
    accelerations: list[AccelSpec] = Field(default_factory=_default_accels, min_length=1)
    baseline: str | None = Field(
        None, description="acceleration label speedups are measured against; default: the first"
    )
    limit: int | None = Field(
        None, ge=1, description="cap on problems per dataset (overrides nothing larger)"
    )

    @field_validator("models", mode="before")
    @classmethod
    def _model_strings(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"name": v} if isinstance(v, str) or v is None else v for v in value]
        return value

    @model_validator(mode="after")
    def _labels(self) -> SuiteConfig:
        for what, labels in (
            ("models", [m.display_name for m in self.models]),
            ("datasets", [d.display_name for d in self.datasets]),
            ("strategies", [s.label for s in self.strategies]),
            ("accelerations", [a.label for a in self.accelerations]),
        ):
            dupes = sorted({x for x in labels if labels.count(x) > 1})
            if dupes:
                raise ValueError(f"{what}: labels must be unique; repeated: {dupes} (set label: ...)")
        if self.baseline is not None and self.baseline not in [a.label for a in self.accelerations]:
            raise ValueError(
                f"baseline {self.baseline!r} is not an acceleration label "
                f"({', '.join(a.label for a in self.accelerations)})"
            )
        return self

    @property
    def baseline_label(self) -> str:
        return self.baseline or self.accelerations[0].label

    def cells(self) -> list[Cell]:
        return [
            Cell(m, d, s, a)
            for m in self.models
            for d in self.datasets
            for s in self.strategies
            for a in self.accelerations
        ]

    def fingerprint(self) -> str:
        """Hash of the validated config: a run directory belongs to one suite configuration."""
        blob = json.dumps(self.model_dump(mode="json", by_alias=True), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def load_suite(path: str | Path) -> SuiteConfig:
    """Read and validate a suite file (YAML or JSON); strategies are built to validate them too."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise SuiteError(f"cannot read suite {p}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise SuiteError(f"suite {p}: {describe_yaml_error(exc)}") from exc
    if not isinstance(data, dict):
        found = "an empty document" if data is None else f"a {type(data).__name__}"
        raise SuiteError(f"suite {p} must be a mapping with name, datasets, strategies...; found {found}")
    try:
        suite = SuiteConfig.model_validate(data)
    except ValidationError as exc:
        raise SuiteError(f"invalid suite {p}: {describe_validation_error(exc)}") from exc
    for i, spec in enumerate(suite.strategies):
        try:
            spec.build(p.parent)
        except ValidationError as exc:
            raise SuiteError(
                f"invalid suite {p}: strategies.{i} ({spec.label!r}): {describe_validation_error(exc)}"
            ) from exc
        except (TypeError, OSError) as exc:
            raise SuiteError(f"invalid suite {p}: strategies.{i} ({spec.label!r}): {exc}") from exc
    return suite
