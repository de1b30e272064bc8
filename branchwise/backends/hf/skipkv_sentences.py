"""SkipKV's sentences (the SkipKV paper, §4.1, App. A.1): where a row's generated tokens split into
sentences, which sentences are non-execution thoughts, and where each sentence's tokens sit in the
row's cache after evictions.

Why its own module: this is the bookkeeping every other part of SkipKV reads (the scores in
`skipkv_policy.py` need a row's sentence spans; steering in `skipkv_steering.py` needs the
delimiter tokens and the non-execution count), and it is the one stateful piece: `SentenceTracker`
follows a row across evictions (Eq. 9-11) by keeping the composed surviving set P (the gs index of
every held slot) instead of re-mapping ranges step by step: Eq. 11 applied to P gives the same
ranges, and one list is far harder to get wrong than n incrementally patched pairs. Pure logic on
token ids, no backend.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING

import torch

from branchwise.backends.hf.vocab import token_texts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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
    own, once when it closes (what the steering strength counts, `n_nonexec`); the open sentence is
    labelled only when asked for (`sentences`), from its whole text then, because growth can both
    add a keyword and remove one ("again" → "against"). Labelling it at every `append` decoded a
    sentence per row per step, most of SkipKV's own cost per step, for a label no step reads.

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
        self._hcount: list[int] = []  # tokens summed into each sentence's row of _hsum
        self._head_new = 0  # slots appended since _head_gs was last made whole (`_heads`)
        self._open_stale = False  # the open sentence grew since it was labelled

    # -- updates
    def append(self, token_ids: Sequence[int], hidden: torch.Tensor | None = None) -> None:
        """Record generated tokens whose KV was just written; `hidden` [len, d] feeds `sentence_vectors`."""
        ids = [int(t) for t in token_ids]
        if hidden is not None and (hidden.dim() != 2 or hidden.shape[0] != len(ids)):
            raise ValueError(
                f"hidden must be [len(token_ids), d] = [{len(ids)}, d], got {list(hidden.shape)}"
            )
        sentence_of_token: list[int] = []
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
                    self._open_stale = False
                self._ends[-1] = g  # consecutive delimiters merge into the sentence's end
            else:
                if not self._starts or self._closed[-1]:
                    self._new_sentence(g, closed=False)
                self._ends[-1] = g
                self._open_ids.append(token)
                self._open_stale = True
            if self._head_gs is None:
                self._slot_gs.append(g)
            self._gen_len += 1
            sentence_of_token.append(len(self._starts) - 1)
        self._head_new += len(ids) if self._head_gs is not None else 0
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
        if (heads := self._heads()) is not None:  # the same slots of every head
            self._head_gs = heads[..., torch.tensor(idx, dtype=torch.long)]
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
        table = self._heads()
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

    def _heads(self) -> torch.Tensor | None:
        """The per-head P with the slots appended since made whole (one cat per eviction or read,
        not per step)."""
        if self._head_gs is not None and self._head_new:
            new = torch.arange(self._gen_len - self._head_new, self._gen_len, dtype=torch.long)
            self._head_gs = torch.cat([self._head_gs, new.expand(*self._head_gs.shape[:2], -1)], dim=-1)
            self._head_new = 0
        return self._head_gs

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
        if self._hsum is None:
            self._hsum = h.new_zeros(0, h.shape[1])
        if self._hsum.shape[1] != h.shape[1]:
            raise ValueError(f"hidden width {h.shape[1]} != earlier appends' {self._hsum.shape[1]}")
        if self._hsum.shape[0] < n:
            grow = max(n - self._hsum.shape[0], self._hsum.shape[0])  # amortised doubling
            self._hsum = torch.cat([self._hsum, self._hsum.new_zeros(grow, h.shape[1])])
        self._hcount.extend([0] * (n - len(self._hcount)))
        for i in sentence_of_token:
            self._hcount[i] += 1
        if len(sentence_of_token) == 1:  # a decode step's token: one in-place add
            self._hsum[sentence_of_token[0]].add_(h[0].to(self._hsum.device))
        else:
            index = torch.tensor(sentence_of_token, device=self._hsum.device)
            self._hsum.index_add_(0, index, h.to(self._hsum.device))

    # -- views
    @property
    def sentences(self) -> list[Sentence]:
        if self._open_stale:  # labelled now, from its whole text so far (the class docstring)
            self._label_last()
            self._open_stale = False
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
        heads = self._heads()
        return heads if heads is not None else self.positions

    @property
    def cache_len(self) -> int:
        if self._head_gs is not None:
            return int(self._head_gs.shape[-1]) + self._head_new
        return len(self._slot_gs)

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
        if self._hsum is None:
            raise ValueError("no hidden states recorded: pass hidden= to SentenceTracker.append")
        n = len(self._starts)
        sums = self._hsum[:n]
        have = self._hcount[:n]
        counts = torch.tensor(have + [0] * (sums.shape[0] - len(have)), dtype=sums.dtype, device=sums.device)
        if sums.shape[0] < n:  # sentences begun by appends without hidden states
            sums = torch.cat([sums, sums.new_zeros(n - sums.shape[0], sums.shape[1])])
            counts = torch.cat([counts, counts.new_zeros(n - counts.shape[0])])
        return sums / counts.clamp_min(1.0).unsqueeze(1)
