"""The decode loop's stop checks: incremental detokenization agrees with decoding the whole output."""

from __future__ import annotations

import pytest

from branchwise.backends.base import DecodeParams
from branchwise.backends.hf.decode import TextTail, finish_text

TEXTS = [
    "The answer is 19.\nWait, check again: 12 + 7 = 19.\n\n#### 19",
    "Thé café — naïve façade ✓ 🚀 日本語\nnext line",
    "  leading spaces, then\ttabs\n\n\nand newlines",
]


@pytest.mark.parametrize("text", TEXTS)
def test_text_tail_equals_full_decode(tiny_tokenizer, text: str) -> None:
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]

    def detok(t):
        return tiny_tokenizer.decode(list(t), skip_special_tokens=True)

    tail = TextTail(detok)
    for i, token in enumerate(ids, start=1):
        tail.push(token)
        full = detok(ids[:i])
        # withheld only while a multi-byte character is incomplete (the full decode ends in U+FFFD)
        assert tail.text == full or (full.endswith("\ufffd") and full.startswith(tail.text))
    assert tail.text == text == detok(ids)


def test_finish_text_rules() -> None:
    stop = DecodeParams(stop=("####",))
    assert finish_text("so 19 #### 19", stop) == ("so 19 ", "stop")
    step = DecodeParams(step_delimiter="\n")
    assert finish_text("\nfirst step\nsecond", step) == ("\nfirst step\n", "delimiter")
    assert finish_text("\n  no step yet", step) == ("\n  no step yet", None)


# --------------------------------------------------------------------------------------------------
# Streaming: text deltas and the per-step listener of `extend`
# --------------------------------------------------------------------------------------------------

STOPPED = [
    ("The answer is 19.\nWait, check again: 12 + 7 = 19.\n\n#### 19", ("####",)),
    ("Thé café — naïve façade ✓ 🚀 日本語\nnext line", ("🚀 日", "xyz")),
    ("no stop in here, just text", ("STOP",)),
    ("ab" * 20, ("abab",)),  # a stop string the text begins with: nothing is ever released early
]


@pytest.mark.parametrize(("text", "stop"), STOPPED)
def test_text_stream_deltas_equal_the_final_text(tiny_tokenizer, text: str, stop: tuple[str, ...]) -> None:
    """Token by token, what is released is always a prefix of the final (stop-cut) text; together
    with `finish` it is exactly that text."""
    from branchwise.backends.text import TextStream

    params = DecodeParams(stop=stop)

    def detok(t):
        return tiny_tokenizer.decode(list(t), skip_special_tokens=True)

    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    final, reason = finish_text(detok(ids), params)
    stream = TextStream(detok, params)
    released = ""
    for token in ids:
        released += stream.push([token])
        assert final.startswith(released), (released, final)
    assert released + stream.finish(final) == final
    if reason is None:
        assert len(released) >= len(final) - max(len(s) for s in stop) + 1  # held back no more
