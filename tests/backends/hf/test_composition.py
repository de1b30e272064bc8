"""Every combination of accelerations the config allows runs under self-consistency and beam search;
lossless settings keep greedy tokens equal to share="none"; forbidden pairs fail at construction."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from branchwise.backends.accel import (
    EXCLUSIVE,
    Accel,
    ASKSConfig,
    CGEEConfig,
    ProbeConfig,
    ReasonCacheConfig,
    RiverConfig,
    RSBCMConfig,
    SkipKVConfig,
    SteeringConfig,
)
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.skipkv_policy import SteeringVector
from branchwise.reasoners import Reasoner
from branchwise.strategies import beam_search, self_consistency

NAMES = tuple(Accel.configs())  # every registered acceleration: a new one must join the lists below
QUESTION = "What is 12 + 7?"
VARIANTS = ["What is 12 + 7?", "Compute 12 + 7.", "What is 12 plus 7?"]


def _allowed(names: tuple[str, ...]) -> bool:
    return not any(a in names and b in names for a, b, _ in EXCLUSIVE)


PAIRS = [pair for pair in itertools.combinations(NAMES, 2) if _allowed(pair)]
# "all of them together": every largest set of accelerations no exclusive pair rules out
EVICTING = ("rsbcm", "skipkv", "reasoncache")  # pairwise exclusive: one of them at a time
ALL = [tuple(n for n in NAMES if n not in EVICTING or n == keep) for keep in EVICTING]


@pytest.fixture(scope="module")
def backend(tiny_model_dir) -> HFBackend:
    return HFBackend(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def vector_path(backend: HFBackend, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("steering") / "v.pt"
    d = backend.parts.embed.embedding_dim
    SteeringVector(layer=1, vector=torch.full((d,), 0.05), n_exec=2, n_nonexec=1, model="tiny").save(path)
    return path


def _acting(names: tuple[str, ...], vector_path: Path) -> Accel:
    """Settings under which every acceleration acts on a tiny model (lossy where it must be)."""
    configs = {
        "asks": ASKSConfig(tau=0.0),
        "probe": ProbeConfig(repeats=1),
        # level 1 rarely skips (so level 2 exits run); the decode gate fires after the 9th token
        "cgee": CGEEConfig(
            level2=True,
            cost_aware=False,
            tau_conf=0.99,
            theta=99.0,
            epsilon=99.0,
            l_min=1,
            decode_gate=True,
            theta_dec=0.0,
            r_dec=0.0,
            decode_gate_min_tokens=9,
        ),
        "rsbcm": RSBCMConfig(capacity_blocks=3, block_tokens=4),
        "river": RiverConfig(threshold=-1.0, entry_layer=0, prefill=True),
        "skipkv": SkipKVConfig(
            budget=6,
            interval=4,
            window=2,
            query_window=4,
            steering=SteeringConfig(vector_path=str(vector_path)),
        ),
        "reasoncache": ReasonCacheConfig(block_tokens=2, mode="random", random_rate=1.0),
    }
    return Accel(**{name: configs[name] for name in names})


def _lossless(names: tuple[str, ...]) -> Accel:
    """Settings under which each acceleration is exact by design."""
    configs = {
        "asks": ASKSConfig(tau=1.0),
        "probe": ProbeConfig(repeats=1),
        "cgee": CGEEConfig.lossless(theta=1e-9),
        "rsbcm": RSBCMConfig(capacity_blocks=10_000),
        "river": RiverConfig(threshold=1.0, entry_layer=0),
        "skipkv": SkipKVConfig(budget=64, interval=4),
        "reasoncache": ReasonCacheConfig(tau_strict=1.0, tau_soft=1.0),  # no step is ever similar enough
    }
    return Accel(**{name: configs[name] for name in names})


def _strategies() -> list:
    return [
        self_consistency(n=3, max_tokens=12, seed=0),
        beam_search(width=4, depth=2, verifier="judge", max_step_tokens=8, step_delimiter="\n", seed=0),
    ]


@pytest.mark.parametrize("names", PAIRS + ALL, ids=lambda names: "+".join(names))
def test_allowed_combinations_run_under_both_strategies(backend: HFBackend, vector_path: Path, names) -> None:
    accel = _acting(names, vector_path)
    acted: dict[str, float] = {}
    for strategy in _strategies():
        result = Reasoner(strategy, backend=backend, accel=accel).run(QUESTION, variants=VARIANTS)
        assert result.branches, names
        assert result.kv_stats["tokens_computed"] > 0
        for key, value in result.kv_stats.items():
            acted[key] = acted.get(key, 0.0) + value
    # each acceleration of the combination really acted in at least one of the two runs
    for name in names:
        if name == "asks" and acted.get("probe_recompute"):
            continue  # the probe found recompute faster for a fork on this tiny model: nothing to gate
        assert any(acted.get(key, 0) > 0 for key in EVIDENCE[name]), (name, sorted(acted.items()))
    assert backend.kv_stats().live_nodes == 0 and backend.kv_stats().bytes_held == 0


@pytest.mark.parametrize("names", PAIRS + ALL, ids=lambda names: "+".join(names))
def test_lossless_combinations_keep_greedy_tokens(backend: HFBackend, names) -> None:
    greedy = self_consistency(n=3, temperature=0.0, max_tokens=10)
    reference = Reasoner(greedy, backend=backend, share="none").run(QUESTION, variants=VARIANTS)
    got = Reasoner(greedy, backend=backend, share="exact", accel=_lossless(names)).run(
        QUESTION, variants=VARIANTS
    )
    assert [b.text for b in got.branches] == [b.text for b in reference.branches]
    assert got.kv_stats.get("river_exits", 0) == 0 and got.kv_stats.get("skipkv_evicted_tokens", 0) == 0
    assert got.kv_stats.get("rsbcm_evictions", 0) == 0 and got.kv_stats.get("asks_reused", 0) == 0
    assert got.kv_stats.get("reasoncache_blocks_reused", 0) == 0


def test_rksc_without_rsbcm_plus_river_and_skipkv(backend: HFBackend) -> None:
    """The probe's timing runs no longer swap the backend's accel (this used to crash at the first fork)."""
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


@pytest.mark.parametrize(("a", "b"), [(a, b) for a, b, _ in EXCLUSIVE])
def test_forbidden_pairs_fail_at_construction_naming_both(a: str, b: str, vector_path: Path) -> None:
    others = tuple(n for n in NAMES if n not in (a, b) and _allowed((n, a)) and _allowed((n, b)))
    acting = _acting(others, vector_path)
    both = {a: getattr(_acting((a,), vector_path), a), b: getattr(_acting((b,), vector_path), b)}
    with pytest.raises(ValueError, match=rf"{a}.*{b}|{b}.*{a}"):
        Accel(**both)
    with pytest.raises(ValueError, match=rf"{a}.*{b}|{b}.*{a}"):
        Accel(**{**dict(acting), **both})


EVIDENCE = {
    "asks": ("asks_reused", "asks_rejected"),
    "probe": ("probe_share", "probe_recompute"),
    "cgee": ("verify_rows", "decode_gate_stops"),
    "rsbcm": ("rsbcm_evictions",),
    "river": ("river_exits",),
    "skipkv": ("skipkv_compressions",),
    "reasoncache": ("reasoncache_blocks_reused",),
}


@pytest.mark.parametrize("keep", EVICTING)
def test_constrained_rows_hold_their_grammar_under_every_acceleration(
    backend: HFBackend, vector_path: Path, keep: str
) -> None:
    """With every acceleration acting (River exiting from layer 0, CGEE's decode gate firing after
    9 tokens, eviction), each row's output still follows its grammar and ends whole: the mask acts
    on whatever logits a step produced, and the gate waits for complete constrained rows."""
    from branchwise.backends.base import DecodeParams
    from branchwise.constraints import Constraint

    names = next(group for group in ALL if keep in group)
    session = backend.session(accel=_acting(names, vector_path))
    c = Constraint.of_regex(r"(yes|no), [0-9]{2,12}\.")
    root = session.prefill(session.chat_prompt([{"role": "user", "content": QUESTION}]))
    kids = session.fork(root, 3)
    gens = session.extend(kids, DecodeParams(temperature=1.0, seed=0, max_tokens=40, constraint=c))
    session.release([*kids, root])
    for g in gens:
        assert g.finish_reason in ("eos", "confident"), g
        c.parse(g.text)
