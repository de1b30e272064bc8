"""Shared-prefix ("cascade") attention over the branch tree.

Why: B branches that share a prefix should read its KV once per step, not B copies of it. Each
batch row attends to (a) the KV segments of its ancestors in the branch tree, which are held once and
may be shared by many rows, and (b) its own growing tail. For every ancestor segment we run ONE
batched product of the queries of all rows that share it against its keys, keep the softmax
statistics (running max and sum), and merge the partial results with log-sum-exp. The result equals
attention over the concatenated keys (checked against a full recompute in the tests) without ever
materialising per-branch copies of the prefix.

The function is registered with transformers' `AttentionInterface`, so the model's own attention
modules (projections, rotary embedding, head layout) stay in charge; the runner passes the batch
context (`batch.BatchContext`) as the `bw_ctx` keyword through its own layer loop. Without a context
it defers to SDPA, so `model.generate()` keeps working for the `hf_generate` baseline.

This module holds only the arithmetic; where the tails live and which rows read which segment is
`batch.py`'s business.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ATTN_NAME = "branchwise"


@dataclass
class SharedSegment:
    """One ancestor KV segment and the batch rows that attend to it (None = every row)."""

    keys: Sequence[torch.Tensor]  # per layer [H_kv, T, D]
    values: Sequence[torch.Tensor]
    rows: torch.Tensor | None
    key: int = -1  # the tree's segment id, so per-segment observers know which segment this is


@dataclass
class Weights:
    """The softmax statistics of one cascade call, for observers that need attention weights.

    `own` = (max, unnormalised probabilities) over each row's tail; `segments` = (segment, max,
    unnormalised probabilities) per shared segment; `m`, `s` = the merged max and sum. The
    normalised weight of a key is p · exp(m_part − m) / s.
    """

    own: tuple[torch.Tensor, torch.Tensor]
    segments: list[tuple[SharedSegment, torch.Tensor, torch.Tensor]]
    m: torch.Tensor
    s: torch.Tensor


def cascade(
    query: torch.Tensor,
    k_own: torch.Tensor,
    v_own: torch.Tensor,
    own_mask_g: torch.Tensor,
    shared: Sequence[SharedSegment],
    layer: int,
    scaling: float,
    want_weights: bool,
) -> tuple[torch.Tensor, Weights | None]:
    """Attention of `query` [B, H, q, D] over each row's tail and its shared segments → [B, q, H, D].

    `own_mask_g` [B, 1, G·q, T] says which tail keys each (grouped) query sees.
    """
    b, h, q_len, d = query.shape
    h_kv = k_own.shape[1]
    gq = (h // h_kv) * q_len
    # Query head j*G..(j+1)*G-1 uses KV head j (transformers' repeat_kv layout).
    qg = query.reshape(b, h_kv, gq, d)
    # Own tail: unnormalised softmax statistics.
    scores = torch.matmul(qg, k_own.transpose(-1, -2)).mul_(scaling)
    scores.masked_fill_(~own_mask_g, float("-inf"))
    m = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - m)
    s = p.sum(-1, keepdim=True)
    o = torch.matmul(p, v_own)
    own_stats = (m, p)
    seg_stats = []
    for seg in shared:
        ks, vs = seg.keys[layer], seg.values[layer]
        q_rows = qg if seg.rows is None else qg.index_select(0, seg.rows)
        r = q_rows.shape[0]
        # One GEMM per KV head for all rows that share this segment.
        qs = q_rows.permute(1, 0, 2, 3).reshape(h_kv, r * gq, d)
        sc = torch.bmm(qs, ks.transpose(1, 2)).mul_(scaling)
        ms = sc.amax(-1, keepdim=True)
        ps = torch.exp(sc - ms)
        ss = ps.sum(-1, keepdim=True)
        os_ = torch.bmm(ps, vs)

        def back(t: torch.Tensor, r: int = r) -> torch.Tensor:
            return t.reshape(h_kv, r, gq, t.shape[-1]).permute(1, 0, 2, 3)

        ms, ss, os_ = back(ms), back(ss), back(os_)
        seg_stats.append((seg, ms, ps))
        if seg.rows is None:
            m, s, o = _merge(m, s, o, ms, ss, os_)
        else:
            mm, sm, om = _merge(m[seg.rows], s[seg.rows], o[seg.rows], ms, ss, os_)
            m, s, o = m.clone(), s.clone(), o.clone()
            m[seg.rows], s[seg.rows], o[seg.rows] = mm, sm, om
    weights = Weights(own_stats, seg_stats, m, s) if want_weights else None
    out = (o / s).reshape(b, h, q_len, d)
    return out.transpose(1, 2), weights


def _merge(
    m1: torch.Tensor, s1: torch.Tensor, o1: torch.Tensor, m2: torch.Tensor, s2: torch.Tensor, o2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-sum-exp merge of two partial softmax-attention results."""
    m = torch.maximum(m1, m2)
    a, c = torch.exp(m1 - m), torch.exp(m2 - m)
    return m, s1 * a + s2 * c, o1 * a + o2 * c


class AttentionContext(Protocol):
    """What the registered attention function needs from the batch it runs in."""

    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
    ) -> torch.Tensor: ...


def branchwise_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    bw_ctx: AttentionContext | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention entry point registered with transformers (see module docstring)."""
    if bw_ctx is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return bw_ctx.attend(module.layer_idx, query, key, value, scale), None


def register() -> str:
    """Register the attention function (idempotent) and return its name."""
    AttentionInterface.register(ATTN_NAME, branchwise_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)
    return ATTN_NAME
