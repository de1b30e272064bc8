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
from typing import Any, Protocol, cast

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from branchwise.backends.hf.arch import LAYER_CONTEXT

ATTN_NAME = "branchwise"


@dataclass
class SharedSegment:
    """One KV segment read by several batch rows (None = every row).

    An ancestor is read whole by each of its rows. A pool of shared blocks (ReasonCache) is read
    through `mask` `[r, T]` (True = visible, one line per row of `rows`): each row sees only the
    blocks its block table points at, still in one product for all rows.
    """

    keys: Sequence[torch.Tensor]  # per layer [H_kv, T, D]
    values: Sequence[torch.Tensor]
    rows: torch.Tensor | None
    key: int = -1  # the tree's segment id, so per-segment observers know which segment this is
    mask: torch.Tensor | None = None
    start: int | None = None
    """The logical position of its first key, read by a sliding window (`exact_attention`); None
    where its keys are not consecutive positions (evicted slots, a pool of blocks)."""

    def grouped_mask(self, gq: int) -> torch.Tensor | None:
        """`mask` for queries stacked row-major as `[r·gq, T]` (None = all visible)."""
        if self.mask is None:
            return None
        r, t = self.mask.shape
        return self.mask[:, None, :].expand(r, gq, t).reshape(r * gq, t)


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

    `own_mask_g` [B, 1, G·q, T] says which tail keys each (grouped) query sees. Without
    `want_weights` every part runs through a fused kernel that returns its log-sum-exp
    (`fused_cascade`); the explicit-softmax path below is kept for observers of the weights (RSBCM).
    """
    if not want_weights:
        return fused_cascade(query, k_own, v_own, own_mask_g, shared, layer, scaling), None
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
        seg_mask = seg.grouped_mask(gq)
        if seg_mask is not None:
            sc.masked_fill_(~seg_mask[None], float("-inf"))
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
    weights = Weights(own_stats, seg_stats, m, s)
    out = (o / s).reshape(b, h, q_len, d)
    return out.transpose(1, 2), weights


def fused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention `[N, H, L, D]` → (normalised output, log-sum-exp `[N, H, L]`, float32).

    Fused kernels that return the LSE with the output: the flash kernel on CPU, the memory-efficient
    one on CUDA (fp32-capable, takes a bias); plain torch elsewhere. `mask` is boolean and
    broadcastable to `[N, H, L, S]` (True = visible); every query must see at least one key.
    `causal` is top-left aligned (only meaningful when L == S). A floating `mask` is taken as an
    additive bias already (see `bias_of`).

    Inside a compiled step on a CPU (the fixed-shape step's cascade) it is the plain products:
    inductor fuses the softmax between the two batched matmuls, which at decode shapes beat the
    flash kernel with its additive bias (an ad-hoc micro-benchmark in benchmarks/RESULTS.md; 8
    rows, 3 query heads per KV head, compiled, 2 cores: 278 against 310 us a layer over a
    1,024-token shared prompt and 256 own slots, 103 against 144 over 32 and 128, 112 against 124
    for one row); uncompiled, the products were no faster.
    """
    if query.device.type == "cpu" and not torch.compiler.is_compiling():
        bias = None if mask is None else bias_of(mask, query.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, causal, attn_mask=bias, scale=scaling
        )
        return out, lse.float()
    if query.device.type == "cuda":
        n, h, length = query.shape[:3]
        bias = None
        if mask is not None:
            # the kernel wants a dense bias whose last dim is padded to a multiple of 16
            s_len = key.shape[2]
            padded = -(-s_len // 16) * 16
            full = torch.zeros(n, h, length, padded, dtype=query.dtype, device=query.device)
            full[..., :s_len] = bias_of(mask, query.dtype).expand(n, h, length, s_len)
            bias = full[..., :s_len]
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, True, 0.0, causal, scale=scaling
        )[:2]
        return out, lse[..., :length].float()
    scores = torch.matmul(query, key.transpose(-1, -2)).mul_(scaling)
    if mask is not None:
        scores.add_(bias_of(mask, scores.dtype))
    if causal:
        tri = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores.masked_fill_(~tri, float("-inf"))
    lse = torch.logsumexp(scores.float(), -1)
    out = torch.matmul(torch.exp(scores - lse[..., None].to(scores.dtype)), value)
    return out, lse


def bias_of(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility mask as the additive bias the fused kernels take (0 / -inf)."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def fused_cascade(
    query: torch.Tensor,
    k_own: torch.Tensor,
    v_own: torch.Tensor,
    own_mask: torch.Tensor | None,
    shared: Sequence[SharedSegment],
    layer: int,
    scaling: float,
) -> torch.Tensor:
    """`cascade` through fused kernels: the own tail and each shared segment each give (output,
    LSE), merged by log-sum-exp. `own_mask` [B, 1, G·q, T] is boolean or an additive bias;
    None means a fresh causal tail (the tail holds
    exactly this forward's tokens), which runs in the per-head layout with the causal kernel."""
    b, h, q_len, d = query.shape
    h_kv = k_own.shape[1]
    g = h // h_kv
    gq = g * q_len
    qg = query.reshape(b, h_kv, gq, d)
    if own_mask is None:
        kx = k_own.repeat_interleave(g, dim=1) if g > 1 else k_own
        vx = v_own.repeat_interleave(g, dim=1) if g > 1 else v_own
        o, lse = fused_attention(query, kx, vx, scaling, causal=True)
        o, lse = o.reshape(b, h_kv, gq, d), lse.reshape(b, h_kv, gq)
    else:
        o, lse = fused_attention(qg, k_own, v_own, scaling, mask=own_mask)
    o, lse = merge_shared(qg, o, lse, shared, layer, scaling)
    return o.reshape(b, h, q_len, d).transpose(1, 2)


def merge_shared(
    qg: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    shared: Sequence[SharedSegment],
    layer: int,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' attention over their own KV (`o` `[B, H_kv, G·q, D]` and its log-sum-exp `lse`
    `[B, H_kv, G·q]`, for queries `qg` stacked the same way) merged with each shared segment's, each
    segment read once for all its rows: whatever read the own KV (a rectangle of tails, or pages in
    place), the shared part is the same."""
    h_kv, gq, d = qg.shape[1:]
    for seg in shared:
        ks, vs = seg.keys[layer], seg.values[layer]
        q_rows = qg if seg.rows is None else qg.index_select(0, seg.rows)
        r = q_rows.shape[0]
        # One kernel for all rows that share this segment: their queries stacked per KV head.
        qs = q_rows.transpose(0, 1).reshape(1, h_kv, r * gq, d)
        seg_mask = seg.grouped_mask(gq)
        os_, ls = fused_attention(
            qs, ks[None], vs[None], scaling, mask=None if seg_mask is None else seg_mask[None, None]
        )
        os_ = os_.reshape(h_kv, r, gq, d).transpose(0, 1)
        ls = ls.reshape(h_kv, r, gq).transpose(0, 1)
        if seg.rows is None:
            o, lse = _merge_lse(o, lse, os_, ls)
        else:
            om, lm = _merge_lse(o.index_select(0, seg.rows), lse.index_select(0, seg.rows), os_, ls)
            o, lse = o.index_copy(0, seg.rows, om), lse.index_copy(0, seg.rows, lm)
    return o, lse


def _merge_lse(
    o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum-exp merge of two normalised partial attention outputs with their LSEs."""
    lse = torch.logaddexp(l1, l2)
    w1 = torch.exp(l1 - lse)[..., None].to(o1.dtype)
    w2 = torch.exp(l2 - lse)[..., None].to(o2.dtype)
    return o1 * w1 + o2 * w2, lse


def _merge(
    m1: torch.Tensor, s1: torch.Tensor, o1: torch.Tensor, m2: torch.Tensor, s2: torch.Tensor, o2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-sum-exp merge of two partial softmax-attention results."""
    m = torch.maximum(m1, m2)
    a, c = torch.exp(m1 - m), torch.exp(m2 - m)
    return m, s1 * a + s2 * c, o1 * a + o2 * c


def explicit_scores(
    query: torch.Tensor, key: torch.Tensor, visible: torch.Tensor, scaling: float, softcap: float | None
) -> torch.Tensor:
    """The scores of `query` `[B, H, q, D]` against `key` `[B, H_kv, S, D]`, -inf where not
    `visible` (boolean, broadcastable to `[B, H, q, S]`). With `softcap` they are
    `cap * tanh(s / cap)` before the mask (Gemma 2), which no fused kernel takes."""
    g = query.shape[1] // key.shape[1]
    if g > 1:
        key = key.repeat_interleave(g, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return scores.masked_fill(~visible, float("-inf"))


def explicit_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor,
    scaling: float,
    softcap: float | None,
) -> torch.Tensor:
    """Softmax attention over `explicit_scores` → `[B, q, H, D]`."""
    return _softmax_values(explicit_scores(query, key, visible, scaling, softcap), value)


def _softmax_values(scores: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`softmax(scores) @ value` → `[B, q, H, D]`, the softmax in float32 as transformers' eager
    attention runs it."""
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    g = scores.shape[1] // value.shape[1]
    if g > 1:
        value = value.repeat_interleave(g, dim=1)
    return torch.matmul(probs, value).transpose(1, 2)


def _explicit_weights(
    scores: torch.Tensor, h_kv: int, shared: Sequence[SharedSegment], sizes: Sequence[int]
) -> Weights:
    """`Weights` in `cascade`'s layout from the scores over every key of a row `[B, H, q, S]`
    (shared segments' keys first, sizes `sizes`, then the tail): one max for all parts, so each
    part's `p` is already relative to it."""
    b, h, q_len, total = scores.shape
    grouped = scores.reshape(b, h_kv, (h // h_kv) * q_len, total)
    m = grouped.amax(-1, keepdim=True)
    p = torch.exp(grouped - m)
    s = p.sum(-1, keepdim=True)
    parts = list(torch.split(p, [*sizes, total - sum(sizes)], dim=-1))
    segments = []
    for seg, part in zip(shared, parts, strict=False):
        rows = part if seg.rows is None else part[seg.rows]
        m_rows = m if seg.rows is None else m[seg.rows]
        segments.append((seg, m_rows, rows.permute(1, 0, 2, 3).reshape(h_kv, -1, part.shape[-1])))
    return Weights((m, parts[-1]), segments, m, s)


def visible_of(mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """transformers' attention mask as a boolean one: None is causal (the queries the last keys),
    an additive mask is visible where it adds nothing."""
    if mask is None:
        q_len, s_len = query.shape[2], key.shape[2]
        q_at = torch.arange(q_len, device=query.device)[:, None] + (s_len - q_len)
        return torch.arange(s_len, device=query.device)[None, :] <= q_at
    return mask if mask.dtype == torch.bool else mask == 0


@dataclass
class Window:
    """A sliding window as `exact_attention` applies it: its `size`, the queries' positions `q_pos`
    `[B, q]` and the tail slots' `own_pos` `[B, T]` (None: unknown, after an eviction)."""

    size: int
    q_pos: torch.Tensor
    own_pos: torch.Tensor | None

    @classmethod
    def of(
        cls,
        size: int,
        tail_start: torch.Tensor | None,
        pos_next: torch.Tensor,
        lens: torch.Tensor,
        q_len: int,
        slots: int,
    ) -> Window:
        """The window of a forward of `q_len` tokens per row over `slots` tail slots. The tail holds
        a row's copied ancestors from slot 0 at their own positions, then from `tail_start` its own
        KV, at the positions its next token's (`pos_next`) and its length (`lens`) put it."""
        q_pos = pos_next[:, None] + torch.arange(q_len, device=pos_next.device)
        if tail_start is None:
            return cls(size, q_pos, None)
        at = torch.arange(slots, device=pos_next.device)[None, :]
        shift = (pos_next - lens)[:, None]
        return cls(size, q_pos, at + torch.where(at >= tail_start[:, None], shift, 0))


def exact_attention(
    query: torch.Tensor,
    k_own: torch.Tensor,
    v_own: torch.Tensor,
    own_visible: torch.Tensor,
    shared: Sequence[SharedSegment],
    layer: int,
    scaling: float,
    softcap: float | None,
    window: Window | None,
    want_weights: bool = False,
) -> tuple[torch.Tensor, Weights | None]:
    """Attention of `query` `[B, H, q, D]` over its shared segments and its tail, every key of a
    row laid out beside its others: for what the fused cascade cannot do, soft-capped scores and a
    sliding window. `own_visible` `[B, q, T]` says which tail slots each query sees; with a
    `window`, a key is seen within `window.size` positions of the query (transformers' sliding
    window: distance < size).

    Each row reads its own copy of the shared keys (the `copy` broadcast's cost): exact, not fast.
    A window over keys whose positions are unknown (evicted, pooled) is refused, never guessed.
    With `want_weights`, also the softmax statistics in `cascade`'s layout (`Weights`)."""
    b, q_len = query.shape[0], query.shape[2]
    keys, values, seen, where = [], [], [], []
    for seg in shared:
        ks, vs = seg.keys[layer], seg.values[layer]
        t = ks.shape[1]
        keys.append(ks[None].expand(b, -1, -1, -1))
        values.append(vs[None].expand(b, -1, -1, -1))
        rows = torch.ones(b, t, dtype=torch.bool, device=query.device)
        if seg.rows is not None:
            rows = torch.zeros_like(rows)
            rows[seg.rows] = True if seg.mask is None else seg.mask
        seen.append(rows[:, None, :].expand(b, q_len, t))
        if window is not None:
            if seg.start is None:
                raise ValueError(
                    "sliding-window attention over KV whose positions are not consecutive (evicted slots, "
                    "pooled blocks) is not supported: run this model without KV-evicting accelerations"
                )
            where.append((seg.start + torch.arange(t, device=query.device))[None].expand(b, t))
    keys.append(k_own)
    values.append(v_own)
    seen.append(own_visible)
    visible = torch.cat(seen, dim=2)
    if window is not None:
        if window.own_pos is None:
            raise ValueError(
                "sliding-window attention over a tail whose slots were evicted or moved is not supported: "
                "run this model without KV-evicting accelerations"
            )
        k_pos = torch.cat([*where, window.own_pos], dim=1)
        visible = visible & (window.q_pos[:, :, None] - k_pos[:, None, :] < window.size)
    scores = explicit_scores(query, torch.cat(keys, dim=2), visible[:, None], scaling, softcap)
    out = _softmax_values(scores, torch.cat(values, dim=2))
    if not want_weights:
        return out, None
    return out, _explicit_weights(scores, k_own.shape[1], shared, [k.shape[2] for k in keys[:-1]])


class AttentionContext(Protocol):
    """What the registered attention function needs from the batch it runs in. `softcap` and
    `window` are the layer's (transformers passes them: Gemma 2's soft-capping, a sliding-window
    layer's size); a context honours both exactly or raises."""

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
        softcap: float | None = None,
        window: int | None = None,
    ) -> torch.Tensor: ...


UNSUPPORTED_KWARGS = {"s_aux": "attention sinks", "sinks": "attention sinks"}
"""Keywords a layer may pass its attention that change the result and that the backend does not
apply: a layer passing one is refused (naming it), never run without it."""


def branchwise_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    bw_ctx: AttentionContext | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention entry point registered with transformers (see module docstring)."""
    for name, what in UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{type(module).__name__} passes {name}= ({what}): not supported by the local backend"
            )
    softcap = kwargs.pop("softcap", None)
    window = kwargs.pop("sliding_window", None)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if bw_ctx is None:  # a layer that hands its attention no keywords, inside the backend's loop
        bw_ctx = cast("AttentionContext | None", LAYER_CONTEXT.get())
    if bw_ctx is None:
        if softcap is not None:  # SDPA takes no soft-cap: the scores written out (the mask has the window)
            return explicit_attention(
                query, key, value, visible_of(attention_mask, query, key), scale, softcap
            ), None
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    # every decoder attention module transformers calls this from numbers its layer
    return bw_ctx.attend(cast(int, module.layer_idx), query, key, value, scale, softcap, window), None


def register() -> str:
    """Register the attention function (idempotent) and return its name."""
    AttentionInterface.register(ATTN_NAME, branchwise_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)
    return ATTN_NAME
