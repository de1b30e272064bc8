"""Adding an acceleration is one new module and one registration line: shown with a toy.

The toy below is everything a new acceleration consists of: a config that declares what it needs
of the model and what its notes say when it never acted, and a plug-in class naming that config
with the hooks it uses. Registering it is a field on `Accel` and its line in `plugins.PLUGINS`;
here a subclass of `Accel` adds the field and the test adds the line, and nothing else in the
backend, the reasoner or the remote backend changes: the plug-in runs in the layer loop, its
counters reach the run's statistics, its note and the remote backend's refusal come from its
config's declarations.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from branchwise.backends.accel import Accel, AccelConfig
from branchwise.backends.base import DecodeParams
from branchwise.backends.hf import HFBackend, plugins
from branchwise.backends.hf.hooks import Acceleration, Exit, Forward, Host, Setup
from branchwise.backends.remote import RemoteBackend, UnsupportedOnRemote


class ToyConfig(AccelConfig):
    """Counts the decoder layers the backend runs (it reads the layer loop, so not remotely)."""

    internals: ClassVar[str | None] = "Toy (the layer loop)"

    def notes(self, stats: Mapping[str, float]) -> list[str]:
        return [] if stats.get("toy_layers") else ["toy: no layer ran"]


class Toy(Acceleration):
    name = "toy"
    config = ToyConfig

    def __init__(self, host: Host) -> None:
        self.host = host

    @classmethod
    def build(cls, cfg: ToyConfig, setup: Setup) -> Toy:
        return cls(setup.host)

    def after_layer(self, fwd: Forward, index: int, h_in: torch.Tensor, h: torch.Tensor) -> Exit | None:
        self.host.stats.bump("toy_layers")
        return None


class ToyAccel(Accel):
    toy: ToyConfig | None = None  # registration, part 1: the field


def test_a_toy_acceleration_runs_from_its_module_and_one_line(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plugins, "PLUGINS", (*plugins.PLUGINS, Toy))  # registration, part 2: the line
    backend = HFBackend(tiny_llama_dir)
    accel = ToyAccel(toy=ToyConfig())
    assert ToyAccel.configs()["toy"] is ToyConfig and plugins.plugin_for(ToyConfig) is Toy

    session = backend.session(accel=accel)
    root = session.prefill(session.encode("The answer is"))
    (gen,) = session.extend([root], DecodeParams(max_tokens=3, min_tokens=3))
    stats = session.kv_stats().as_dict()
    layers = backend.model.config.num_hidden_layers
    assert len(gen.token_ids) == 3
    assert stats["toy_layers"] == layers * stats["forward_calls"] > 0  # ran on every layer of every forward
    # the notes say the toy kept its decode steps off the fast step (it acts between layers)
    (note,) = accel.notes(stats)
    assert f"{int(stats['decode_steps_off_fast'])} decode steps left the fast step" in note
    assert note.endswith(f"toy ({int(stats['decode_steps_off_fast'])})")
    assert accel.notes({}) == ["toy: no layer ran"]

    with pytest.raises(UnsupportedOnRemote, match=r"Toy \(the layer loop\)"):
        RemoteBackend.check_accel(accel)
