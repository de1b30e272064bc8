"""Every combination of accelerations the config allows runs under self-consistency and beam search;
lossless settings keep greedy tokens equal to share="none"; forbidden pairs fail at construction.

The combinations and the settings come from the registry alone: the fields of `Accel`, each
config's `excludes` and its declared `examples` (settings that make it act, the statistics that
show it did, settings that keep it exact). A new acceleration joins every test here by declaring
them; nothing below names one. The last test shows it with a toy acceleration, which also gets its
command-line options with no CLI edit.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import typer
from pydantic import Field
from typer.testing import CliRunner

from branchwise.backends.accel import Accel, AccelConfig, Examples
from branchwise.backends.base import DecodeParams
from branchwise.backends.hf import HFBackend, plugins
from branchwise.backends.hf.hooks import Acceleration, Exit, Forward, Host, Setup, needs_layer_loop
from branchwise.reasoners import Reasoner
from branchwise.strategies import Strategy, beam_search, self_consistency

QUESTION = "What is 12 + 7?"
VARIANTS = ["What is 12 + 7?", "Compute 12 + 7.", "What is 12 plus 7?"]


def examples(config: type[AccelConfig]) -> Examples:
    assert config.examples is not None, f"{config.__name__} declares no `examples` for its tests"
    return config.examples


def exclusive(registry: type[Accel]) -> list[tuple[str, str]]:
    return [(a, b) for a, config in registry.configs().items() for b in config.excludes]


def allowed(registry: type[Accel], names: tuple[str, ...]) -> bool:
    return not any(a in names and b in names for a, b in exclusive(registry))


def pairs(registry: type[Accel]) -> list[tuple[str, ...]]:
    return [p for p in itertools.combinations(registry.configs(), 2) if allowed(registry, p)]


def largest(registry: type[Accel]) -> list[tuple[str, ...]]:
    """ "All of them together": every largest set of accelerations no exclusive pair rules out."""
    names = tuple(registry.configs())
    out: list[tuple[str, ...]] = []
    for size in range(len(names), 0, -1):
        for group in itertools.combinations(names, size):
            if allowed(registry, group) and not any(set(group) <= set(kept) for kept in out):
                out.append(group)
    return out


def acting(registry: type[Accel], names: tuple[str, ...]) -> Accel:
    """Settings under which every acceleration of ``names`` acts on a tiny model (lossy where it must be)."""
    configs = registry.configs()
    return registry(**{n: configs[n].model_validate(dict(examples(configs[n]).acting)) for n in names})


def lossless(registry: type[Accel], names: tuple[str, ...]) -> Accel:
    """Settings under which each acceleration of ``names`` is exact by design."""
    configs = registry.configs()
    settings = {n: examples(configs[n]).lossless for n in names}
    return registry(**{n: configs[n].model_validate(dict(s)) for n, s in settings.items() if s is not None})


def strategies() -> list[Strategy]:
    return [
        self_consistency(n=3, max_tokens=12, seed=0),
        beam_search(width=4, depth=2, verifier="judge", max_step_tokens=8, step_delimiter="\n", seed=0),
    ]


def check_acting(backend: HFBackend, registry: type[Accel], names: tuple[str, ...]) -> None:
    """Both strategies run with ``names`` acting, each acceleration shows it acted, nothing leaks."""
    accel = acting(registry, names)
    acted: dict[str, float] = {}
    for strategy in strategies():
        result = Reasoner(strategy, backend=backend, accel=accel).run(QUESTION, variants=VARIANTS)
        assert result.branches, names
        assert result.kv_stats["tokens_computed"] > 0
        for key, value in result.kv_stats.items():
            acted[key] = acted.get(key, 0.0) + value
    configs = registry.configs()
    for name in names:  # each acceleration of the combination really acted in at least one of the runs
        assert any(acted.get(key, 0) > 0 for key in examples(configs[name]).acted), (
            name,
            sorted(acted.items()),
        )
    if registry is Accel:  # every allowed combination decodes on the fast step
        assert not acted.get("decode_steps_layer_loop") and not acted.get("decode_steps_off_fast"), acted
    assert backend.kv_stats().live_nodes == 0 and backend.kv_stats().bytes_held == 0


def check_lossless(backend: HFBackend, registry: type[Accel], names: tuple[str, ...]) -> None:
    """Greedy tokens equal share="none"'s, and no acceleration counted an approximation."""
    greedy = self_consistency(n=3, temperature=0.0, max_tokens=10)
    reference = Reasoner(greedy, backend=backend, share="none").run(QUESTION, variants=VARIANTS)
    got = Reasoner(greedy, backend=backend, share="exact", accel=lossless(registry, names)).run(
        QUESTION, variants=VARIANTS
    )
    assert [b.text for b in got.branches] == [b.text for b in reference.branches]
    configs = registry.configs()
    changed = {key: got.kv_stats.get(key, 0) for n in names for key in examples(configs[n]).changed}
    assert not any(changed.values()), changed


@pytest.fixture(scope="module")
def backend(steered_backend: HFBackend) -> HFBackend:
    return steered_backend


def test_every_registered_acceleration_declares_its_examples() -> None:
    for name, config in Accel.configs().items():
        ex = examples(config)
        config.model_validate(dict(ex.acting))  # valid settings, or the tests below could not run
        if ex.lossless is not None:
            config.model_validate(dict(ex.lossless))
        assert ex.acted, name


@pytest.mark.parametrize("names", pairs(Accel) + largest(Accel), ids="+".join)
def test_allowed_combinations_run_under_both_strategies(backend: HFBackend, names: tuple[str, ...]) -> None:
    check_acting(backend, Accel, names)


@pytest.mark.parametrize("names", pairs(Accel) + largest(Accel), ids="+".join)
def test_lossless_combinations_keep_greedy_tokens(backend: HFBackend, names: tuple[str, ...]) -> None:
    check_lossless(backend, Accel, names)


def test_largest_sets_cover_every_acceleration_and_exclude_each_forbidden_pair() -> None:
    groups = largest(Accel)
    assert set().union(*groups) == set(Accel.configs())
    for a, b in exclusive(Accel):
        assert not any(a in g and b in g for g in groups)


def test_rksc_without_rsbcm_plus_river_and_skipkv(backend: HFBackend) -> None:
    """The probe's timing runs no longer swap the backend's accel (this used to crash at the first fork)."""
    from branchwise.backends.accel import RiverConfig, SkipKVConfig

    accel = Accel(
        **{
            **dict(Accel.rksc()),
            "rsbcm": None,
            "river": RiverConfig(threshold=-1.0, entry_layer=0),
            "skipkv": SkipKVConfig(budget=6, interval=4, window=2),
        }
    )
    result = Reasoner(self_consistency(n=3, max_tokens=12, seed=0), backend=backend, accel=accel).run(
        QUESTION
    )
    assert len(result.branches) == 3
    assert result.kv_stats["river_exits"] > 0
    assert result.kv_stats.get("probe_share", 0) + result.kv_stats.get("probe_recompute", 0) == 1


@pytest.mark.parametrize(("a", "b"), exclusive(Accel))
def test_forbidden_pairs_fail_at_construction_naming_both(a: str, b: str) -> None:
    names = tuple(Accel.configs())
    others = tuple(n for n in names if n not in (a, b) and allowed(Accel, (n, a)) and allowed(Accel, (n, b)))
    both = {a: getattr(acting(Accel, (a,)), a), b: getattr(acting(Accel, (b,)), b)}
    with pytest.raises(ValueError, match=rf"{a}.*{b}|{b}.*{a}"):
        Accel(**both)
    with pytest.raises(ValueError, match=rf"{a}.*{b}|{b}.*{a}"):
        Accel(**{**dict(acting(Accel, others)), **both})


@pytest.mark.parametrize("group", largest(Accel), ids="+".join)
def test_constrained_rows_hold_their_grammar_under_every_acceleration(
    backend: HFBackend, group: tuple[str, ...]
) -> None:
    """With every acceleration acting (River exiting from layer 0, CGEE's decode gate firing after
    9 tokens, eviction), each row's output still follows its grammar and ends whole: the mask acts
    on whatever logits a step produced, and the gate waits for complete constrained rows."""
    from branchwise.backends.base import DecodeParams
    from branchwise.constraints import Constraint

    session = backend.session(accel=acting(Accel, group))
    c = Constraint.of_regex(r"(yes|no), [0-9]{2,12}\.")
    root = session.prefill(session.chat_prompt([{"role": "user", "content": QUESTION}]))
    kids = session.fork(root, 3)
    gens = session.extend(kids, DecodeParams(temperature=1.0, seed=0, max_tokens=40, constraint=c))
    session.release([*kids, root])
    for g in gens:
        assert g.finish_reason in ("eos", "confident"), g
        c.parse(g.text)


# --- a new acceleration: one module (the config and the plug-in below) and one registration line


class ToyConfig(AccelConfig):
    """Counts the decoder layers the backend runs, every `every`-th one."""

    internals: ClassVar[str | None] = "Toy (the layer loop)"
    examples: ClassVar[Examples | None] = Examples(
        acting={"every": 1}, acted=("toy_layers",), lossless={"every": 2}
    )

    every: int = Field(1, ge=1, le=64, description="count every k-th layer")

    def notes(self, stats: Mapping[str, float]) -> list[str]:
        return [] if stats.get("toy_layers") else ["toy: no layer ran"]


class Toy(Acceleration):
    name = "toy"
    config = ToyConfig

    def __init__(self, host: Host, every: int) -> None:
        self.host, self.every = host, every

    @classmethod
    def build(cls, cfg: ToyConfig, setup: Setup) -> Toy:
        return cls(setup.host, cfg.every)

    def after_layer(self, fwd: Forward, index: int, h_in: torch.Tensor, h: torch.Tensor) -> Exit | None:
        if index % self.every == 0:
            self.host.stats.bump("toy_layers")
        return None


class ToyAccel(Accel):
    toy: ToyConfig | None = None  # registration: the field (and, below, the line in plugins.PLUGINS)


def test_a_toy_acceleration_gets_its_cli_options_and_its_composition_coverage(
    backend: HFBackend, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from branchwise import cli
    from branchwise.cli_accel import AccelCommand, accel_options

    monkeypatch.setattr(plugins, "PLUGINS", (*plugins.PLUGINS, Toy))

    # composition: the toy joins a pair with every other acceleration and every largest set (what
    # the tests above are parametrized with); one of each kind runs here, to keep this test short
    toy_pairs = [p for p in pairs(ToyAccel) if "toy" in p]
    assert len(toy_pairs) == len(Accel.configs())
    assert [tuple(n for n in g if n != "toy") for g in largest(ToyAccel)] == largest(Accel)
    check_acting(backend, ToyAccel, largest(ToyAccel)[0])
    check_lossless(backend, ToyAccel, ("toy", "river"))

    # the command line: `run`'s own function, its options generated from the registry with the toy
    app = typer.Typer(rich_markup_mode=None)
    app.command(cls=AccelCommand)(accel_options(ToyAccel)(cli.run.__wrapped__))  # type: ignore[attr-defined]
    runner = CliRunner()
    shown = runner.invoke(app, ["--help"], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    assert "Acceleration toy:" in shown.output and "--toy / --no-toy" in shown.output
    assert "--toy-every" in shown.output and "count every k-th layer [1<=x<=64; default 1]" in shown.output
    bad = runner.invoke(app, ["q", "--toy-every", "0"])
    assert bad.exit_code == 2 and "'--toy-every': 0 is not in the range 1<=x<=64" in bad.output
    args = ["What is 12 + 7?", "--n", "2", "--max-tokens", "3", "--model", str(tiny_llama_dir), "--json"]
    ran = runner.invoke(app, [*args, "--toy-every", "2"])
    assert ran.exit_code == 0, ran.output
    stats = json.loads(ran.stdout.strip().splitlines()[-1])["kv_stats"]
    assert stats["toy_layers"] > 0
    off = runner.invoke(app, args)
    assert "toy_layers" not in json.loads(off.stdout.strip().splitlines()[-1])["kv_stats"]


@pytest.mark.parametrize("name", sorted(Accel.configs()))
def test_every_acceleration_decodes_on_the_fixed_step(backend: HFBackend, name: str) -> None:
    """Every acceleration decodes on the fixed-shape step (`step.py`, what a GPU captures): those
    that act between steps simply, those that act inside one through its inputs (steering, exits,
    taps the step feeds, the block pool). Each with the settings its config declares for tests."""
    config = Accel.configs()[name]
    assert config.examples is not None
    accel = Accel(**{name: config.model_validate(dict(config.examples.acting))})
    session = backend.session(accel=accel)
    root = session.prefill(backend.encode("What is 12 + 7? Think step by step."))
    kids = session.fork(root, 2)
    session.extend(kids, DecodeParams(max_tokens=6, min_tokens=6))
    stats = session.kv_stats().as_dict()
    session.release([root, *kids])
    on_fixed_step = stats.get("decode_steps_fixed", 0) + stats.get(
        "decode_steps_captured", 0
    )  # captured: CUDA
    assert on_fixed_step >= 5, stats
    assert "decode_steps_layer_loop" not in stats and "decode_steps_off_fast" not in stats, stats
    assert needs_layer_loop(session.plugins) == []
