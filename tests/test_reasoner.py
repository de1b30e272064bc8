"""Reasoner end to end on tiny random models: plan execution, results, release on failure."""

from __future__ import annotations

import asyncio
import json

import pytest

from branchwise.backends import DecodeParams
from branchwise.backends.hf import HFBackend
from branchwise.reasoners import Reasoner, ReasoningResult
from branchwise.reasoners.verifiers import Candidate
from branchwise.strategies import (
    AggregateNode,
    GenerateNode,
    LoopNode,
    ScoreNode,
    SelectNode,
    Strategy,
    best_of_n,
    self_consistency,
)


@pytest.fixture
def backend(tiny_llama_dir) -> HFBackend:
    return HFBackend(tiny_llama_dir)


def test_self_consistency_result_shape(backend: HFBackend) -> None:
    result = Reasoner(self_consistency(n=6, max_tokens=12, seed=3), backend=backend).run("What is 12 + 7?")
    assert isinstance(result, ReasoningResult)
    assert len(result.branches) == 6
    assert {b.finish_reason for b in result.branches} <= {"eos", "length"}
    assert result.tree[0].parent is None and len(result.tree) == 7
    assert all(t.parent == result.tree[0].node for t in result.tree[1:])
    assert result.timings["total"] >= result.timings["generate"] > 0
    assert result.kv_stats["tokens_reused"] == 6 * len(result.tree[0].token_ids)
    # the vote is over the branches' extracted answers
    answers = [b.answer for b in result.branches if b.answer is not None]
    if answers:
        assert result.answer in answers
        assert sum(result.votes.values()) == len(answers)
    json.loads(result.model_dump_json())
    assert backend.kv_stats().live_nodes == 0


def test_share_none_and_exact_agree_greedy(backend: HFBackend) -> None:
    strat = self_consistency(n=4, temperature=0.0, max_tokens=10)
    a = Reasoner(strat, backend=backend, share="exact").run("Count to five:")
    b = Reasoner(strat, backend=backend, share="none").run("Count to five:")
    assert [x.text for x in a.branches] == [x.text for x in b.branches]
    assert a.kv_stats["peak_bytes"] < b.kv_stats["peak_bytes"]
    assert b.kv_stats["tokens_reused"] == 0


def test_best_of_n_with_judge(backend: HFBackend) -> None:
    result = Reasoner(best_of_n(n=4, max_tokens=8, seed=1), backend=backend).run("What is 2 + 2?")
    assert len(result.branches) == 1
    assert 0.0 <= result.branches[0].scores["judge"] <= 1.0
    pruned = [t for t in result.tree if t.pruned]
    assert len(pruned) == 3
    assert all("judge" in t.scores for t in result.tree[1:])


def test_step_loop_strategy(backend: HFBackend) -> None:
    strat = Strategy(
        name="step_beam",
        nodes=[
            GenerateNode(id="start", n=2, max_tokens=6, until="step", step_delimiter=" ", seed=0),
            LoopNode(id="loop", body=["expand", "score", "keep"], max_iterations=2),
            GenerateNode(id="expand", n=2, max_tokens=6, until="step", step_delimiter=" ", seed=0),
            ScoreNode(id="score", verifier="confidence"),
            SelectNode(id="keep", k=2),
            AggregateNode(id="vote", method="weighted_majority"),
        ],
        edges=[
            ("start", "loop"),
            ("loop", "expand"),
            ("expand", "score"),
            ("score", "keep"),
            ("keep", "loop"),
            ("loop", "vote"),
        ],
    )
    result = Reasoner(strat, backend=backend).run("Say a few words.")
    assert 1 <= len(result.branches) <= 4
    assert max(t.depth for t in result.tree) <= 3
    assert backend.kv_stats().live_nodes == 0


class _Boom:
    name = "boom"

    def score(self, backend, question: str, candidates: list[Candidate]) -> list[float]:
        raise RuntimeError("verifier failed")


def test_nodes_released_when_a_step_raises(backend: HFBackend) -> None:
    strat = best_of_n(n=3, max_tokens=4, verifier="boom")
    reasoner = Reasoner(strat, backend=backend, verifiers={"boom": _Boom()})
    with pytest.raises(RuntimeError, match="verifier failed"):
        reasoner.run("Hi")
    assert backend.kv_stats().live_nodes == 0
    assert backend.kv_stats().bytes_held == 0


def test_unknown_verifier_and_share_are_clear_errors(backend: HFBackend) -> None:
    with pytest.raises(ValueError, match="verifier"):
        Reasoner(best_of_n(n=2, verifier="nope"), backend=backend)
    with pytest.raises(ValueError, match="share"):
        Reasoner(self_consistency(n=2), backend=backend, share="fuzzy")  # type: ignore[arg-type]


def test_unknown_extractor_is_rejected_before_running(backend: HFBackend) -> None:
    with pytest.raises(ValueError, match=r"nodes\[1\]\.extractor 'nope' .* allowed: .*last_number"):
        Reasoner(self_consistency(n=2, extractor="nope"), backend=backend)


class _Short:
    """A verifier that loses a score: the error must name it and both counts."""

    name = "short"

    def score(self, backend, question, candidates):  # type: ignore[no-untyped-def]
        return [0.5] * (len(candidates) - 1)


def test_verifier_returning_wrong_count_is_named(backend: HFBackend) -> None:
    reasoner = Reasoner(
        best_of_n(n=3, max_tokens=4, verifier="short"), backend=backend, verifiers={"short": _Short()}
    )
    with pytest.raises(ValueError, match=r"verifier 'short' \(_Short\) returned 2 scores for 3 candidates"):
        reasoner.run("Hi")
    assert backend.kv_stats().live_nodes == 0


def test_batch_runs_each_question(backend: HFBackend) -> None:
    results = Reasoner(self_consistency(n=2, max_tokens=4), backend=backend).batch(["a", "b"], progress=False)
    assert [r.question for r in results] == ["a", "b"]


@pytest.mark.parametrize("questions", [["What is 1 + 2?"], ["What is 1 + 2?", "Name a colour."]])
def test_batch_progress_counts_the_tokens_decoded(
    tiny_backend: HFBackend, monkeypatch: pytest.MonkeyPatch, questions: list[str]
) -> None:
    """The bar of `batch(progress=True)` moves with decode steps: it ends at the tokens the branches
    decoded (one question alone, and several decoded together) and counts each question answered."""
    from branchwise.reasoners import reasoner as module
    from branchwise.reasoners.batching import DecodeProgress

    bars: list[DecodeProgress] = []
    widths: list[int] = []

    class Seen(DecodeProgress):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            bars.append(self)

        def __call__(self, step: object) -> None:
            super().__call__(step)  # type: ignore[arg-type]
            widths.append(self.branches)

    monkeypatch.setattr(module, "DecodeProgress", Seen)
    strategy = self_consistency(n=3, max_tokens=5, temperature=0.0)
    results = Reasoner(strategy, backend=tiny_backend).batch(questions, progress=True)
    decoded = sum(len(t.token_ids) for r in results for t in r.tree if t.parent is not None)
    (bar,) = bars
    assert bar.tokens == decoded > 0
    assert bar.answered == len(questions)
    assert 3 <= max(widths) <= 3 * len(questions)  # a question's 3 branches decode together


def test_decode_params_forwarded(backend: HFBackend) -> None:
    """Generate node parameters reach the backend (max_tokens bounds every branch)."""
    result = Reasoner(self_consistency(n=3, max_tokens=5), backend=backend).run("x")
    assert all(b.n_tokens <= 5 for b in result.branches)
    assert DecodeParams(max_tokens=5).max_tokens == 5


def test_min_tokens_makes_every_branch_that_long(backend: HFBackend) -> None:
    """`GenerateNode.min_tokens` reaches the backend: end of sequence is masked until then."""
    result = Reasoner(self_consistency(n=3, max_tokens=12, min_tokens=12), backend=backend).run("x")
    assert [b.n_tokens for b in result.branches] == [12, 12, 12]


def test_probe_switch_to_recompute_is_noted(backend: HFBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    from branchwise.backends.accel import Accel, ProbeConfig
    from branchwise.backends.hf.probe import KVProbe

    def recompute_wins(self: KVProbe, length: int, n: int, *paths: object) -> bool:
        self.verdicts[self.key(length, n)] = False  # as if recompute had timed faster
        return False

    monkeypatch.setattr(KVProbe, "decide", recompute_wins)
    accel = Accel(probe=ProbeConfig())
    result = Reasoner(self_consistency(n=3, max_tokens=4, seed=0), backend=backend, accel=accel).run("1 + 2?")
    assert result.kv_stats["probe_recompute"] >= 1
    assert any(note.startswith("probe: ") and "recomputed" in note for note in result.notes)


def test_batch_runs_questions_together_with_serial_answers(backend: HFBackend) -> None:
    """Greedy: batching the questions' generate steps through one scheduler gives each question the
    tokens a serial run gives it, and its own KV stats; some extends decoded several questions' rows."""
    from branchwise.strategies import beam_search

    questions = ["What is 1 + 2?", "What is 12 + 7 and why?", "Name a colour.", "2 * 3?"]
    # No prefix cache across requests: the serial runs would leave the prompts cached for the batch,
    # and the per-question bytes compared below would then depend on which ran first.
    backend.cache_bytes = 0
    for strategy in (
        self_consistency(n=2, max_tokens=6, temperature=0.0),
        beam_search(
            width=4, keep="fixed", k=2, depth=2, max_step_tokens=4, temperature=0.0, verifier="confidence"
        ),
    ):
        reasoner = Reasoner(strategy, backend=backend)
        serial = [reasoner.run(q) for q in questions]
        batched = reasoner.batch(questions, progress=False)
        for s, b in zip(serial, batched, strict=True):
            assert [t.token_ids for t in b.tree] == [t.token_ids for t in s.tree]
            assert b.answer == s.answer and b.notes == s.notes
            assert b.kv_stats["peak_bytes"] > 0 and b.kv_stats["batch_shared_extends"] >= 1
            assert b.kv_stats["bytes_held"] == s.kv_stats["bytes_held"]  # its own nodes, not the others'
        assert backend.kv_stats().live_nodes == 0


def test_arun_answers_like_run_without_blocking_the_event_loop(tiny_backend: HFBackend) -> None:
    """Greedy: `arun` gives `run`'s tokens; two `arun`s gathered finish while the loop keeps ticking."""
    reasoner = Reasoner(self_consistency(n=2, max_tokens=6, temperature=0.0), backend=tiny_backend)
    questions = ["What is 1 + 2?", "Name a colour."]
    serial = [reasoner.run(q) for q in questions]

    async def main() -> tuple[list[ReasoningResult], int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        ticker = asyncio.create_task(tick())
        results = await asyncio.gather(*(reasoner.arun(q) for q in questions))
        ticker.cancel()
        return list(results), ticks

    results, ticks = asyncio.run(main())
    for s, a in zip(serial, results, strict=True):
        assert [b.token_ids for b in a.tree] == [b.token_ids for b in s.tree]
        assert a.answer == s.answer
    assert ticks > 1  # the loop ran while the strategies decoded in worker threads
    assert tiny_backend.kv_stats().live_nodes == 0


def test_history_turns_sit_between_the_system_prompt_and_the_question(tiny_backend: HFBackend) -> None:
    demo = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]
    reasoner = Reasoner(self_consistency(n=1), backend=tiny_backend, system_prompt="Be brief.", history=demo)
    assert reasoner._messages("3 + 3?") == [
        {"role": "system", "content": "Be brief."},
        *demo,
        {"role": "user", "content": "3 + 3?"},
    ]
    with pytest.raises(ValueError, match="role/content"):
        Reasoner(self_consistency(n=1), backend=tiny_backend, history=[{"role": "user"}])


def test_a_kv_budget_defers_rows_and_a_budget_too_small_is_said(tiny_llama_dir) -> None:
    """Dense branches under a budget that holds a few at a time decode in turns with the unbounded
    run's greedy texts. Under a budget below what the finished branches hold together, their KV is
    freed to make room (and the result says so); a budget that what the caller holds outside the
    run fills cannot bound the run, and its result says so instead of running over it silently."""
    strat = self_consistency(n=6, temperature=0.0, max_tokens=12)
    free = HFBackend(tiny_llama_dir, kv_budget=None, cache_bytes=0)
    want = Reasoner(strat, backend=free, share="none").run("Count to five:")
    tb = free.engine.pool.token_bytes
    prompt = len(want.tree[0].token_ids)  # each dense row computes and holds it as its own KV
    row = prompt + 12 + 12  # a dense row's price: its prompt and tokens once, and its free slots
    # one token short of six rows at once: five start, the sixth waits
    roomy = HFBackend(tiny_llama_dir, kv_budget=int((6 * row - 1) * tb / 0.98), cache_bytes=0)
    got = Reasoner(strat, backend=roomy, share="none").run("Count to five:")
    assert [b.text for b in got.branches] == [b.text for b in want.branches]
    assert got.kv_stats["deferred_rows"] > 0 and not any("kv_budget" in n for n in got.notes)
    tiny = HFBackend(tiny_llama_dir, kv_budget=2 * row * tb, cache_bytes=0)
    small = Reasoner(strat, backend=tiny, share="none").run("Count to five:")
    assert [b.text for b in small.branches] == [b.text for b in want.branches]
    freed = small.kv_stats["freed_ended_kv_nodes"]
    assert freed > 0 and "kv_overruns" not in small.kv_stats
    assert any(n.startswith(f"kv_budget: the KV of {freed:g} ended branch") for n in small.notes)
    filler = tiny.encode("Count to five: " * 2 * row)[: 2 * row - prompt]  # the caller's KV, not the run's
    held = tiny.prefill(filler)  # to free: no row of the run fits beside it
    tiny.extend([held], DecodeParams(max_tokens=1))  # its KV computed (a prefill alone defers it)
    full = Reasoner(strat, backend=tiny, share="none").run("Count to five:")
    tiny.release([held])
    assert [b.text for b in full.branches] == [b.text for b in want.branches]
    assert full.kv_stats["kv_overruns"] > 0
    assert any(n.startswith(f"kv_budget: {full.kv_stats['kv_overruns']:g} decode step") for n in full.notes)
