"""Notes on a run whose acceleration was on but never acted (RKSC's ASKS, CGEE and RSBCM here; River,
the probe, SkipKV and ReasonCache in their own tests): a result must never imply a speed-up it did
not get. The wording lives on each config (`notes(stats)`); the plug-ins' counters feed it."""

from __future__ import annotations

from branchwise.backends.accel import Accel, ASKSConfig, CGEEConfig, RSBCMConfig
from branchwise.backends.hf import HFBackend
from branchwise.reasoners import Reasoner
from branchwise.strategies import best_of_n, self_consistency


def _starts(notes: list[str], prefix: str) -> list[str]:
    return [n for n in notes if n.startswith(prefix)]


def test_notes_from_statistics_alone() -> None:
    """Each config says what its counters show, and nothing once it acted."""
    asks = ASKSConfig(tau=0.9)
    assert asks.notes({"asks_rejected": 2, "asks_sigma_sum": 1.5}) == [
        "asks: the gate rejected all 2 differently phrased prompt(s) (mean similarity 0.750 < tau 0.9); "
        "each computed its own KV"
    ]
    assert asks.notes({"asks_rejected": 2, "asks_reused": 1}) == []
    assert _starts(asks.notes({}), "asks: no fork met a differently phrased prompt")
    cgee = CGEEConfig(level2=True, decode_gate=True)
    notes = cgee.notes({"cgee_skip_checks": 3, "verify_rows": 6})
    assert _starts(notes, "cgee: level 1 skipped none of 3 verify pass(es)")
    assert _starts(notes, "cgee: level 2 let none of 6 verify row(s) exit early")
    assert _starts(notes, "cgee: the decode gate never")
    acted = {"cgee_skip_checks": 3, "cgee_verify_skips": 1, "verify_rows": 6, "verify_exits": 2}
    assert cgee.notes({**acted, "decode_gate_stops": 1}) == []
    assert CGEEConfig().notes({}) == ["cgee: the run had no verify pass to skip or shorten"]
    rsbcm = RSBCMConfig(capacity_blocks=8, block_tokens=4)
    assert rsbcm.notes({}) == [
        "rsbcm: the run never held more than 8 evictable blocks of 4 tokens after a decode; "
        "nothing was evicted (attention mass was never tracked)"
    ]
    assert rsbcm.notes({"rsbcm_tracked_batches": 2}) == [
        "rsbcm: the run never held more than 8 evictable blocks of 4 tokens after a decode; "
        "nothing was evicted"
    ]
    assert rsbcm.notes({"rsbcm_evictions": 1}) == []
    both = Accel(asks=asks, rsbcm=rsbcm).notes({"asks_reused": 1})
    assert both == rsbcm.notes({})  # `Accel.notes` collects the enabled ones


def test_cgee_that_never_skipped_or_exited_says_so(tiny_llama_dir) -> None:
    backend = HFBackend(tiny_llama_dir)
    strat = best_of_n(n=3, max_tokens=4, seed=0)
    skip = Reasoner(strat, backend=backend, accel=Accel(cgee=CGEEConfig(tau_conf=0.0, r_gap=0.0))).run("q")
    assert skip.verify_skipped == 1 and not _starts(skip.notes, "cgee")
    # level 1 never decisive; level 2 with an entropy threshold no layer reaches
    never = CGEEConfig(tau_conf=1.0, level2=True, theta=1e-6, l_min=1)
    result = Reasoner(strat, backend=backend, accel=Accel(cgee=never)).run("q")
    assert result.verify_skipped == 0 and result.kv_stats["verify_exits"] == 0
    assert _starts(result.notes, "cgee: level 1 skipped none of 1 verify pass(es)")
    assert _starts(result.notes, "cgee: level 2 let none of 3 verify row(s) exit early")


def test_asks_that_rejected_every_prompt_says_so(tiny_llama_dir) -> None:
    backend = HFBackend(tiny_llama_dir)
    strat = self_consistency(n=4, temperature=0.0, max_tokens=4)
    variants = ["How many apples?", "Count the apples.", "Apples in total?"]
    for tau, noted in ((1.0, True), (0.0, False)):
        result = Reasoner(strat, backend=backend, accel=Accel(asks=ASKSConfig(tau=tau))).run(
            "How many apples?", variants=variants
        )
        assert bool(_starts(result.notes, "asks: the gate rejected all 2")) is noted, result.notes


def test_rsbcm_that_never_evicted_says_so(tiny_llama_dir) -> None:
    backend = HFBackend(tiny_llama_dir)
    strat = self_consistency(n=3, max_tokens=8, seed=0)
    for capacity, noted in ((10_000, True), (1, False)):
        accel = Accel(rsbcm=RSBCMConfig(capacity_blocks=capacity, block_tokens=4))
        result = Reasoner(strat, backend=backend, accel=accel).run("What is 1 + 2?")
        assert bool(result.kv_stats.get("rsbcm_evictions")) is not noted
        assert bool(_starts(result.notes, "rsbcm: the run never held more than")) is noted, result.notes
