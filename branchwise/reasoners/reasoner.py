"""Reasoner = strategy + backend + verifiers: compiles the strategy and walks its plan.

Why the executor lives here: `strategies` only describes (no torch), `backends` only executes tree
ops (no strategy imports); this module is the one place that knows both and translates plan nodes
into backend calls over a branch tree (DESIGN §3).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from branchwise.backends.accel import Accel
from branchwise.backends.base import Backend, DecodeParams, ShareMode
from branchwise.backends.hf.cgee import verify_skip
from branchwise.reasoners.answers import extract_answer, majority_vote
from branchwise.reasoners.result import Branch, ReasoningResult, TreeNode
from branchwise.reasoners.verifiers import Candidate, Verifier, default_verifiers
from branchwise.strategies import (
    AggregateNode,
    GenerateNode,
    LoopStep,
    OpStep,
    Plan,
    ScoreNode,
    SelectNode,
    Strategy,
)

if TYPE_CHECKING:
    from collections.abc import Iterator


@dataclass
class _Leaf:
    """A live branch during execution: its backend node and everything generated on its path."""

    node: int
    record: TreeNode
    text: str = ""
    top1: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    n_tokens: int = 0
    finished: bool = False
    score: float | None = None
    scores: dict[str, float] = field(default_factory=dict)


@dataclass
class _Run:
    """Mutable state of one `Reasoner.run`."""

    question: str
    leaves: list[_Leaf]
    variants: list[str]
    tree: dict[int, TreeNode]
    timings: dict[str, float]
    notes: list[str]
    answer: str | None = None
    verify_calls: int = 0
    verify_skipped: int = 0
    votes: dict[str, float] = field(default_factory=dict)
    support: float = 0.0
    winners: set[int] = field(default_factory=set)


class Reasoner:
    """Run a reasoning strategy on a backend.

    >>> reasoner = Reasoner(self_consistency(n=8), backend=HFBackend(), share="exact")  # doctest: +SKIP
    >>> reasoner.run("What is 12 + 7?").answer  # doctest: +SKIP
    """

    def __init__(
        self,
        strategy: Strategy,
        backend: Backend | None = None,
        *,
        share: ShareMode = "exact",
        verifiers: dict[str, Verifier] | None = None,
        system_prompt: str | None = None,
        prompt_template: Callable[[str], str] | None = None,
        accel: Accel | None = None,
    ) -> None:
        if share not in ("none", "exact"):
            raise ValueError(f"share={share!r} is not one of 'none', 'exact'")
        self.strategy = strategy
        self.plan: Plan = strategy.compile()
        if backend is None:
            from branchwise.backends.hf import HFBackend

            backend = HFBackend()
        self.backend = backend
        self.share: ShareMode = share
        self.verifiers = {**default_verifiers(), **(verifiers or {})}
        missing = {n.verifier for n in self.plan.nodes() if isinstance(n, ScoreNode)} - set(self.verifiers)
        if missing:
            raise ValueError(f"strategy uses verifier(s) {sorted(missing)}; known: {sorted(self.verifiers)}")
        self.system_prompt = system_prompt
        self.prompt_template = prompt_template
        self.accel = accel

    # ------------------------------------------------------------------ public
    def run(self, question: str, variants: Sequence[str] | None = None) -> ReasoningResult:
        """Answer one question with the strategy; every node is released even if a step raises.

        `variants` are alternative phrasings of the question: the first generate step gives branch i
        the phrasing `variants[i % len(variants)]` (diverse-phrasing self-consistency). Token-exact
        sharing then reuses only their common prefix; with ASKS on, similar phrasings reuse the
        question's whole KV (RKSC §4.1).
        """
        if variants is not None and not variants:
            raise ValueError("variants must hold at least 1 phrasing (or be None)")
        with self._accelerated():
            return self._run(question, self._messages(question), list(variants or []))

    def _messages(self, question: str) -> list[dict[str, str]]:
        messages = [] if self.system_prompt is None else [{"role": "system", "content": self.system_prompt}]
        content = self.prompt_template(question) if self.prompt_template else question
        messages.append({"role": "user", "content": content})
        return messages

    @contextmanager
    def _accelerated(self) -> Iterator[None]:
        """Apply this reasoner's `accel` to the backend for one run (None keeps the backend's own)."""
        if self.accel is None or not hasattr(self.backend, "accel"):
            yield
            return
        previous = self.backend.accel
        self.backend.accel = self.accel
        try:
            yield
        finally:
            self.backend.accel = previous

    def _run(self, question: str, messages: list[dict[str, str]], variants: list[str]) -> ReasoningResult:
        backend = self.backend
        backend.reset_stats()
        start = time.perf_counter()
        prompt = backend.chat_prompt(messages)
        root = backend.prefill(prompt)
        record = TreeNode(node=root, parent=None, depth=0, text="", token_ids=list(prompt))
        run = _Run(
            variants=variants,
            question=question,
            leaves=[_Leaf(node=root, record=record)],
            tree={root: record},
            timings={},
            notes=[],
        )
        try:
            self._execute(self.plan.steps, run)
            stats = backend.kv_stats().as_dict()
        finally:
            live = [leaf.node for leaf in run.leaves]
            if live:
                backend.release(live)
        run.timings["total"] = time.perf_counter() - start
        return self._result(run, stats)

    def batch(self, questions: Iterable[str], *, progress: bool = True) -> list[ReasoningResult]:
        """Run several questions (one after the other; each run batches its own branches)."""
        items = list(questions)
        return [self.run(q) for q in tqdm(items, desc="reasoning", disable=not progress)]

    # ------------------------------------------------------------------ executor
    def _execute(self, steps: Sequence[OpStep | LoopStep], run: _Run) -> None:
        for step in steps:
            if isinstance(step, LoopStep):
                for _ in range(step.node.max_iterations):
                    if step.node.until == "all_finished" and all(leaf.finished for leaf in run.leaves):
                        break
                    self._execute(step.body, run)
                continue
            node = step.node
            with self._timed(run, node.kind):
                if isinstance(node, GenerateNode):
                    self._generate(node, run)
                elif isinstance(node, ScoreNode):
                    self._score(node, run)
                elif isinstance(node, SelectNode):
                    self._select(node, run)
                elif isinstance(node, AggregateNode):
                    self._aggregate(node, run)

    @contextmanager
    def _timed(self, run: _Run, key: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            run.timings[key] = run.timings.get(key, 0.0) + time.perf_counter() - t0

    def _generate(self, node: GenerateNode, run: _Run) -> None:
        backend = self.backend
        params = DecodeParams(
            temperature=node.temperature,
            top_p=node.top_p,
            max_tokens=node.max_tokens,
            stop=tuple(node.stop),
            step_delimiter=node.step_delimiter if node.until == "step" else None,
            seed=node.seed,
        )
        expand = [leaf for leaf in run.leaves if not leaf.finished]
        keep = [leaf for leaf in run.leaves if leaf.finished]
        children: list[tuple[_Leaf, int]] = []
        for leaf in expand:
            if run.variants and leaf.record.parent is None and hasattr(backend, "fork_prompts"):
                prompts = [
                    backend.chat_prompt(self._messages(run.variants[i % len(run.variants)]))
                    for i in range(node.n)
                ]
                kids = backend.fork_prompts(leaf.node, prompts, share=self.share)
            else:
                kids = backend.fork(leaf.node, node.n, share=self.share)
            children += [(leaf, child) for child in kids]
        # the parents stay alive in the backend while their children need their KV
        if expand:
            backend.release([leaf.node for leaf in expand])
        run.leaves = keep
        try:
            gens = backend.extend([c for _, c in children], params) if children else []
        except BaseException:
            backend.release([c for _, c in children])
            raise
        for (parent, _), gen in zip(children, gens, strict=True):
            record = TreeNode(
                node=gen.node,
                parent=parent.node,
                depth=parent.record.depth + 1,
                text=gen.text,
                token_ids=gen.token_ids,
                top1_probs=gen.top1_probs,
                logprobs=gen.logprobs,
                finish_reason=gen.finish_reason,
            )
            run.tree[gen.node] = record
            run.leaves.append(
                _Leaf(
                    node=gen.node,
                    record=record,
                    text=parent.text + gen.text,
                    top1=parent.top1 + gen.top1_probs,
                    logprobs=parent.logprobs + gen.logprobs,
                    n_tokens=parent.n_tokens + len(gen.token_ids),
                    finished=node.until == "answer" or gen.finish_reason != "delimiter",
                )
            )

    def _candidates(self, leaves: Sequence[_Leaf], extractor: str = "auto") -> list[Candidate]:
        return [
            Candidate(
                node=leaf.node,
                text=leaf.text,
                answer=extract_answer(leaf.text, extractor),
                top1_probs=leaf.top1,
                logprobs=leaf.logprobs,
            )
            for leaf in leaves
        ]

    def _score(self, node: ScoreNode, run: _Run) -> None:
        cgee = getattr(getattr(self.backend, "accel", None), "cgee", None)
        run.verify_calls += 1
        name = node.verifier
        if cgee is not None and cgee.level1:
            confidences = [sum(leaf.top1) / len(leaf.top1) if leaf.top1 else 0.0 for leaf in run.leaves]
            if verify_skip(confidences, cgee.tau_conf, cgee.r_gap):
                # CGEE level 1 (RKSC Eq. 4): rank by generation confidence, no verify pass
                run.verify_skipped += 1
                self._set_scores(run.leaves, "confidence", confidences)
                return
        verifier = self.verifiers[name]
        scores = verifier.score(self.backend, run.question, self._candidates(run.leaves))
        self._set_scores(run.leaves, name, scores)
        if hasattr(self.backend, "set_scores"):  # RSBCM keeps the blocks of better branches longer
            self.backend.set_scores([leaf.node for leaf in run.leaves], scores)

    @staticmethod
    def _set_scores(leaves: Sequence[_Leaf], name: str, scores: Sequence[float]) -> None:
        for leaf, s in zip(leaves, scores, strict=True):
            leaf.score = float(s)
            leaf.scores[name] = float(s)
            leaf.record.scores[name] = float(s)

    def _select(self, node: SelectNode, run: _Run) -> None:
        unscored = [leaf for leaf in run.leaves if leaf.score is None]
        if unscored:
            raise RuntimeError(f"select {node.id!r} reached {len(unscored)} unscored branches")
        ranked = sorted(run.leaves, key=lambda leaf: -(leaf.score or 0.0))
        if node.method == "top_k":
            kept = ranked[: node.k]
        else:
            kept = [leaf for leaf in ranked if (leaf.score or 0.0) >= (node.threshold or 0.0)]
            if not kept and ranked:
                kept = ranked[:1]
                run.notes.append(f"select {node.id!r}: no branch reached the threshold; kept the best one")
        kept_ids = {leaf.node for leaf in kept}
        dropped = [leaf for leaf in run.leaves if leaf.node not in kept_ids]
        for leaf in dropped:
            leaf.record.pruned = True
        if dropped:
            self.backend.release([leaf.node for leaf in dropped])
        run.leaves = [leaf for leaf in run.leaves if leaf.node in kept_ids]

    def _aggregate(self, node: AggregateNode, run: _Run) -> None:
        answers = [extract_answer(leaf.text, node.extractor) for leaf in run.leaves]
        if node.method == "best_score":
            best = max(range(len(run.leaves)), key=lambda i: run.leaves[i].score or 0.0, default=None)
            run.answer = answers[best] if best is not None else None
            run.winners = {run.leaves[best].node} if best is not None else set()
            weights = [leaf.score or 0.0 for leaf in run.leaves]
        else:
            weights = None
            if node.method == "weighted_majority":
                weights = [
                    leaf.score
                    if leaf.score is not None
                    else (sum(leaf.top1) / len(leaf.top1) if leaf.top1 else 0.0)
                    for leaf in run.leaves
                ]
            vote = majority_vote(answers, weights)
            run.answer = vote.answer
            run.winners = {
                leaf.node
                for leaf, a in zip(run.leaves, answers, strict=True)
                if a is not None and a == vote.answer
            }
        vote = majority_vote(answers, weights)
        run.votes, run.support = dict(vote.counts), vote.support
        if node.method == "best_score" and run.answer is not None:
            total = sum(vote.counts.values())
            run.support = vote.counts.get(run.answer, 0.0) / total if total else 0.0

    def _result(self, run: _Run, stats: dict[str, float]) -> ReasoningResult:
        branches = [
            Branch(
                node=leaf.node,
                text=leaf.text,
                answer=extract_answer(leaf.text),
                n_tokens=leaf.n_tokens,
                confidence=sum(leaf.top1) / len(leaf.top1) if leaf.top1 else 0.0,
                mean_logprob=sum(leaf.logprobs) / len(leaf.logprobs) if leaf.logprobs else 0.0,
                finish_reason=leaf.record.finish_reason or "none",
                scores=dict(leaf.scores),
                selected=leaf.node in run.winners,
            )
            for leaf in run.leaves
        ]
        return ReasoningResult(
            question=run.question,
            answer=run.answer,
            strategy=self.strategy.name,
            share=self.share,
            votes=run.votes,
            support=run.support,
            branches=branches,
            tree=list(run.tree.values()),
            timings=run.timings,
            kv_stats=stats,
            notes=run.notes,
            verify_calls=run.verify_calls,
            verify_skipped=run.verify_skipped,
        )
