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


@pytest.fixture(scope="module")
def tiny_hf(tiny_llama_dir):
    from branchwise.backends.hf import HFBackend

    return HFBackend(tiny_llama_dir)


def _kids(backend, n: int) -> list[int]:
    root = backend.prefill(backend.encode("What is 12 + 7?"))
    kids = backend.fork(root, n)
    backend.release([root])
    return kids


def test_on_step_sees_each_token_before_decoding_ends(tiny_hf) -> None:
    params = DecodeParams(max_tokens=8, min_tokens=8)
    kids = _kids(tiny_hf, 2)
    steps = []

    def listen(step):
        # what each row has decoded by now, as the generations will say
        steps.append(({r: list(t) for r, t in step.tokens.items()}, dict(step.finished)))

    try:
        gens = tiny_hf.extend(kids, params, on_step=listen)
    finally:
        tiny_hf.release(kids)
    assert len(steps) == params.max_tokens  # called at every step, the first after one token
    assert steps[0][0] == {0: gens[0].token_ids[:1], 1: gens[1].token_ids[:1]} and not steps[0][1]
    for row, g in enumerate(gens):
        assert [t for tokens, _ in steps for t in tokens.get(row, [])] == g.token_ids
    # each row is reported finished once, at its last step, with the very object extend returns
    assert [sorted(f) for _, f in steps] == [[]] * 7 + [[0, 1]]
    assert all(steps[-1][1][row] is g for row, g in enumerate(gens))


def test_on_step_stops_the_rows_it_returns_and_leaves_the_others_exact(tiny_hf) -> None:
    params = DecodeParams(max_tokens=10, min_tokens=10)
    kids = _kids(tiny_hf, 3)
    try:
        plain = tiny_hf.extend(kids, params)
    finally:
        tiny_hf.release(kids)
    kids = _kids(tiny_hf, 3)
    seen = []

    def listen(step):
        seen.append(sorted(step.tokens))
        return [1] if len(seen) == 3 else None  # row 1's consumer leaves after 3 tokens

    try:
        gens = tiny_hf.extend(kids, params, on_step=listen)
    finally:
        tiny_hf.release(kids)
    assert gens[1].finish_reason == "cancelled" and gens[1].token_ids == plain[1].token_ids[:3]
    assert seen == [[0, 1, 2]] * 3 + [[0, 2]] * 7
    for row in (0, 2):
        assert gens[row].token_ids == plain[row].token_ids and gens[row].finish_reason == "length"
