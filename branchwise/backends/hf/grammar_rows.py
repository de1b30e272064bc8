"""The grammars of one decode call's constrained rows (`RowGrammars`): a matcher per row, its token
mask at each step, what it accepts, and whether the row may or must end.

Why a module of its own: a decode holds these per row for its length, while `grammar.py` holds what
a backend keeps across calls (the compiler, its cache, its workers, budget fits).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import xgrammar as xgr

from branchwise.backends.hf.grammar import Grammars
from branchwise.constraints import Constraint

log = logging.getLogger(__name__)


class RowGrammars:
    """One matcher per constrained row of one `extend` call, keyed by the row's segment id.

    Each row also keeps room to close its output within its budget (`within_budget`,
    `grammar_close`): `_closing` holds the rest of a closure being forced, `_forced` the rows whose
    closure was forced (their finish reason is ``length``, however they end).

    A tool-call reply is closed by force only until it holds one whole call: a later call the model
    did not finish is dropped where the reply is read (`toolcalls.split_calls`), as a cut one always
    was, since closing it would fill in arguments the model never chose (a second call
    `magic_function(0)` after the model's `magic_function(3)`, seen under a 64-token budget)."""

    def __init__(self, grammars: Grammars) -> None:
        self.grammars = grammars
        self._matchers: dict[int, xgr.GrammarMatcher] = {}
        self._bitmask: torch.Tensor | None = None
        self._closing: dict[int, list[int]] = {}
        self._forced: set[int] = set()
        self._unclosable: set[int] = set()
        self._calls: set[int] = set()  # rows whose constraint is tool calls
        self._whole: set[int] = set()  # ... of those, the rows that wrote a whole call already
        self.notes: list[str] = []
        """Waits of this call's constrained rows for the tokenizer's tables (`Grammars.take_notes`),
        said in its replies' notes."""

    def attach(self, seg_id: int, constraint: Constraint | None, max_tokens: int | None = None) -> None:
        """Constrain the row of segment `seg_id` from its next token on (None: leave it free), fitted
        to the row's `max_tokens` where given (`Grammars.fit`)."""
        if constraint is not None and seg_id not in self._matchers:
            if max_tokens is not None:
                constraint = self.grammars.fit(constraint, max_tokens).constraint
            matcher = xgr.GrammarMatcher(self.grammars.compile(constraint))
            self._matchers[seg_id] = matcher
            if constraint.kind == "tool_calls":
                self._calls.add(seg_id)
            if max_tokens is not None:
                plan = self.grammars.closer().plan(matcher)
                if plan is None or len(plan) > max_tokens:
                    log.warning(
                        "a %s reply may be cut at max_tokens=%d: %s",
                        constraint.kind,
                        max_tokens,
                        "no closing text was found for its grammar"
                        if plan is None
                        else f"closing its shortest output takes {len(plan)} tokens",
                    )
            self.notes += self.grammars.take_notes()  # a wait of `fit`, `compile` or `closer` above

    def within_budget(self, seg_id: int, token: int, room: int) -> int:
        """The token the row takes instead of `token` (sampled), so that what it leaves open can still
        be closed with the `room` tokens it has left, this one included (`grammar_close`): `token`
        itself when it leaves room, else the first of the tokens that close the output from here (the
        rest follow at the next steps, whatever is sampled), or an end of sequence when the output is
        whole already. A token the grammar refuses is returned as it is (`accept` ends the row)."""
        matcher = self._matchers.get(seg_id)
        if matcher is None or seg_id in self._whole:
            return token
        closing = self._closing.get(seg_id)
        if closing:
            return closing.pop(0)
        if not matcher.accept_token(token):
            return token
        closer = self.grammars.closer()
        after = closer.plan(matcher)
        matcher.rollback(1)
        if after is not None and len(after) < room:
            if not after and seg_id in self._calls:  # a whole call: none after it is forced
                self._whole.add(seg_id)
            return token
        now = closer.plan(matcher)
        if now is None:  # no closure known: decoded as without a budget, and said once
            if seg_id not in self._unclosable:
                self._unclosable.add(seg_id)
                log.warning("a constrained reply may be cut at max_tokens: no closing text was found")
            return token
        self._forced.add(seg_id)
        if not now:
            return min(self.grammars.eos_ids)
        self._closing[seg_id] = now[1:]
        return now[0]

    def forced(self, seg_id: int) -> bool:
        """Whether the row's closure was forced by its budget (`within_budget`)."""
        return seg_id in self._forced

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
        whole, and the next token would be end-of-sequence whatever the model preferred (never when
        the budget forced its closure: that reply was cut short, and says so)."""
        matcher = self._matchers.get(seg_id)
        if matcher is None or seg_id in self._forced or not matcher.is_completed():
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
        self._closing.pop(seg_id, None)
        self._forced.discard(seg_id)
        self._unclosable.discard(seg_id)
        self._calls.discard(seg_id)
        self._whole.discard(seg_id)
