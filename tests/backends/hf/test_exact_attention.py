"""`attention.exact_attention`: the path of soft-capped and sliding-window layers, against the
fused cascade where both apply and against attention over each row's whole key sequence.

Why apart from the family tests: those run rows whose tails hold their own tokens only; here a
row's tail also holds copied ancestors in front of a shared segment (the layout `Batch.assemble`
makes for short root prompts), where the slots' positions are not their indices.
"""

from __future__ import annotations

import torch

from branchwise.backends.hf.attention import (
    SharedSegment,
    Weights,
    Window,
    cascade,
    exact_attention,
    explicit_attention,
)

B, H, H_KV, D, SCALE = 3, 4, 2, 8, 8**-0.5


def _mass(weights: Weights) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Each key's normalised weight summed over heads and queries (what RSBCM reads)."""
    m_own, p_own = weights.own
    own = (p_own * torch.exp(m_own - weights.m) / weights.s).sum(dim=(1, 2))
    segments = []
    for seg, ms, ps in weights.segments:
        m = weights.m if seg.rows is None else weights.m[seg.rows]
        s = weights.s if seg.rows is None else weights.s[seg.rows]
        factor = (torch.exp(ms - m) / s).permute(1, 0, 2, 3).reshape(H_KV, -1, 1)
        segments.append((ps * factor).sum(dim=(0, 1)))
    return own, segments


def test_exact_attention_equals_the_cascade_and_gives_its_weights() -> None:
    torch.manual_seed(0)
    shared = [
        SharedSegment([torch.randn(H_KV, 5, D)], [torch.randn(H_KV, 5, D)], None),
        SharedSegment([torch.randn(H_KV, 4, D)], [torch.randn(H_KV, 4, D)], torch.tensor([0, 2])),
    ]
    q_len, tail = 2, 6
    query = torch.randn(B, H, q_len, D)
    k_own, v_own = torch.randn(B, H_KV, tail, D), torch.randn(B, H_KV, tail, D)
    lens = torch.tensor([3, 1, 4])
    visible = torch.arange(tail)[None, None, :] <= (lens[:, None] + torch.arange(q_len)[None, :])[:, :, None]
    g = H // H_KV
    mask_g = visible[:, None, None].expand(-1, 1, g, -1, -1).reshape(B, 1, g * q_len, tail)
    want, weights = cascade(query, k_own, v_own, mask_g, shared, 0, SCALE, want_weights=True)
    got, exact = exact_attention(
        query, k_own, v_own, visible, shared, 0, SCALE, None, None, want_weights=True
    )
    assert weights is not None and exact is not None
    torch.testing.assert_close(got, want)
    (own_a, segs_a), (own_b, segs_b) = _mass(weights), _mass(exact)
    torch.testing.assert_close(own_b, own_a)
    for a, b in zip(segs_a, segs_b, strict=True):
        torch.testing.assert_close(b, a)


def test_a_window_over_copied_ancestors_a_shared_segment_and_own_kv() -> None:
    """Row r's keys in path order: `copied` tokens at slots 0.. of its tail, then a shared segment
    (positions from `copied`), then its own KV (its tail from `copied` on): a window over the
    positions, not over the slots, equals attention over the row's path with the window's mask."""
    torch.manual_seed(1)
    copied, n_shared, own, size = 3, 5, 4, 6
    seg_k, seg_v = torch.randn(H_KV, n_shared, D), torch.randn(H_KV, n_shared, D)
    shared = [SharedSegment([seg_k], [seg_v], None, start=copied)]
    tail = copied + own
    k_own, v_own = torch.randn(B, H_KV, tail, D), torch.randn(B, H_KV, tail, D)
    query = torch.randn(B, H, 1, D)
    lens = torch.full((B,), tail - 1)  # the last own slot is this step's token
    pos_next = lens + n_shared  # its position: the shared segment sits before the own KV
    visible = (torch.arange(tail)[None, :] <= lens[:, None])[:, None, :]
    window = Window.of(size, torch.full((B,), copied), pos_next, lens, 1, tail)
    got, _ = exact_attention(query, k_own, v_own, visible, shared, 0, SCALE, 2.0, window)

    path_k = torch.cat([k_own[:, :, :copied], seg_k[None].expand(B, -1, -1, -1), k_own[:, :, copied:]], dim=2)
    path_v = torch.cat([v_own[:, :, :copied], seg_v[None].expand(B, -1, -1, -1), v_own[:, :, copied:]], dim=2)
    positions = torch.arange(path_k.shape[2])
    seen = (positions <= pos_next[:, None]) & (pos_next[:, None] - positions < size)
    want = explicit_attention(query, path_k, path_v, seen[:, None, None, :], SCALE, 2.0)
    torch.testing.assert_close(got, want)
    assert not bool(seen[:, :copied].any())  # the window really cut the copied ancestors off
