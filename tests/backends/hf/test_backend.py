"""Behaviour of the local backend on tiny random models (no hub): fidelity, sharing, memory, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from branchwise.backends import DecodeParams
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.attention import SharedSegment
from branchwise.backends.hf.batch import BatchContext
from branchwise.backends.hf.own_kv import Tails

PROMPTS = ["What is 12 + 7?", "Name three colours.", "Count to five:", "The quick brown fox"]
GREEDY = DecodeParams(max_tokens=10, min_tokens=10)


@pytest.fixture(params=["llama", "qwen2"])
def backend(request: pytest.FixtureRequest, tiny_model_dir) -> HFBackend:
    return HFBackend(tiny_model_dir(request.param))


@pytest.mark.parametrize("b", [1, 8])
def test_greedy_fidelity_exact_none_generate(backend: HFBackend, b: int, branch_tokens) -> None:
    """share='exact' == share='none' == model.generate(), token for token, B=1 and B=8."""
    for text in PROMPTS:
        prompt = backend.encode(text)
        hints = [backend.encode(" hint" * (i % 3)) for i in range(b)]  # unequal suffix lengths, some empty
        exact = branch_tokens(backend, prompt, hints, "exact", GREEDY)
        none = branch_tokens(backend, prompt, hints, "none", GREEDY)
        generate = [backend.hf_generate([prompt + h], GREEDY.max_tokens, exact_length=True)[0] for h in hints]
        assert exact == none
        assert exact == generate


def test_self_consistency_branches_identical_prompts(backend: HFBackend, branch_tokens) -> None:
    prompt = backend.encode(PROMPTS[0])
    out = branch_tokens(backend, prompt, [[] for _ in range(8)], "exact", GREEDY)
    ref = backend.hf_generate([prompt], GREEDY.max_tokens, exact_length=True)[0]
    assert all(o == ref for o in out)


def test_prefix_held_once(backend: HFBackend) -> None:
    prompt = backend.encode("A long shared problem statement. " * 6)
    per_token = backend.kv_token_bytes
    for share in ("exact", "none"):
        backend.reset_stats()
        root = backend.prefill(prompt)
        kids = backend.fork(root, 8, share=share)
        backend.extend(kids, DecodeParams(max_tokens=4, min_tokens=4))
        stats = backend.kv_stats()
        if share == "exact":
            # prefix once + 8 short own segments (4 tokens, the last one not yet computed)
            assert stats.bytes_held == (len(prompt) + 8 * 3) * per_token
            assert stats.tokens_reused == 8 * len(prompt)
            assert stats.tokens_computed == len(prompt) + 8 * 3
        else:
            assert stats.bytes_held == 8 * (len(prompt) + 3) * per_token
            assert stats.tokens_reused == 0
            assert stats.tokens_computed == 8 * (len(prompt) + 3)
        backend.release([root, *kids])
        assert backend.kv_stats().bytes_held == 0
        assert backend.kv_stats().live_nodes == 0


def test_tree_of_segments_continues_exactly(backend: HFBackend) -> None:
    """Decoding in two steps through a fork equals decoding in one go (the tree generalises)."""
    prompt = backend.encode(PROMPTS[1])
    one_go = backend.hf_generate([prompt], 12, exact_length=True)[0]
    root = backend.prefill(prompt)
    (a,) = backend.fork(root, 1)
    first = backend.extend([a], DecodeParams(max_tokens=5, min_tokens=5))[0].token_ids
    kids = backend.fork(a, 3)
    second = backend.extend(kids, DecodeParams(max_tokens=7, min_tokens=7))
    for g in second:
        assert first + g.token_ids == one_go
        assert backend.tokens(g.node) == prompt + one_go
    backend.release([root, a, *kids])
    assert backend.kv_stats().live_nodes == 0


def test_release_frees_subtree_and_frozen_nodes(backend: HFBackend) -> None:
    root = backend.prefill(backend.encode(PROMPTS[2]))
    kids = backend.fork(root, 2)
    with pytest.raises(ValueError, match="frozen"):
        backend.extend([root], GREEDY)
    backend.extend(kids, DecodeParams(max_tokens=3))
    backend.release([root])  # still alive through its children
    assert backend.kv_stats().live_nodes == 3
    backend.release(kids)
    assert backend.kv_stats().live_nodes == 0
    assert backend.kv_stats().bytes_held == 0
    with pytest.raises(KeyError):
        backend.release([root])


def test_bad_input_names_the_field(backend: HFBackend) -> None:
    with pytest.raises(ValueError, match="token_ids"):
        backend.prefill([10**9])
    with pytest.raises(ValueError, match="at least 1"):
        backend.prefill([])
    with pytest.raises(ValueError, match="share"):
        backend.fork(backend.prefill([1, 2]), 2, share="fuzzy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="temperature"):
        DecodeParams(temperature=-1)


def test_score_next_does_not_grow_node(backend: HFBackend) -> None:
    root = backend.prefill(backend.encode(PROMPTS[0]))
    kids = backend.fork(root, 2)
    backend.extend(kids, DecodeParams(max_tokens=3, min_tokens=3))
    before = [backend.tokens(k) for k in kids]
    probs = backend.score_next(kids, backend.encode(" Yes or no?"), [5, 6])
    assert len(probs) == 2 and all(0.0 <= p <= 1.0 for row in probs for p in row)
    assert [backend.tokens(k) for k in kids] == before
    # the judge pass over shared KV equals a from-scratch forward of the full sequence
    full = torch.tensor([before[0] + backend.encode(" Yes or no?")], device=backend.device)
    with torch.inference_mode():
        ref = torch.softmax(backend.model(full).logits[0, -1].float(), -1)[[5, 6]].tolist()
    assert probs[0] == pytest.approx(ref, abs=1e-5)
    backend.release([root, *kids])


def test_sampling_is_seeded(backend: HFBackend) -> None:
    prompt = backend.encode(PROMPTS[3])
    params = DecodeParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=7)
    outs = []
    for _ in range(2):
        root = backend.prefill(prompt)
        kids = backend.fork(root, 4)
        outs.append([g.token_ids for g in backend.extend(kids, params)])
        backend.release([root, *kids])
    assert outs[0] == outs[1]
    assert len({tuple(o) for o in outs[0]}) > 1  # branches differ from each other


def test_stop_and_delimiter(tiny_llama_dir: Path) -> None:
    backend = HFBackend(tiny_llama_dir)
    root = backend.prefill(backend.encode(PROMPTS[0]))
    (a,) = backend.fork(root, 1)
    gen = backend.extend([a], DecodeParams(max_tokens=12, min_tokens=12))[0]
    assert gen.finish_reason == "length"
    assert gen.text == backend.decode(gen.token_ids)
    assert len(gen.top1_probs) == len(gen.logprobs) == 12
    assert all(0 < p <= 1 for p in gen.top1_probs)
    # a stop string taken from the greedy text cuts it there, at the same position
    text = gen.text.strip()
    stop = text[len(text) // 2 :][:2] if len(text) >= 4 else None
    if stop and stop.strip():
        (b,) = backend.fork(root, 1)
        g2 = backend.extend([b], DecodeParams(max_tokens=12, min_tokens=12, stop=(stop,)))[0]
        assert g2.finish_reason == "stop"
        assert stop not in g2.text
        assert gen.text.startswith(g2.text)


def test_cascade_attention_matches_concatenated_keys() -> None:
    """Shared-segment + own-tail attention with LSE merge == plain attention over the concatenation."""
    torch.manual_seed(0)
    b, h, h_kv, d, n_shared, n_own, q = 3, 6, 2, 8, 11, 5, 2
    shared_k = torch.randn(h_kv, n_shared, d)
    shared_v = torch.randn(h_kv, n_shared, d)
    own_k = torch.randn(b, h_kv, n_own, d)
    own_v = torch.randn(b, h_kv, n_own, d)
    new_k = torch.randn(b, h_kv, q, d)
    new_v = torch.randn(b, h_kv, q, d)
    query = torch.randn(b, h, q, d)
    tail_k = torch.zeros(b, h_kv, n_own + q, d)
    tail_v = torch.zeros(b, h_kv, n_own + q, d)
    tail_k[:, :, :n_own], tail_v[:, :, :n_own] = own_k, own_v
    ctx = BatchContext(
        kv=Tails([tail_k], [tail_v]),
        lens=torch.full((b,), n_own),
        shared=[SharedSegment([shared_k], [shared_v], None)],
        n_groups=h // h_kv,
    )
    ctx.begin(q)
    out = ctx.attend(0, query, new_k, new_v, scaling=d**-0.5)  # [b, q, h, d]
    keys = torch.cat([shared_k.expand(b, -1, -1, -1), own_k, new_k], dim=2).repeat_interleave(h // h_kv, 1)
    vals = torch.cat([shared_v.expand(b, -1, -1, -1), own_v, new_v], dim=2).repeat_interleave(h // h_kv, 1)
    total = n_shared + n_own + q
    mask = torch.ones(q, total, dtype=torch.bool)
    mask[:, n_shared + n_own :] = torch.tril(torch.ones(q, q, dtype=torch.bool))
    ref = torch.nn.functional.scaled_dot_product_attention(query, keys, vals, attn_mask=mask)
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_copy_broadcast_baseline_matches(tiny_llama_dir: Path, branch_tokens) -> None:
    """broadcast='copy' (per-row prefix copies, the RKSC notebook's path) gives the same tokens."""
    backend = HFBackend(tiny_llama_dir)
    prompt = backend.encode(PROMPTS[0])
    hints = [backend.encode(" hint" * (i % 3)) for i in range(4)]
    cascade = branch_tokens(backend, prompt, hints, "exact", GREEDY)
    backend.broadcast = "copy"
    assert branch_tokens(backend, prompt, hints, "exact", GREEDY) == cascade
    with pytest.raises(ValueError, match="broadcast"):
        HFBackend(tiny_llama_dir, broadcast="fuzzy")  # type: ignore[arg-type]
