"""The fused shared-prefix attention equals attention over the concatenated keys, in every layout."""

from __future__ import annotations

import pytest
import torch

from branchwise.backends.hf.attention import SharedSegment, fused_attention
from branchwise.backends.hf.batch import AttentionTap, BatchContext
from branchwise.backends.hf.own_kv import Tails


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


# (device, dtype, tolerance): the fused kernels of each device, in fp32 and in bf16 (where the
# reference sees the same bf16-rounded inputs and computes in fp32, so only the kernels' own
# rounding differs)
LAYOUTS = [
    pytest.param("cpu", torch.float32, 1e-5, id="cpu-fp32"),
    pytest.param("cpu", torch.bfloat16, 2e-2, id="cpu-bf16"),
    pytest.param("cuda", torch.float32, 1e-5, id="cuda-fp32", marks=pytest.mark.gpu),
    pytest.param("cuda", torch.bfloat16, 2e-2, id="cuda-bf16", marks=pytest.mark.gpu),
]


def _placed(t: torch.Tensor, device: str, dtype: torch.dtype) -> torch.Tensor:
    """`t` on `device`; floating tensors also in `dtype` (masks and indices keep theirs)."""
    return t.to(device, dtype) if t.is_floating_point() else t.to(device)


@pytest.mark.parametrize("device,dtype,tol", LAYOUTS)
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
def test_cascade_matches_concatenated_keys(
    lens: list[int], q: int, subset: bool, weights: bool, device: str, dtype: torch.dtype, tol: float
) -> None:
    torch.manual_seed(0)
    b, h, h_kv, d = 4, 6, 2, 16

    def randn(*shape: int) -> torch.Tensor:  # rounded to `dtype`, kept in fp32 for the reference
        return torch.randn(*shape).to(dtype).float()

    def on(t: torch.Tensor) -> torch.Tensor:
        return _placed(t, device, dtype)

    segments = [SharedSegment([randn(h_kv, 11, d)], [randn(h_kv, 11, d)], None)]
    if subset:
        segments.append(SharedSegment([randn(h_kv, 7, d)], [randn(h_kv, 7, d)], torch.tensor([1, 3])))
    own = max(lens)
    own_k, own_v = randn(b, h_kv, own + q, d), randn(b, h_kv, own + q, d)
    tail_k, tail_v = torch.zeros(b, h_kv, own + q, d), torch.zeros(b, h_kv, own + q, d)
    for r, n in enumerate(lens):
        tail_k[r, :, :n], tail_v[r, :, :n] = own_k[r, :, :n], own_v[r, :, :n]
    new_k, new_v, query = randn(b, h_kv, q, d), randn(b, h_kv, q, d), randn(b, h, q, d)
    placed = [
        SharedSegment([on(s.keys[0])], [on(s.values[0])], None if s.rows is None else on(s.rows))
        for s in segments
    ]
    ctx = BatchContext(
        kv=Tails([on(tail_k)], [on(tail_v)]),
        lens=on(torch.tensor(lens)),
        shared=placed,
        n_groups=h // h_kv,
        taps=[_WantWeights()] if weights else [],
    )
    ctx.begin(q)
    out = ctx.attend(0, on(query), on(new_k), on(new_v), scaling=d**-0.5)
    assert out.dtype == dtype and out.device.type == device
    ref = _reference(query, segments, own_k, own_v, new_k, new_v, lens, d**-0.5)
    torch.testing.assert_close(out.float().cpu(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("device,dtype,tol", LAYOUTS)
def test_fused_attention_returns_lse(device: str, dtype: torch.dtype, tol: float) -> None:
    """Output and log-sum-exp of the device's fused kernel, with a mask (ragged last dim: 9 keys,
    not a multiple of the CUDA kernel's bias alignment) and causal."""
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(*shape).to(dtype).float() for shape in ((2, 3, 5, 16), (2, 3, 9, 16), (2, 3, 9, 16))
    )
    mask = torch.rand(2, 1, 5, 9) > 0.4
    mask[..., 0] = True

    def on(*ts: torch.Tensor) -> list[torch.Tensor]:
        return [_placed(t, device, dtype) for t in ts]

    out, lse = fused_attention(*on(q, k, v), 0.3, mask=on(mask)[0])
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (2, 3, 5)
    scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(lse.cpu(), torch.logsumexp(scores, -1), atol=tol, rtol=tol)
    torch.testing.assert_close(out.float().cpu(), torch.softmax(scores, -1) @ v, atol=tol, rtol=tol)
    out_c, lse_c = fused_attention(*on(q, k[:, :, :5], v[:, :, :5]), 0.3, causal=True)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k[:, :, :5], v[:, :, :5], attn_mask=causal, scale=0.3
    )
    torch.testing.assert_close(out_c.float().cpu(), ref, atol=tol, rtol=tol)
    causal_scores = (q @ k[:, :, :5].transpose(-1, -2) * 0.3).masked_fill(~causal, float("-inf"))
    torch.testing.assert_close(lse_c.cpu(), torch.logsumexp(causal_scores, -1), atol=tol, rtol=tol)
