"""Verifiers: how a score node turns a branch into a number in [0, 1].

Why an interface: score nodes name a verifier (`"judge"`, `"confidence"`, ...) so strategies stay
serialisable; the reasoner resolves the name here. An LM-as-judge, a confidence signal, an exact
outcome checker and (for hub users) a PRM head all fit the same `score()` call.

Known by name in every reasoner (`default_verifiers`): `judge`, `confidence`, `logprob`,
`step_judge` (LM-as-judge process reward), `arithmetic` and `chain_sum` (programmatic step checkers),
`tot_value` and `tot_vote` (Tree-of-Thoughts evaluators). Built per task and passed in:
`ReasoningGymVerifier` (reasoning-gym's `score_answer`), `Game24Verifier`, `OutcomeVerifier` (any
checker), `PRMVerifier` (an HF PRM head).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal, Protocol, runtime_checkable

from branchwise.backends.base import Backend, NodeId
from branchwise.backends.scores import judge_score
from branchwise.reasoners.answers import answer_tag
from branchwise.reasoners.tasks import (
    chain_sum_terms,
    check_game24,
    equations,
    extract_expression,
    game24_numbers,
    running_totals,
)


@dataclass(frozen=True)
class Candidate:
    """What a verifier sees of a branch: its backend node, full text and the extracted answer.

    Step-level verifiers also get the branch's steps (the text each generate node added, root
    first) and whether the branch finished: a process reward scores ``step`` in the context of
    ``text``, an outcome checker can only judge a finished branch.
    """

    node: NodeId
    text: str
    answer: str | None
    top1_probs: Sequence[float]
    logprobs: Sequence[float]
    steps: tuple[str, ...] = ()
    finished: bool = True

    @property
    def step(self) -> str:
        """The last step (the text of the most recent generate), or the whole text without steps."""
        return self.steps[-1] if self.steps else self.text


@runtime_checkable
class Verifier(Protocol):
    """Scores candidates of one question; higher is better, in [0, 1]."""

    name: str

    def score(self, backend: Backend, question: str, candidates: Sequence[Candidate]) -> list[float]: ...


class ConfidenceVerifier:
    """Mean top-1 probability of the branch's own tokens (RKSC Eq. 3): free, no extra forward pass."""

    name = "confidence"

    def score(self, backend: Backend, question: str, candidates: Sequence[Candidate]) -> list[float]:
        return [sum(c.top1_probs) / len(c.top1_probs) if c.top1_probs else 0.0 for c in candidates]


class LogprobVerifier:
    """exp(mean log-probability) of the branch's tokens: the sequence's per-token likelihood."""

    name = "logprob"

    def score(self, backend: Backend, question: str, candidates: Sequence[Candidate]) -> list[float]:
        return [math.exp(sum(c.logprobs) / len(c.logprobs)) if c.logprobs else 0.0 for c in candidates]


class JudgeVerifier:
    """LM-as-judge on the same backend: P(Yes) / (P(Yes) + P(No)) after a judge question.

    The question is appended to each branch's own node, so the judge pass reads the prompt and the
    branch's KV instead of recomputing them; all candidates are scored in one batched pass.
    """

    name = "judge"

    def __init__(self, question: str = "\n\nIs the answer above correct? Reply Yes or No.\nReply:") -> None:
        self.question = question

    def probe(self, backend: Backend) -> tuple[list[int], list[int], int]:
        """The judge suffix, the candidate tokens ([yes spellings…, no spellings…]) and how many are yes."""
        yes = _first_tokens(backend, ["Yes", " Yes", "yes", " yes"])
        no = [t for t in _first_tokens(backend, ["No", " No", "no", " no"]) if t not in yes]
        return backend.encode(self.question), yes + no, len(yes)

    def score(self, backend: Backend, question: str, candidates: Sequence[Candidate]) -> list[float]:
        if not candidates:
            return []
        suffix, tokens, n_yes = self.probe(backend)
        probs = backend.score_next([c.node for c in candidates], suffix, tokens)
        return [judge_score(p, n_yes) for p in probs]


class StepJudgeVerifier(JudgeVerifier):
    """LM-as-judge step scorer: P(Yes) for "is the last step correct?" after the branch so far.

    The process reward of tree search when no trained PRM is at hand (ETS App. A suggests using an
    instruction-tuned model this way). Like the answer judge, the question is appended to the
    branch's own node, so the prompt and all earlier steps are read from the shared KV.
    """

    name = "step_judge"

    def __init__(
        self, question: str = "\n\nIs the last step above correct and useful? Reply Yes or No.\nReply:"
    ) -> None:
        super().__init__(question)


class OutcomeVerifier:
    """An exact outcome checker: ``check(question, answer, text) -> score in [0, 1]``.

    Only a finished branch has an outcome; unfinished ones get ``unfinished`` (neutral by default),
    so the same verifier can sit in a step-level search and in best-of-n.
    """

    def __init__(
        self,
        check: Callable[[str, str | None, str], float],
        *,
        name: str = "outcome",
        unfinished: float = 0.5,
    ) -> None:
        if not 0.0 <= unfinished <= 1.0:
            raise ValueError(f"unfinished must be in [0, 1], got {unfinished}")
        self.check = check
        self.name = name
        self.unfinished = unfinished

    def score(self, backend: Backend, question: str, candidates: Sequence[Candidate]) -> list[float]:
        return [
            float(self.check(question, c.answer, c.text)) if c.finished else self.unfinished
            for c in candidates
        ]


class ReasoningGymVerifier(OutcomeVerifier):
    """reasoning-gym's own exact checker (``dataset.score_answer``) for the dataset's questions.

    The entry is looked up by the question text the reasoner was run with, so one verifier serves
    every problem of the dataset. The answer is the last ``<answer>...</answer>`` tag when the branch
    wrote one (reasoning-gym's format), else the reasoner's extracted answer.
    """

    def __init__(self, dataset: Any, *, name: str = "reasoning_gym", unfinished: float = 0.5) -> None:
        self.dataset = dataset
        self.entries = {entry["question"]: entry for entry in dataset}
        super().__init__(self._check, name=name, unfinished=unfinished)

    def _check(self, question: str, answer: str | None, text: str) -> float:
        entry = self.entries.get(question)
        if entry is None:
            raise KeyError("question is not one of this reasoning-gym dataset's questions")
        given = answer_tag(text) or answer
        if given is None:
            return 0.0
        return float(self.dataset.score_answer(given, entry))


class Game24Verifier(OutcomeVerifier):
    """Game of 24: the final expression uses the puzzle's four numbers once each and equals 24."""

    def __init__(self, *, name: str = "game24", unfinished: float = 0.5) -> None:
        super().__init__(self._check, name=name, unfinished=unfinished)

    @staticmethod
    def _check(question: str, answer: str | None, text: str) -> float:
        return float(check_game24(game24_numbers(question), extract_expression(text)))


class ArithmeticStepVerifier:
    """Programmatic step checker: the share of ``lhs = value`` equations in the last step that hold.

    Exact (fractions), free, and task-agnostic for arithmetic word problems; a step without any
    equation gets ``neutral``. ``tie_break`` mixes in the branch's mean top-1 probability so equally
    checked steps are still ranked (REBASE's softmax needs distinct rewards to prefer anything).
    """

    name = "arithmetic"

    def __init__(self, neutral: float = 0.5, tie_break: float = 0.1) -> None:
        self.neutral = neutral
        self.tie_break = tie_break

    def _step_score(self, question: str, candidate: Candidate) -> float:
        found = [(claimed, exact) for _, claimed, exact in equations(candidate.step) if exact is not None]
        if not found:
            return self.neutral
        return sum(claimed == exact for claimed, exact in found) / len(found)

    def score(self, backend: Backend, question: str, candidates: Sequence[Candidate]) -> list[float]:
        out = []
        for c in candidates:
            confidence = sum(c.top1_probs) / len(c.top1_probs) if c.top1_probs else 0.0
            out.append((1.0 - self.tie_break) * self._step_score(question, c) + self.tie_break * confidence)
        return out


class ChainSumStepVerifier(ArithmeticStepVerifier):
    """Step checker for reasoning-gym ``chain_sum``: equations must be right *and* on the chain.

    The problem's terms are parsed from the question; a step's equations score when they hold and
    their result is one of the running totals the chain passes through (so "4 - 1 = 3" is on track
    for "4 - 1 - 7", "4 + 7 = 11" is not). A finished branch is scored by its final answer against the
    chain's value. Everything is computed from the question alone — a cheap, exact process reward
    for search on small models, not a learned one.
    """

    name = "chain_sum"

    def _step_score(self, question: str, candidate: Candidate) -> float:
        terms = chain_sum_terms(question)
        if not terms or len(terms) < 2:
            return super()._step_score(question, candidate)
        totals = running_totals(terms)
        if candidate.finished:
            given = answer_tag(candidate.text) or candidate.answer
            if given is not None:
                try:
                    return float(Fraction(given.replace(",", "")) == totals[-1])
                except (ValueError, ZeroDivisionError):
                    return 0.0
        found = [(claimed, exact) for _, claimed, exact in equations(candidate.step) if exact is not None]
        if not found:
            return self.neutral
        return sum(claimed == exact and claimed in totals for claimed, exact in found) / len(found)


#: Tree of Thoughts' value scale (sure 20, likely 1, impossible 0.001), divided by 20 to lie in [0, 1].
TOT_VALUES: dict[str, float] = {"sure": 1.0, "likely": 0.05, "impossible": 0.00005}


class ToTValueVerifier:
    """Tree-of-Thoughts value evaluator: expected value of the judge's sure/likely/impossible verdict.

    ToT samples the value prompt several times and sums the mapped verdicts; reading the next-token
    probabilities of the three labels after the prompt gives that expectation in one batched pass,
    on the branch's own KV (the prompt is appended to each branch, as for the judge). Pass a
    task-specific ``prompt`` (for Game of 24: can the numbers left still reach 24?).
    """

    name = "tot_value"

    def __init__(
        self,
        prompt: str = (
            "\n\nEvaluate the partial solution above: can it still reach a correct final answer? "
            "Reply with one word: sure, likely or impossible.\nEvaluation:"
        ),
        values: dict[str, float] | None = None,
    ) -> None:
        self.prompt = prompt
        self.values = dict(values or TOT_VALUES)
        if not self.values:
            raise ValueError("values must name at least one label")

    def score(self, backend: Backend, question: str, candidates: Sequence[Candidate]) -> list[float]:
        if not candidates:
            return []
        tokens: list[int] = []
        owner: list[float] = []
        for label, value in self.values.items():
            spellings = [label, " " + label, label.capitalize(), " " + label.capitalize()]
            for t in _first_tokens(backend, spellings):
                if t not in tokens:  # a token shared by two labels counts for the first only
                    tokens.append(t)
                    owner.append(value)
        probs = backend.score_next([c.node for c in candidates], backend.encode(self.prompt), tokens)
        out = []
        for row in probs:
            mass = sum(row)
            out.append(sum(p * v for p, v in zip(row, owner, strict=True)) / mass if mass > 0 else 0.0)
        return out


class ToTVoteVerifier:
    """Tree-of-Thoughts vote evaluator: one prompt lists the candidate states, the model picks one.

    The score of a candidate is the probability that the next token after "The best choice is"
    names it (the expectation of ToT's sampled votes), normalised over the choices. The vote prompt
    is a fresh context (prefilled, read once, released), and candidates are voted on in groups of at
    most nine so that every choice is one digit token.
    """

    name = "tot_vote"

    def __init__(
        self,
        instruction: str = (
            "Several partial solutions to the problem below are listed as choices. Analyse each "
            "briefly, then decide which one is most promising."
        ),
        answer_prefix: str = "The best choice is",
        max_chars: int = 600,
    ) -> None:
        self.instruction = instruction
        self.answer_prefix = answer_prefix
        self.max_chars = max_chars
        self.notes: list[str] = []
        """Fallbacks of the last `score` calls, drained into the result's notes by the reasoner."""

    def _choice_tokens(self, backend: Backend, m: int) -> tuple[list[int], list[int]] | None:
        """(suffix, one token per choice) with each choice a single distinct token, or None."""
        for suffix, fmt in ((self.answer_prefix, " {}"), (self.answer_prefix + " ", "{}")):
            ids = [backend.encode(fmt.format(i)) for i in range(1, m + 1)]
            if all(len(t) == 1 for t in ids) and len({t[0] for t in ids}) == m:
                return backend.encode(suffix), [t[0] for t in ids]
        return None

    def score(self, backend: Backend, question: str, candidates: Sequence[Candidate]) -> list[float]:
        out: list[float] = []
        for start in range(0, len(candidates), 9):
            group = candidates[start : start + 9]
            if len(group) == 1:
                out.append(1.0)
                continue
            picked = self._choice_tokens(backend, len(group))
            if picked is None:  # a tokenizer with no single-token digits: no preference
                self.notes.append("tot_vote: no single-token choice digits in this tokenizer; uniform scores")
                out += [1.0 / len(group)] * len(group)
                continue
            suffix, tokens = picked
            listing = "\n".join(
                f"Choice {i}: {c.text.strip()[-self.max_chars :]}" for i, c in enumerate(group, start=1)
            )
            message = f"{self.instruction}\n\nProblem: {question}\n\n{listing}"
            root = backend.prefill(backend.chat_prompt([{"role": "user", "content": message}]))
            try:
                probs = backend.score_next([root], suffix, tokens)[0]
            finally:
                backend.release([root])
            mass = sum(probs)
            if mass <= 0:
                self.notes.append("tot_vote: the vote gave every choice probability 0; uniform scores")
            out += [p / mass if mass > 0 else 1.0 / len(group) for p in probs]
        return out


PRMHead = Literal["auto", "token_classification", "causal_lm"]
PRMReduce = Literal["last", "min", "prod", "mean"]


class PRMVerifier:
    """A process reward model loaded with transformers (a hub id or a local path), for hub users.

    Two common PRM shapes are supported:

    * ``token_classification`` (a ``*ForTokenClassification`` head, or a remote-code
      ``*ProcessRewardModel`` whose output has per-token class ``logits``; pass
      ``trust_remote_code=True`` for those): the probability of class ``good_label`` at the end of
      each step;
    * ``causal_lm`` (Math-Shepherd style): P(``good_token``) / (P(good) + P(bad)) predicted at the
      end of each step.

    The input is the question, then every step followed by ``step_tag`` (the PRM's own step
    separator); steps are encoded piece by piece so the positions read are exactly the tags' last
    tokens. ``reduce`` turns step scores into one score: ``"last"`` (what ETS and REBASE use as the
    reward), ``"min"``, ``"prod"`` or ``"mean"``. The PRM runs as its own model (no shared KV with the
    policy); candidates are scored in padded batches of ``batch_size``.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | Any,
        tokenizer: Any = None,
        *,
        head: PRMHead = "auto",
        step_tag: str = "\n\n",
        good_label: int = 1,
        good_token: str = "+",
        bad_token: str = "-",
        reduce: PRMReduce = "last",
        name: str = "prm",
        device: str = "cpu",
        dtype: Any = None,
        batch_size: int = 8,
        max_length: int = 4096,
        trust_remote_code: bool = False,
    ) -> None:
        import torch
        from transformers import (
            AutoConfig,
            AutoModel,
            AutoModelForCausalLM,
            AutoModelForTokenClassification,
            AutoTokenizer,
        )

        from branchwise.backends.compute_thread import COMPUTE

        if reduce not in ("last", "min", "prod", "mean"):
            raise ValueError(f"reduce={reduce!r} is not one of 'last', 'min', 'prod', 'mean'")
        remote = {"trust_remote_code": True} if trust_remote_code else {}
        if isinstance(model, str | os.PathLike):
            path = str(model)
            archs = AutoConfig.from_pretrained(path, **remote).architectures or []
            if head == "auto":
                head = "token_classification" if any(_is_classifier(a) for a in archs) else "causal_lm"
            if head == "causal_lm":
                loader: Any = AutoModelForCausalLM
            elif any("TokenClassification" in a for a in archs):
                loader = AutoModelForTokenClassification
            else:  # a custom PRM class (remote code): its own AutoModel mapping builds it
                loader = AutoModel
            kwargs = {**remote, **({} if dtype is None else {"dtype": dtype})}
            # loaded, moved and run on the thread where the backend computes (`backends/compute_thread.py`)
            model = COMPUTE.run(lambda: loader.from_pretrained(path, **kwargs))
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(path, **remote)
        elif tokenizer is None:
            raise ValueError("pass the tokenizer together with an already loaded PRM model")
        elif head == "auto":
            head = "token_classification" if _is_classifier(type(model).__name__) else "causal_lm"
        if head not in ("token_classification", "causal_lm"):
            raise ValueError(f"head={head!r} is not one of 'auto', 'token_classification', 'causal_lm'")
        self.model = COMPUTE.run(lambda: model.to(device).eval())
        self.tokenizer = tokenizer
        self.head: PRMHead = head
        self.step_tag = step_tag
        self.good_label = good_label
        self.reduce: PRMReduce = reduce
        self.name = name
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.max_length = max_length
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.label_ids: tuple[int, int] | None = None
        if head == "causal_lm":
            good = self._encode(good_token)
            bad = self._encode(bad_token)
            if not good or not bad or good[-1] == bad[-1]:
                raise ValueError("good_token and bad_token must encode to distinct tokens")
            self.label_ids = (good[-1], bad[-1])
        elif good_label >= int(getattr(self.model.config, "num_labels", 2)):
            raise ValueError(f"good_label={good_label} is not a class of this PRM head")

    def _encode(self, text: str, special: bool = False) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def inputs(self, question: str, steps: Sequence[str]) -> tuple[list[int], list[int]]:
        """Token ids of question + tagged steps, and the position of each step's tag (left-truncated)."""
        ids = self._encode(question.strip() + "\n", special=True)
        tag = self._encode(self.step_tag)
        positions = []
        for step in steps:
            ids += self._encode(step.strip()) + tag
            positions.append(len(ids) - 1)
        cut = max(0, len(ids) - self.max_length)
        kept = [p - cut for p in positions if p >= cut]
        return ids[cut:], kept or [len(ids) - cut - 1]

    def step_scores(self, question: str, candidates: Sequence[Candidate]) -> list[list[float]]:
        """Every step's score, per candidate (the PRM's raw per-step output), computed on the
        process's compute thread, where the backend decodes (`backends/compute_thread.py`)."""
        from branchwise.backends.compute_thread import COMPUTE

        return COMPUTE.run(lambda: self._step_scores(question, candidates))

    def _step_scores(self, question: str, candidates: Sequence[Candidate]) -> list[list[float]]:
        import torch

        out: list[list[float]] = []
        for start in range(0, len(candidates), self.batch_size):
            group = candidates[start : start + self.batch_size]
            encoded = [self.inputs(question, c.steps or (c.text,)) for c in group]
            width = max(len(ids) for ids, _ in encoded)
            ids = torch.full((len(group), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, (row, _) in enumerate(encoded):
                ids[i, : len(row)] = torch.tensor(row)
                mask[i, : len(row)] = 1
            with torch.inference_mode():
                logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            logits = logits.float()
            for i, (_, positions) in enumerate(encoded):
                at = logits[i, positions]
                if self.head == "token_classification":
                    probs = torch.softmax(at, dim=-1)[:, self.good_label]
                else:
                    assert self.label_ids is not None
                    probs = torch.softmax(at[:, list(self.label_ids)], dim=-1)[:, 0]
                out.append(probs.tolist())
        return out

    def score(self, backend: Backend, question: str, candidates: Sequence[Candidate]) -> list[float]:
        scores = []
        for steps in self.step_scores(question, candidates):
            if self.reduce == "last":
                scores.append(steps[-1])
            elif self.reduce == "min":
                scores.append(min(steps))
            elif self.reduce == "prod":
                scores.append(math.prod(steps))
            else:
                scores.append(sum(steps) / len(steps))
        return scores


def _is_classifier(architecture: str) -> bool:
    """Whether a model class name is a per-token classifier PRM rather than a causal LM."""
    return any(key in architecture for key in ("TokenClassification", "ProcessReward"))


def _first_tokens(backend: Backend, words: Sequence[str]) -> list[int]:
    """First token id of each spelling, deduplicated (so a probability is never counted twice)."""
    seen: list[int] = []
    for w in words:
        ids = backend.encode(w)
        if ids and ids[0] not in seen:
            seen.append(ids[0])
    return seen


def default_verifiers() -> dict[str, Verifier]:
    """The verifiers every reasoner knows by name (task-specific ones are passed to the reasoner)."""
    return {
        v.name: v
        for v in (
            JudgeVerifier(),
            ConfidenceVerifier(),
            LogprobVerifier(),
            StepJudgeVerifier(),
            ArithmeticStepVerifier(),
            ChainSumStepVerifier(),
            ToTValueVerifier(),
            ToTVoteVerifier(),
        )
    }
