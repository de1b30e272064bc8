"""SkipKV (004 §4.1-4.3, App. A.1): sentences across evictions, Eq. 3-6 scores, selection, steering, grouping."""

from __future__ import annotations

import re
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from branchwise.backends.hf.skipkv_policy import (
    eviction_scores,
    key_redundancy,
    newest_mask,
    select_keep,
    select_keep_per_head,
    sentence_redundancy,
    token_importance,
)
from branchwise.backends.hf.skipkv_sentences import SentenceTracker, delimiter_token_ids, is_delimiter_text
from branchwise.backends.hf.skipkv_steering import (
    SteeringVector,
    steering_path,
    steering_strength,
    steering_vector,
)

# A toy vocabulary: ids 100-102 are delimiters; " again" + "st" shows a keyword disappearing.
VOCAB = {1: " x", 2: " Wait", 3: " again", 4: "st", 5: " Wa", 6: "it", 100: "\n", 101: ".\n", 102: ")\n\n"}
DELIMS = frozenset({100, 101, 102})
KEYWORDS = ("Wait", "Alternatively", "again")
_KEYWORD = re.compile(r"(?<!\w)(?:Wait|Alternatively|again)(?!\w)")


def decode(ids: Sequence[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def tracker() -> SentenceTracker:
    return SentenceTracker(DELIMS, KEYWORDS, decode)


# ---------------------------------------------------------------------------------------------- delimiters
@pytest.mark.parametrize("text", ["\n", ".\n", ")\n", "\n\n", ".\n\n", ")\n\n", " \n", "\t.\n", "  )\n\n\n"])
def test_delimiter_texts(text: str) -> None:
    assert is_delimiter_text(text)


@pytest.mark.parametrize("text", [":\n", ":\n\n", "", ".", "a\n", "\n.", ". \n", ",\n", "\r\n", "..\n", " "])
def test_non_delimiter_texts(text: str) -> None:
    """`:\\n` ends `if x:` lines: splitting there would fragment code blocks (App. A.1)."""
    assert not is_delimiter_text(text)


def test_delimiter_token_ids_on_a_real_tokenizer(tiny_tokenizer) -> None:
    ids = delimiter_token_ids(tiny_tokenizer)
    (newline,) = tiny_tokenizer("\n")["input_ids"]
    assert newline in ids
    assert all(is_delimiter_text(tiny_tokenizer.decode([i])) for i in ids)
    assert not ids & set(tiny_tokenizer.all_special_ids)
    for text in (":", ".", "The"):
        assert not ids & set(tiny_tokenizer(text)["input_ids"])


# ---------------------------------------------------------------------------------------------- sentences
def test_consecutive_delimiters_merge_into_one_sentence_end() -> None:
    t = tracker()
    t.append([1, 1, 101, 100, 102, 1, 100])
    assert [(s.start, s.end, s.closed) for s in t.sentences] == [(0, 4, True), (5, 6, True)]
    t.append([100])
    assert t.sentences[-1].end == 7 and len(t.sentences) == 2
    t.append([1])
    assert [(s.start, s.end, s.closed) for s in t.sentences][-1] == (8, 8, False)


def test_leading_delimiters_form_their_own_closed_sentence() -> None:
    t = tracker()
    t.append([100, 100, 1])
    assert [(s.start, s.end, s.closed) for s in t.sentences] == [(0, 1, True), (2, 2, False)]


def test_keyword_labels_follow_the_open_sentence_and_count_when_closed() -> None:
    t = tracker()
    t.append([1])
    assert not t.sentences[-1].nonexec
    t.append([2])  # " x Wait": becomes non-execution as it grows
    assert t.sentences[-1].nonexec and t.n_nonexec == 0  # open sentences are not counted yet
    t.append([100, 3])
    assert t.n_nonexec == 1 and t.sentences[-1].nonexec  # " again"
    t.append([4])  # " again" + "st" = " against": no longer a whole-word keyword
    assert not t.sentences[-1].nonexec
    t.append([101, 5])
    assert t.n_nonexec == 1 and not t.sentences[-1].nonexec
    t.append([6, 100])  # " Wa" + "it" only match once decoded together
    assert t.sentences[-1].nonexec and t.n_nonexec == 2
    assert [s.nonexec for s in t.sentences] == [True, False, True]


def test_keywords_are_case_sensitive_whole_words() -> None:
    t = SentenceTracker(DELIMS, KEYWORDS, lambda ids: {1: " wait Waiter Again", 100: "\n"}[ids[0]])
    t.append([1, 100])
    assert not t.sentences[0].nonexec


def test_decoding_is_per_sentence_not_the_whole_trace() -> None:
    calls: list[int] = []

    def counting(ids: Sequence[int]) -> str:
        calls.append(len(ids))
        return decode(ids)

    t = SentenceTracker(DELIMS, KEYWORDS, counting)
    for _ in range(50):
        for token in (1, 2, 1, 100):
            t.append([token])
    assert max(calls) == 4  # the longest sentence, never the 200-token trace


def _reference(tokens: list[int]) -> list[int]:
    """Sentence id of every generated token, by the rule stated plainly."""
    sid, current, closed = [], -1, True
    for token in tokens:
        if token in DELIMS:
            current = max(current, 0)
            closed = True
        elif closed:
            current, closed = current + 1, False
        sid.append(current)
    return sid


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_generation_to_cache_map_matches_a_list_oracle(data: st.DataObject) -> None:
    """After any mix of appends and evictions, P, Eq. 11 ranges and slot sentences match an oracle."""
    t = tracker()
    tokens: list[int] = []
    slots: list[tuple[int, int]] = []  # oracle: (gs index, sentence id) of every cs slot
    for _ in range(data.draw(st.integers(1, 12), label="ops")):
        if slots and data.draw(st.booleans(), label="evict"):
            mask = data.draw(st.lists(st.booleans(), min_size=len(slots), max_size=len(slots)), label="keep")
            keep = [k for k, m in enumerate(mask) if m]
            t.evict(torch.tensor(keep, dtype=torch.long) if data.draw(st.booleans()) else keep)
            slots = [slots[k] for k in keep]
        else:
            new = data.draw(st.lists(st.sampled_from(sorted(VOCAB)), max_size=8), label="append")
            t.append(new)
            tokens += new
            sid = _reference(tokens)
            slots += [(g, sid[g]) for g in range(len(tokens) - len(new), len(tokens))]
        sid = _reference(tokens)
        assert t.gen_len == len(tokens) and t.cache_len == len(slots)
        assert t.positions.tolist() == [g for g, _ in slots]
        assert t.sentence_of_slot().tolist() == [s for _, s in slots]
        sentences = t.sentences
        assert len(sentences) == (max(sid) + 1 if sid else 0)
        for i, s in enumerate(sentences):
            members = [g for g, x in enumerate(sid) if x == i]
            assert (s.start, s.end) == (members[0], members[-1])
            assert s.closed == (tokens[s.end] in DELIMS)
            assert s.nonexec == bool(_KEYWORD.search(decode([tokens[g] for g in members])))
            held = [k for k, (_, x) in enumerate(slots) if x == i]
            span = t.cache_range(i)
            if not held:
                assert span is None
            else:
                assert span is not None and list(range(span[0], span[1] + 1)) == held
        assert t.n_nonexec == sum(s.closed and s.nonexec for s in sentences)


def test_evict_rejects_unsorted_or_out_of_range_slots() -> None:
    t = tracker()
    t.append([1, 1, 100])
    with pytest.raises(ValueError, match="strictly increasing"):
        t.evict([1, 0])
    with pytest.raises(ValueError, match="cache_len=3"):
        t.evict([0, 3])


def test_sentence_vectors_average_hidden_states_including_evicted_tokens() -> None:
    t = tracker()
    t.append([1, 1, 100], hidden=torch.tensor([[1.0, 0.0], [3.0, 0.0], [2.0, 3.0]]))
    t.evict([2])
    t.append([1], hidden=torch.tensor([[0.0, 5.0]]))
    t.append([100])  # no hidden for this one: the mean is over the tokens that had one
    torch.testing.assert_close(t.sentence_vectors(), torch.tensor([[2.0, 1.0], [0.0, 5.0]]))
    lam = torch.tensor([0.97, 0.0])
    torch.testing.assert_close(t.sentence_penalty(lam), torch.tensor([0.97, 0.0, 0.0]))
    with pytest.raises(ValueError, match="hidden must be"):
        t.append([1], hidden=torch.zeros(2, 2))


# ---------------------------------------------------------------------------------------------- scores
def test_importance_maps_query_heads_to_kv_groups_like_repeat_kv() -> None:
    """Heads 0,1 → KV head 0 and 2,3 → KV head 1; an interleaved mapping would also light up 5 and 2."""
    d, n = 4, 9
    e = torch.eye(d) * 8.0
    keys = torch.zeros(2, n, d)
    keys[0, 3], keys[0, 5] = e[0], e[1]
    keys[1, 7], keys[1, 2] = e[1], e[0]
    queries = torch.stack([e[0], e[0], e[1], e[1]]).unsqueeze(1).expand(4, 3, d)  # α = 3
    imp = token_importance(queries, keys, scaling=1.0, pool_kernel=1)
    assert imp.shape == (2, n) and imp.dtype == torch.float32
    torch.testing.assert_close(imp.sum(-1), torch.ones(2))
    assert imp[0].argmax() == 3 and imp[1].argmax() == 7
    assert imp[0, 5] < 0.01 and imp[1, 2] < 0.01
    pooled = token_importance(queries, keys, scaling=1.0, pool_kernel=3)
    assert pooled[0, 2] == pooled[0, 3] == pooled[0, 4] > pooled[0, 0]


def test_importance_masks_keys_and_accepts_low_precision() -> None:
    torch.manual_seed(0)
    queries, keys = torch.randn(4, 2, 8), torch.randn(2, 6, 8)
    valid = torch.tensor([True, True, False, True, True, True])
    imp = token_importance(queries.bfloat16(), keys.bfloat16(), scaling=8**-0.5, pool_kernel=3, valid=valid)
    assert imp.dtype == torch.float32 and (imp[:, 2] == 0).all()
    torch.testing.assert_close(imp.sum(-1), torch.ones(2))
    causal = torch.ones(2, 6, dtype=torch.bool).tril(diagonal=4)  # query 0 cannot see the last key
    imp = token_importance(queries, keys, scaling=8**-0.5, pool_kernel=1, valid=causal)
    assert (imp > 0).all()
    with pytest.raises(ValueError, match="pool_kernel=4"):
        token_importance(queries, keys, scaling=1.0, pool_kernel=4)
    with pytest.raises(ValueError, match="H_q % H_kv"):
        token_importance(torch.randn(3, 2, 8), keys, scaling=1.0, pool_kernel=1)


@pytest.mark.parametrize("pool_kernel", [1, 3])
def test_importance_of_stacked_layers_is_each_layers_own(pool_kernel: int) -> None:
    """Layers stacked along a leading dim (one product for a row's every layer, as SkipKV scores
    them) give each layer what it gets alone, masks included."""
    torch.manual_seed(1)
    queries, keys = torch.randn(5, 4, 3, 8), torch.randn(5, 2, 7, 8)  # 5 layers
    valid = torch.tensor([True, True, False, True, True, True, True])
    stacked = token_importance(queries, keys, scaling=8**-0.5, pool_kernel=pool_kernel, valid=valid)
    assert stacked.shape == (5, 2, 7)
    for layer in range(5):
        alone = token_importance(queries[layer], keys[layer], 8**-0.5, pool_kernel, valid=valid)
        torch.testing.assert_close(stacked[layer], alone)


@pytest.mark.parametrize("max_bytes", [1, 64 << 20])
def test_redundancy_of_stacked_layers_is_each_layers_own(max_bytes: int) -> None:
    """Layers stacked along a leading dim give each layer's own scores, whether the heads run one
    at a time (a 1-byte bound) or all at once."""
    torch.manual_seed(2)
    keys = torch.randn(4, 3, 9, 8)
    valid = torch.tensor([True] * 6 + [False] + [True] * 2)
    stacked = key_redundancy(keys, valid, max_bytes=max_bytes)
    assert stacked.shape == (4, 3, 9)
    for layer in range(4):
        torch.testing.assert_close(stacked[layer], key_redundancy(keys[layer], valid))


def test_duplicated_keys_are_more_redundant_than_a_unique_one() -> None:
    keys = torch.eye(6)[[0, 0, 0, 1, 2, 3]].unsqueeze(0) * 3.0
    keys = torch.cat([keys, torch.eye(6)[[4, 5, 1, 1, 2, 3]].unsqueeze(0)])  # head 1: its own duplicates
    r = key_redundancy(keys)
    assert r.shape == (2, 6)
    assert r[0, :3].min() > r[0, 3:].max()
    assert r[1, 2:4].min() > r[1, [0, 1, 4, 5]].max()  # per head, not head 0's similarities


def test_redundancy_ignores_invalid_keys() -> None:
    torch.manual_seed(0)
    keys = torch.randn(2, 7, 5)
    valid = torch.tensor([True, False, True, True, False, True, True])
    r = key_redundancy(keys, valid)
    assert (r[:, ~valid] == 0).all()
    torch.testing.assert_close(r[:, valid], key_redundancy(keys[:, valid]))


def test_sentence_redundancy_flags_the_earlier_of_two_similar_sentences() -> None:
    a, b = torch.tensor([1.0, 0.0, 0.2]), torch.tensor([0.0, 1.0, 0.0])
    lam = sentence_redundancy(torch.stack([a, b, a * 2.0 + 0.01]), tau=0.95)
    assert lam[0] > 0.95 and lam[1] == 0 and lam[2] == 0
    assert sentence_redundancy(a.unsqueeze(0), tau=0.5).tolist() == [0.0]


def test_eviction_scores_put_a_redundant_sentence_lowest() -> None:
    torch.manual_seed(0)
    importance = torch.softmax(torch.randn(3, 2, 10), dim=-1)  # [L, H_kv, N]
    redundancy = torch.softmax(torch.randn(3, 2, 10), dim=-1)
    penalty = torch.zeros(10)
    penalty[4:7] = 0.96
    score = eviction_scores(importance, redundancy, penalty, sigma=0.1)
    assert set(score.argsort()[:3].tolist()) == {4, 5, 6}
    expected = 0.1 * importance.mean((0, 1)) - 0.9 * redundancy.mean((0, 1)) - penalty
    torch.testing.assert_close(score, expected)
    torch.testing.assert_close(eviction_scores(importance, None, None, sigma=1.0), importance.mean((0, 1)))


def test_select_keep_budget_counts_generated_slots_including_the_window() -> None:
    scores = torch.tensor([0.0, 0.0, 0.5, 0.1, 0.9, 0.3, 0.8, 0.2, 0.0, 0.0])
    evictable = torch.tensor([False, False] + [True] * 8)  # 2 prompt/ancestor slots
    window = newest_mask(evictable, 2)
    assert window.nonzero().flatten().tolist() == [8, 9]
    keep = select_keep(scores, 5, evictable=evictable, protected=window)
    assert keep.tolist() == [0, 1, 2, 4, 6, 8, 9]  # + window 8, 9 and the top 3: 4, 6, 2
    assert keep.dtype == torch.long
    everything = select_keep(scores, 20, evictable=evictable, protected=window)
    assert everything.tolist() == list(range(10))
    assert select_keep(scores, 2, evictable=evictable, protected=window).tolist() == [0, 1, 8, 9]
    with pytest.raises(ValueError, match=r"budget=1 .* 2 protected"):
        select_keep(scores, 1, evictable=evictable, protected=window)
    with pytest.raises(ValueError, match="must all be"):
        select_keep(scores, 5, evictable=evictable[:5], protected=window)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_select_keep_properties(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 30))
    evictable = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    window = newest_mask(evictable, data.draw(st.integers(0, 5)))
    n_window = int(window.sum())
    budget = data.draw(st.integers(n_window, n + 2))
    scores = torch.tensor(data.draw(st.lists(st.floats(-1, 1), min_size=n, max_size=n)))
    keep = select_keep(scores, budget, evictable=evictable, protected=window)
    kept = torch.zeros(n, dtype=torch.bool)
    kept[keep] = True
    assert keep.tolist() == sorted(set(keep.tolist()))
    assert kept[~evictable].all() and kept[window].all()
    assert int((kept & evictable).sum()) == min(budget, int(evictable.sum()))
    dropped, chosen = evictable & ~kept, evictable & kept & ~window
    if dropped.any() and chosen.any():
        assert scores[chosen].min() >= scores[dropped].max()


# ---------------------------------------------------------------------------------------------- steering
def test_steering_vector_round_trip(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("BRANCHWISE_CACHE_DIR", str(tmp_path))
    path = steering_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert path == tmp_path / "steering" / "HuggingFaceTB_SmolLM2-135M-Instruct.pt"
    execution = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    other = torch.tensor([[0.0, 1.0]])
    v = steering_vector(execution.bfloat16(), other)
    torch.testing.assert_close(v, torch.tensor([2.0, 2.0]))
    saved = SteeringVector(
        layer=3, vector=v, n_exec=2, n_nonexec=1, model="HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    saved.save(path)
    loaded = SteeringVector.load(path)
    assert (loaded.layer, loaded.n_exec, loaded.n_nonexec, loaded.model) == (3, 2, 1, saved.model)
    torch.testing.assert_close(loaded.vector, v)
    torch.save({"something": "else"}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="not a saved steering vector"):
        SteeringVector.load(tmp_path / "bad.pt")


def test_steering_vector_names_the_empty_set() -> None:
    with pytest.raises(ValueError, match="nonexec_states is empty"):
        steering_vector(torch.ones(2, 4), torch.ones(0, 4))
    with pytest.raises(ValueError, match="exec_states is empty"):
        steering_vector(torch.ones(0, 4), torch.ones(2, 4))


def test_steering_strength_grows_with_non_execution_thoughts() -> None:
    assert steering_strength(1.0, 0.02, 0) == 1.0
    assert steering_strength(1.25, 0.02, 10) == pytest.approx(1.45)


def test_select_keep_per_head_keeps_each_heads_own_best_slots_same_count() -> None:
    evictable = torch.tensor([False, False] + [True] * 8)  # 2 prompt slots, 8 generated
    window = newest_mask(evictable, 2)
    scores = torch.zeros(2, 2, 10)  # [L, H, N]
    scores[0, 0, 2:5] = 1.0  # head (0, 0) prefers the oldest generated slots
    scores[0, 1, 5:8] = 1.0  # head (0, 1) the middle ones
    scores[1, :, 3] = 1.0
    keep = select_keep_per_head(scores, 5, evictable=evictable, protected=window)
    assert keep.shape == (2, 2, 7)  # the prompt + 5 generated in every head
    assert keep[0, 0].tolist() == [0, 1, 2, 3, 4, 8, 9]
    assert keep[0, 1].tolist() == [0, 1, 5, 6, 7, 8, 9]
    assert bool((keep[..., 1:] > keep[..., :-1]).all())  # sorted per head
    # the shared selection of the same scores, averaged, is one set for every head
    shared = select_keep(eviction_scores(scores, None, None, 1.0), 5, evictable=evictable, protected=window)
    assert shared.numel() == 7
    with pytest.raises(ValueError, match="budget=1 is below"):
        select_keep_per_head(scores, 1, evictable=evictable, protected=window)


def test_tracker_per_head_maps_and_sentences() -> None:
    t = tracker()
    t.append([1, 1, 100, 1, 3, 101])  # two sentences: gs 0-2, 3-5
    t.evict_per_head(torch.tensor([[[0, 1, 4, 5], [2, 3, 4, 5]]]))  # [L=1, H=2, 4]
    assert t.per_head and t.cache_len == 4
    assert t.slot_positions.tolist() == [[[0, 1, 4, 5], [2, 3, 4, 5]]]
    assert t.sentence_of_slot().tolist() == [[[0, 0, 1, 1], [0, 1, 1, 1]]]
    lam = torch.tensor([0.97, 0.0])
    assert t.sentence_penalty(lam).shape == (1, 2, 4)
    t.append([1, 1])  # new tokens land in every head
    assert t.cache_len == 6 and t.slot_positions[0, 1].tolist() == [2, 3, 4, 5, 6, 7]
    t.evict_per_head(torch.tensor([[[0, 3, 5], [1, 2, 4]]]))  # composes with the earlier map
    assert t.slot_positions.tolist() == [[[0, 5, 7], [3, 4, 6]]]
    t.evict([1, 2])  # a shared eviction applies to every head
    assert t.slot_positions.tolist() == [[[5, 7], [4, 6]]]
    with pytest.raises(ValueError, match="slot_positions"):
        _ = t.positions
    with pytest.raises(ValueError, match="strictly increasing"):
        t.evict_per_head(torch.tensor([[[1, 0], [0, 1]]]))
