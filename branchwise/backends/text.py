"""Text of a generation while it is decoded: incremental detokenization and the stop rules.

Why its own module (no torch): the local decode loop uses these to detect stops, and a consumer of
per-step tokens (the server's streaming) turns the same tokens into text deltas by the same rules,
so the streamed text and the finished one cannot drift apart. Backend-neutral, so a front end can
import it without loading the local backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

from branchwise.backends.base import DecodeParams, FinishReason

__all__ = ["Detokenize", "TextStream", "TextTail", "finish_text"]

log = logging.getLogger(__name__)

Detokenize = Callable[[Sequence[int]], str]


class TextTail:
    """Incremental detokenization of one row's output.

    The text of the tokens since `_prefix` is decoded with and without the newest tokens and the
    difference appended, so multi-token characters (a UTF-8 sequence split over byte tokens) are
    appended only once complete (the decode no longer ends in U+FFFD). The same scheme as the
    incremental detokenizers of vLLM and TGI; per step it decodes a handful of tokens.
    """

    def __init__(self, detokenize: Detokenize) -> None:
        self._detokenize = detokenize
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0
        self._read = 0

    def push(self, token: int) -> None:
        self.extend((token,))

    def extend(self, tokens: Iterable[int]) -> None:
        """Take several tokens at once: two decodes for all of them, not two per token.

        Why: a consumer that fell behind (a streamed request whose tokens arrive several a step, or
        a remote backend whose detokenization is an HTTP round trip) catches up in one step
        instead of paying per token and falling further behind. The text is the same."""
        size = len(self.ids)
        self.ids.extend(tokens)
        if len(self.ids) == size:
            return
        before = self._detokenize(self.ids[self._prefix : self._read])
        after = self._detokenize(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)


def finish_text(text: str, params: DecodeParams) -> tuple[str, FinishReason | None]:
    """Apply the stop rules to a row's full text: (text to keep, why it ended or None).

    A stop string cuts the text before it; the step delimiter ends a step after it (kept), but not
    a delimiter the text starts with (leading whitespace is not a step).
    """
    for stop in params.stop:
        cut = text.find(stop)
        if cut >= 0:
            return text[:cut], "stop"
    delim = params.step_delimiter
    if delim:
        body = len(text) - len(text.lstrip())
        at = text.find(delim, body + 1) if body < len(text) else -1
        if at >= 0:
            return text[: at + len(delim)], "delimiter"
    return text, None


class TextStream:
    """One generation's text as deltas, released while it is decoded; together they are its text.

    Why deltas are held back: a stop string removes itself (and what follows) from the final text,
    and its first characters arrive before its last. So text is released only where no stop string
    can begin any more: all but the last ``len(longest stop) - 1`` characters (vLLM's rule), and
    nothing once the text holds a whole stop string or step delimiter (the row ends there; `finish`
    then releases the rest, cut by the backend exactly as the non-streamed text is). Multi-token
    characters come out whole (`TextTail`). Deltas are computed on the consumer's side, from token
    ids, so the decoding thread pays nothing for them.
    """

    def __init__(self, detokenize: Detokenize, params: DecodeParams) -> None:
        self._tail = TextTail(detokenize)
        self._params = params
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        self._sent = 0
        """Characters of ``_tail.text`` released so far."""

    def push(self, tokens: Iterable[int]) -> str:
        """Take the newest tokens; the text that is now safe to release ("" if none)."""
        tail = self._tail
        tail.extend(tokens)
        text = tail.text
        end = len(text) - self._hold
        if end <= self._sent or finish_text(text, self._params)[1] is not None:
            return ""
        delta = text[self._sent : end]
        self._sent = end
        return delta

    def finish(self, text: str) -> str:
        """The rest of the generation, given its final `text` (as the backend cut it)."""
        sent = self._tail.text[: self._sent]
        if not text.startswith(sent):
            # incremental and whole detokenization disagree (not seen with byte-level BPE or
            # SentencePiece): what was released cannot be taken back, so say so
            log.warning("streamed text %r is not a prefix of the final text", sent[-40:])
        return text[len(sent) :]
