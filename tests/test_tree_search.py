"""Tree search on the shared KV tree: search selects, allocation, pruning, KV accounting, verifiers.

The executor tests run on the tiny random Llama (steps end at a space so trees get several levels)
with a deterministic process reward, so every expectation (REBASE's per-leaf counts, DVTS's
subtrees, ETS's pruning) can be recomputed from the returned tree. The pure algorithms themselves
are tested in test_search.py; here they are tested *wired to a backend*.
"""

from __future__ import annotations

import importlib.util
import math
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from branchwise.backends import DecodeParams
from branchwise.backends.hf import HFBackend
from branchwise.reasoners import Reasoner, ReasoningResult, TreeNode
from branchwise.reasoners.search import CallableEmbedder, rebase_allocation
from branchwise.reasoners.tasks import (
    chain_sum_terms,
    check_game24,
    equations,
    extract_expression,
    game24_puzzles,
    running_totals,
)
from branchwise.reasoners.verifiers import (
    ArithmeticStepVerifier,
    Candidate,
    ChainSumStepVerifier,
    Game24Verifier,
    OutcomeVerifier,
    PRMVerifier,
    ReasoningGymVerifier,
    ToTValueVerifier,
    ToTVoteVerifier,
)
from branchwise.strategies import (
    GenerateNode,
    SelectNode,
    Strategy,
    beam_search,
    dvts,
    ets,
    rebase,
    tree_of_thoughts,
)

STEP = {"max_step_tokens": 6, "step_delimiter": " ", "seed": 0}


class HashReward:
    """A deterministic process reward in [0, 1) from the branch text: reproducible, ties are rare."""

    name = "hash"

    def score(self, backend, question: str, candidates: Sequence[Candidate]) -> list[float]:
        return [(zlib.crc32(c.text.encode()) % 997) / 997 for c in candidates]


@pytest.fixture
def backend(tiny_llama_dir: Path) -> HFBackend:
    return HFBackend(tiny_llama_dir)


def run(backend: HFBackend, strategy: Strategy, **kw) -> ReasoningResult:
    reasoner = Reasoner(strategy, backend=backend, verifiers={"hash": HashReward()}, **kw)
    result = reasoner.run("What is 12 + 7?")
    stats = backend.kv_stats()
    assert stats.live_nodes == 0 and stats.bytes_held == 0, "every node must be released after a run"
    return result


def with_stop(strategy: Strategy, stop: list[str]) -> Strategy:
    """The same graph with stop strings on every generate: branches that hit one finish."""
    nodes = [
        n.model_copy(update={"stop": stop}) if isinstance(n, GenerateNode) else n for n in strategy.nodes
    ]
    return Strategy(name=strategy.name, nodes=nodes, edges=strategy.edges)


def children(result: ReasoningResult) -> dict[int, list[TreeNode]]:
    out: dict[int, list[TreeNode]] = {}
    for t in result.tree:
        if t.parent is not None:
            out.setdefault(t.parent, []).append(t)
    return out


def ended(t: TreeNode) -> bool:
    return t.finish_reason in ("eos", "stop")


# --------------------------------------------------------------------------------------------------
# strategy layer (no torch)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: beam_search(width=16),
        lambda: dvts(width=16, subtrees=4),
        lambda: rebase(width=16),
        lambda: ets(width=16, embedder="hidden"),
        lambda: tree_of_thoughts(),
        lambda: tree_of_thoughts(search="dfs", evaluator="vote"),
        lambda: rebase(width=4, depth=1),
    ],
)
def test_search_strategies_compile_and_round_trip(make) -> None:
    strategy = make()
    plan = strategy.compile()
    assert [n.kind for n in plan.nodes()][-1] == "aggregate"
    assert Strategy.from_yaml(strategy.to_yaml()) == strategy
    assert Strategy.from_json(strategy.to_json()) == strategy


def test_select_parameters_are_checked_against_the_method() -> None:
    with pytest.raises(ValidationError, match="requires width"):
        SelectNode(id="s", method="rebase")
    with pytest.raises(ValidationError, match="width is only used with"):
        SelectNode(id="s", method="top_k", width=8)
    with pytest.raises(ValidationError, match="lambda_b is only used with method 'ets'"):
        SelectNode(id="s", method="rebase", width=8, lambda_b=2.0)
    with pytest.raises(ValidationError, match="temperature is only used"):
        SelectNode(id="s", method="beam", width=8, temperature=0.5)
    with pytest.raises(ValidationError, match="keep='sqrt'"):
        SelectNode(id="s", method="beam", width=9, keep="sqrt", k=2)
    with pytest.raises(ValidationError, match="method='dfs' requires threshold"):
        SelectNode(id="s", method="dfs")
    with pytest.raises(ValidationError) as excinfo:
        SelectNode(id="s", method="ets", width=8, lambda_d=-1)
    assert excinfo.value.errors()[0]["loc"] == ("lambda_d",)
    with pytest.raises(ValidationError) as excinfo:
        SelectNode(id="s", method="ets", width=0)
    assert excinfo.value.errors()[0]["loc"] == ("width",)


# --------------------------------------------------------------------------------------------------
# executor
# --------------------------------------------------------------------------------------------------


def test_kv_metric_counts_candidates_and_unique_ancestors(backend: HFBackend) -> None:
    result = run(backend, rebase(width=6, depth=3, verifier="hash", **STEP))
    by_id = {t.node: t for t in result.tree}
    root = next(t for t in result.tree if t.parent is None)
    depths = sorted({t.depth for t in result.tree if t.parent is not None})
    assert len(result.kv_per_step) == len(depths)
    for step, depth in zip(result.kv_per_step, depths, strict=True):
        counted: set[int] = set()
        for t in (t for t in result.tree if t.depth == depth):
            at: int | None = t.node
            while at is not None:
                counted.add(at)
                at = by_id[at].parent
        assert step == sum(len(by_id[n].token_ids) for n in counted)
    assert result.kv_per_step[0] == len(root.token_ids) + sum(
        len(t.token_ids) for t in result.tree if t.depth == 1
    )
    assert result.kv_metric_tokens == sum(result.kv_per_step)


def test_rebase_allocates_by_reward_and_shrinks_width(backend: HFBackend) -> None:
    width = 8
    result = run(backend, with_stop(rebase(width=width, depth=4, verifier="hash", **STEP), ["th"]))
    kids = children(result)
    assert result.search_steps, "the search loop must have run"
    assert any(step.finished for step in result.search_steps), "some branches must finish (stop string)"
    for depth, step in enumerate(result.search_steps, start=1):
        active = [t for t in result.tree if t.depth == depth and not ended(t)]
        finished = sum(ended(t) for t in result.tree if 1 <= t.depth <= depth)
        assert step.width == max(0, width - finished) and step.finished == finished
        expected = rebase_allocation([t.scores["hash"] for t in active], step.width, 0.2)
        assert [len(kids.get(t.node, [])) for t in active] == expected
        assert step.children == step.width and step.pruned == expected.count(0)
        assert all(t.pruned == (n == 0) for t, n in zip(active, expected, strict=True))


def test_beam_keeps_sqrt_width_and_pruning_frees_kv(backend: HFBackend) -> None:
    result = run(backend, beam_search(width=9, keep="sqrt", depth=4, verifier="hash", **STEP))
    kids = children(result)
    for depth, step in enumerate(result.search_steps, start=1):
        active = sorted(
            (t for t in result.tree if t.depth == depth and not ended(t)), key=lambda t: -t.scores["hash"]
        )
        kept = [t for t in active if t.node in kids]
        assert kept == active[: min(3, step.width, len(active))]  # round(sqrt(9)) = 3, best first
        counts = [len(kids[t.node]) for t in kept]
        assert sum(counts) == step.width and max(counts) - min(counts) <= 1
        if step.pruned:  # pruned subtrees are freed at once, before the next step decodes
            assert step.kv_bytes_after < step.kv_bytes_before


def test_dvts_subtrees_search_independently(backend: HFBackend) -> None:
    result = run(backend, dvts(width=8, subtrees=2, depth=4, verifier="hash", **STEP))
    by_id = {t.node: t for t in result.tree}
    kids = children(result)

    def subtree(t: TreeNode) -> int:
        while t.depth > 1:
            t = by_id[t.parent]
        first = sorted(x.node for x in result.tree if x.depth == 1)
        return first.index(t.node) * 2 // len(first)

    for depth in range(1, len(result.search_steps) + 1):
        expanded = [t for t in result.tree if t.depth == depth and t.node in kids]
        groups = Counter(subtree(t) for t in expanded)
        assert all(n == 1 for n in groups.values()), "each subtree keeps its single best leaf"
        for g in groups:
            done = sum(ended(t) for t in result.tree if 1 <= t.depth <= depth and subtree(t) == g)
            (leaf,) = [t for t in expanded if subtree(t) == g]
            assert len(kids[leaf.node]) == 4 - done  # each subtree owns width / subtrees = 4
            best = max(
                (t for t in result.tree if t.depth == depth and not ended(t) and subtree(t) == g),
                key=lambda t: t.scores["hash"],
            )
            assert leaf is best


def test_ets_prunes_redundant_leaves_and_reports_solver(backend: HFBackend) -> None:
    # one cluster for everything (all steps "paraphrases") and a heavy budget term: ETS keeps one leaf
    same = CallableEmbedder(lambda texts: np.ones((len(texts), 4)))
    strategy = ets(width=6, depth=3, verifier="hash", lambda_b=5.0, **STEP)
    result = run(backend, strategy, embedder=same)
    kids = children(result)
    for depth, step in enumerate(result.search_steps, start=1):
        assert step.solver_status in ("optimal", "trivial") and not step.used_fallback
        if step.active > 1:
            assert step.clusters == 1 and step.kept == 1 and step.pruned == step.active - 1
            assert step.kv_bytes_after < step.kv_bytes_before
        (kept,) = [t for t in result.tree if t.depth == depth and t.node in kids]
        assert len(kids[kept.node]) == step.width
    assert result.timings["ets_ilp"] > 0


@pytest.mark.parametrize("embedder", ["hidden", "callable"])
def test_ets_end_to_end_with_embedders(backend: HFBackend, embedder: str) -> None:
    strategy = ets(
        width=6,
        depth=3,
        verifier="confidence",
        embedder="hidden" if embedder == "hidden" else "minilm",
        **STEP,
    )
    kw = {"embedder": CallableEmbedder(lambda t: np.eye(len(t)))} if embedder == "callable" else {}
    result = run(backend, strategy, **kw)
    assert result.branches and result.search_steps
    for step in result.search_steps:
        assert step.children == step.width and step.kept + step.pruned == step.active
        if step.active > 1:
            assert step.clusters is not None and 1 <= step.clusters <= step.active
            assert step.embedder == ("hidden" if embedder == "hidden" else "minilm")  # what clustered


def test_tot_vote_uniform_fallback_is_noted(backend: HFBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    from branchwise.reasoners.verifiers import ToTVoteVerifier

    monkeypatch.setattr(ToTVoteVerifier, "_choice_tokens", lambda self, backend, m: None)
    vote = run(backend, tree_of_thoughts(breadth=2, depth=2, n_generate=3, evaluator="vote", **STEP))
    assert any(note.startswith("tot_vote: no single-token choice digits") for note in vote.notes)


def test_tree_of_thoughts_bfs_and_dfs(backend: HFBackend) -> None:
    bfs = run(backend, tree_of_thoughts(breadth=2, depth=3, n_generate=3, **STEP))
    assert max(t.depth for t in bfs.tree) <= 3
    assert all("tot_value" in t.scores for t in bfs.tree if t.parent is not None)
    expanded = Counter(t.depth for t in bfs.tree if t.depth < 3 and any(c.parent == t.node for c in bfs.tree))
    assert all(n <= 2 for d, n in expanded.items() if d >= 1)  # breadth 2 kept per step

    dfs = run(backend, tree_of_thoughts(n_generate=2, search="dfs", threshold=0.0, max_expansions=4, **STEP))
    for step in dfs.search_steps:
        assert step.children <= 1  # DFS expands one state at a time
    vote = run(backend, tree_of_thoughts(breadth=2, depth=2, n_generate=3, evaluator="vote", **STEP))
    assert all("tot_vote" in t.scores for t in vote.tree if t.parent is not None)


def test_finished_leaves_are_retired_and_vote_over_finished_only(backend: HFBackend) -> None:
    result = run(backend, with_stop(rebase(width=8, depth=4, verifier="hash", **STEP), ["an"]))
    finished = [b for b in result.branches if b.finish_reason in ("eos", "stop")]
    assert finished and len(finished) < len(result.branches)
    if result.answer is not None:
        assert result.answer in {b.answer for b in finished}
    assert {b.node for b in result.branches if b.selected} <= {b.node for b in finished}
    # a finished leaf is never expanded
    kids = children(result)
    assert not any(t.node in kids for t in result.tree if ended(t))


# --------------------------------------------------------------------------------------------------
# verifiers
# --------------------------------------------------------------------------------------------------


def cand(
    text: str, steps: tuple[str, ...] = (), finished: bool = False, answer: str | None = None
) -> Candidate:
    return Candidate(
        node=0, text=text, answer=answer, top1_probs=[1.0], logprobs=[0.0], steps=steps, finished=finished
    )


def test_task_helpers() -> None:
    assert chain_sum_terms("State the final answer: 4 - 1 - 7 + 12 =") == [4, -1, -7, 12]
    assert running_totals([4, -1, -7, 12]) == [3, -4, 8]
    assert [(lhs, float(c), float(e)) for lhs, c, e in equations("1. 4 - 1 = 3\n3 * 2 = 7")] == [
        ("4 - 1", 3.0, 3.0),
        ("3 * 2", 7.0, 6.0),
    ]
    assert check_game24([4, 9, 10, 13], "(10 - 4) * (13 - 9)")
    assert not check_game24([4, 9, 10, 13], "(10 - 4) * (13 - 9) * 1")  # an extra number
    assert not check_game24([4, 9, 10, 13], "4 * 6")
    assert extract_expression("1 + 2 = 3 (left: 3 4)\nAnswer: (1 + 2) * (4 + 4) = 24") == "(1 + 2) * (4 + 4)"
    if importlib.util.find_spec("tot") is None:
        pytest.skip("tree-of-thoughts-llm is not installed (pip install --no-deps tree-of-thoughts-llm)")
    puzzles = game24_puzzles(start=900, limit=3)
    assert len(puzzles) == 3 and all(len(p.split()) == 4 for p in puzzles)
    assert game24_puzzles()[0] == "1 1 4 6" and len(game24_puzzles()) == 1362


def test_step_checkers() -> None:
    question = "State the final answer to the following arithmetic problem: 4 - 1 - 7 ="
    chain = ChainSumStepVerifier(tie_break=0.0)
    scores = chain.score(
        None,
        question,
        [
            cand("4 - 1 = 3\n", steps=("4 - 1 = 3\n",)),  # right and on the chain
            cand("4 + 7 = 11\n", steps=("4 + 7 = 11\n",)),  # right arithmetic, off the chain
            cand("4 - 1 = 5\n", steps=("4 - 1 = 5\n",)),  # wrong
            cand("Let me think.", steps=("Let me think.",)),  # nothing to check
            cand("<answer>-4</answer>", steps=("<answer>-4</answer>",), finished=True),
            cand("<answer>4</answer>", steps=("<answer>4</answer>",), finished=True),
        ],
    )
    assert scores == [1.0, 0.0, 0.0, 0.5, 1.0, 0.0]
    arithmetic = ArithmeticStepVerifier(tie_break=0.0)
    assert arithmetic.score(None, question, [cand("4 + 7 = 11", steps=("4 + 7 = 11",))]) == [1.0]
    with_tie = ArithmeticStepVerifier(tie_break=0.1).score(None, question, [cand("x", steps=("x",))])
    assert with_tie == [pytest.approx(0.9 * 0.5 + 0.1)]


def test_outcome_checkers() -> None:
    game = Game24Verifier()
    good = cand("6 - 4 = 2 (left: 2 10 13)\nAnswer: (10 - 4) * (13 - 9) = 24", finished=True)
    assert game.score(None, "4 9 10 13", [good, cand("Answer: 4 * 6 = 24", finished=True), cand("...")]) == [
        1.0,
        0.0,
        0.5,
    ]
    rg = pytest.importorskip("reasoning_gym")
    dataset = rg.create_dataset("chain_sum", size=2, seed=1)
    entry = dataset[0]
    checker = ReasoningGymVerifier(dataset)
    right = cand(f"so <answer>{entry['answer']}</answer>", finished=True)
    wrong = cand("<answer>123456</answer>", finished=True)
    assert checker.score(None, entry["question"], [right, wrong]) == [1.0, 0.0]
    with pytest.raises(KeyError):
        checker.score(None, "not a question of the dataset", [right])
    custom = OutcomeVerifier(lambda q, a, t: float(a == "19"), unfinished=0.25)
    assert custom.score(None, "q", [cand("19", answer="19", finished=True), cand("1")]) == [1.0, 0.25]


def test_tot_value_and_vote_verifiers(backend: HFBackend) -> None:
    root = backend.prefill(backend.chat_prompt([{"role": "user", "content": "Make 24 from 4 9 10 13."}]))
    leaves = backend.fork(root, 10)
    backend.release([root])
    try:
        gens = backend.extend(leaves, DecodeParams(temperature=1.0, max_tokens=4, seed=0))
        cands = [
            Candidate(
                node=g.node, text=g.text, answer=None, top1_probs=[0.5], logprobs=[0.0], steps=(g.text,)
            )
            for g in gens
        ]
        values = ToTValueVerifier().score(backend, "4 9 10 13", cands)
        assert len(values) == 10 and all(0.0 <= v <= 1.0 for v in values)
        votes = ToTVoteVerifier().score(backend, "4 9 10 13", cands)
        assert len(votes) == 10 and all(0.0 <= v <= 1.0 for v in votes)
        assert sum(votes[:9]) == pytest.approx(1.0) and votes[9] == 1.0  # groups of at most nine
        assert (
            backend.kv_stats().live_nodes == 10 + 1
        )  # vote prompts released; the leaves and their root remain
    finally:
        backend.release(leaves)


# --------------------------------------------------------------------------------------------------
# PRM head loader (offline: tiny random heads built here)
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_prm_dir(tiny_tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForTokenClassification

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tiny_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=2,
        initializer_range=0.3,
        pad_token_id=tiny_tokenizer.pad_token_id,
    )
    out = tmp_path_factory.mktemp("tiny-prm")
    LlamaForTokenClassification(config).eval().save_pretrained(out)
    tiny_tokenizer.save_pretrained(out)
    return out


def test_prm_token_classification_head(tiny_prm_dir: Path) -> None:
    prm = PRMVerifier(tiny_prm_dir)
    assert prm.head == "token_classification"
    cands = [
        cand("a", steps=("First, add 12 and 7.", "12 + 7 = 19.", "The answer is 19.")),
        cand("b", steps=("12 + 7 = 20.",)),
        cand("c", steps=("Let's think step by step about the problem.", "The answer is 19.")),
    ]
    per_step = prm.step_scores("What is 12 + 7?", cands)
    assert [len(s) for s in per_step] == [3, 1, 2]
    assert all(0.0 <= p <= 1.0 for s in per_step for p in s)
    # padding must not change a row's scores: batched equals one at a time
    for c, steps in zip(cands, per_step, strict=True):
        assert prm.step_scores("What is 12 + 7?", [c])[0] == pytest.approx(steps, abs=1e-5)
    last = prm.score(None, "What is 12 + 7?", cands)
    assert last == pytest.approx([s[-1] for s in per_step])
    low = PRMVerifier(tiny_prm_dir, reduce="min").score(None, "What is 12 + 7?", cands)
    prod = PRMVerifier(tiny_prm_dir, reduce="prod").score(None, "What is 12 + 7?", cands)
    assert low == pytest.approx([min(s) for s in per_step])
    assert prod == pytest.approx([math.prod(s) for s in per_step])


def test_prm_causal_lm_head(tiny_llama_dir: Path) -> None:
    prm = PRMVerifier(tiny_llama_dir, step_tag=" ки", good_token="+", bad_token="-", batch_size=2)
    assert prm.head == "causal_lm"
    ids, positions = prm.inputs("What is 12 + 7?", ["12 + 7 = 19.", "The answer is 19."])
    tag = prm._encode(" ки")
    assert len(positions) == 2 and all(ids[p] == tag[-1] for p in positions)
    scores = prm.score(None, "What is 12 + 7?", [cand("x", steps=("12 + 7 = 19.",)), cand("y"), cand("z")])
    assert len(scores) == 3 and all(0.0 <= s <= 1.0 for s in scores)
    with pytest.raises(ValueError, match="distinct tokens"):
        PRMVerifier(tiny_llama_dir, good_token="+", bad_token="+")


# --------------------------------------------------------------------------------------------------
# backend: hidden-state embedder
# --------------------------------------------------------------------------------------------------


def test_embed_nodes_matches_a_full_forward(backend: HFBackend, tiny_llama_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    root = backend.prefill(backend.encode("What is 12 + 7? Let's think step by step."))
    kids = backend.fork(root, 3)
    backend.release([root])
    backend.extend(kids, DecodeParams(temperature=1.0, max_tokens=5, seed=0))
    probe = backend.encode("\n")
    before = backend.kv_stats()
    states = backend.embed_nodes(kids, probe)
    assert states.shape == (3, backend.model.config.hidden_size)
    after = backend.kv_stats()
    # the probe children are gone; what stays is each node's last sampled token, now computed
    # (it would have been on the node's next use anyway)
    assert after.live_nodes == before.live_nodes
    assert after.bytes_held == before.bytes_held + 3 * backend.kv_token_bytes
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    reference.to(backend.device)
    for kid, state in zip(kids, states, strict=True):
        ids = torch.tensor([backend.tokens(kid) + probe], device=backend.device)
        with torch.inference_mode():
            hidden = reference(input_ids=ids, output_hidden_states=True).hidden_states[-1][0, -1]
        torch.testing.assert_close(state, hidden, atol=1e-4, rtol=1e-4)
    backend.release(kids)


# --------------------------------------------------------------------------------------------------
# the embedded model (slow): every strategy, the examples and the benchmark's JSON
# --------------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "State the final answer to the following arithmetic problem: 4 - 1 - 7 ="
SMALL = {"max_step_tokens": 8, "step_delimiter": "\n", "seed": 0}  # short steps: the loop runs


def run_script(*args: str) -> str:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, *args, "--threads", "1"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Pin torch to one thread for the test: on a shared 2-core machine two OpenMP threads beside a
    busy neighbour make a decode step many times slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_every_strategy_on_the_embedded_model(embedded_dir: Path) -> None:
    backend = HFBackend(embedded_dir)
    strategies = [
        beam_search(width=4, depth=2, verifier="chain_sum", **SMALL),
        dvts(width=4, depth=2, verifier="chain_sum", **SMALL),
        rebase(width=4, depth=2, verifier="step_judge", **SMALL),
        ets(width=4, depth=2, verifier="chain_sum", embedder="hidden", **SMALL),
        tree_of_thoughts(breadth=2, depth=2, n_generate=2, evaluator="vote", **SMALL),
        tree_of_thoughts(n_generate=2, search="dfs", threshold=0.01, max_expansions=3, **SMALL),
    ]
    for strategy in strategies:
        result = Reasoner(strategy, backend=backend).run(QUESTION)
        assert result.branches and result.kv_metric_tokens > 0, strategy.name
        assert result.kv_stats["peak_bytes"] > 0 and result.kv_stats["tokens_reused"] > 0
        if strategy.name != "tree_of_thoughts":  # ToT's two thoughts may both end at once
            assert len(result.kv_per_step) >= 2 and result.search_steps, f"{strategy.name}: the loop ran"
        assert backend.kv_stats().live_nodes == 0


@pytest.mark.slow
def test_examples_run_on_the_embedded_model(embedded_dir: Path) -> None:
    pytest.importorskip("reasoning_gym")
    out = run_script("examples/ets_vs_rebase.py", "--problems", "1", "--width", "4", "--depth", "2")
    assert "rebase" in out and "ets" in out and "clustering + ILP" in out
    out = run_script("examples/tot_game24.py", "--puzzles", "1", "--breadth", "2", "--n-generate", "2")
    assert "solved" in out and "KV metric" in out


@pytest.mark.slow
def test_ets_vs_rebase_benchmark_json(embedded_dir: Path) -> None:
    import json

    pytest.importorskip("reasoning_gym")
    out = run_script(
        "benchmarks/ets_vs_rebase.py",
        *("--widths", "4", "--problems", "1", "--depth", "2", "--max-step-tokens", "16"),
    )
    result = json.loads(out.strip().splitlines()[-1])
    assert result["benchmark"] == "ets_vs_rebase"
    row = result["per_width"]["4"]
    assert set(row["methods"]) == {"beam_search", "dvts", "rebase", "ets"}
    for summary in row["methods"].values():
        assert {"accuracy", "kv_metric_tokens", "peak_kv_bytes", "wall_s", "tokens_computed"} <= set(summary)
    assert {"kv_reduction", "throughput", "accuracy_delta_points", "ets_overhead_share"} <= set(
        row["ets_vs_rebase"]
    )
