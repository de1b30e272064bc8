"""Reasoner = strategy + backend + verifiers: compiles the strategy and walks its plan.

Why the executor lives here: `strategies` only describes (no torch), `backends` only executes tree
ops (no strategy imports); this module is the one place that knows both and translates plan nodes
into backend calls over a branch tree.

Tree search on the shared KV tree: every leaf is a backend node whose ancestors' KV is held once and
read by all its descendants. A generate forks each unfinished leaf (n times, or as many times as the
previous select allocated) and decodes all children in one `extend` batch; a select that prunes a
leaf releases it, and the backend frees every ancestor no other leaf still needs at once. Search
selects (beam/DVTS, REBASE, ETS, ToT's DFS) also retire finished leaves: their text and score stay
for the vote, their KV goes. Each run reports ETS's KV metric (per generate, the tokens of all new
candidates plus their unique ancestors, prompt included, summed), the peak bytes actually held, and
tokens computed vs reused.

Per-run settings travel with the run: a backend that supports sessions (`SupportsSessions`) gives
each `run` its own view with this reasoner's `share` and `accel` and its own statistics, so runs on
one backend from several threads never change each other's settings or mix their numbers.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

from branchwise.backends.accel import Accel
from branchwise.backends.base import (
    Accelerated,
    Backend,
    DecodeParams,
    ShareMode,
    StepListener,
    SupportsBranchScores,
    SupportsPromptFork,
    SupportsSessions,
    SupportsVerifySkip,
    check_share,
)
from branchwise.backends.cancel import Cancellable
from branchwise.backends.scheduler import Scheduler
from branchwise.constraints import Constraint, OutputError
from branchwise.reasoners.answers import extract_answer, majority_vote
from branchwise.reasoners.batching import BATCH_ROWS, DecodeProgress, run_threads
from branchwise.reasoners.registry import check_names
from branchwise.reasoners.result import Branch, ReasoningResult, TreeNode, kv_budget_notes
from branchwise.reasoners.search import kv_size_per_step
from branchwise.reasoners.search.tree import search_select
from branchwise.reasoners.state import Leaf, RunState
from branchwise.reasoners.typed import Typed
from branchwise.reasoners.verifiers import Candidate, Verifier, default_verifiers
from branchwise.strategies import (
    ALLOCATING_METHODS,
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

    from branchwise.reasoners.search import Embedder


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
        embedder: Embedder | None = None,
        history: Sequence[dict[str, str]] | None = None,
        tools: Sequence[Any] | None = None,
        tool_choice: Any = "auto",
        parallel_tool_calls: bool = True,
        response_format: Any = None,
    ) -> None:
        """Typed answers and actions: with `tools` (OpenAI function tools, Python functions or
        pydantic models) the model is shown them and every answer-generating step decodes under
        their grammar, so each branch ends in valid calls (or, with `tool_choice="auto"`, prose);
        with `response_format` (a pydantic model class, a JSON Schema, OpenAI's response_format or
        a `Constraint`) each branch writes a value of that type. Votes then compare values and
        canonical calls, and the result carries the winner as `value` / `tool_calls` (see `typed.py`).

        `embedder` replaces the text embedder of ETS selects with `embedder="minilm"` (any
        `Embedder`: texts -> rows); by default the packaged all-MiniLM-L6-v2 is loaded on first use.

        `history` is chat turns (role/content dicts) placed between the system prompt and the
        question, e.g. few-shot demonstrations as real user/assistant turns: small models copy a
        demonstrated reply far more reliably than one described in the system text."""
        self.share: ShareMode = check_share(share)  # before a default backend loads a model
        self.strategy = strategy
        self.plan: Plan = strategy.compile()
        if backend is None:  # the process's embedded model, shared with other front ends
            from branchwise.backends.hf.registry import shared_backend

            backend = shared_backend()
        self.backend = backend
        self.verifiers = {**default_verifiers(), **(verifiers or {})}
        check_names(strategy, self.verifiers)
        self.system_prompt = system_prompt
        self.prompt_template = prompt_template
        self.accel = accel
        self.embedder = embedder
        self.history = [dict(m) for m in history or []]
        self.typed = Typed.build(
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
            response_format=response_format,
        )
        bad = [m for m in self.history if set(m) != {"role", "content"}]
        if bad:
            raise ValueError(f"history turns must be role/content dicts; got {bad[0]!r}")

    # ------------------------------------------------------------------ public
    def run(
        self,
        question: str,
        variants: Sequence[str] | None = None,
        *,
        cancel: threading.Event | None = None,
    ) -> ReasoningResult:
        """Answer one question with the strategy; every node is released even if a step raises.

        Setting `cancel` (from another thread: a server whose client left, a deadline) stops the run
        within one decode step on the local backend, releases its nodes and raises `Cancelled`.

        `variants` are alternative phrasings of the question: the first generate step gives branch i
        the phrasing `variants[i % len(variants)]` (diverse-phrasing self-consistency). Token-exact
        sharing then reuses only their common prefix; with ASKS on, similar phrasings reuse the
        question's whole KV (RKSC §4.1).
        """
        if variants is not None and not variants:
            raise ValueError("variants must hold at least 1 phrasing (or be None)")
        return self._run(question, self._messages(question), list(variants or []), cancel=cancel)

    async def arun(self, question: str, variants: Sequence[str] | None = None) -> ReasoningResult:
        """`run` from async code: the run goes to a worker thread, so the event loop stays free and
        concurrent `arun`s (``asyncio.gather``) proceed side by side, each in its own session."""
        return await asyncio.to_thread(self.run, question, variants)

    def _messages(self, question: str) -> list[dict[str, str]]:
        messages = [] if self.system_prompt is None else [{"role": "system", "content": self.system_prompt}]
        messages += [dict(m) for m in self.history]
        content = self.prompt_template(question) if self.prompt_template else question
        messages.append({"role": "user", "content": content})
        return messages

    def _tools(self) -> list[dict[str, Any]] | None:
        return self.typed.tools if self.typed is not None else None

    def _answer_constraint(self, node: GenerateNode) -> Constraint | None:
        """The reasoner's typed output constrains the steps that write an answer, not the steps of
        a step search (a reasoning step is prose; the answer it leads to is typed)."""
        return self.typed.constraint if self.typed is not None and node.until == "answer" else None

    def _session(self) -> tuple[Backend, list[str]]:
        """This run's backend view: its own session (this reasoner's share and accel, its own
        statistics) where the backend has sessions, else the backend itself with its counters reset."""
        if isinstance(self.backend, SupportsSessions):
            return self.backend.session(share=self.share, accel=self.accel), []
        self.backend.reset_stats()
        if self.accel is None:
            return self.backend, []
        return self.backend, [f"accel ignored: backend {self.backend.name!r} runs no accelerations"]

    def _run(
        self,
        question: str,
        messages: list[dict[str, str]],
        variants: list[str],
        session: Backend | None = None,
        cancel: threading.Event | None = None,
        on_step: StepListener | None = None,
    ) -> ReasoningResult:
        start = time.perf_counter()
        backend, notes = (session, []) if session is not None else self._session()
        if cancel is not None:
            backend = cast(Backend, Cancellable(backend, cancel))
        prompt = backend.chat_prompt(messages, self._tools())
        root = backend.prefill(prompt)
        record = TreeNode(node=root, parent=None, depth=0, text="", token_ids=list(prompt))
        run = RunState(
            variants=variants,
            question=question,
            leaves=[Leaf(node=root, record=record)],
            tree={root: record},
            timings={},
            notes=notes,
            backend=backend,
            on_step=on_step,
        )
        try:
            self._execute(self.plan.steps, run)
            stats = backend.kv_stats().as_dict()
        finally:
            live = [leaf.node for leaf in run.leaves if not leaf.retired]
            if live:
                backend.release(live)
        run.timings["total"] = time.perf_counter() - start
        return self._result(run, stats)

    def batch(self, questions: Iterable[str], *, progress: bool = True) -> list[ReasoningResult]:
        """Run several questions together: each runs its plan in its own thread and session, and
        their generate steps decode through one `Scheduler`, so the branches of every question that
        is generating decode as one batch (a question that reaches its next step while others
        decode joins them at a step boundary), within the backend's KV budget. Each result keeps
        its own tree, notes and KV statistics (its share of the batched work: `batch_*` in
        `kv_stats`). Greedy tokens equal a serial run's; sampled ones share one random stream per
        batch, so they differ from a serial run with the same seed.

        One after the other instead (and said so in the notes) where the backend has no sessions or
        accelerations are on (their plug-ins keep per-run state that one shared batch cannot).
        `progress` shows a bar of the tokens decoded and the branches decoding (`DecodeProgress`).
        """
        items = list(questions)
        serial_note = None
        with DecodeProgress(len(items), disable=not progress) as bar:
            if len(items) > 1 and isinstance(self.backend, SupportsSessions):
                sessions = [self.backend.session(share=self.share, accel=self.accel) for _ in items]
                if all(getattr(s, "accel", None) in (None, Accel()) for s in sessions):
                    return self._batched(items, sessions, bar)
                serial_note = (
                    "batch: accelerations keep per-run state, so the questions ran one after another"
                )
            results = [self._counted(bar, q, on_step=bar) for q in items]
        for r in results:
            r.notes += [serial_note] if serial_note else []
        return results

    def _counted(self, bar: DecodeProgress, question: str, **run: Any) -> ReasoningResult:
        result = self._run(question, self._messages(question), [], **run)
        bar.answered_one()
        return result

    def _batched(
        self, items: list[str], sessions: list[Backend], bar: DecodeProgress
    ) -> list[ReasoningResult]:
        assert isinstance(self.backend, SupportsSessions)
        merged = self.backend.session(share=self.share, accel=Accel())
        scheduler = Scheduler(
            merged, max_rows=BATCH_ROWS, window_s=0.005, batch_seeded=True, name="branchwise-reasoner-batch"
        )
        views = [scheduler.view(s) for s in sessions]
        try:
            return run_threads(
                [
                    functools.partial(self._counted, bar, q, session=view, on_step=bar)
                    for q, view in zip(items, views, strict=True)
                ]
            )
        finally:
            scheduler.close(timeout=60)

    # ------------------------------------------------------------------ executor
    def _execute(self, steps: Sequence[OpStep | LoopStep], run: RunState) -> None:
        for step in steps:
            if isinstance(step, LoopStep):
                for _ in range(step.node.max_iterations):
                    if step.node.until == "all_finished" and all(leaf.finished for leaf in run.leaves):
                        break
                    if run.exhausted:  # a search select found nothing left to expand
                        break
                    self._execute(step.body, run)
                run.allocation, run.exhausted = None, False
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
    def _timed(self, run: RunState, key: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            run.timings[key] = run.timings.get(key, 0.0) + time.perf_counter() - t0

    def _generate(self, node: GenerateNode, run: RunState) -> None:
        backend = run.backend
        params = DecodeParams(
            temperature=node.temperature,
            top_p=node.top_p,
            max_tokens=node.max_tokens,
            min_tokens=node.min_tokens,
            stop=tuple(node.stop),
            step_delimiter=node.step_delimiter if node.until == "step" else None,
            seed=node.seed,
            constraint=node.response_format or self._answer_constraint(node),
        )
        if params.constraint is not None and node.until == "answer":
            run.typed = self.typed if node.response_format is None else Typed(node.response_format)
        allocation, run.allocation = run.allocation, None
        expand: list[tuple[Leaf, int]] = []
        keep: list[Leaf] = []
        for leaf in run.leaves:
            n = node.n
            if allocation is not None:  # the previous select chose per-leaf counts (see GenerateNode)
                chosen = allocation.get(leaf.node, 0)
                n = node.n if chosen is None else chosen
            if leaf.finished or leaf.retired or n <= 0:
                keep.append(leaf)  # finished, or parked (a DFS frontier)
            else:
                expand.append((leaf, n))
        children: list[tuple[Leaf, int]] = []
        for leaf, n in expand:
            if run.variants and leaf.record.parent is None and isinstance(backend, SupportsPromptFork):
                prompts = [
                    backend.chat_prompt(self._messages(run.variants[i % len(run.variants)]), self._tools())
                    for i in range(n)
                ]
                kids = backend.fork_prompts(leaf.node, prompts, share=self.share)
            else:
                kids = backend.fork(leaf.node, n, share=self.share)
            children += [(leaf, child) for child in kids]
        # the parents stay alive in the backend while their children need their KV
        if expand:
            backend.release([leaf.node for leaf, _ in expand])
        run.leaves = keep
        try:
            listen = {} if run.on_step is None else {"on_step": run.on_step}  # a progress display's
            gens = backend.extend([c for _, c in children], params, **listen) if children else []
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
                Leaf(
                    node=gen.node,
                    record=record,
                    text=parent.text + gen.text,
                    top1=parent.top1 + gen.top1_probs,
                    logprobs=parent.logprobs + gen.logprobs,
                    n_tokens=parent.n_tokens + len(gen.token_ids),
                    # a step cut by its token cap (or the decode gate) is a long step, not an ended
                    # trajectory: only EOS or a stop string end a branch under until="step"
                    finished=node.until == "answer" or gen.finish_reason in ("eos", "stop"),
                    steps=(*parent.steps, gen.text),
                    group=parent.group,
                )
            )
        if gens:
            run.kv_per_step.append(self._kv_metric_step(run, [gen.node for gen in gens]))

    @staticmethod
    def _kv_metric_step(run: RunState, candidates: Sequence[int]) -> int:
        """ETS's KV term for one step: the candidates' tokens plus their unique ancestors' (prompt too)."""
        tree = [(t.node, t.parent, len(t.token_ids)) for t in run.tree.values()]
        return kv_size_per_step([tree], [list(candidates)])[0]

    def _candidates(self, leaves: Sequence[Leaf], extractor: str = "auto") -> list[Candidate]:
        return [
            Candidate(
                node=leaf.node,
                text=leaf.text,
                answer=extract_answer(leaf.text, extractor),
                top1_probs=leaf.top1,
                logprobs=leaf.logprobs,
                steps=leaf.steps,
                finished=leaf.finished,
            )
            for leaf in leaves
        ]

    def _score(self, node: ScoreNode, run: RunState) -> None:
        """Score the leaves this verifier has not scored yet.

        A leaf carried over unchanged (finished, or a parked DFS state) keeps the score it already
        has from this verifier, so a step-level search does not pay the verifier again for it; a
        retired leaf (KV released) cannot be read by a new verifier and keeps its last score.
        """
        backend = run.backend
        name = node.verifier
        todo: list[Leaf] = []
        for leaf in run.leaves:
            if name in leaf.scores:
                leaf.score = leaf.scores[name]
            elif leaf.retired:
                note = f"score {node.id!r}: retired (finished, KV released) branches keep their earlier score"
                if note not in run.notes:
                    run.notes.append(note)
            else:
                todo.append(leaf)
        if not todo:
            return
        run.verify_calls += 1
        if isinstance(backend, SupportsVerifySkip):
            confidences = [sum(leaf.top1) / len(leaf.top1) if leaf.top1 else 0.0 for leaf in todo]
            if backend.skip_verify(confidences):
                # CGEE level 1 (RKSC Eq. 4): rank by generation confidence, no verify pass
                run.verify_skipped += 1
                self._set_scores(todo, "confidence", confidences)
                return
        verifier = self.verifiers[name]
        scores = list(verifier.score(backend, run.question, self._candidates(todo)))
        fallbacks = getattr(verifier, "notes", None)
        if isinstance(fallbacks, list):  # a verifier that fell back (e.g. ToT vote -> uniform) says so
            for note in fallbacks:
                if note not in run.notes:
                    run.notes.append(note)
            fallbacks.clear()
        if len(scores) != len(todo):
            raise ValueError(
                f"verifier {name!r} ({type(verifier).__name__}) returned {len(scores)} scores for "
                f"{len(todo)} candidates; a verifier must return exactly one score per candidate"
            )
        self._set_scores(todo, name, scores)
        if isinstance(backend, SupportsBranchScores):  # RSBCM keeps the blocks of better branches longer
            backend.set_scores([leaf.node for leaf in todo], scores)

    @staticmethod
    def _set_scores(leaves: Sequence[Leaf], name: str, scores: Sequence[float]) -> None:
        for leaf, s in zip(leaves, scores, strict=True):
            leaf.score = float(s)
            leaf.scores[name] = float(s)
            leaf.record.scores[name] = float(s)

    def _select(self, node: SelectNode, run: RunState) -> None:
        unscored = [leaf for leaf in run.leaves if leaf.score is None]
        if unscored:
            raise RuntimeError(f"select {node.id!r} reached {len(unscored)} unscored branches")
        if node.method in ALLOCATING_METHODS:
            search_select(node, run, self.embedder)
            return
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
            run.backend.release([leaf.node for leaf in dropped])
        run.leaves = [leaf for leaf in run.leaves if leaf.node in kept_ids]

    # ------------------------------------------------------------------ aggregation
    def _aggregate(self, node: AggregateNode, run: RunState) -> None:
        voters = run.leaves
        if node.finished_only:
            done = [leaf for leaf in run.leaves if leaf.finished]
            if done:
                voters = done
            elif run.leaves:
                run.notes.append(f"aggregate {node.id!r}: no branch finished; voted over all of them")
        if run.typed is not None:  # typed output votes on values and canonical calls
            answers = [run.typed.key(leaf.text) for leaf in voters]
        else:
            answers = [extract_answer(leaf.text, node.extractor) for leaf in voters]
        if node.method == "best_score":
            best = max(range(len(voters)), key=lambda i: voters[i].score or 0.0, default=None)
            run.answer = answers[best] if best is not None else None
            run.winners = {voters[best].node} if best is not None else set()
            weights = [leaf.score or 0.0 for leaf in voters]
        else:
            weights = None
            if node.method == "weighted_majority":
                weights = [
                    leaf.score
                    if leaf.score is not None
                    else (sum(leaf.top1) / len(leaf.top1) if leaf.top1 else 0.0)
                    for leaf in voters
                ]
            vote = majority_vote(answers, weights)
            run.answer = vote.answer
            run.winners = {
                leaf.node
                for leaf, a in zip(voters, answers, strict=True)
                if a is not None and a == vote.answer
            }
        vote = majority_vote(answers, weights)
        run.votes, run.support = dict(vote.counts), vote.support
        ranked = sorted(vote.counts, key=lambda a: -vote.counts[a])
        run.runner_up = next((a for a in ranked if a != run.answer), None)
        if node.method == "best_score" and run.answer is not None:
            total = sum(vote.counts.values())
            run.support = vote.counts.get(run.answer, 0.0) / total if total else 0.0

    def _result(self, run: RunState, stats: dict[str, float]) -> ReasoningResult:
        if isinstance(run.backend, Accelerated):
            # an acceleration that was on but never acted says so (each config words its notes), so a
            # result never implies a speed-up it did not get
            run.notes += run.backend.accel.notes(stats)
        run.notes += kv_budget_notes(stats)
        key = run.typed.key if run.typed is not None else extract_answer
        value, calls = self._typed_answer(run)
        branches = [
            Branch(
                node=leaf.node,
                text=leaf.text,
                answer=key(leaf.text),
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
            runner_up=run.runner_up,
            value=value,
            tool_calls=calls,
            branches=branches,
            tree=list(run.tree.values()),
            timings=run.timings,
            kv_stats=stats,
            notes=run.notes,
            verify_calls=run.verify_calls,
            verify_skipped=run.verify_skipped,
            kv_metric_tokens=sum(run.kv_per_step),
            kv_per_step=run.kv_per_step,
            search_steps=run.search,
        )

    def _typed_answer(self, run: RunState) -> tuple[Any, list[Any]]:
        """The winning branch's typed value and tool calls (None / [] without typed output)."""
        typed = run.typed
        if typed is None or not run.winners:
            return None, []
        winner = next(leaf for leaf in run.leaves if leaf.node in run.winners)
        calls = typed.calls(winner.text)
        try:
            value = calls if typed.constraint.kind == "tool_calls" else typed.value(winner.text)
        except (OutputError, ValueError) as err:
            run.notes.append(f"the winning branch holds no valid typed value ({err})")
            value = None
        return value, calls
