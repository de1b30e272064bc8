"""Tests for answer extraction and majority voting (branchwise.reasoners.answers)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from branchwise.reasoners import answers as ans
from branchwise.reasoners.answers import (
    VoteResult,
    extract_answer,
    extractor_names,
    get_extractor,
    majority_vote,
    normalize_answer,
    normalize_number,
    register_extractor,
)

# ---------------------------------------------------------------------------------------------
# normalisation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("19", "19"),
        ("19.0", "19"),
        ("19.000", "19"),
        ("1,000", "1000"),
        ("1,234,567.50", "1234567.5"),
        ("-3", "-3"),
        ("-0", "0"),
        ("0.00", "0"),
        ("0.50", "0.5"),
        (".5", "0.5"),
        ("007", "7"),
        ("+4", "4"),
        ("3/4", "3/4"),
        ("-3/4", "-3/4"),
        ("6/8", "6/8"),
        ("\u22127", "-7"),
        ("12345678901234567890", "12345678901234567890"),
    ],
)
def test_normalize_number(raw: str, expected: str) -> None:
    assert normalize_number(raw) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("$19$", "19"),
        ("**19**", "19"),
        ("19.", "19"),
        ("\\$1,000", "1000"),
        ("$5", "5"),
        ("50\\%", "50"),
        ("50%", "50"),
        ("90^\\circ", "90"),
        ("\\frac{3}{4}", "3/4"),
        ("\\dfrac{1}{2}", "1/2"),
        ("\\text{19}", "19"),
        ("1\\,000", "1000"),
        ("(19)", "19"),
        ("(C)", "C"),
        ("(1, 2)", "(1, 2)"),
        ("x^{2}+1", "x^{2}+1"),
        ("  Paris. ", "Paris"),
        ("\\(42\\)", "42"),
    ],
)
def test_normalize_answer(raw: str, expected: str) -> None:
    assert normalize_answer(raw) == expected


# ---------------------------------------------------------------------------------------------
# last_number
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("I have 19.0 apples", "19"),
        ("Total: 1,000 dollars", "1000"),
        ("It costs $1,234.50 in total.", "1234.5"),
        ("about 3/4 of them", "3/4"),
        ("x = -5.", "-5"),
        ("so the value is (-3)", "-3"),
        ("12 + 7 = 19", "19"),
        ("12 - 7 = 5", "5"),
        ("pages 3-4", "4"),  # a hyphen inside a range is not a sign
        ("x-1", "1"),
        ("19.", "19"),
        ("first 1, then 2, then 3", "3"),
        ("0.75 and .5", "0.5"),
        ("\u22128 degrees", "-8"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_last_number(text: str, expected: str | None) -> None:
    assert extract_answer(text, "last_number") == expected


# ---------------------------------------------------------------------------------------------
# boxed
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{19}", "19"),
        ("$\\boxed{19.0}$", "19"),
        ("\\boxed{1,000}", "1000"),
        ("\\boxed{\\frac{3}{4}}", "3/4"),
        ("first \\boxed{5}, finally \\boxed{x^{2}+1}", "x^{2}+1"),
        ("nested \\boxed{f(x) = {x}^{2}} done", "f(x) = {x}^{2}"),
        ("\\boxed{\\text{Paris}}", "Paris"),
        ("\\boxed{5} and then a cut-off \\boxed{7", "5"),  # unterminated box is skipped
        ("\\boxed{}", None),
        ("\\fbox{12}", "12"),
        ("no box, 42", None),
    ],
)
def test_boxed(text: str, expected: str | None) -> None:
    assert extract_answer(text, "boxed") == expected


# ---------------------------------------------------------------------------------------------
# answer_is
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 19.", "19"),
        ("the ANSWER IS 19", "19"),
        ("The answer is 19 apples.", "19"),
        ("The answer is 19.0", "19"),
        ("The answer is: -3/4", "-3/4"),
        ("The final answer is $19$. I hope it is correct.", "19"),
        ("The final answer is $\\boxed{42}$.", "42"),
        ("Answer: 1,000", "1000"),
        ("**Answer:** $19$", "19"),
        ("**Answer**: 7", "7"),
        ("Reasoning...\n#### 72", "72"),
        ("#### 1,234.0", "1234"),
        ("The answer is Paris. It is the capital.", "Paris"),
        ("The answer is Paris, because it is the capital.", "Paris"),
        ("The answer is 3. Wait, no. The answer is 4.", "4"),  # the last statement wins
        ("I will answer this question later: 5 or 6", None),
        ("Answer 12", None),  # needs 'is', ':' or '='
        ("no conclusion at all", None),
    ],
)
def test_answer_is(text: str, expected: str | None) -> None:
    assert extract_answer(text, "answer_is") == expected


# ---------------------------------------------------------------------------------------------
# choice
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is (C).", "C"),
        ("The answer is C", "C"),
        ("Answer: **B**", "B"),
        ("The correct answer is D because ...", "D"),
        ("answer: (e)", "E"),
        ("So the answer is \\boxed{A}", "A"),
        ("A) 3\nB) 4\nC) 5\nThe answer is B.", "B"),  # the commitment beats the listed options
        ("I think B) is right", "B"),
        ("**D**", "D"),
        ("**(C)**", "C"),
        ("Option E looks best", "E"),
        ("\\boxed{(D)}", "D"),
        ("c", "C"),
        ("B.", "B"),
        ("the answer is a dog", None),  # article, not option A
        ("The answer is Ethanol", None),
        ("Fifty", None),
        ("(F)", None),
    ],
)
def test_choice(text: str, expected: str | None) -> None:
    assert extract_answer(text, "choice") == expected


# ---------------------------------------------------------------------------------------------
# auto
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 7. But formally \\boxed{8}", "8"),  # boxed first
        ("12 + 7 = 19, so the answer is 20 (typo?) 21", "20"),  # answer_is before last_number
        ("12 + 7 = 19", "19"),  # last_number fallback
        ("The answer is Paris.", "Paris"),
        ("nothing to see", None),
        ("", None),
    ],
)
def test_auto(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected
    assert extract_answer(text, "auto") == expected


# ---------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------


def test_builtin_names_registered() -> None:
    assert {"last_number", "boxed", "answer_is", "choice", "auto", "answer_tag"} <= set(extractor_names())
    assert extractor_names() == sorted(extractor_names())


def test_unknown_method_lists_allowed_names() -> None:
    with pytest.raises(ValueError) as err:
        extract_answer("19", "nope")
    message = str(err.value)
    assert "'nope'" in message
    for name in ("last_number", "boxed", "answer_is", "choice", "auto"):
        assert repr(name) in message
    with pytest.raises(ValueError):
        get_extractor("nope")


def test_register_custom_extractor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ans, "_EXTRACTORS", dict(ans._EXTRACTORS))  # keep the global registry clean
    register_extractor("first_word", lambda text: text.split()[0] if text.split() else None)
    assert extract_answer("hello world", "first_word") == "hello"
    assert get_extractor("first_word")("") is None
    assert "first_word" in extractor_names()


def test_register_refuses_silent_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ans, "_EXTRACTORS", dict(ans._EXTRACTORS))
    with pytest.raises(ValueError, match="already registered"):
        register_extractor("boxed", lambda text: "x")
    register_extractor("boxed", lambda text: "x", replace=True)
    assert extract_answer("\\boxed{1}", "boxed") == "x"


def test_register_validates_arguments() -> None:
    with pytest.raises(ValueError):
        register_extractor("", lambda text: None)
    with pytest.raises(TypeError):
        register_extractor("not_callable", "nope")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "module",
    [
        "branchwise.reasoners.answers",
        "branchwise.reasoners.tasks",
        "branchwise.reasoners.verifiers",
        "branchwise.evals.datasets",
        "branchwise.evals.report",
    ],
)
def test_module_does_not_import_torch(module: str) -> None:
    # verifiers are imported by strategies and the eval harness on machines without a model
    code = f"import sys, {module}; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so <answer> 19.0 </answer>", "19.0"),
        ("<answer>1 2\n3 4</answer>", "1 2\n3 4"),  # a closed tag may span lines (grid answers)
        ("cut off <answer>42\nmore text", "42"),  # an unclosed one ends at its line
        ("<answer>3</answer> no wait, <answer>4", "4"),  # the last tag wins, closed or not
        ("<answer>5</answer> then <answer> </answer>", "5"),  # an empty tag is skipped
        ("<ANSWER>7</ANSWER>", "7"),
        ("no tag here", None),
    ],
)
def test_answer_tag(text: str, expected: str | None) -> None:
    assert ans.answer_tag(text) == expected
    assert extract_answer(text, "answer_tag") == (
        normalize_answer(expected) if expected is not None else ans.extract_auto(text)
    )


# ---------------------------------------------------------------------------------------------
# majority_vote
# ---------------------------------------------------------------------------------------------


def test_vote_simple_majority() -> None:
    result = majority_vote(["19", "19", "20"])
    assert result == VoteResult(answer="19", counts={"19": 2.0, "20": 1.0}, support=2 / 3, n_valid=3)


def test_vote_none_abstains() -> None:
    result = majority_vote([None, None, None, "7", None])
    assert result.answer == "7"
    assert result.n_valid == 1
    assert result.support == 1.0
    assert result.counts == {"7": 1.0}


def test_vote_all_none_or_empty() -> None:
    for answers in ([], [None, None]):
        result = majority_vote(answers)
        assert result.answer is None
        assert result.counts == {}
        assert result.support == 0.0
        assert result.n_valid == 0


def test_vote_tie_goes_to_first_occurrence() -> None:
    assert majority_vote(["b", "a", "a", "b"]).answer == "b"
    assert majority_vote(["a", "b", "b", "a"]).answer == "a"
    assert majority_vote([None, "z", "y"]).answer == "z"


def test_vote_counts_keep_first_occurrence_order() -> None:
    assert list(majority_vote(["c", "a", "c", "b"]).counts) == ["c", "a", "b"]


def test_vote_weighted() -> None:
    result = majority_vote(["1", "2", "2"], weights=[0.9, 0.3, 0.3])
    assert result.answer == "1"
    assert result.counts == pytest.approx({"1": 0.9, "2": 0.6})
    assert result.support == pytest.approx(0.6)
    assert result.n_valid == 3


def test_vote_weight_of_none_answer_is_ignored() -> None:
    result = majority_vote([None, "a"], weights=[100.0, 1.0])
    assert result.answer == "a"
    assert result.support == 1.0


def test_vote_zero_total_weight_has_no_winner() -> None:
    result = majority_vote(["a", "b"], weights=[0.0, 0.0])
    assert result.answer is None
    assert result.n_valid == 2
    assert result.counts == {"a": 0.0, "b": 0.0}
    assert result.support == 0.0


@pytest.mark.parametrize(
    ("weights", "fragment"),
    [
        ([1.0], "same length"),
        ([1.0, 2.0, 3.0], "same length"),
        ([1.0, -0.5], ">= 0"),
        ([1.0, math.nan], ">= 0"),
    ],
)
def test_vote_rejects_bad_weights(weights: list[float], fragment: str) -> None:
    with pytest.raises(ValueError, match="weights") as err:
        majority_vote(["a", "b"], weights=weights)
    assert fragment in str(err.value)


def test_vote_rejects_infinite_weight() -> None:
    with pytest.raises(ValueError, match="weights"):
        majority_vote(["a"], weights=[math.inf])


def test_extract_then_vote_end_to_end() -> None:
    outputs = [
        "12 + 7 = 19. The answer is 19.",
        "Twelve plus seven is \\boxed{19.0}",
        "I think it's 20",
        "no idea",
        "#### 19",
    ]
    result = majority_vote([extract_answer(o) for o in outputs])
    assert result.answer == "19"
    assert result.n_valid == 4
    assert result.support == pytest.approx(0.75)


# ---------------------------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------------------------

_answers = st.lists(st.one_of(st.none(), st.sampled_from(["a", "b", "c", "d", "19"])), max_size=30)


@given(_answers)
def test_vote_winner_has_max_count(answers: list[str | None]) -> None:
    result = majority_vote(answers)
    valid = [a for a in answers if a is not None]
    assert result.n_valid == len(valid)
    assert sum(result.counts.values()) == pytest.approx(len(valid))
    if not valid:
        assert result.answer is None
        return
    top = max(result.counts.values())
    assert result.counts[result.answer] == top
    # tie-break: the winner is the first answer (in input order) that reaches the top count
    assert result.answer == next(a for a in valid if result.counts[a] == top)
    assert result.support == pytest.approx(top / len(valid))
    assert 0.0 < result.support <= 1.0


@given(_answers, st.randoms(use_true_random=False))
def test_vote_permutation_invariant_up_to_ties(answers: list[str | None], rnd: object) -> None:
    shuffled = list(answers)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    a, b = majority_vote(answers), majority_vote(shuffled)
    assert a.counts == b.counts  # dict equality ignores order
    assert a.n_valid == b.n_valid
    assert a.support == pytest.approx(b.support)
    if a.answer is None:
        assert b.answer is None
    else:
        top = max(a.counts.values())
        assert a.counts[b.answer] == top  # a different winner only among tied answers


@given(
    st.lists(
        st.tuples(
            st.one_of(st.none(), st.sampled_from(["x", "y", "z"])),
            st.floats(min_value=0.0, max_value=1e6, allow_nan=False),
        ),
        max_size=20,
    )
)
def test_weighted_vote_winner_has_max_weight(pairs: list[tuple[str | None, float]]) -> None:
    answers = [p[0] for p in pairs]
    weights = [p[1] for p in pairs]
    result = majority_vote(answers, weights)
    if result.answer is None:
        assert all(v == 0.0 for v in result.counts.values())
        return
    assert result.counts[result.answer] == max(result.counts.values())
    assert 0.0 < result.support <= 1.0 + 1e-12


@given(st.integers(min_value=-(10**12), max_value=10**12))
def test_number_normalisation_round_trips_integers(n: int) -> None:
    assert normalize_number(str(n)) == str(n)
    assert normalize_number(f"{n}.0") == str(n)
    assert normalize_number(f"{n:,}") == str(n)
    assert extract_answer(f"so the total is {n:,}.", "last_number") == str(n)


@given(st.decimals(min_value=-1000, max_value=1000, places=3, allow_nan=False, allow_infinity=False))
def test_decimal_normalisation_is_idempotent(value: object) -> None:
    once = normalize_number(str(value))
    assert normalize_number(once) == once
    assert "e" not in once.lower()


@given(st.text(max_size=200))
def test_extractors_never_crash_and_return_nonempty_or_none(text: str) -> None:
    for name in ("last_number", "boxed", "answer_is", "choice", "auto"):
        out = extract_answer(text, name)
        assert out is None or (isinstance(out, str) and out != "")
