"""CGEE (RKSC §2.3): level-1 gate, decode gate, level-2 entropy exit, calibration."""

from __future__ import annotations

import pytest
import torch

from branchwise.backends import DecodeParams
from branchwise.backends.accel import Accel, CGEEConfig
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.cgee import (
    Calibration,
    EntropyTrace,
    calibrate_from,
    count_flips,
    entropy,
)
from branchwise.backends.scores import gap_ratio, verify_skip
from branchwise.reasoners import Reasoner
from branchwise.strategies import best_of_n

PAPER = {"cost_aware": False, "verdict_gate": False}  # Alg. 3 as written: every layer from l_min


def test_gate_needs_both_conditions() -> None:
    assert verify_skip([0.9, 0.5], tau_conf=0.7, r_gap=0.06)
    assert not verify_skip([0.9, 0.89], tau_conf=0.7, r_gap=0.06)  # close competitor
    assert not verify_skip([0.3, 0.1], tau_conf=0.7, r_gap=0.06)  # big gap, low confidence
    assert not verify_skip([], tau_conf=0.0, r_gap=0.0)
    assert gap_ratio([0.8]) == 1.0
    assert gap_ratio([0.8, 0.4]) == pytest.approx(0.5)
    assert gap_ratio([0.0, 0.0]) == 0.0


def _kids(backend: HFBackend, n: int = 4) -> tuple[int, list[int]]:
    root = backend.prefill(backend.encode("Is two plus two four?"))
    kids = backend.fork(root, n)
    backend.extend(kids, DecodeParams(temperature=1.0, max_tokens=5, min_tokens=5, seed=0))
    return root, kids


def test_level2_without_exit_equals_full_depth(tiny_llama_dir) -> None:
    backend = HFBackend(tiny_llama_dir)
    root, kids = _kids(backend)
    suffix, cands = backend.encode(" Yes or no?"), [5, 6, 7]
    full = backend.score_next(kids, suffix, cands)
    backend.accel = Accel(cgee=CGEEConfig.lossless(theta=1e-9, l_min=1))  # nothing can pass θ
    trace: list[EntropyTrace] = []
    got = backend.score_next(kids, suffix, cands, trace=trace)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(full), atol=1e-6, rtol=1e-5)
    assert all(t.exit_layer is None for t in trace)
    backend.release([root, *kids])


def test_level2_exit_uses_the_normed_logit_lens(tiny_llama_dir) -> None:
    backend = HFBackend(tiny_llama_dir)
    root, kids = _kids(backend, 3)
    backend.accel = Accel(cgee=CGEEConfig.lossless(theta=99.0, epsilon=99.0, l_min=1, **PAPER))
    suffix, cands = backend.encode(" Yes?"), [5, 6]
    trace: list[EntropyTrace] = []
    probs = backend.score_next(kids, suffix, cands, trace=trace)
    # layer 1 has no previous entropy to be stable against (H_prev = +inf), so the exit is at layer 2
    assert [t.exit_layer for t in trace] == [2, 2, 2]
    stats = backend.kv_stats().extra
    assert stats["verify_exits"] == 3 and stats["verify_layers"] == 6
    # reference: layer-2 hidden state of the full sequence, through the final norm and the LM head
    for kid, p in zip(kids, probs, strict=True):
        ids = torch.tensor([backend.tokens(kid) + suffix], device=backend.device)
        with torch.inference_mode():
            hidden = backend.model(ids, output_hidden_states=True).hidden_states[2][0, -1]
            logits = backend.model.lm_head(backend.model.model.norm(hidden))
        ref = torch.softmax(logits, -1)[cands]
        assert p == pytest.approx(ref.tolist(), abs=1e-5)
    backend.release([root, *kids])


def test_level1_skips_verify_in_reasoner(tiny_llama_dir) -> None:
    backend = HFBackend(tiny_llama_dir)
    strat = best_of_n(n=3, max_tokens=4, seed=0)
    skip = Reasoner(strat, backend=backend, accel=Accel(cgee=CGEEConfig(tau_conf=0.0, r_gap=0.0))).run("q")
    assert skip.verify_calls == 1 and skip.verify_skipped == 1
    assert "confidence" in skip.branches[0].scores and "judge" not in skip.branches[0].scores
    never = Reasoner(strat, backend=backend, accel=Accel(cgee=CGEEConfig(tau_conf=1.0, level2=False))).run(
        "q"
    )
    assert never.verify_skipped == 0 and "judge" in never.branches[0].scores
    assert backend.accel == Accel()  # the reasoner's accel applied only during its runs


def test_decode_gate_stops_confident_batches(tiny_llama_dir) -> None:
    backend = HFBackend(tiny_llama_dir)
    backend.accel = Accel(
        cgee=CGEEConfig(decode_gate=True, theta_dec=0.0, r_dec=0.0, decode_gate_min_tokens=2)
    )
    root = backend.prefill(backend.encode("Hello"))
    kids = backend.fork(root, 3)
    gens = backend.extend(kids, DecodeParams(temperature=1.0, max_tokens=20, seed=1))
    assert all(g.finish_reason == "confident" or len(g.token_ids) < 2 for g in gens)
    assert max(len(g.token_ids) for g in gens) == 2
    backend.release([root, *kids])


def _trace(ent: dict[int, float], probs: dict[int, list[float]]) -> EntropyTrace:
    return EntropyTrace(entropies=ent, probs=probs)


def test_calibration_percentiles_and_safe_l_min(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("BRANCHWISE_CACHE_DIR", str(tmp_path))
    # 3 inspected layers + final (4); layer 1 cannot exit (no previous entropy). Row A is confident
    # at layer 2 and there prefers itself; at full depth row B wins: exiting at 2 flips the decision.
    early_wrong = [
        _trace({1: 0.2, 2: 0.05, 3: 0.5}, {1: [0.5, 0.5], 2: [0.9, 0.1], 3: [0.2, 0.8], 4: [0.2, 0.8]}),
        _trace({1: 0.2, 2: 0.15, 3: 0.5}, {1: [0.5, 0.5], 2: [0.8, 0.2], 3: [0.8, 0.2], 4: [0.8, 0.2]}),
    ]
    confidences = [[0.9, 0.5], [0.6, 0.55], [0.8, 0.2], [0.7, 0.7]]
    assert count_flips([early_wrong], theta=0.1, epsilon=5.0, l_min=1, n_layers=4) == 1
    assert count_flips([early_wrong], theta=0.1, epsilon=5.0, l_min=3, n_layers=4) == 0
    cal = calibrate_from("m/x", confidences, [early_wrong], epsilon=5.0, l_min=1, n_layers=4)
    assert cal.tau_conf == pytest.approx(0.825)  # 75th percentile of maxima [0.9, 0.6, 0.8, 0.7]
    assert cal.r_gap == pytest.approx(0.0625)  # 25th percentile of gaps [0.444, 0.083, 0.75, 0]
    assert cal.theta == pytest.approx(0.1)  # median entropy at the first stable layer (2): 0.05, 0.15
    assert cal.l_min == 3 and cal.flips_at_l_min == 0
    cal.save()
    assert Calibration.load("m/x") == cal


def test_entropy_of_uniform_and_peaked() -> None:
    assert entropy(torch.zeros(4)).item() == pytest.approx(torch.log(torch.tensor(4.0)).item())
    assert entropy(torch.tensor([100.0, 0.0, 0.0])).item() == pytest.approx(0.0, abs=1e-6)


def test_candidate_mass_guard_blocks_uninformative_exits(tiny_llama_dir) -> None:
    """With the guard, a row exits only where the verdict tokens hold enough probability."""
    backend = HFBackend(tiny_llama_dir)
    root, kids = _kids(backend, 3)
    backend.accel = Accel(
        cgee=CGEEConfig.lossless(theta=99.0, epsilon=99.0, l_min=1, min_candidate_mass=0.999, **PAPER)
    )
    trace: list[EntropyTrace] = []
    backend.score_next(kids, backend.encode(" Yes?"), [5, 6], trace=trace)
    assert all(t.exit_layer is None for t in trace)  # two random tokens never hold 99.9 % of the mass
    assert all(t.exit_at(99.0, 99.0, 1) == 2 for t in trace)  # without the guard they would exit at 2
    assert all(t.exit_at(99.0, 99.0, 1, min_candidate_mass=0.999) is None for t in trace)
    backend.release([root, *kids])


def test_rows_exiting_at_different_layers(tiny_llama_dir) -> None:
    """Some rows exit at layer 2, the rest run to full depth in the same forward (batch shrinks mid-loop)."""
    backend = HFBackend(tiny_llama_dir)
    root, kids = _kids(backend, 4)
    suffix, cands = backend.encode(" Yes?"), [5, 6]
    full = backend.score_next(kids, suffix, cands)
    trace: list[EntropyTrace] = []
    backend.score_next(kids, suffix, cands, trace=trace)  # record entropies (level 2 off)
    layer2 = sorted(t.entropies[2] for t in trace)
    theta = (layer2[1] + layer2[2]) / 2  # two rows below, two above
    backend.accel = Accel(cgee=CGEEConfig.lossless(theta=theta, epsilon=99.0, l_min=2, **PAPER))
    exits: list[EntropyTrace] = []
    got = backend.score_next(kids, suffix, cands, trace=exits)
    assert sorted(t.exit_layer is not None for t in exits) == [False, False, True, True]
    for t, g, f in zip(exits, got, full, strict=True):
        if t.exit_layer is None:  # rows that stayed see exactly the full-depth result
            torch.testing.assert_close(torch.tensor(g), torch.tensor(f), atol=1e-6, rtol=1e-5)
    backend.release([root, *kids])


def _fake_parts(n_layers: int, hidden: int, vocab: int):
    from torch import nn

    from branchwise.backends.hf.arch import DecoderParts

    layers = nn.ModuleList([nn.Sequential(nn.Linear(hidden, hidden, bias=False)) for _ in range(n_layers)])
    return DecoderParts(
        embed=nn.Identity(), layers=layers, rotary=nn.Identity(), norm=nn.Identity(),
        head=nn.Linear(hidden, vocab, bias=False), n_heads=1, n_kv_heads=1, head_dim=hidden,
    )  # fmt: skip


def test_cost_aware_schedule_inspects_only_layers_that_can_pay() -> None:
    """Head = 8 layers of cost: in a 30-layer model an exit after layer 22 saves ≤ 8 layers, so no
    check there; from l_min = 4 every 3rd layer (and l_min − 1 for the previous entropy)."""
    from branchwise.backends.hf.cgee import EntropyExit, head_cost_layers

    parts = _fake_parts(30, 16, 8 * 16)
    assert head_cost_layers(parts) == pytest.approx(8.0)
    aware = EntropyExit(parts, 1, 1.0, 1.0, l_min=4, check_every=3, cost_aware=True)
    assert [d for d in range(1, 31) if aware.inspects(d)] == [3, 4, 7, 10, 13, 16, 19]
    paper = EntropyExit(parts, 1, 1.0, 1.0, l_min=4)
    assert [d for d in range(1, 31) if paper.inspects(d)] == list(range(3, 30))
    record = EntropyExit(parts, 1, 1.0, 1.0, l_min=4, exit=False, cost_aware=True)
    assert [d for d in range(1, 31) if record.inspects(d)] == list(range(1, 30))  # calibration sees all


def test_verdict_gate_removes_full_checks_without_changing_results(tiny_llama_dir) -> None:
    """The verdict gate only skips full-vocabulary checks: with θ that nothing passes, results equal
    full depth, and the gate runs fewer full checks than the paper's every-layer schedule."""
    backend = HFBackend(tiny_llama_dir)
    root, kids = _kids(backend, 4)
    suffix, cands = backend.encode(" Yes or no?"), [5, 6, 7]
    full = backend.score_next(kids, suffix, cands)
    checks = {}
    for gate in (False, True):
        backend.accel = Accel(
            cgee=CGEEConfig.lossless(theta=1e-9, l_min=1, cost_aware=False, verdict_gate=gate)
        )
        backend.reset_stats()
        got = backend.score_next(kids, suffix, cands)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(full), atol=1e-6, rtol=1e-5)
        checks[gate] = backend.kv_stats().extra.get("verify_checks", 0)
    n_layers = backend.model.config.num_hidden_layers
    assert checks[False] == 4 * (n_layers - 1)
    assert checks[True] < checks[False]
    backend.release([root, *kids])
