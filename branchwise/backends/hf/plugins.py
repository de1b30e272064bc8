"""The registry of acceleration plug-ins: which plug-in each `Accel` config turns on, and in what
order their hooks run.

This is the one module that names every acceleration: the core (tree, batch, runner, decode loop,
session) only calls hooks. Each plug-in class declares its config type (`Acceleration.config`) and
how one run's instance is built (`Acceleration.build`); what the config alone must say without torch
(needs the model, exclusions, notes) lives on the config (`backends/accel.py`). So adding an
acceleration is its config, its module, and its line in `PLUGINS`.

A run gets fresh plug-in instances (their state is per run), built on cached artefacts that depend
only on the backend and the config (`Setup.cached`):

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

from typing import TYPE_CHECKING

from branchwise.backends.accel import Accel, AccelConfig
from branchwise.backends.hf.asks import ASKS
from branchwise.backends.hf.cgee import CGEE, EntropyTrace, layer_trace
from branchwise.backends.hf.hooks import Acceleration, Builds, Host, Setup
from branchwise.backends.hf.probe import Probe
from branchwise.backends.hf.reasoncache import ReasonCache
from branchwise.backends.hf.river import River
from branchwise.backends.hf.rsbcm import RSBCM
from branchwise.backends.hf.skipkv import SkipKV

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["PLUGINS", "EntropyTrace", "build_plugins", "layer_trace", "plugin_for"]

PLUGINS: tuple[type[Acceleration], ...] = (Probe, ASKS, RSBCM, SkipKV, ReasonCache, River, CGEE)
"""Every acceleration's plug-in class, in the order their hooks run (the probe decides a fork before
ASKS places prompts; evictions run before River and CGEE read the layers)."""


def plugin_for(config: type[AccelConfig]) -> type[Acceleration]:
    """The plug-in class registered for a config type; a config with none fails loudly (an `Accel`
    field whose acceleration was never registered would otherwise be silently off)."""
    for plugin in PLUGINS:
        if plugin.config is config:
            return plugin
    raise TypeError(f"no plug-in is registered for {config.__name__}: add its class to plugins.PLUGINS")


def build_plugins(
    accel: Accel,
    host: Host,
    *,
    tokenizer: PreTrainedTokenizerBase,
    model_name: str,
    builds: Builds,
) -> list[Acceleration]:
    """Fresh plug-ins for one run of `accel`, in the order their hooks must run."""
    configs = {type(cfg): cfg for cfg in accel.enabled().values()}
    for config in configs:
        plugin_for(config)
    setup = Setup(host, tokenizer, model_name, builds)
    out: list[Acceleration] = []
    for plugin in PLUGINS:
        cfg = None if plugin.config is None else configs.get(plugin.config)
        if cfg is not None:
            out.append(plugin.build(cfg, setup))
    setup.report()
    return out
