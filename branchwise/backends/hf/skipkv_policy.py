"""SkipKV's eviction policy (the SkipKV paper, §4.1, App. A.1): which KV slots of a row to keep.

Pure logic on tensors, no backend: `skipkv.py` applies it inside the decode loop, one row
(decoding branch) at a time, over the sentences `skipkv_sentences.SentenceTracker` keeps.

- Scores: attention importance (Eq. 4, SnapKV-style window of recent queries, GQA groups maxed),
  R-KV key redundancy (Eq. 5, per row), sentence redundancy λ (Eq. 3) and their combination (Eq. 6).
  Per KV head (the paper's Eq. 4-6 and selection, `SkipKVConfig.per_head`): every (layer, KV head)
  scores its own slots and keeps its own best ones, the same number in every head so KV stays a
  rectangular `[H_kv, kept, D]` per layer; the tracker then holds one gs↔cs map per (layer, head).
  With `per_head=False` one surviving slot set is shared by all layers and heads of a row (scores
  averaged) and the row has a single map.
- `select_keep` turns scores into the kept slots under a budget on the row's own generated tokens;
  `select_keep_per_head` does it for every (layer, head) row of scores at once.

Sentences live in `skipkv_sentences.py`, steering (§4.2) in `skipkv_steering.py`; batch grouping
(§4.3) is not SkipKV's own: it lives in `backends/grouping.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_EPS = 1e-8


# ---------------------------------------------------------------------------------------------- scores
@torch.no_grad()
def token_importance(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    pool_kernel: int,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. 4: attention the last α queries pay each key, per KV head → [..., H_kv, N] (float32, sums
    to 1).

    `queries` [..., H_q, α, D] and `keys` [..., H_kv, N, D] are one row's post-RoPE states at one
    layer (or at every layer, stacked along the leading dims: one product for all of them). Query
    head i belongs to KV head i // (H_q / H_kv), the `repeat_kv` layout of transformers; the query
    heads are viewed in groups rather than the keys repeated, so memory stays O(H_q·α·N).
    Attention is averaged over the α queries, maxed over a group's query heads, max-pooled along the
    tokens (kernel `pool_kernel`, stride 1, same length: a token next to an attended one is kept
    too, so kept spans stay readable), and normalised per KV head. The paper writes that
    normalisation as a softmax, but softmax over probabilities in [0, 1] is nearly uniform and
    erases the ranking against Eq. 6's other terms, so we divide by the sum instead.

    `valid` masks keys (False = padding / not a key of this row): [N], or [α, N] per query — pass
    the latter for causality when the keys include the observation window itself. Masked keys get 0.
    """
    *lead, h_q, alpha, d = queries.shape
    *_, h_kv, n, d_k = keys.shape
    if d != d_k or h_q % h_kv:
        raise ValueError(
            f"queries [H_q={h_q}, α, D={d}] and keys [H_kv={h_kv}, N, D={d_k}]: need equal D and H_q % H_kv == 0"
        )
    if pool_kernel < 1 or pool_kernel % 2 == 0:
        raise ValueError(f"pool_kernel={pool_kernel} must be odd and >= 1")
    group = h_q // h_kv
    q = queries.float().reshape(*lead, h_kv, group * alpha, d)
    logits = torch.matmul(q, keys.float().transpose(-1, -2)).mul_(scaling).view(*lead, h_kv, group, alpha, n)
    key_ok: torch.Tensor | None = None
    if valid is not None:
        mask = valid.to(device=logits.device, dtype=torch.bool)
        if mask.shape not in ((n,), (alpha, n)):
            raise ValueError(f"valid must be [N={n}] or [α={alpha}, N={n}], got {list(mask.shape)}")
        logits = logits.masked_fill(~mask, float("-inf"))
        key_ok = mask if mask.dim() == 1 else mask.any(0)
    attn = torch.softmax(logits, dim=-1)
    if key_ok is not None:
        attn = torch.nan_to_num(attn, nan=0.0)  # a query with no valid key → 0
    scores = attn.mean(dim=-2).amax(dim=-2)  # [..., H_kv, N]
    if pool_kernel > 1:
        pooled = F.max_pool1d(scores.reshape(-1, 1, n), pool_kernel, stride=1, padding=pool_kernel // 2)
        scores = pooled.view(scores.shape)
    if key_ok is not None:
        scores = scores.masked_fill(~key_ok, 0.0)  # pooling must not spill onto padding
    return scores / scores.sum(dim=-1, keepdim=True).clamp_min(_EPS)


@torch.no_grad()
def key_redundancy(
    keys: torch.Tensor, valid: torch.Tensor | None = None, max_bytes: int = 64 << 20
) -> torch.Tensor:
    """Eq. 5 (R-KV): how much each key is duplicated by the row's other keys → [..., H_kv, N] float32.

    Per KV head: unit keys K̄, similarities K̄K̄ᵀ with the diagonal excluded, a softmax over each
    row, then the mean over rows — key j scores high when many other keys are most similar to it.
    Invalid (padding) keys are neither candidates in the softmax nor rows in the mean, and score 0.
    `keys` is one row's, `[H_kv, N, D]` or every layer's stacked `[L, H_kv, N, D]`: R-KV's public
    code took batch row 0's similarities for every row, which scores one branch's tokens by another's
    keys. As many heads run at once as keep the N×N temporaries within `max_bytes` (at least one).
    """
    *lead, h_kv, n, d = keys.shape
    k = keys.float()
    k = (k / (k.norm(dim=-1, keepdim=True) + _EPS)).reshape(-1, n, d)
    mask = None
    if valid is not None:
        if valid.shape != (n,):
            raise ValueError(f"valid must be [N={n}], got {list(valid.shape)}")
        mask = valid.to(device=k.device, dtype=torch.bool)
    rows = float(n) if mask is None else mask.sum().clamp_min(1).float()
    out = torch.empty(k.shape[0], n, device=k.device)
    per = max(1, max_bytes // max(n * n * 4, 1))
    for i in range(0, k.shape[0], per):
        part = k[i : i + per]
        sim = part @ part.transpose(-1, -2)
        sim.diagonal(dim1=-2, dim2=-1).fill_(float("-inf"))  # a key is not its own duplicate
        if mask is None:  # every key valid: no masking (with n > 1 every softmax row has a finite entry)
            out[i : i + per] = (torch.softmax(sim, dim=-1) if n > 1 else sim.zero_()).sum(dim=1) / rows
            continue
        sim.masked_fill_(~mask, float("-inf"))
        probs = torch.nan_to_num(torch.softmax(sim, dim=-1), nan=0.0)  # a lone valid key has no others
        out[i : i + per] = probs[:, mask].sum(dim=1) / rows
    out = out.view(*lead, h_kv, n)
    return out if mask is None else out.masked_fill_(~mask, 0.0)


@torch.no_grad()
def sentence_redundancy(vectors: torch.Tensor, tau: float) -> torch.Tensor:
    """Eq. 3: λ_i = max_{j>i} cos(v_i, v_j) if it exceeds τ, else 0 → [n] float32.

    Only the *earlier* sentence of a similar pair is penalised (the later one restates it with more
    context, and is what the model attends to next); the last sentence is never redundant.
    """
    n = vectors.shape[0]
    if n < 2:
        return vectors.new_zeros(n, dtype=torch.float32)
    v = vectors.float()
    v = v / (v.norm(dim=-1, keepdim=True) + _EPS)
    sim = v @ v.T
    later = torch.ones(n, n, dtype=torch.bool, device=v.device).triu(diagonal=1)
    lam = sim.masked_fill(~later, float("-inf")).amax(dim=-1)
    return torch.where(lam > tau, lam, torch.zeros_like(lam))


@torch.no_grad()
def eviction_scores(
    importance: torch.Tensor,
    redundancy: torch.Tensor | None,
    sentence_penalty: torch.Tensor | None,
    sigma: float,
    per_head: bool = False,
) -> torch.Tensor:
    """Eq. 6 per slot: σ·I − (1−σ)·R − λ → [N] float32 (`per_head`: shaped like `importance`);
    lowest is evicted first.

    `importance`/`redundancy` are [..., N] (e.g. [H_kv, N] or [L, H_kv, N]). Unless `per_head`,
    they are averaged over every leading dim first: a row keeps one slot set for all layers and
    heads (one gs↔cs map); averaging first is exact since Eq. 6 is linear. `sentence_penalty` is the
    λ of each slot's sentence (0 when not redundant), [N] or per head like `importance` (averaged
    unless `per_head`); at ≈τ ≥ 0.95 against token terms ≈1/N it puts a redundant sentence's tokens
    below every other, as §4.1 intends. None omits a term (`redundancy=None, sigma=1` is the
    attention-only baseline).
    """
    n = importance.shape[-1]

    def term(t: torch.Tensor) -> torch.Tensor:
        return t.float() if per_head else t.float().reshape(-1, n).mean(dim=0)

    score = sigma * term(importance)
    if redundancy is not None:
        if redundancy.shape[-1] != n or (per_head and redundancy.shape != importance.shape):
            raise ValueError(
                f"redundancy {list(redundancy.shape)} does not match importance {list(importance.shape)}"
            )
        score = score - (1.0 - sigma) * term(redundancy).to(score.device)
    if sentence_penalty is not None:
        if sentence_penalty.shape not in ((n,), importance.shape):
            raise ValueError(
                f"sentence_penalty must be [N={n}] or {list(importance.shape)}, got {list(sentence_penalty.shape)}"
            )
        lam = sentence_penalty.float() if sentence_penalty.dim() == 1 else term(sentence_penalty)
        score = score - lam.to(score.device)
    return score


def newest_mask(evictable: torch.Tensor, window: int) -> torch.Tensor:
    """The newest `window` evictable slots ([N] bool): SkipKV's always-kept recent window."""
    out = torch.zeros_like(evictable, dtype=torch.bool)
    if window > 0:
        idx = torch.nonzero(evictable, as_tuple=True)[0]
        out[idx[-window:]] = True
    return out


@torch.no_grad()
def select_keep(
    scores: torch.Tensor,
    budget: int,
    *,
    evictable: torch.Tensor,
    protected: torch.Tensor,
) -> torch.Tensor:
    """Slots of one row's tail that survive a compression: sorted LongTensor of indices into [N].

    `evictable` [N] marks the row's own generated slots: everything else (prompt, ancestors' KV
    shared with other branches) is always kept and is outside the budget. `budget` counts kept
    evictable slots, the `protected` ones (the recent window, see `newest_mask`) included: those are
    kept first, then the highest-`scores` ones until exactly `budget` evictable slots remain (all of
    them when there are no more than `budget`). The masks are keyword-only so they cannot be swapped.
    """
    n = scores.shape[-1]
    if scores.dim() != 1 or evictable.shape != (n,) or protected.shape != (n,):
        raise ValueError(
            f"scores, evictable and protected must all be [N]; got {list(scores.shape)}, "
            f"{list(evictable.shape)}, {list(protected.shape)}"
        )
    evictable, fixed, n_fixed = _window_slots(evictable, protected, budget, scores.device)
    keep = ~evictable | fixed
    candidates = torch.nonzero(evictable & ~fixed, as_tuple=True)[0]
    k = min(budget - n_fixed, candidates.numel())
    if k > 0:
        cand_scores = torch.nan_to_num(scores[candidates].float(), nan=float("-inf"))
        keep[candidates[cand_scores.topk(k).indices]] = True
    return torch.nonzero(keep, as_tuple=True)[0]


def _window_slots(
    evictable: torch.Tensor, protected: torch.Tensor, budget: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(evictable, its protected slots, their count) on `device`; refuses a budget below the window."""
    evictable = evictable.to(device=device, dtype=torch.bool)
    fixed = evictable & protected.to(device=device, dtype=torch.bool)
    n_fixed = int(fixed.sum())
    if budget < n_fixed:
        raise ValueError(
            f"budget={budget} is below the {n_fixed} protected (window) evictable slots; "
            "budget must be >= window"
        )
    return evictable, fixed, n_fixed


@torch.no_grad()
def select_keep_per_head(
    scores: torch.Tensor,
    budget: int,
    *,
    evictable: torch.Tensor,
    protected: torch.Tensor,
) -> torch.Tensor:
    """`select_keep` for every head at once: `scores` [..., N] (e.g. [L, H_kv, N]) → kept slots
    [..., K], each row sorted, every row the same K so the gathered KV stays rectangular.

    `evictable` and `protected` [N] are shared by all heads: the prompt (never evicted) and the
    recent window sit at the same slots in every head, since every compression keeps all of the
    former and the newest slots of each head are the same newest tokens. Each head keeps them and
    its own highest-scoring `budget - window` other evictable slots."""
    n = scores.shape[-1]
    if evictable.shape != (n,) or protected.shape != (n,):
        raise ValueError(
            f"evictable and protected must be [N={n}]; got {list(evictable.shape)}, {list(protected.shape)}"
        )
    lead = scores.shape[:-1]
    flat = scores.reshape(-1, n).float()
    evictable, fixed, n_fixed = _window_slots(evictable, protected, budget, scores.device)
    always = torch.nonzero(~evictable | fixed, as_tuple=True)[0]
    candidates = torch.nonzero(evictable & ~fixed, as_tuple=True)[0]
    k = min(budget - n_fixed, candidates.numel())
    kept = always.expand(flat.shape[0], -1)
    if k > 0:
        cand_scores = torch.nan_to_num(flat[:, candidates], nan=float("-inf"))
        chosen = candidates[cand_scores.topk(k, dim=-1).indices]
        kept = torch.cat([kept, chosen], dim=-1)
    return kept.sort(dim=-1).values.reshape(*lead, -1)
