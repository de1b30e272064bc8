"""The grammars of one decode call's constrained rows (`RowGrammars`): a matcher per row, its token
mask at each step, what it accepts, and whether the row may or must end.

Why a module of its own: a decode holds these per row for its length, while `grammar.py` holds what
a backend keeps across calls (the compiler, its cache, its workers, budget fits).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

from branchwise.backends.hf.grammar import Grammars
from branchwise.constraints import Constraint


class RowGrammars:
    """One matcher per constrained row of one `extend` call, keyed by the row's segment id."""

    def __init__(self, grammars: Grammars) -> None:
        self.grammars = grammars
        self._matchers: dict[int, xgr.GrammarMatcher] = {}
        self._bitmask: torch.Tensor | None = None

    def attach(self, seg_id: int, constraint: Constraint | None, max_tokens: int | None = None) -> None:
        """Constrain the row of segment `seg_id` from its next token on (None: leave it free), fitted
        to the row's `max_tokens` where given (`Grammars.fit`)."""
        if constraint is not None and seg_id not in self._matchers:
            if max_tokens is not None:
                constraint = self.grammars.fit(constraint, max_tokens).constraint
            self._matchers[seg_id] = xgr.GrammarMatcher(self.grammars.compile(constraint))

    def __bool__(self) -> bool:
        return bool(self._matchers)

    def mask(self, logits: torch.Tensor, seg_ids: Sequence[int]) -> tuple[torch.Tensor, set[int]]:
        """Logits (float32, a copy) with each constrained row narrowed to its grammar's tokens, and the
        batch positions whose grammar allows no token now (their logits are left as they were)."""
        rows = [(pos, self._matchers[s]) for pos, s in enumerate(seg_ids) if s in self._matchers]
        if not rows:
            return logits, set()
        vocab = logits.shape[-1]
        if (
            self._bitmask is None
            or self._bitmask.shape[0] < len(seg_ids)
            or self._bitmask.shape[1] * 32 < vocab
        ):
            self._bitmask = xgr.allocate_token_bitmask(max(len(seg_ids), 8), self.grammars.vocab_size)
        bitmask = self._bitmask
        masked = logits.float().clone()
        dead: set[int] = set()
        positions = []
        for pos, matcher in rows:
            if matcher.is_terminated():
                dead.add(pos)
                continue
            matcher.fill_next_token_bitmask(bitmask, pos)
            positions.append(pos)
        if positions:
            on_device = bitmask[: len(seg_ids)].to(masked.device, non_blocking=True)
            xgr.apply_token_bitmask_inplace(masked, on_device, vocab_size=vocab, indices=positions)
            finite = torch.isfinite(masked[positions]).any(dim=-1).tolist()
            dead.update(pos for pos, ok in zip(positions, finite, strict=True) if not ok)
        for pos in dead:
            masked[pos] = logits[pos].float()
        return masked, dead

    def accept(self, seg_id: int, token: int) -> bool:
        """Advance the row's matcher by `token`; False when the grammar refuses it (the row ends)."""
        matcher = self._matchers.get(seg_id)
        return matcher is None or matcher.accept_token(token)

    def ends_here(self, seg_id: int) -> bool:
        """Whether the row's grammar allows nothing but the end of the sequence now: its output is
        whole, and the next token would be end-of-sequence whatever the model preferred."""
        matcher = self._matchers.get(seg_id)
        if matcher is None or not matcher.is_completed():
            return False
        if matcher.is_terminated():
            return True
        vocab = self.grammars.vocab_size
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        matcher.fill_next_token_bitmask(bitmask, 0)
        allowed = torch.zeros(1, vocab)
        xgr.apply_token_bitmask_inplace(allowed, bitmask, vocab_size=vocab)
        return set(torch.isfinite(allowed[0]).nonzero().flatten().tolist()) <= self.grammars.eos_ids

    def complete(self, seg_ids: Sequence[int]) -> bool:
        """Whether every constrained row among `seg_ids` could end here (its output is whole)."""
        return all(self._matchers[s].is_completed() for s in seg_ids if s in self._matchers)

    def drop(self, seg_id: int) -> None:
        self._matchers.pop(seg_id, None)
