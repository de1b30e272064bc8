"""The fused shared-prefix attention equals attention over the concatenated keys, in every layout."""

from __future__ import annotations

import pytest
import torch

from branchwise.backends.hf.attention import SharedSegment, fused_attention
from branchwise.backends.hf.batch import AttentionTap, BatchContext


class _WantWeights(AttentionTap):
    wants_weights = True


def _reference(query, segments, own_k, own_v, new_k, new_v, lens, scaling):
    """Plain SDPA per row over [its segments, its own tail, the new tokens] (causal in the new part)."""
    b, h, q, _ = query.shape
    g = h // own_k.shape[1]
    outs = []
    for r in range(b):
        ks = [s.keys[0] for s in segments if s.rows is None or r in s.rows.tolist()]
        vs = [s.values[0] for s in segments if s.rows is None or r in s.rows.tolist()]
        n = int(lens[r])
        keys = torch.cat([*ks, own_k[r, :, :n], new_k[r]], dim=1).repeat_interleave(g, 0)
        vals = torch.cat([*vs, own_v[r, :, :n], new_v[r]], dim=1).repeat_interleave(g, 0)
        total = keys.shape[1]
        mask = torch.ones(q, total, dtype=torch.bool)
        mask[:, total - q :] = torch.tril(torch.ones(q, q, dtype=torch.bool))
        o = torch.nn.functional.scaled_dot_product_attention(
            query[r], keys, vals, attn_mask=mask, scale=scaling
        )
        outs.append(o.transpose(0, 1))
    return torch.stack(outs)


@pytest.mark.parametrize("weights", [False, True], ids=["fused", "explicit"])
@pytest.mark.parametrize(
    "lens,q,subset",
    [
        ([0, 0, 0, 0], 5, False),  # fresh tails (suffix prefill): the causal kernel
        ([0, 0, 0, 0], 1, True),
        ([3, 3, 3, 3], 1, False),  # decode, uniform tails
        ([2, 0, 4, 1], 3, True),  # ragged tails, a segment read by a subset of rows
    ],
)
def test_cascade_matches_concatenated_keys(lens: list[int], q: int, subset: bool, weights: bool) -> None:
    torch.manual_seed(0)
    b, h, h_kv, d = 4, 6, 2, 8
    segments = [SharedSegment([torch.randn(h_kv, 11, d)], [torch.randn(h_kv, 11, d)], None)]
    if subset:
        segments.append(
            SharedSegment([torch.randn(h_kv, 7, d)], [torch.randn(h_kv, 7, d)], torch.tensor([1, 3]))
        )
    own = max(lens)
    own_k, own_v = torch.randn(b, h_kv, own + q, d), torch.randn(b, h_kv, own + q, d)
    tail_k, tail_v = torch.zeros(b, h_kv, own + q, d), torch.zeros(b, h_kv, own + q, d)
    for r, n in enumerate(lens):
        tail_k[r, :, :n], tail_v[r, :, :n] = own_k[r, :, :n], own_v[r, :, :n]
    new_k, new_v, query = torch.randn(b, h_kv, q, d), torch.randn(b, h_kv, q, d), torch.randn(b, h, q, d)
    ctx = BatchContext(
        tail_k=[tail_k],
        tail_v=[tail_v],
        lens=torch.tensor(lens),
        shared=segments,
        n_groups=h // h_kv,
        taps=[_WantWeights()] if weights else [],
    )
    ctx.begin(q)
    out = ctx.attend(0, query, new_k, new_v, scaling=d**-0.5)
    ref = _reference(query, segments, own_k, own_v, new_k, new_v, lens, d**-0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_fused_attention_returns_lse() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 9, 8), torch.randn(2, 3, 9, 8)
    mask = torch.rand(2, 1, 5, 9) > 0.4
    mask[..., 0] = True
    out, lse = fused_attention(q, k, v, 0.3, mask=mask)
    scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ v, atol=1e-5, rtol=1e-5)
    out_c, _ = fused_attention(q, k[:, :, :5], v[:, :, :5], 0.3, causal=True)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k[:, :, :5], v[:, :, :5], attn_mask=causal, scale=0.3
    )
    torch.testing.assert_close(out_c, ref, atol=1e-5, rtol=1e-5)
