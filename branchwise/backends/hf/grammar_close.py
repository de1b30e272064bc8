"""How a constrained row closes within its token budget: the text that completes its grammar's output
from where the row stands, and the tokens that text takes (`Closer`).

Why: a JSON reply cut by ``max_tokens`` is not JSON, and a client (DSPy's JSON adapter, a tool
runner) can do nothing with it. So at each step the decode loop asks whether the token just sampled
still leaves room to close what is open (`RowGrammars.within_budget`); when it does not, the row
takes the first token of the closing text instead, and so on until the output is whole, at the
budget at the latest. The reply is then valid under its constraint whatever ``max_tokens`` is, as
long as the closing text of the empty output fits (the server refuses a schema whose shortest output
does not, before any work: `schema_budget`).

How the closing text is found: by walking the row's own grammar matcher forward with a fixed policy
and rolling it back (xgrammar's ``rollback``; a step costs microseconds). The text the grammar forces
(its jump-forward string: a required key, the end of ``true``, a tool call's closing tag) is taken
whole; otherwise the first character the grammar accepts from a short list that closes before it
opens: inside a string (a ``#`` is allowed there and nowhere else in JSON) the quote comes first;
outside, ``}`` and ``]``, then ``:`` and ``,`` (a missing required key or array item, a number
that must not grow digit by digit), then ``0`` and the quote (the shortest values), then the
letters that start ``false``, ``null`` and ``true``; failing those, the first byte the grammar
allows (`_FALLBACK`). The walk stops once the grammar allows the end of the sequence (`is_completed`).

The text is not always the shortest there is, but it is the one this policy writes, so its token
count is exact for the closure that is forced: a deterministic policy from a state reached by its own
first step continues with the rest of the same text. The tokens are the text cut greedily into the
longest vocabulary pieces (a prefix-consistent cut: the rest of the text cuts into the rest of the
pieces), so the closing budget shrinks by exactly one for each forced token.
"""

from __future__ import annotations

import torch
import xgrammar as xgr

__all__ = ["MAX_CLOSING_STEPS", "Closer", "closing_pieces"]

MAX_CLOSING_STEPS = 512
"""Characters (or forced runs) a closing walk may take before it gives up: far past any closing text
a JSON output within a server's limits needs, and a bound on a pattern the policy cannot close (a
string whose pattern allows ``}`` but no ``#``, say). A row whose closure is not found is decoded
as before, with nothing reserved, and this is logged."""
_PIECE_CHARS = 16
"""Longest vocabulary piece the closing text is cut into (closing texts are short runs of
punctuation, keys and tags; a longer piece is rare and saves little)."""
_IN_STRING = b"#"
"""A byte JSON allows inside a string and nowhere else: the probe for "the row is in a string"."""
_INSIDE = (b'"', b"}", b"]", b":", b",", b"0", b"f", b"n", b"t")
_OUTSIDE = (b"}", b"]", b":", b",", b"0", b'"', b"f", b"n", b"t")
_FALLBACK = bytes(range(0x21, 0x7F)) + b" \n" + bytes(range(0x80, 0x100))
"""The bytes tried when no listed one is allowed: printable ASCII, then whitespace, then the bytes
above ASCII (a row that stopped inside a multi-byte character needs its continuation bytes)."""


def closing_pieces(info: xgr.TokenizerInfo, excluded: set[int]) -> dict[bytes, int]:
    """The vocabulary entries the closing text is cut into: each entry's bytes (up to `_PIECE_CHARS`)
    and its first token, leaving out `excluded` (special and added tokens: a grammar never allows
    their text as one token). Built once per tokenizer (`grammar_tables`): a walk over every token."""
    pieces: dict[bytes, int] = {}
    for token, text in enumerate(info.decoded_vocab):
        if token not in excluded and 0 < len(text) <= _PIECE_CHARS:
            pieces.setdefault(bytes(text), token)
    return pieces


class Closer:
    """The closing walk (see the module docstring) for one tokenizer's vocabulary.

    `pieces` maps a vocabulary entry's bytes to its token (`closing_pieces`); every single byte must
    be one (byte-level and byte-fallback vocabularies are), or `plan` finds no closure."""

    def __init__(self, pieces: dict[bytes, int], vocab_size: int) -> None:
        self.pieces = pieces
        self.vocab_size = vocab_size
        self._bitmask: torch.Tensor | None = None

    def plan(self, matcher: xgr.GrammarMatcher) -> list[int] | None:
        """The tokens that close the matcher's output from its state (empty when it may end now),
        or None when the walk found no closure. The matcher is left as it was."""
        text = bytearray()
        taken = 0
        try:
            for _ in range(MAX_CLOSING_STEPS):
                if matcher.is_completed() or matcher.is_terminated():
                    return self._cut(bytes(text))
                step = self._step(matcher)
                if not step:
                    return None
                text += step
                taken += len(step)
            return None
        finally:
            if taken:
                matcher.rollback(taken)

    def _step(self, matcher: xgr.GrammarMatcher) -> bytes:
        """Advance the matcher by the policy's next bytes (one token per byte) and return them;
        empty when no byte is allowed."""
        forced = matcher.find_jump_forward_string().encode()
        if forced:
            for i in range(len(forced)):
                if not self._take(matcher, forced[i : i + 1]):
                    matcher.rollback(i)
                    return b""
            return forced
        inside = self._take(matcher, _IN_STRING)
        if inside:
            matcher.rollback(1)
        for char in _INSIDE if inside else _OUTSIDE:
            if self._take(matcher, char):
                return char
        return self._any(matcher)

    def _take(self, matcher: xgr.GrammarMatcher, char: bytes) -> bool:
        token = self.pieces.get(char)
        return token is not None and bool(matcher.accept_token(token))

    def _any(self, matcher: xgr.GrammarMatcher) -> bytes:
        """The first byte of `_FALLBACK` the grammar allows now (taken), read from its token mask."""
        if self._bitmask is None:
            self._bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(self._bitmask, 0)
        words = self._bitmask[0]
        for byte in _FALLBACK:
            char = bytes((byte,))
            token = self.pieces.get(char, -1)
            allowed = token >= 0 and (int(words[token // 32]) >> (token % 32)) & 1
            if allowed and matcher.accept_token(token):
                return char
        return b""

    def _cut(self, text: bytes) -> list[int] | None:
        """`text` cut greedily into the longest vocabulary pieces (None: a byte has no token)."""
        tokens = []
        at = 0
        while at < len(text):
            for size in range(min(_PIECE_CHARS, len(text) - at), 0, -1):
                token = self.pieces.get(text[at : at + size])
                if token is not None:
                    tokens.append(token)
                    at += size
                    break
            else:
                return None
        return tokens
