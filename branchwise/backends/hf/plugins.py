"""Which plug-ins an `Accel` config turns on, and the cache of their expensive builds.

This is the one module that names every acceleration: the core (tree, batch, runner, decode loop,
session) only calls hooks. A run gets fresh plug-in instances (their state is per run), built on
cached artefacts that depend only on the backend and the config:

| build | cache key | cost it saves per run |
|---|---|---|
| River's quantized layers | the config's weight fields (`river.weights_key`) | quantizing every layer after the entry layer |
| SkipKV's delimiter ids | the backend (its tokenizer) | decoding the whole vocabulary |
| ReasonCache's step boundaries | the backend (its tokenizer) | decoding the whole vocabulary |
| ReasonCache's PAT distances | block size, percentile, warm-up | the warm-up: the distance distribution is the model's, so it is collected once per backend |
| SkipKV's steering vector | the steering config | loading, checking and moving the vector |
| CGEE's thresholds | the config and the calibration file's stamp | reading the saved calibration |
| the KV probe's verdicts | the probe's bucket size and repeats | timing sharing against recompute |

A run reports `<acceleration>_build_s` (the one-time cost of what it uses) and `accel_builds` (how
many of those it had to build itself: 0 once cached).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, TypeVar

from branchwise.backends.accel import Accel
from branchwise.backends.hf.asks import ASKS
from branchwise.backends.hf.cgee import CGEE, EntropyTrace, Thresholds, calibration_path, layer_trace
from branchwise.backends.hf.hooks import Acceleration, Host
from branchwise.backends.hf.probe import KVProbe, Probe
from branchwise.backends.hf.reasoncache import ReasonCache, StepBoundaries
from branchwise.backends.hf.reasoncache_filter import PercentileThreshold
from branchwise.backends.hf.river import River, RiverPath, weights_key
from branchwise.backends.hf.rsbcm import RSBCM
from branchwise.backends.hf.skipkv import SkipKV, SteeringBuild
from branchwise.backends.hf.skipkv_policy import delimiter_token_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["Builds", "EntropyTrace", "build_plugins", "layer_trace"]

T = TypeVar("T")


class Builds:
    """Artefacts built once per backend and key (see the module docstring); callers hold the
    backend's lock, so two runs never build the same thing twice."""

    def __init__(self) -> None:
        self._items: dict[Hashable, tuple[Any, float]] = {}

    def get(self, key: Hashable, make: Callable[[], T]) -> tuple[T, float, bool]:
        """`(artefact, seconds its build took, built just now)`."""
        if key in self._items:
            value, seconds = self._items[key]
            return value, seconds, False
        start = time.perf_counter()
        value = make()
        seconds = time.perf_counter() - start
        self._items[key] = (value, seconds)
        return value, seconds, True

    def __len__(self) -> int:
        return len(self._items)


def _calibration_stamp(model_name: str) -> tuple[int, int] | None:
    """When and how big the saved calibration is, so a new calibration is picked up (None: none)."""
    path = calibration_path(model_name)
    if not path.is_file():
        return None
    stat = path.stat()
    return stat.st_mtime_ns, stat.st_size


def build_plugins(
    accel: Accel,
    host: Host,
    *,
    tokenizer: PreTrainedTokenizerBase,
    model_name: str,
    builds: Builds,
) -> list[Acceleration]:
    """Fresh plug-ins for one run of `accel`, in the order their hooks must run."""
    stats, parts = host.stats, host.parts
    timings: dict[str, float] = {}
    fresh = 0

    def cached(name: str, key: Hashable, make: Callable[[], T]) -> T:
        nonlocal fresh
        value, seconds, built = builds.get(key, make)
        timings[name] = timings.get(name, 0.0) + seconds
        fresh += built
        return value

    out: list[Acceleration] = []
    if accel.probe is not None:
        cfg = accel.probe
        probe, _, _ = builds.get(
            ("probe", cfg.bucket_tokens, cfg.repeats, cfg.suffix_tokens),
            lambda: KVProbe(cfg.bucket_tokens, cfg.repeats, cfg.suffix_tokens),
        )
        out.append(Probe(cfg, probe))
    if accel.asks is not None:
        out.append(ASKS(accel.asks))
    if accel.rsbcm is not None:
        out.append(RSBCM(accel.rsbcm, host))
    if accel.skipkv is not None:
        skip = accel.skipkv
        delimiters = cached("skipkv", ("delimiters",), lambda: delimiter_token_ids(tokenizer))
        steering = None
        if skip.steering is not None:
            steer_cfg = skip.steering
            steering = cached(
                "skipkv",
                ("steering", steer_cfg),
                lambda: SteeringBuild.load(steer_cfg, parts, model_name, delimiters),
            )
        out.append(SkipKV(skip, parts, tokenizer, delimiters, steering, stats, host.tree))
    if accel.reasoncache is not None:
        rc = accel.reasoncache
        boundaries = cached("reasoncache", ("step_boundaries",), lambda: StepBoundaries.of(tokenizer))
        pat = cached(
            "reasoncache",
            ("pat", rc.block_tokens, rc.percentile, rc.warmup_blocks),
            lambda: PercentileThreshold(rc.percentile, rc.warmup_blocks),
        )
        out.append(ReasonCache(rc, tokenizer, boundaries, pat, host.tree, stats))
    if accel.river is not None:
        river_cfg = accel.river
        path = cached(
            "river",
            ("river", weights_key(river_cfg, parts, host.device)),
            lambda: RiverPath(parts, river_cfg, host.device),
        )
        out.append(River(river_cfg, path, stats))
    if accel.cgee is not None:
        cgee_cfg = accel.cgee
        thresholds = cached(
            "cgee",
            ("cgee", cgee_cfg, _calibration_stamp(model_name)),
            lambda: Thresholds.resolve(cgee_cfg, model_name),
        )
        out.append(CGEE(cgee_cfg, thresholds, parts, stats))
    for name, seconds in timings.items():
        stats.bump(f"{name}_build_s", seconds)
    if timings:
        stats.bump("accel_builds", fresh)
    return out
