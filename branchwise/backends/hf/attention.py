"""Shared-prefix ("cascade") attention over the branch tree.

Why: B branches that share a prefix should read its KV once per step, not B copies of it. Each
batch row attends to (a) the KV segments of its ancestors in the branch tree, which are held once and
may be shared by many rows, and (b) its own growing tail. For every ancestor segment we run ONE
batched product of the queries of all rows that share it against its keys, keep the softmax
statistics (running max and sum), and merge the partial results with log-sum-exp. The result equals
attention over the concatenated keys (checked against a full recompute in the tests) without ever
materialising per-branch copies of the prefix.

The function is registered with transformers' `AttentionInterface`, so the model's own attention
modules (projections, rotary embedding, head layout) stay in charge; the backend passes the batch
context as the `bw_ctx` keyword through its own layer loop. Without a context it defers to SDPA, so
`model.generate()` keeps working for the `hf_generate` baseline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
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
    key: int = -1  # the backend's segment id (attention-mass bookkeeping)
    track: bool = True  # accumulate its attention mass (False for segments RSBCM never evicts)


@dataclass
class BatchContext:
    """Per-batch KV state the attention function reads and writes, layer by layer.

    `tail_k[l]` / `tail_v[l]` are `[B, H_kv, cap, D]` buffers holding each row's own tokens, right
    padded; `lens[b]` is how many of them are valid before the current forward. `begin(q)` prepares
    the masks and write positions for a forward of `q` new tokens per row (padded rows feed dummies
    whose outputs are discarded and whose slots are later overwritten).
    """

    tail_k: list[torch.Tensor]
    tail_v: list[torch.Tensor]
    lens: torch.Tensor  # [B] long
    shared: list[SharedSegment] = field(default_factory=list)
    pos_next: torch.Tensor | None = None  # [B] logical position of each row's next token
    track_mass: bool = False
    """Accumulate the attention mass each key receives (RSBCM's block importance); forces the
    explicit-softmax path, since SDPA does not expose its weights."""
    own_mass: torch.Tensor | None = None  # [B, cap]
    seg_mass: dict[int, torch.Tensor] = field(default_factory=dict)  # segment key -> [T]
    n_groups: int = 1
    query_window: list[torch.Tensor] | None = None
    """SkipKV: per layer the last α post-RoPE decode queries `[B, H, α', D]` (None = not recorded)."""
    window_size: int = 0
    last_hidden: torch.Tensor | None = None  # final-norm hidden state at each row's last fed token
    # set by begin():
    q_len: int = 0
    _own_mask: torch.Tensor | None = None  # [B,1,q,T] bool
    _own_mask_g: torch.Tensor | None = None  # [B,1,G*q,T] bool
    _write_idx: torch.Tensor | None = None
    _uniform: int | None = None

    @property
    def batch(self) -> int:
        return int(self.lens.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.tail_k[0].shape[2])

    def begin(self, q_len: int) -> None:
        """Prepare masks and write positions for a forward of `q_len` tokens per row."""
        self.q_len = q_len
        device = self.lens.device
        max_len = int(self.lens.max())
        total = max_len + q_len
        if total > self.capacity:
            self._grow(total)
        j = torch.arange(total, device=device)
        i = torch.arange(q_len, device=device)
        # key j is visible to query i of row b iff j <= lens[b] + i (causal within the tail).
        limit = self.lens[:, None] + i[None, :]  # [B, q]
        mask = j[None, None, :] <= limit[:, :, None]  # [B, q, T]
        self._own_mask = mask[:, None]
        g = self.n_groups
        self._own_mask_g = (
            mask[:, None, None].expand(-1, 1, g, -1, -1).reshape(self.batch, 1, g * q_len, total)
        )
        lens_list = self.lens.tolist()
        self._uniform = lens_list[0] if all(x == lens_list[0] for x in lens_list) else None
        self._write_idx = None if self._uniform is not None else limit  # [B, q]

    def _grow(self, needed: int) -> None:
        new_cap = max(needed, self.capacity + max(128, self.capacity // 2))
        for layer in range(len(self.tail_k)):
            for buf in (self.tail_k, self.tail_v):
                old = buf[layer]
                new = old.new_zeros(old.shape[0], old.shape[1], new_cap, old.shape[3])
                new[:, :, : old.shape[2]] = old
                buf[layer] = new
        if self.own_mass is not None:
            grown = self.own_mass.new_zeros(self.own_mass.shape[0], new_cap)
            grown[:, : self.own_mass.shape[1]] = self.own_mass
            self.own_mass = grown

    def select_rows(self, keep: torch.Tensor, row_map: dict[int, int]) -> None:
        """Drop batch rows not in `keep` (a long tensor of old row indices, in order)."""
        self.tail_k = [t.index_select(0, keep) for t in self.tail_k]
        self.tail_v = [t.index_select(0, keep) for t in self.tail_v]
        self.lens = self.lens.index_select(0, keep)
        # per-forward state too: rows can leave between layers (CGEE level-2 exits)
        if self._own_mask is not None:
            self._own_mask = self._own_mask.index_select(0, keep)
            self._own_mask_g = self._own_mask_g.index_select(0, keep)
        if self._write_idx is not None:
            self._write_idx = self._write_idx.index_select(0, keep)
        if self.own_mass is not None:
            self.own_mass = self.own_mass.index_select(0, keep)
        if self.pos_next is not None:
            self.pos_next = self.pos_next.index_select(0, keep)
        if self.query_window is not None:
            self.query_window = [w.index_select(0, keep) for w in self.query_window]
        new_shared = []
        for seg in self.shared:
            if seg.rows is None:
                new_shared.append(seg)
                continue
            rows = [row_map[r] for r in seg.rows.tolist() if r in row_map]
            if rows:
                new_shared.append(
                    SharedSegment(
                        seg.keys, seg.values, torch.tensor(rows, device=self.lens.device), seg.key, seg.track
                    )
                )
        self.shared = new_shared

    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """Write this forward's K/V into the tail and attend over ancestors + tail.

        query `[B, H, q, D]`, key/value `[B, H_kv, q, D]` (post-RoPE). Returns `[B, q, H, D]`.
        """
        tk, tv = self.tail_k[layer], self.tail_v[layer]
        q_len = self.q_len
        if self.query_window is not None and q_len == 1:
            # decode step: slide the observation window SkipKV scores token importance with
            self.query_window[layer] = torch.cat([self.query_window[layer], query], dim=2)[
                :, :, -self.window_size :
            ]
        if self._uniform is not None:
            start = self._uniform
            tk[:, :, start : start + q_len] = key
            tv[:, :, start : start + q_len] = value
        else:
            rows = torch.arange(self.batch, device=key.device)[:, None]
            tk[rows, :, self._write_idx] = key.transpose(1, 2)
            tv[rows, :, self._write_idx] = value.transpose(1, 2)
        total = self._own_mask.shape[-1]
        k_own, v_own = tk[:, :, :total], tv[:, :, :total]
        if not self.shared and not self.track_mass:
            out = F.scaled_dot_product_attention(
                query, k_own, v_own, attn_mask=self._own_mask, scale=scaling, enable_gqa=self.n_groups > 1
            )
            return out.transpose(1, 2)
        return self._cascade(layer, query, k_own, v_own, scaling)

    def _cascade(
        self, layer: int, query: torch.Tensor, k_own: torch.Tensor, v_own: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        b, h, q_len, d = query.shape
        h_kv = k_own.shape[1]
        gq = (h // h_kv) * q_len
        # Query head j*G..(j+1)*G-1 uses KV head j (transformers' repeat_kv layout).
        qg = query.reshape(b, h_kv, gq, d)
        # Own tail: unnormalised softmax statistics.
        scores = torch.matmul(qg, k_own.transpose(-1, -2)).mul_(scaling)
        scores.masked_fill_(~self._own_mask_g, float("-inf"))
        m = scores.amax(-1, keepdim=True)
        p = torch.exp(scores - m)
        s = p.sum(-1, keepdim=True)
        o = torch.matmul(p, v_own)
        own_stats = (m, p)
        seg_stats = []
        for seg in self.shared:
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
        if self.track_mass:
            self._add_mass(own_stats, seg_stats, m, s)
        out = (o / s).reshape(b, h, q_len, d)
        return out.transpose(1, 2)

    def _add_mass(
        self,
        own: tuple[torch.Tensor, torch.Tensor],
        segments: list[tuple[SharedSegment, torch.Tensor, torch.Tensor]],
        m: torch.Tensor,
        s: torch.Tensor,
    ) -> None:
        """Add the normalised attention weight each key got (summed over heads and queries)."""
        m_own, p_own = own
        weight = (p_own * torch.exp(m_own - m) / s).sum(dim=(1, 2))  # [B, T]
        self.own_mass[:, : weight.shape[-1]] += weight.float()
        for seg, ms, ps in segments:
            if not seg.track:
                continue
            m_r = m if seg.rows is None else m[seg.rows]
            s_r = s if seg.rows is None else s[seg.rows]
            factor = torch.exp(ms - m_r) / s_r  # [R, H_kv, G*q, 1]
            h_kv = factor.shape[1]
            factor = factor.permute(1, 0, 2, 3).reshape(h_kv, -1, 1)
            total = (ps * factor).sum(dim=(0, 1)).float()  # [T_seg]
            if seg.key in self.seg_mass:
                self.seg_mass[seg.key] += total
            else:
                self.seg_mass[seg.key] = total


def _merge(
    m1: torch.Tensor, s1: torch.Tensor, o1: torch.Tensor, m2: torch.Tensor, s2: torch.Tensor, o2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-sum-exp merge of two partial softmax-attention results."""
    m = torch.maximum(m1, m2)
    a, c = torch.exp(m1 - m), torch.exp(m2 - m)
    return m, s1 * a + s2 * c, o1 * a + o2 * c


def branchwise_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    bw_ctx: BatchContext | None = None,
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
