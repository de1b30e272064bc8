"""The acceleration registry: each `Accel` field's config type has exactly one plug-in registered
against it, and every table the backends need (exclusive pairs, what needs the model, notes) is
collected from the configs' own declarations, never kept beside them."""

from __future__ import annotations

import pytest

from branchwise.backends.accel import (
    EXCLUSIVE,
    Accel,
    AccelConfig,
    ASKSConfig,
    CGEEConfig,
    ProbeConfig,
    ReasonCacheConfig,
    RiverConfig,
    RSBCMConfig,
    SkipKVConfig,
)
from branchwise.backends.hf.plugins import PLUGINS, plugin_for


def test_every_config_has_one_plugin_named_as_its_field() -> None:
    configs = Accel.configs()
    assert sorted(p.__name__ for p in map(plugin_for, configs.values())) == sorted(
        p.__name__ for p in PLUGINS
    )
    for name, config in configs.items():
        assert plugin_for(config).name == name  # errors and notes name it `accel.<name>`
    assert len({p.config for p in PLUGINS}) == len(PLUGINS)


def test_a_config_with_no_plugin_fails_loudly() -> None:
    class Unregistered(AccelConfig):
        pass

    with pytest.raises(TypeError, match="no plug-in is registered for Unregistered"):
        plugin_for(Unregistered)


def test_exclusive_pairs_come_from_the_configs_and_name_real_fields() -> None:
    fields = set(Accel.configs())
    pairs = [frozenset((a, b)) for a, b, _ in EXCLUSIVE]
    assert len(pairs) == len(set(pairs))  # each pair declared once
    assert all(pair <= fields and len(pair) == 2 for pair in pairs)
    assert set(pairs) == {
        frozenset(("skipkv", "rsbcm")),
        frozenset(("reasoncache", "skipkv")),
        frozenset(("reasoncache", "rsbcm")),
    }


def test_needs_model_names_all_but_cgee_level1() -> None:
    everything_but_cgee = [
        Accel(asks=ASKSConfig(), probe=ProbeConfig(), rsbcm=RSBCMConfig(), river=RiverConfig()),
        Accel(skipkv=SkipKVConfig(budget=8)),
        Accel(reasoncache=ReasonCacheConfig()),
    ]
    named = [part for accel in everything_but_cgee for part in accel.needs_model()]
    assert len(named) == 6 and all(part for part in named)
    assert Accel(cgee=CGEEConfig()).needs_model() == []  # level 1 runs on token probabilities
    assert Accel(cgee=CGEEConfig(level1=False, level2=True, decode_gate=True)).needs_model() == [
        "CGEE level 2 (per-layer entropy exit)",
        "the CGEE decode gate (stopping inside the decode loop)",
    ]
    assert Accel().needs_model() == []


def test_cgee_level1_thresholds_fall_back_to_the_papers() -> None:
    assert CGEEConfig().level1_thresholds() == (CGEEConfig.PAPER_TAU_CONF, CGEEConfig.PAPER_R_GAP)
    assert CGEEConfig(tau_conf=0.5, r_gap=0.2).level1_thresholds() == (0.5, 0.2)
