"""SkipKV's policy (the SkipKV paper, §4.1-4.3, App. A.1): sentences, eviction scores, steering
vectors, batch grouping.

Pure logic on tensors and token ids, no backend: `skipkv.py` applies it inside the decode loop. One
row (decoding branch) at a time:

- `SentenceTracker` cuts the row's generated tokens into sentences at the newline delimiters of
  App. A.1 (consecutive delimiters merged, `:\\n` excluded), labels non-execution sentences by
  keyword, and maps generation-space (gs) sentence spans to cache-space (cs) slot ranges across
  evictions (Eq. 9-11). It keeps the composed surviving set P (the gs index of every held slot)
  instead of re-mapping ranges step by step: Eq. 11 applied to P gives the same ranges, and one
  list is far harder to get wrong than n incrementally patched pairs.
- Scores: attention importance (Eq. 4, SnapKV-style window of recent queries, GQA groups maxed),
  R-KV key redundancy (Eq. 5, per row), sentence redundancy λ (Eq. 3) and their combination (Eq. 6).
  Per KV head (the paper's Eq. 4-6 and selection, `SkipKVConfig.per_head`): every (layer, KV head)
  scores its own slots and keeps its own best ones, the same number in every head so KV stays a
  rectangular `[H_kv, kept, D]` per layer; the tracker then holds one gs↔cs map per (layer, head).
  With `per_head=False` one surviving slot set is shared by all layers and heads of a row (scores
  averaged) and the row has a single map.
- `select_keep` turns scores into the kept slots under a budget on the row's own generated tokens;
  `select_keep_per_head` does it for every (layer, head) row of scores at once.
- Steering (§4.2): the vector v = mean(exec) − mean(non-exec) hidden states, its save/load, and the
  adaptive strength α0 + γ·N_nonexec.

Batch grouping (§4.3) is not SkipKV's own: it lives in `backends/grouping.py`.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from branchwise.backends.hf.model_files import model_file
from branchwise.backends.hf.vocab import token_texts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_EPS = 1e-8

# ---------------------------------------------------------------------------------------------- delimiters
# App. A.1: D = {"\n", ".\n", ")\n", "\n\n", ".\n\n", ")\n\n"}, generalised to any run of newlines
# (tokenizers merge "\n\n\n" too) and to leading spaces/tabs (byte-level BPE glues indentation on).
# Anything else before the newline — notably ":" of `if x:\n` — is not a sentence end: splitting
# there would cut code blocks apart and invite their premature eviction (App. A.1).
_DELIMITER = re.compile(r"[ \t]*[.)]?\n+")


def is_delimiter_text(text: str) -> bool:
    """Whether a token's decoded text is a newline delimiter of App. A.1 (`:\\n` is not)."""
    return _DELIMITER.fullmatch(text) is not None


def delimiter_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Ids of the vocabulary tokens that decode, on their own, to a newline delimiter (special
    tokens excluded; see `vocab.token_texts` for why the rule is on text)."""
    return frozenset(i for i, text in token_texts(tokenizer) if is_delimiter_text(text))


# ---------------------------------------------------------------------------------------------- sentences
@dataclass(frozen=True)
class Sentence:
    """One sentence of a row's generation, in generation space (gs: index into generated tokens)."""

    start: int
    """gs index of its first token."""
    end: int
    """gs index of its last token (inclusive); for the open (last, unfinished) sentence, the newest token."""
    closed: bool
    """Ended by a delimiter (trailing delimiters merged in)."""
    nonexec: bool
    """Contains a non-execution keyword as a whole word (App. A.1, "Wait", "Alternatively", "again")."""


class SentenceTracker:
    """A row's sentences and the gs index of each KV slot it still holds (the composed set P).

    `append` is called once the tokens' KV is written (the cache grows by as many slots), `evict`
    with the surviving slots after a compression. Labels come from decoding each sentence on its
    own — only the open sentence is re-decoded, once per `append`, so the cost per step is the
    length of the current sentence, not of the whole trace. The open sentence is re-labelled each
    time because growth can both add a keyword and remove one ("again" → "against").

    Optionally `append` also takes the tokens' last-layer hidden states; the tracker then keeps a
    running sum per sentence so `sentence_vectors` gives Eq. 2's means without storing any token's
    state (the evicted tokens' states would otherwise have to be kept around for Eq. 3).
    """

    def __init__(
        self,
        delimiters: frozenset[int],
        keywords: Sequence[str],
        decode: Callable[[Sequence[int]], str],
    ) -> None:
        self._delimiters = delimiters
        self._decode = decode
        self._keyword = (
            re.compile("|".join(rf"(?<!\w){re.escape(k)}(?!\w)" for k in keywords)) if keywords else None
        )
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._closed: list[bool] = []
        self._nonexec: list[bool] = []
        self._open_ids: list[int] = []  # tokens of the last sentence while it is open
        self._slot_gs: list[int] = []  # P: gs index of every held slot, increasing
        self._head_gs: torch.Tensor | None = None  # per (layer, KV head) P [L, H, n], once per-head
        self._gen_len = 0
        self._n_nonexec = 0
        self._hsum: torch.Tensor | None = None  # [n_sentences(+), d] float32
        self._hcount: torch.Tensor | None = None  # [n_sentences(+)]

    # -- updates
    def append(self, token_ids: Sequence[int], hidden: torch.Tensor | None = None) -> None:
        """Record generated tokens whose KV was just written; `hidden` [len, d] feeds `sentence_vectors`."""
        ids = [int(t) for t in token_ids]
        if hidden is not None and (hidden.dim() != 2 or hidden.shape[0] != len(ids)):
            raise ValueError(
                f"hidden must be [len(token_ids), d] = [{len(ids)}, d], got {list(hidden.shape)}"
            )
        sentence_of_token: list[int] = []
        open_grew = False
        first = self._gen_len
        for token in ids:
            g = self._gen_len
            if token in self._delimiters:
                if not self._starts:
                    # the generation opens with delimiters: they form a (closed) sentence of their own,
                    # so every generated token belongs to exactly one sentence
                    self._new_sentence(g, closed=True)
                elif not self._closed[-1]:
                    self._open_ids.append(token)
                    self._closed[-1] = True
                    self._label_last()
                    self._open_ids = []
                    open_grew = False
                self._ends[-1] = g  # consecutive delimiters merge into the sentence's end
            else:
                if not self._starts or self._closed[-1]:
                    self._new_sentence(g, closed=False)
                self._ends[-1] = g
                self._open_ids.append(token)
                open_grew = True
            if self._head_gs is None:
                self._slot_gs.append(g)
            self._gen_len += 1
            sentence_of_token.append(len(self._starts) - 1)
        if self._head_gs is not None and ids:
            new = torch.arange(first, self._gen_len, dtype=torch.long)
            grown = new.expand(*self._head_gs.shape[:2], len(ids))
            self._head_gs = torch.cat([self._head_gs, grown], dim=-1)
        if open_grew:
            self._label_last()
        if hidden is not None and ids:
            self._accumulate(hidden, sentence_of_token)

    def evict(self, keep: Sequence[int] | torch.Tensor) -> None:
        """Keep only the cs slots `keep` (sorted, unique, in range); the rest were dropped from the KV."""
        idx = keep.tolist() if isinstance(keep, torch.Tensor) else [int(k) for k in keep]
        n = self.cache_len
        if any(b <= a for a, b in pairwise(idx)):
            raise ValueError("keep must be strictly increasing cache slot indices")
        if idx and (idx[0] < 0 or idx[-1] >= n):
            raise ValueError(f"keep holds slot indices outside [0, cache_len={n})")
        if self._head_gs is not None:  # the same slots of every head
            self._head_gs = self._head_gs[..., torch.tensor(idx, dtype=torch.long)]
        else:
            self._slot_gs = [self._slot_gs[k] for k in idx]

    def evict_per_head(self, keep: torch.Tensor) -> None:
        """Keep, per (layer, KV head), its own cs slots: `keep` [L, H, k], each row strictly
        increasing and in range. From then on the tracker holds one P per (layer, head)."""
        if keep.dim() != 3:
            raise ValueError(f"keep must be [L, H, k], got {list(keep.shape)}")
        idx = keep.to("cpu", torch.long)
        n = self.cache_len
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise ValueError(f"keep holds slot indices outside [0, cache_len={n})")
        if idx.shape[-1] > 1 and not bool((idx[..., 1:] > idx[..., :-1]).all()):
            raise ValueError("keep must be strictly increasing cache slot indices in every head")
        table = self._head_gs
        if table is None:
            table = self.positions.expand(idx.shape[0], idx.shape[1], n)
        elif table.shape[:2] != idx.shape[:2]:
            raise ValueError(
                f"keep has [L, H] = {list(idx.shape[:2])}, earlier evictions {list(table.shape[:2])}"
            )
        self._head_gs = table.gather(-1, idx).contiguous()
        self._slot_gs = []

    def _new_sentence(self, g: int, closed: bool) -> None:
        self._starts.append(g)
        self._ends.append(g)
        self._closed.append(closed)
        self._nonexec.append(False)

    def _label_last(self) -> None:
        """(Re)label the last sentence from its decoded text; count it once it closes as non-exec."""
        text = self._decode(self._open_ids)
        nonexec = self._keyword is not None and self._keyword.search(text) is not None
        self._nonexec[-1] = nonexec
        if nonexec and self._closed[-1]:
            self._n_nonexec += 1

    def _accumulate(self, hidden: torch.Tensor, sentence_of_token: list[int]) -> None:
        n = len(self._starts)
        h = hidden.detach().float()
        if self._hsum is None or self._hcount is None:
            self._hsum = h.new_zeros(0, h.shape[1])
            self._hcount = h.new_zeros(0)
        if self._hsum.shape[1] != h.shape[1]:
            raise ValueError(f"hidden width {h.shape[1]} != earlier appends' {self._hsum.shape[1]}")
        if self._hsum.shape[0] < n:
            grow = max(n - self._hsum.shape[0], self._hsum.shape[0])  # amortised doubling
            self._hsum = torch.cat([self._hsum, self._hsum.new_zeros(grow, h.shape[1])])
            self._hcount = torch.cat([self._hcount, self._hcount.new_zeros(grow)])
        index = torch.tensor(sentence_of_token, device=h.device)
        self._hsum.index_add_(0, index, h.to(self._hsum.device))
        self._hcount.index_add_(0, index, torch.ones_like(index, dtype=self._hcount.dtype))

    # -- views
    @property
    def sentences(self) -> list[Sentence]:
        return [
            Sentence(s, e, c, x)
            for s, e, c, x in zip(self._starts, self._ends, self._closed, self._nonexec, strict=True)
        ]

    @property
    def n_nonexec(self) -> int:
        """Closed non-execution sentences so far: N in the steering strength α0 + γ·N (Alg. 2 l. 27)."""
        return self._n_nonexec

    @property
    def positions(self) -> torch.Tensor:
        """gs index of every held cs slot, increasing (LongTensor [cache_len]); the paper's P composed
        over all evictions. The KV slot's logical (RoPE) position is the generation's first position
        plus this. Only while every head holds the same slots (see `slot_positions`)."""
        if self._head_gs is not None:
            raise ValueError("the heads hold different slots since a per-head eviction: use slot_positions")
        return torch.tensor(self._slot_gs, dtype=torch.long)

    @property
    def per_head(self) -> bool:
        """Whether the heads hold different slots (a per-head eviction happened)."""
        return self._head_gs is not None

    @property
    def slot_positions(self) -> torch.Tensor:
        """gs index of every held slot: [cache_len] while all heads share them, else [L, H, cache_len]."""
        return self._head_gs if self._head_gs is not None else self.positions

    @property
    def cache_len(self) -> int:
        return int(self._head_gs.shape[-1]) if self._head_gs is not None else len(self._slot_gs)

    @property
    def gen_len(self) -> int:
        return self._gen_len

    def cache_range(self, i: int) -> tuple[int, int] | None:
        """Eq. 11: sentence i's cs slots are (min{k: p_k ≥ start_i}, max{k: p_k ≤ end_i}), inclusive;
        None once none of its tokens is held. Contiguous because P is increasing and sentences tile gs.
        Only while every head holds the same slots."""
        if self._head_gs is not None:
            raise ValueError("the heads hold different slots since a per-head eviction")
        lo = bisect_left(self._slot_gs, self._starts[i])
        hi = bisect_right(self._slot_gs, self._ends[i]) - 1
        return (lo, hi) if lo <= hi else None

    def sentence_of_slot(self) -> torch.Tensor:
        """Sentence index of every held cs slot (LongTensor shaped like `slot_positions`), for Eq. 6's
        per-token λ."""
        starts = torch.tensor(self._starts, dtype=torch.long)
        return torch.searchsorted(starts, self.slot_positions.contiguous(), right=True) - 1

    def sentence_penalty(self, lam: torch.Tensor) -> torch.Tensor:
        """Per-slot λ of Eq. 6 (shaped like `slot_positions`, on lam's device) from per-sentence λ
        ([n_sentences])."""
        if lam.shape != (len(self._starts),):
            raise ValueError(f"lam must be [n_sentences] = [{len(self._starts)}], got {list(lam.shape)}")
        return lam[self.sentence_of_slot().to(lam.device)]

    def sentence_vectors(self) -> torch.Tensor:
        """Eq. 2: mean hidden state per sentence [n_sentences, d] (float32), over every token appended
        with `hidden` (evicted ones included, as Alg. 2 scores sentences in gs); zero for sentences
        without any, so their cosine with anything is 0 and they are never flagged redundant."""
        if self._hsum is None or self._hcount is None:
            raise ValueError("no hidden states recorded: pass hidden= to SentenceTracker.append")
        n = len(self._starts)
        sums, counts = self._hsum[:n], self._hcount[:n]
        if sums.shape[0] < n:  # sentences begun by appends without hidden states
            sums = torch.cat([sums, sums.new_zeros(n - sums.shape[0], sums.shape[1])])
            counts = torch.cat([counts, counts.new_zeros(n - counts.shape[0])])
        return sums / counts.clamp_min(1.0).unsqueeze(1)


# ---------------------------------------------------------------------------------------------- scores
@torch.no_grad()
def token_importance(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    pool_kernel: int,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. 4: attention the last α queries pay each key, per KV head → [H_kv, N] (float32, sums to 1).

    `queries` [H_q, α, D] and `keys` [H_kv, N, D] are one row's post-RoPE states at one layer. Query
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
    h_q, alpha, d = queries.shape
    h_kv, n, d_k = keys.shape
    if d != d_k or h_q % h_kv:
        raise ValueError(
            f"queries [H_q={h_q}, α, D={d}] and keys [H_kv={h_kv}, N, D={d_k}]: need equal D and H_q % H_kv == 0"
        )
    if pool_kernel < 1 or pool_kernel % 2 == 0:
        raise ValueError(f"pool_kernel={pool_kernel} must be odd and >= 1")
    group = h_q // h_kv
    q = queries.float().reshape(h_kv, group * alpha, d)
    logits = torch.matmul(q, keys.float().transpose(-1, -2)).mul_(scaling).view(h_kv, group, alpha, n)
    key_ok: torch.Tensor | None = None
    if valid is not None:
        mask = valid.to(device=logits.device, dtype=torch.bool)
        if mask.shape not in ((n,), (alpha, n)):
            raise ValueError(f"valid must be [N={n}] or [α={alpha}, N={n}], got {list(mask.shape)}")
        logits = logits.masked_fill(~mask, float("-inf"))
        key_ok = mask if mask.dim() == 1 else mask.any(0)
    attn = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)  # a query with no valid key → 0
    scores = attn.mean(dim=2).amax(dim=1)  # [H_kv, N]
    if pool_kernel > 1:
        scores = F.max_pool1d(scores.unsqueeze(1), pool_kernel, stride=1, padding=pool_kernel // 2).squeeze(1)
    if key_ok is not None:
        scores = scores.masked_fill(~key_ok, 0.0)  # pooling must not spill onto padding
    return scores / scores.sum(dim=-1, keepdim=True).clamp_min(_EPS)


@torch.no_grad()
def key_redundancy(keys: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Eq. 5 (R-KV): how much each key is duplicated by the row's other keys → [H_kv, N] float32.

    Per KV head: unit keys K̄, similarities K̄K̄ᵀ with the diagonal excluded, a softmax over each
    row, then the mean over rows — key j scores high when many other keys are most similar to it.
    Invalid (padding) keys are neither candidates in the softmax nor rows in the mean, and score 0.
    `keys` is one row's: R-KV's public code took batch row 0's similarities for every row, which
    scores one branch's tokens by another's keys. Heads run one at a time, so the N×N temporary is
    one head's.
    """
    h_kv, n, _ = keys.shape
    k = keys.float()
    k = k / (k.norm(dim=-1, keepdim=True) + _EPS)
    mask = torch.ones(n, dtype=torch.bool, device=k.device)
    if valid is not None:
        if valid.shape != (n,):
            raise ValueError(f"valid must be [N={n}], got {list(valid.shape)}")
        mask = valid.to(device=k.device, dtype=torch.bool)
    exclude = ~mask.unsqueeze(0) | torch.eye(n, dtype=torch.bool, device=k.device)
    rows = mask.sum().clamp_min(1).float()
    out = torch.empty(h_kv, n, device=k.device)
    for h in range(h_kv):
        sim = (k[h] @ k[h].T).masked_fill_(exclude, float("-inf"))
        probs = torch.nan_to_num(torch.softmax(sim, dim=-1), nan=0.0)  # a lone valid key has no others
        out[h] = probs[mask].sum(dim=0) / rows
    return out.masked_fill_(~mask, 0.0)


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


# ---------------------------------------------------------------------------------------------- steering
@dataclass
class SteeringVector:
    """SkipKV §4.2: v = mean(execution) − mean(non-execution) hidden states at one layer's input.

    Adding +α·v at delimiter tokens pushes the next thought toward execution (away from reflection
    and transitions). Built once per model, so it is saved next to the other per-model caches.
    """

    layer: int
    vector: torch.Tensor
    n_exec: int
    n_nonexec: int
    model: str

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "layer": self.layer,
                "vector": self.vector.detach().to("cpu", torch.float32).contiguous(),
                "n_exec": self.n_exec,
                "n_nonexec": self.n_nonexec,
                "model": self.model,
            },
            path,
        )

    @classmethod
    def load(cls, path: Path) -> SteeringVector:
        """Load a saved vector; `weights_only=True` so a cache file cannot run code on load."""
        data = torch.load(path, map_location="cpu", weights_only=True)
        fields = ("layer", "vector", "n_exec", "n_nonexec", "model")
        if not isinstance(data, dict) or any(f not in data for f in fields):
            raise ValueError(f"{path} is not a saved steering vector (needs fields {', '.join(fields)})")
        if not isinstance(data["vector"], torch.Tensor) or data["vector"].dim() != 1:
            raise ValueError(f"{path}: vector must be a 1-D tensor")
        return cls(
            layer=int(data["layer"]),
            vector=data["vector"],
            n_exec=int(data["n_exec"]),
            n_nonexec=int(data["n_nonexec"]),
            model=str(data["model"]),
        )


def steering_vector(exec_states: torch.Tensor, nonexec_states: torch.Tensor) -> torch.Tensor:
    """mean(exec_states) − mean(nonexec_states) over rows ([n, d] each) → [d] float32."""
    for name, states in (("exec_states", exec_states), ("nonexec_states", nonexec_states)):
        if states.dim() != 2:
            raise ValueError(f"{name} must be [n, d], got {list(states.shape)}")
        if states.shape[0] == 0:
            raise ValueError(f"{name} is empty: need at least one hidden state of that kind of thought")
    if exec_states.shape[1] != nonexec_states.shape[1]:
        raise ValueError(
            f"hidden sizes differ: exec {exec_states.shape[1]}, non-exec {nonexec_states.shape[1]}"
        )
    return exec_states.float().mean(dim=0) - nonexec_states.float().mean(dim=0).to(exec_states.device)


def steering_path(model_name: str) -> Path:
    """Where a model's steering vector lives: `<cache>/steering/<model>.pt`."""
    return model_file("steering", model_name, "pt")


def steering_strength(alpha0: float, gamma: float, n_nonexec: int) -> float:
    """α_t = α0 + γ·N_nonexec (§4.2): steer harder the more the row has already hesitated."""
    return alpha0 + gamma * n_nonexec
