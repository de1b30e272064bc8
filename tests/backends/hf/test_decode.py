"""The decode loop's stop checks: incremental detokenization agrees with decoding the whole output."""

from __future__ import annotations

import pytest
from testkit import fail_forward

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


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("size", [2, 3, 7])
def test_text_tail_takes_tokens_in_chunks_at_two_decodes_a_chunk(
    tiny_tokenizer, text: str, size: int
) -> None:
    """Tokens handed over several at a time (a consumer that fell behind) give the text they give
    one by one, at two detokenizations a chunk."""
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    calls = []

    def detok(t):
        calls.append(len(t))
        return tiny_tokenizer.decode(list(t), skip_special_tokens=True)

    tail = TextTail(detok)
    chunks = [ids[i : i + size] for i in range(0, len(ids), size)]
    for chunk in chunks:
        tail.extend(chunk)
    tail.extend([])  # nothing new: no decode
    assert tail.text == text
    assert len(calls) == 2 * len(chunks)


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


def _newcomers(backend, prompt: str, made: list[int]) -> list[int]:
    """Two branches of a new prompt, for an `admit` to hand in mid-decode (recorded in `made`)."""
    root = backend.prefill(backend.encode(prompt))
    made.extend(backend.fork(root, 2))
    backend.release([root])
    return made


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


def _greedy_alone(backend, prompt: str, n: int, params: DecodeParams) -> list[list[int]]:
    root = backend.prefill(backend.encode(prompt))
    kids = backend.fork(root, n)
    backend.release([root])
    try:
        return [g.token_ids for g in backend.extend(kids, params)]
    finally:
        backend.release(kids)


def test_admitted_rows_join_a_running_decode_and_decode_as_they_would_alone(tiny_hf) -> None:
    """Continuous batching: nodes handed in by `admit` at step 3 become rows 2-3 of the same call,
    decode their own `max_tokens` (so they end 3 steps after the others), and every row's greedy
    tokens equal its tokens decoded alone."""
    params = DecodeParams(max_tokens=10, min_tokens=10)
    first, late = "What is 12 + 7?", "Name a prime number."
    alone_first = _greedy_alone(tiny_hf, first, 2, params)
    alone_late = _greedy_alone(tiny_hf, late, 2, params)
    kids = _kids(tiny_hf, 2)
    made: list[int] = []
    asked: list[int] = []
    steps: list[tuple[list[int], list[int]]] = []

    def admit(alive: int) -> list[int]:
        asked.append(alive)
        return [] if len(asked) != 3 else _newcomers(tiny_hf, late, made)

    def listen(step):
        steps.append((sorted(step.tokens), sorted(step.finished)))

    before = tiny_hf.kv_stats().extra.get("admitted_rows", 0.0)
    try:
        gens = tiny_hf.extend(kids, params, on_step=listen, admit=admit)
    finally:
        tiny_hf.release(kids + made)
    assert len(gens) == 4 and [g.node for g in gens] == kids + made
    assert [g.token_ids for g in gens] == alone_first + alone_late
    assert all(g.finish_reason == "length" and len(g.token_ids) == 10 for g in gens)
    assert asked[:4] == [2, 2, 2, 4]  # asked at every step boundary with the rows still decoding
    assert steps[:3] == [([0, 1], [])] * 3 and steps[3] == ([0, 1, 2, 3], [])
    assert steps[9] == ([0, 1, 2, 3], [0, 1]) and steps[-1] == ([2, 3], [2, 3]) and len(steps) == 13
    assert tiny_hf.kv_stats().extra["admitted_rows"] - before == 2


def test_rows_of_a_re_assembled_batch_hold_their_kv_once(tiny_hf) -> None:
    """A newcomer joining at step 3 re-assembles the batch: the running rows are captured into
    their nodes and copied into the new tails, and their nodes then lend the KV to the tails (it is
    held once, not in both), so admission may price a row's own KV once. Their tokens are unchanged,
    and the nodes hold their KV again once the rows end."""
    params = DecodeParams(max_tokens=10, min_tokens=10)
    first, late = "What is 12 + 7?", "Name a prime number."
    alone_first = _greedy_alone(tiny_hf, first, 2, params)
    kids = _kids(tiny_hf, 2)
    made: list[int] = []
    held: list[list[int]] = []
    tree = tiny_hf.engine.tree

    def admit(alive: int) -> list[int]:
        return [] if made or len(held) < 3 else _newcomers(tiny_hf, late, made)

    def listen(step):
        held.append([tree.get(k).kv_bytes for k in kids])

    try:
        gens = tiny_hf.extend(kids, params, on_step=listen, admit=admit)
        after = [(tree.get(k).kv_bytes, tree.get(k).lent) for k in kids]
    finally:
        tiny_hf.release(kids + made)
    assert [g.token_ids for g in gens[:2]] == alone_first
    # steps 3-8, after the re-assembly and before the rows end: lent to the tails, not held twice
    assert len(held) > 9 and all(h == [0, 0] for h in held[3:9])
    assert all(nbytes > 0 and not lent for nbytes, lent in after)


def test_a_call_that_raises_with_rows_lent_leaves_their_nodes_recomputable(
    tiny_llama_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tails hold a lent row's only copy of its KV: when the call raises, the nodes it did not
    capture hold none and have every token pending (computed again on next use), the books
    balance, and the nodes decode on from their tokens."""
    from branchwise.backends.hf import HFBackend

    backend = HFBackend(tiny_llama_dir, kv_budget=None, cache_bytes=0)
    params = DecodeParams(max_tokens=12, min_tokens=12)
    kids = _kids(backend, 2)
    made: list[int] = []

    def admit(alive: int) -> list[int]:
        return [] if made else _newcomers(backend, "Name a prime number.", made)

    restore = fail_forward(monkeypatch, at=6)
    with pytest.raises(RuntimeError, match="device lost"):
        backend.extend(kids, params, admit=admit)
    restore()
    tree, pool = backend.engine.tree, backend.engine.pool
    for k in kids:
        seg = tree.get(k)
        assert not seg.lent and seg.kv_bytes == 0 and seg.n_computed == 0 and seg.pending
    assert pool.tails == 0 and pool.used() == pool.tree.accounts.total.held
    gens = backend.extend(kids, DecodeParams(max_tokens=4, min_tokens=4))
    assert all(len(g.token_ids) == 4 for g in gens)
    backend.release(kids + made)
    assert pool.used() == 0


def test_a_newcomers_prompt_is_prefilled_on_its_own(tiny_llama_dir) -> None:
    """A prompt node admitted beside decoding rows is computed in a forward of its own: one forward
    with both would pad each decoding row's one-token feed to the prompt's length, and so give
    every row's tail room for its own KV plus the whole prompt (a KV budget once refused a batch
    for it). Every row still decodes what it decodes alone."""
    from branchwise.backends.hf import HFBackend

    # each prompt node holds its whole prompt (no cache), computed whole (as accelerated runs do)
    tiny_hf = HFBackend(tiny_llama_dir, cache_bytes=0, prefill_chunk=0)
    params = DecodeParams(max_tokens=6, min_tokens=6)
    words = ["one two three", "four five six", "seven eight nine"]
    prompts = [f"{i}: " + " ".join(words[i:] + words[:i]) * 6 for i in range(3)]
    ids = [tiny_hf.encode(p) for p in prompts]
    longest = max(map(len, ids))
    assert longest >= 64  # the rows' own KV and the newcomer's prompt each far above a step's slack
    alone = []
    for i in ids:
        node = tiny_hf.prefill(i)
        try:
            alone.append(tiny_hf.extend([node], params)[0].token_ids)
        finally:
            tiny_hf.release([node])
    rows = [tiny_hf.prefill(i) for i in ids[:2]]  # plain rows: each holds its prompt as its own KV
    made: list[int] = []
    asked: list[int] = []
    per_row: list[float] = []
    pool = tiny_hf.engine.pool

    def admit(alive: int) -> list[int]:
        asked.append(alive)
        if len(asked) != 2:
            return []
        made.append(tiny_hf.prefill(ids[2]))  # pending: its whole prompt
        return made

    def listen(step) -> None:
        per_row.append(pool.tails / (len(rows + made) * pool.token_bytes))

    try:
        gens = tiny_hf.extend(rows, params, on_step=listen, admit=admit)
    finally:
        tiny_hf.release(rows + made)
    assert [g.token_ids for g in gens] == alone
    # tail slots per row once the newcomer decodes: the longest row and its growth (slack included),
    # not a row's own KV plus the newcomer's whole prompt
    assert max(per_row[2:]) <= longest + 2 * params.max_tokens < 2 * longest


def test_admission_keeps_each_rows_own_stop_state(tiny_hf) -> None:
    """Rows carried into the re-assembled batch keep their running text and step count: admitted at
    every step boundary, rows still stop where they stop without admission (a stop string, or
    max_tokens counted from their own first token)."""
    root = tiny_hf.prefill(tiny_hf.encode("What is 12 + 7?"))
    kids = tiny_hf.fork(root, 4)
    tiny_hf.release([root])
    try:
        free = tiny_hf.extend(kids, DecodeParams(max_tokens=12, min_tokens=12))
    finally:
        tiny_hf.release(kids)
    # a stop string the greedy text reaches after a few tokens, so it spans admission points
    text = free[0].text
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].strip())
    params = DecodeParams(max_tokens=12, stop=[stop])
    plain = _greedy_alone(tiny_hf, "What is 12 + 7?", 2, params)
    kids = _kids(tiny_hf, 2)
    made: list[int] = []

    def admit(alive: int) -> list[int]:
        if len(made) >= 6:
            return []
        root = tiny_hf.prefill(tiny_hf.encode(f"Name {len(made)} primes."))
        new = tiny_hf.fork(root, 1)
        tiny_hf.release([root])
        made.extend(new)
        return new

    try:
        gens = tiny_hf.extend(kids, params, admit=admit)
    finally:
        tiny_hf.release(kids + made)
    assert gens[0].finish_reason == "stop" and len(gens[0].token_ids) > 1
    assert [g.token_ids for g in gens[:2]] == plain
    assert len(gens) == 8 and all(len(g.token_ids) <= 12 for g in gens)


def test_rows_with_their_own_temperature_and_top_p() -> None:
    """One batch, each row its own sampling: a greedy row takes its argmax, a row at top-p 0.01
    only its top token, a free row anything, from one generator."""
    import torch

    from branchwise.backends.hf.sampling import pick_tokens

    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    gen = torch.Generator().manual_seed(1)
    temperature = torch.tensor([0.0, 1.0, 5.0])
    top_p = torch.tensor([1.0, 0.01, 1.0])
    seen: set[int] = set()
    for _ in range(50):
        tokens, _, chosen = pick_tokens(logits, temperature, top_p, gen)
        assert tokens[0] == logits[0].argmax() and tokens[1] == logits[1].argmax()
        assert torch.allclose(chosen, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1))
        seen.add(int(tokens[2]))
    assert len(seen) > 5  # the hot row really samples


@pytest.mark.parametrize("sharpness", [8.0, 0.5], ids=["peaked", "flat"])
def test_the_nucleus_is_the_sorted_vocabularys_whether_or_not_its_candidates_hold_it(
    sharpness: float,
) -> None:
    """Top-p keeps the smallest set of most likely tokens whose mass reaches p. Peaked rows (a
    trained model's) find it among their `NUCLEUS_CANDIDATES` most likely tokens without a sort of
    the vocabulary; flat rows (mass spread past those) sort it all. Both keep exactly what a sort
    of the whole vocabulary keeps, per row and with each row's own p."""
    import torch

    from branchwise.backends.hf.sampling import NUCLEUS_CANDIDATES, _nucleus

    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(4, 4096) * sharpness, dim=-1)
    top = probs.topk(NUCLEUS_CANDIDATES, dim=-1).values.sum(-1)
    assert bool((top > 0.97).all()) if sharpness > 1 else bool((top < 0.5).all())

    def sorted_reference(p: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
        values, order = p.sort(dim=-1, descending=True)
        cumulative = values.cumsum(dim=-1)
        return torch.zeros_like(p).scatter_(-1, order, values.masked_fill(cumulative - values >= limit, 0.0))

    for top_p in (0.5, 0.9, torch.tensor([0.3, 0.6, 0.9, 0.95])):
        limit = top_p[:, None] if isinstance(top_p, torch.Tensor) else torch.tensor(top_p)
        kept = _nucleus(probs, top_p)
        reference = sorted_reference(probs, limit)
        assert torch.equal(kept > 0, reference > 0)
        assert torch.allclose(kept, reference)


def test_draw_samples_each_token_with_its_probability_and_never_a_masked_one() -> None:
    """The sampler inverts each row's cumulative distribution: over many draws each token's
    frequency matches its probability (a chi-square test at 0.1 %), tokens of probability 0 are
    never drawn (also at the vocabulary's ends), rows need not be normalised, and a seeded
    generator repeats its draws."""
    import torch
    from scipy.stats import chisquare

    from branchwise.backends.hf.sampling import draw

    probs = torch.tensor([0.0, 0.1, 0.0, 0.2, 0.3, 0.4, 0.0])
    rows = probs.repeat(4000, 1) * 3.0  # unnormalised on purpose
    tokens = draw(rows, torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=7)
    assert counts[probs == 0].sum() == 0
    support = probs > 0
    assert chisquare(counts[support].numpy(), (probs[support] * len(tokens)).numpy()).pvalue > 1e-3
    again = draw(rows, torch.Generator().manual_seed(0))
    assert torch.equal(tokens, again)
    one_hot = torch.zeros(50, 9)
    one_hot[:, 8] = 1.0  # all mass on the last token
    assert draw(one_hot, None).eq(8).all()
    first = torch.zeros(50, 9)
    first[:, 0] = 1.0  # all mass on the first token, the rest 0 (the search must not run past it)
    assert draw(first, None).eq(0).all()
    for bad in (torch.zeros(2, 9), torch.full((2, 9), float("nan")), torch.full((2, 9), float("inf"))):
        with pytest.raises(RuntimeError, match="cannot sample"):
            draw(bad, None)


def test_draw_held_at_the_last_token_with_mass_when_rounding_overshoots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A uniform number that rounding carries to the row's total would search past the end, onto
    trailing tokens of probability 0: the draw is held at the last token with mass."""
    import torch

    from branchwise.backends.hf import sampling

    probs = torch.zeros(3, 10)
    probs[:, :3] = torch.tensor([0.2, 0.3, 0.5])
    monkeypatch.setattr(sampling.torch, "rand", lambda *shape, **kw: torch.ones(*shape, dtype=kw["dtype"]))
    assert sampling.draw(probs, None).tolist() == [2, 2, 2]
