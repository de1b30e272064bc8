"""ASKS (RKSC §2.2): token-exact partial sharing and the similarity gate."""

from __future__ import annotations

import pytest
import torch

from branchwise.backends import DecodeParams
from branchwise.backends.accel import Accel, ASKSConfig
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.asks import layer_weights, similarity

GREEDY = DecodeParams(max_tokens=6, min_tokens=6)
CONTEXT = " The farmer has 12 apples and buys 7 more in the morning market."
PHRASINGS = [
    "How many apples now?",
    "What is the total number of apples?",
    "Count the apples.",
    "Apples in all?",
]


def _prompts(backend: HFBackend) -> tuple[list[int], list[list[int]]]:
    root = backend.encode(PHRASINGS[0] + CONTEXT)
    return root, [backend.encode(p + CONTEXT) for p in PHRASINGS] + [
        backend.encode(PHRASINGS[0] + CONTEXT + " Go")
    ]


def _decode(backend: HFBackend, root_ids: list[int], prompts: list[list[int]], share: str) -> list[list[int]]:
    root = backend.prefill(root_ids)
    kids = backend.fork_prompts(root, prompts, share=share)
    backend.release([root])
    gens = backend.extend(kids, GREEDY)
    texts = [backend.tokens(k) for k in kids]
    backend.release(kids)
    assert backend.kv_stats().live_nodes == 0
    if backend.accel.asks is None:  # each child stands for its whole prompt
        assert texts == [p + g.token_ids for p, g in zip(prompts, gens, strict=True)]
    return [g.token_ids for g in gens]


def test_weights_and_similarity() -> None:
    w = layer_weights(4, 1.5)
    assert w.sum().item() == pytest.approx(1.0)
    assert all(w[i] < w[i + 1] for i in range(3))  # later layers weigh more
    root = torch.nn.functional.normalize(torch.randn(4, 8), dim=-1)
    same = similarity(root[:, None] * 3.0, root, w)
    assert same.item() == pytest.approx(1.0)
    assert similarity(-root[:, None], root, w).item() == pytest.approx(-1.0)


def test_exact_partial_prefix_equals_recompute(tiny_llama_dir) -> None:
    backend = HFBackend(tiny_llama_dir)
    root_ids, prompts = _prompts(backend)
    prompts = [root_ids[:5] + p for p in prompts]  # a shared start, then divergence
    root_ids = root_ids[:5] + root_ids
    exact = _decode(backend, root_ids, prompts, "exact")
    none = _decode(backend, root_ids, prompts, "none")
    assert exact == none
    assert backend.kv_stats().tokens_reused > 0


def test_asks_gate_tau_one_keeps_exact_results(tiny_llama_dir) -> None:
    """τ = 1: only identical states pass, so ASKS gives the exact results and says who it rejected."""
    backend = HFBackend(tiny_llama_dir)
    root_ids, prompts = _prompts(backend)
    reference = _decode(backend, root_ids, prompts, "none")
    backend.accel = Accel(asks=ASKSConfig(tau=1.0))
    backend.reset_stats()
    assert _decode(backend, root_ids, prompts, "exact") == reference
    stats = backend.kv_stats().extra
    assert stats["asks_exact"] == 2  # the root's own phrasing and its extension
    assert stats["asks_rejected"] == 3 and "asks_reused" not in stats


def test_asks_gate_fires_at_low_tau(tiny_llama_dir) -> None:
    """τ = 0: a divergent phrasing whose states point the root's way (σ ≥ 0) reuses the root's KV.
    Reuse is lossy by design: a reused branch reads the root's phrasing, so it decodes exactly what
    the root's own phrasing decodes, and holds no prompt KV of its own."""
    backend = HFBackend(tiny_llama_dir)
    root_ids, prompts = _prompts(backend)
    reference = _decode(backend, root_ids, prompts, "none")
    backend.accel = Accel(asks=ASKSConfig(tau=0.0))
    backend.reset_stats()
    root = backend.prefill(root_ids)
    kids = backend.fork_prompts(root, prompts)
    stats = backend.kv_stats()
    reused = stats.extra.get("asks_reused", 0)
    assert reused >= 1 and reused + stats.extra.get("asks_rejected", 0) == 3  # the gate fired
    hits = [i for i in range(1, 4) if backend.tokens(kids[i]) == root_ids]  # these read the root
    assert len(hits) == reused
    assert stats.tokens_reused >= (2 + reused) * len(root_ids) - 1
    backend.release([root])
    gens = backend.extend(kids, GREEDY)
    for i, gen in enumerate(gens):  # reused branches decode the root phrasing; the rest stay exact
        assert gen.token_ids == (reference[0] if i in hits else reference[i])
    backend.release(kids)
    assert backend.kv_stats().live_nodes == 0 and backend.kv_stats().bytes_held == 0


def test_asks_gate_threshold_splits_between_sigmas(tiny_llama_dir) -> None:
    """τ just above the mean σ of the three divergent phrasings: at least one is rejected and, unless
    all σ are equal, at least one reused — the gate compares each σ with τ, not a constant verdict."""
    backend = HFBackend(tiny_llama_dir)
    root_ids, prompts = _prompts(backend)
    backend.accel = Accel(asks=ASKSConfig(tau=0.0))
    root = backend.prefill(root_ids)
    kids = backend.fork_prompts(root, prompts)
    mean_sigma = backend.kv_stats().extra["asks_sigma_sum"] / 3
    backend.release([root, *kids])
    backend.accel = Accel(asks=ASKSConfig(tau=min(1.0, mean_sigma + 1e-9)))
    backend.reset_stats()
    root = backend.prefill(root_ids)
    kids = backend.fork_prompts(root, prompts)
    stats = backend.kv_stats().extra
    assert stats.get("asks_rejected", 0) >= 1 and stats.get("asks_reused", 0) >= 1
    assert stats.get("asks_rejected", 0) + stats.get("asks_reused", 0) == 3
    backend.release([root, *kids])
    assert backend.kv_stats().live_nodes == 0


def test_reasoner_variants_use_fork_prompts(tiny_llama_dir) -> None:
    from branchwise.reasoners import Reasoner
    from branchwise.strategies import self_consistency

    backend = HFBackend(tiny_llama_dir)
    strat = self_consistency(n=4, temperature=0.0, max_tokens=5)
    variants = ["How many apples?", "Count the apples.", "Apples in total?"]
    none = Reasoner(strat, backend=backend, share="none").run("How many apples?", variants=variants)
    gated = Reasoner(strat, backend=backend, accel=Accel(asks=ASKSConfig(tau=1.0))).run(
        "How many apples?", variants=variants
    )
    assert [b.text for b in gated.branches] == [b.text for b in none.branches]
    assert gated.kv_stats["asks_rejected"] == 2 and gated.kv_stats["asks_exact"] == 2
    assert backend.kv_stats().live_nodes == 0
