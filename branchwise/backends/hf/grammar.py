"""Constrained decoding: a `Constraint` compiled to a grammar, and a per-row token mask in the decode
loop's sampling stage.

Why xgrammar: it is the grammar engine vLLM and SGLang ship (so a schema that works there works
here), it compiles JSON Schema (with OpenAI's ``strict``), regexes, EBNF and *structural tags* — the
last one is what tool calling under ``tool_choice="auto"`` needs: free text until the model opens a
``<tool_call>`` block, then the block's body forced to be a call of one of the tools with arguments
valid under its schema (`Constraint.structural_tag`, in the Hermes format `branchwise.toolcalls` prompts
with). Its CPU wheel computes a row's mask in microseconds from a vocabulary table built
once per tokenizer, and its matchers `fork`, which a shared-prefix batch needs. llguidance
(Guidance's engine, also fast) has no tool-call formats of its own and no matcher fork.

Layout: `Grammars` (one per engine) owns the compiler and caches each constraint's compiled grammar
by its canonical key, so a schema compiles once per backend however many requests use it; each
compile runs within a time limit, in a thread or a killable child process (`grammar_workers`).
`RowGrammars` (`grammar_rows.py`, one per `extend` call) keeps one matcher per constrained row; `mask` narrows each
constrained row's logits to the tokens its grammar allows (rows without a constraint are left
alone, so a batch may mix both), `accept` advances a row's matcher by the token sampled. A row whose
grammar allows no token at some step ends with finish reason "grammar" (other rows go on). The mask
acts on whatever logits the step produced, so River's exited tokens and CGEE's gate see it like any
other token; CGEE's early stop waits until every constrained row's output is complete.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from branchwise.backends.hf.grammar_close import Closer
from branchwise.backends.hf.grammar_fit import (
    CAP_LIMIT,
    MAX_WHITESPACE,
    TIGHT_WHITESPACE,
    BudgetFit,
    _Fitted,
    _shapes,
)
from branchwise.backends.hf.grammar_tables import TablesLoader, TablesStats
from branchwise.backends.hf.grammar_workers import CompileFailed, CompileProcess, CompileTimedOut, Lane, both
from branchwise.constraints import Constraint, ConstraintError
from branchwise.pattern_limits import PatternSize
from branchwise.schema_budget import (
    MAX_TEXT_CHARS,
    OutputFloor,
    Shortest,
    cap_strings,
    pattern_least_chars,
    shortest,
)

__all__ = [
    "COMPILE_TIMEOUT_S",
    "COMPILE_WORKERS",
    "LIGHT_PATTERN_SIZE",
    "PROCESS_WORKERS",
    "BudgetFit",
    "ConstraintError",
    "GrammarStats",
    "GrammarTimeout",
    "Grammars",
]

log = logging.getLogger(__name__)

_LOG_PREFIX = re.compile(r"\[[\d:]+\] \S+:\d+: ")
"""The position prefix of xgrammar's C++ error messages (time, source file and line)."""
_FITS_KEPT = 1024
"""Budget fits remembered per backend (by constraint and max_tokens), oldest forgotten first."""


CACHE_BYTES = 1 << 30
"""Memory the compiled grammars of one backend may hold (xgrammar's `memory_size_bytes`), least
recently used forgotten first: each holds its token-mask cache, 2.6 MB for ``json_object`` and 3.6 MB
for twenty tools with a 49,152-token vocabulary, so a server seeing new schemas for days would
otherwise grow without end."""
_FAILS_KEPT = 1024
"""Refused constraints remembered per backend (`Grammars.timeout_s`), oldest forgotten first."""
TIMEOUT_REMEMBERED_S = 600.0
"""How long a constraint whose compile ran out of time is refused at once, without compiling again:
long enough that a client retrying it costs nothing, short enough that one timed out by a busy
machine is tried again later. A constraint the engine cannot compile is refused for good."""


class GrammarTimeout(ConstraintError):
    """The grammar's compile ran past `Grammars.timeout_s` (or did so recently): the request is refused
    like a constraint the engine cannot compile, naming the field and the limit."""


@dataclass
class GrammarStats:
    """Compiles and cache hits of one backend's grammars, the time compiling took, and the compiles
    refused: `timeouts` ran out of time, `refused` were answered from the remembered failures,
    `in_child` compiled in a `CompileProcess`, `abandoned` overran in a thread (see `Grammars`);
    `tables`: how the tokenizer's tables came (built or read from the cache) and what waited for
    them (`grammar_tables`)."""

    compiled: int = 0
    cache_hits: int = 0
    compile_s: float = 0.0
    last_compile_s: float = 0.0
    timeouts: int = 0
    refused: int = 0
    in_child: int = 0
    abandoned: int = 0
    tables: TablesStats = field(default_factory=TablesStats)


COMPILE_WORKERS = 2
"""Threads that compile small grammars ahead of decoding (`Grammars.prepare`, called by the scheduler
when a request is queued). xgrammar releases the GIL while it compiles, so a compile there never
stalls the decode loop; two let a small grammar compile beside another instead of waiting behind it."""

PROCESS_WORKERS = 2
"""Child processes (`CompileProcess`, started on first use) that compile the grammars too large for
the threads (`LIGHT_PATTERN_SIZE`), each with one xgrammar thread: at most this many cores are ever
spent on such grammars, each at most `COMPILE_TIMEOUT_S`, and a small grammar never waits for one."""

LIGHT_PATTERN_SIZE = 1_000
"""A constraint whose patterns and length bounds stand for at most this many characters
(`pattern_limits.pattern_size`, all together) compiles in a thread; a larger one in a child process.
Measured worst cases within it (49,152-token vocabulary, 2 busy cores): a ``maxLength`` of 1,000,
0.6-2 s; a regex ``[^"]{0,1000}``, 2.7-4.4 s; twenty strings of ``maxLength`` 200, 0.9 s; a schema
of 3,000 properties, 1.7 s; typical tool schemas 0.05-0.16 s. Well under `COMPILE_TIMEOUT_S`, so a
thread's compile, which cannot be stopped, is one that ends. Budget-fitted strings (`CAP_LIMIT` each) of up
to this many characters together stay here too: they are compiled for every new ``max_tokens``."""

COMPILE_TIMEOUT_S = 10.0
"""Default wall-clock limit of one compile (``branchwise serve --grammar-timeout``). Measured on 2
cores shared with other jobs (load 4-4.5), one xgrammar thread: typical tool schemas 0.05-0.16 s;
the costliest grammars `pattern_limits` admits, a regex ``[^"]{0,1000}.{0,1000}`` 6.9-7.4 s and four
strings of ``maxLength`` 1,000 3.7-5.3 s. Past it the request gets a 400 and the constraint is
remembered (`TIMEOUT_REMEMBERED_S`)."""


@dataclass(eq=False)
class Grammars:
    """The engine's grammar compiler and its cache of compiled constraints (see the module docstring).

    Why compiles happen off the caller's thread: a large grammar takes seconds to compile, and the
    caller that needs it is often the one thread that decodes every request (the scheduler's worker,
    holding the engine). `prepare` starts a compile on a worker of its own and returns a future; the
    scheduler queues the request only once it is done, so its decode finds the grammar cached. The
    cache's lock is held only to look up and store, never while compiling: a cache hit never waits for
    another constraint's compile, and a constraint asked for twice while compiling compiles once.

    Why two kinds of worker (`grammar_workers` has the measurements): a constraint whose patterns are
    small (`LIGHT_PATTERN_SIZE`) compiles in a daemon thread of this process, and one whose patterns
    are large in a child process (`PROCESS_WORKERS`), so a slow grammar never holds a thread a small
    one needs. Every compile has `timeout_s`: past it the request fails with `GrammarTimeout`; a child
    is killed, a thread (which cannot be) is abandoned and replaced, and while `COMPILE_WORKERS`
    abandoned threads still run, every compile goes to a child. A constraint that failed, by time or
    because the engine cannot compile it, is remembered and refused at once when asked for again.

    What every grammar of the tokenizer needs (`grammar_tables`: xgrammar's vocabulary table, the
    closing pieces, the longest token) comes from `_tables`, read from `cache_dir` or built there
    (None: built, not stored); `start` begins that at the model's load, on a thread of its own, then
    compiles ``json_object`` ahead too, so that no first call pays for either.
    """

    tokenizer: PreTrainedTokenizerBase
    vocab_size: int
    eos_ids: set[int]
    stats: GrammarStats = field(default_factory=GrammarStats)
    timeout_s: float = COMPILE_TIMEOUT_S
    cache_dir: Path | None = None
    _tables: TablesLoader = field(init=False)
    _compiler: xgr.GrammarCompiler | None = None
    _cache: dict[str, xgr.CompiledGrammar] = field(default_factory=dict)
    _cached_bytes: int = 0
    _pending: dict[str, Future[xgr.CompiledGrammar]] = field(default_factory=dict)
    _failed: dict[str, tuple[ConstraintError, float]] = field(default_factory=dict)
    _fits: dict[tuple[str, int], BudgetFit] = field(default_factory=dict)
    _warned: set[tuple[str, int]] = field(default_factory=set)
    _closer: Closer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _compiler_lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: Lane = field(default_factory=lambda: Lane("grammar", COMPILE_WORKERS))
    _children: Lane = field(default_factory=lambda: Lane("grammar-child", PROCESS_WORKERS))
    _idle: list[CompileProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._tables = TablesLoader(
            self.tokenizer, self.vocab_size, self.eos_ids, self.cache_dir, self.stats.tables
        )

    def start(self) -> None:
        """Load or build the tokenizer's tables in the background, then compile ``json_object``
        (the grammar of every JSON-mode request, whatever its budget: `fit` leaves it as it is)."""
        self._tables.start(then=lambda: self._precompile(Constraint.of_json_object()))

    def _precompile(self, constraint: Constraint) -> None:
        self.prepare(constraint)  # its failure is remembered, and said to the request that asks for it

    def take_notes(self) -> list[str]:
        """What a constrained reply says about waits for the tokenizer's tables (`TablesLoader`)."""
        return self._tables.take_notes()

    def tokenizer_info(self) -> xgr.TokenizerInfo:
        return self._tables.get().info

    def compiler(self) -> xgr.GrammarCompiler:
        info = self.tokenizer_info()
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    def closer(self) -> Closer:
        """The closing walk over this tokenizer's vocabulary (`grammar_close`), made on first use."""
        tables = self._tables.get()
        with self._compiler_lock:
            if self._closer is None:
                self._closer = Closer(tables.pieces, tables.info.vocab_size)
            return self._closer

    def compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        """The constraint's compiled grammar, compiled on first use (by a worker, as `prepare`, within
        `timeout_s`; this thread waits) and cached by its canonical key."""
        return self._submit(constraint).result()

    def prepare(self, constraint: Constraint, max_tokens: int | None = None) -> Future[xgr.CompiledGrammar]:
        """The constraint's compiled grammar as a future: done at once on a cache hit (or a remembered
        failure), else compiled by a worker of this cache. A constraint the engine cannot compile, or
        not within `timeout_s`, fails the future with `ConstraintError` (`GrammarTimeout`).

        With `max_tokens`, the grammar rows with that budget decode under: the constraint `fit` to
        it (`RowGrammars.attach`), done once the constraint's own grammar is compiled too (`extend`
        compiles that first, to refuse a bad constraint before any work): both are then cached.
        """
        fitted = constraint if max_tokens is None else self.fit(constraint, max_tokens).constraint
        if fitted.key() != constraint.key():
            return both(self.prepare(constraint), self.prepare(fitted))
        return self._submit(constraint)

    def _submit(self, constraint: Constraint) -> Future[xgr.CompiledGrammar]:
        key, future, mine = self._claim(constraint)
        if mine:
            if _light(constraint) and self._threads.stuck_now < COMPILE_WORKERS:
                self._threads.submit(lambda: self._in_thread(key, constraint, future))
            else:
                self._children.submit(lambda: self._in_child(key, constraint, future))
        return future

    def _claim(self, constraint: Constraint) -> tuple[str, Future[xgr.CompiledGrammar], bool]:
        """(key, the future of its grammar, whether the caller must compile it)."""
        key = constraint.key()
        with self._lock:
            future: Future[xgr.CompiledGrammar] | None = self._pending.get(key)
            if future is not None:
                return key, future, False
            future = Future()
            hit = self._cache.pop(key, None)
            if hit is not None:
                self._cache[key] = hit  # the most recently used now
                self.stats.cache_hits += 1
                future.set_result(hit)
                return key, future, False
            failed = self._failed.get(key)
            if failed is not None and failed[1] > time.monotonic():
                self.stats.refused += 1
                future.set_exception(failed[0])
                return key, future, False
            self._pending[key] = future
            return key, future, True

    def _in_thread(self, key: str, constraint: Constraint, future: Future[xgr.CompiledGrammar]) -> None:
        """Compile in this (lane) thread; a timer fails the request at `timeout_s` if it runs on."""
        worker = threading.get_ident()
        timer = threading.Timer(self.timeout_s, self._overran, (key, constraint, future, worker))
        timer.daemon = True
        start = time.perf_counter()
        timer.start()
        try:
            compiled = _compile(self.compiler(), constraint)
        except (RuntimeError, ValueError, TypeError) as err:  # xgrammar's refusals
            self._settle(key, future, error=_engine_error(err, constraint))
            return
        except Exception as err:  # a fault, not the constraint's: its request fails, nothing is kept
            self._settle(key, future, error=err)
            return
        finally:
            timer.cancel()
        self._settle(key, future, compiled, time.perf_counter() - start)

    def _overran(
        self, key: str, constraint: Constraint, future: Future[xgr.CompiledGrammar], worker: int
    ) -> None:
        """A thread's compile passed `timeout_s`: fail its request now, and replace the thread."""
        if self._settle(key, future, error=self._timeout(constraint)):
            with self._lock:
                self.stats.abandoned += 1
            self._threads.stuck(worker)
            log.warning(
                "a %s grammar still compiles in a thread after %.1f s: its request was refused; "
                "the thread goes on until xgrammar returns",
                constraint.kind,
                self.timeout_s,
            )

    def _in_child(self, key: str, constraint: Constraint, future: Future[xgr.CompiledGrammar]) -> None:
        """Compile in a child process, killed at `timeout_s`."""
        with self._lock:
            child = self._idle.pop() if self._idle else None
        try:
            if child is None:
                child = CompileProcess(self.tokenizer_info().serialize_json())
            method, args, kwargs = _spec(constraint)
            child.ready()
            start = time.perf_counter()
            text = child.compile(method, args, kwargs, self.timeout_s)
            compiled = xgr.CompiledGrammar.deserialize_json(text, self.tokenizer_info())
        except CompileTimedOut:
            self._settle(key, future, error=self._timeout(constraint))
        except CompileFailed as err:
            self._settle(key, future, error=_engine_error(err, constraint))
        except Exception as err:  # a fault, not the constraint's (no child could start): not kept
            self._settle(key, future, error=err)
        else:
            with self._lock:
                self.stats.in_child += 1
            self._settle(key, future, compiled, time.perf_counter() - start)
        finally:
            if child is not None:
                with self._lock:
                    self._idle.append(child)

    def _timeout(self, constraint: Constraint) -> GrammarTimeout:
        where = _FIELD.get(constraint.kind, "constraint")
        return GrammarTimeout(
            f"{where}: the grammar engine did not compile this {constraint.kind} constraint within "
            f"{self.timeout_s:g} s, the limit of this server: use fewer or shorter patterns and length "
            "bounds"
        )

    def _settle(
        self,
        key: str,
        future: Future[xgr.CompiledGrammar],
        compiled: xgr.CompiledGrammar | None = None,
        took: float = 0.0,
        error: Exception | None = None,
    ) -> bool:
        """Cache `compiled` (or remember `error`) and settle `future`, unless it is settled already (a
        timed-out thread's late result is dropped); whether this call settled it."""
        with self._lock:
            if self._pending.get(key) is not future:
                return False
            del self._pending[key]
            if error is None:
                assert compiled is not None
                self.stats.compiled += 1
                self.stats.compile_s += took
                self.stats.last_compile_s = took
                self._cache[key] = compiled
                self._cached_bytes += compiled.memory_size_bytes
                while self._cached_bytes > CACHE_BYTES and len(self._cache) > 1:
                    self._cached_bytes -= self._cache.pop(next(iter(self._cache))).memory_size_bytes
            elif isinstance(error, ConstraintError):  # remembered: asked again, refused at once
                timeout = isinstance(error, GrammarTimeout)
                self.stats.timeouts += timeout
                if len(self._failed) >= _FAILS_KEPT:
                    self._failed.pop(next(iter(self._failed)))
                until = time.monotonic() + TIMEOUT_REMEMBERED_S if timeout else float("inf")
                self._failed[key] = (error, until)
        if error is None:
            future.set_result(compiled)  # type: ignore[arg-type]
        else:
            future.set_exception(error)
        return True

    def close(self) -> None:
        """Stop the child processes and let the lanes' idle threads end (`Lane.close`). Called by
        the engine's finalizer, so it takes no lock (see `Lane.close`): the idle children are
        taken in one step the interpreter does not interleave."""
        children, self._idle = self._idle, []
        for child in children:
            child.close()
        for lane in (self._threads, self._children, self._tables.lane):
            lane.close()

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
            self._cached_bytes = 0
            self._fits.clear()
            self._failed.clear()
            self._warned.clear()

    def longest_token(self) -> int:
        """The most characters one token of the tokenizer holds: its longest vocabulary entry as
        stored (special tokens included), read once. A stored entry is never shorter than the text
        it decodes to (a byte-level entry has a character per byte; a SentencePiece one writes its
        space as one character), so a text of ``c`` characters takes at least ``c / longest_token``
        tokens: the bound `fit` uses where the shortest output is too long to tokenize (one of the
        tokenizer's tables: `grammar_tables`)."""
        return self._tables.get().longest

    def fit(self, constraint: Constraint, max_tokens: int, *, warn: bool = True) -> BudgetFit:
        """`constraint` fitted to `max_tokens`, so that a valid output fits where the schema allows.

        JSON Schema outputs, and the calls of ``tool_choice="required"`` or a named tool (the first
        call; under ``"auto"`` prose comes first and takes what it likes): the shortest valid output
        is counted in tokens (`BudgetFit` says how); when the room left is small (`CAP_LIMIT`), the
        whitespace JSON may hold between two tokens drops to `TIGHT_WHITESPACE` characters (counted
        as one token a gap) and every free string (no ``maxLength``, ``pattern``, ``format``,
        ``enum`` or ``const``: `schema_budget`) gets an equal share of the rest as its longest
        length, counted at one token a character (a token holds a character or more, bar characters
        outside the tokenizer's merges). A regex: its least match length bounds the tokens from
        below, and nothing is fitted.

        The count takes time that grows with the schema's size, never with a count written in it
        (`schema_budget` says why that matters). A budget below the shortest output itself cannot
        be helped here: with `warn`, that is logged (once per constraint and budget), with the
        count; the server refuses such a request before it gets here (its caller passes
        ``warn=False`` to read the count).
        """
        key = (constraint.key(), max_tokens)
        with self._lock:
            known = self._fits.get(key)
        made = known if known is not None else self._fit(constraint, max_tokens)
        with self._lock:
            if known is None:
                if len(self._fits) >= _FITS_KEPT:
                    oldest = next(iter(self._fits))
                    self._fits.pop(oldest)
                    self._warned.discard(oldest)
                self._fits[key] = made
            short = made.floor_tokens is not None and made.floor_tokens > max_tokens
            tell = warn and short and key not in self._warned
            if tell:
                self._warned.add(key)
        if tell:
            log.warning(
                "max_tokens=%d is below the %s%d tokens of the shortest output this %s constraint "
                "allows: the reply will be cut",
                max_tokens,
                "" if made.floor_exact else "at least ",
                made.floor_tokens,
                constraint.kind,
            )
        return made

    def _tokens(self, begin: str, least: Shortest, end: str, max_tokens: int) -> tuple[int, bool]:
        """Tokens of ``begin + shortest value + end``, and whether counted exactly: bounded from
        below by its length over `longest_token`, and tokenized only when that bound is within
        `max_tokens` (past it the budget cannot hold the output however it is counted) and the
        value is short enough to build (`MAX_TEXT_CHARS`: its length may be a count from the
        request, so a longer one is never built)."""
        chars = len(begin) + least.chars + len(end)
        bound = -(-chars // self.longest_token())
        if bound > max_tokens or least.chars > MAX_TEXT_CHARS:
            return bound, False
        return len(self.tokenizer.encode(begin + least.text + end, add_special_tokens=False)), True

    def _fit(self, constraint: Constraint, max_tokens: int) -> BudgetFit:
        if constraint.kind == "regex" and constraint.pattern is not None:
            chars = pattern_least_chars(constraint.pattern)
            if not chars:
                return BudgetFit(constraint)
            floor = OutputFloor("", -(-chars // self.longest_token()), False)
            return BudgetFit(constraint, floor.tokens, False, (floor,))
        measured: list[tuple[Shortest, int]] = []  # each known output's shortest value and tokens
        outputs: list[OutputFloor] = []
        known = True
        for where, schema, begin, end in _shapes(constraint):
            least = shortest(schema)
            if least is None:
                known = False
                continue
            tokens, exact = self._tokens(begin, least, end, max_tokens)
            measured.append((least, tokens))
            outputs.append(OutputFloor(where, tokens, exact))
        auto = constraint.kind == "tool_calls" and constraint.tool_choice == "auto"
        if not known or auto or not outputs:  # prose first under "auto": it takes what it likes
            return BudgetFit(constraint, outputs=tuple(outputs))
        floor = min(outputs, key=lambda out: out.tokens)  # any one of the outputs will do
        if floor.tokens > max_tokens:  # nothing fitted can help: the constraint is left as it is
            return BudgetFit(constraint, floor.tokens, floor.exact, tuple(outputs))
        rooms = [(least, max_tokens - tokens - 1) for least, tokens in measured]  # and end-of-sequence
        # a run of whitespace is one token in a trained model's tokenizer: one a gap
        shares = [(room - least.gaps) // least.free for least, room in rooms if least.free]
        cap = max(0, min(shares)) if shares and min(shares) < CAP_LIMIT else None
        tight = cap is not None or any(room < least.gaps * 4 for least, room in rooms)
        ws = TIGHT_WHITESPACE if tight else MAX_WHITESPACE
        if ws == MAX_WHITESPACE and cap is None:
            return BudgetFit(constraint, floor.tokens, floor.exact, tuple(outputs))
        fields = constraint.model_dump()
        if cap is not None and constraint.kind == "json_schema":
            fields["json_schema"] = cap_strings(fields["json_schema"], cap)
        elif cap is not None:
            for tool in fields["tools"]:
                tool["function"]["parameters"] = cap_strings(tool["function"]["parameters"], cap)
        try:
            return BudgetFit(_Fitted(**fields, max_whitespace=ws), floor.tokens, floor.exact, tuple(outputs))
        except ValueError:  # many strings' caps past `pattern_limits` together: the whitespace alone
            fitted = _Fitted(**constraint.model_dump(), max_whitespace=ws)
            return BudgetFit(fitted, floor.tokens, floor.exact, tuple(outputs))


_FIELD = {"json_schema": "json_schema", "regex": "pattern", "choice": "choices", "tool_calls": "tools"}
"""The constraint's field an error about its grammar names, by kind."""


def _light(c: Constraint) -> bool:
    """Whether `c` compiles in a thread: its patterns and length bounds are small (`LIGHT_PATTERN_SIZE`)."""
    size = PatternSize()
    try:
        if c.kind == "regex" and c.pattern is not None:
            size.add_pattern(c.pattern, "pattern")
        elif c.json_schema is not None:
            size.add_schema(c.json_schema, "json_schema")
        for tool in c.tools:
            size.add_schema(tool["function"]["parameters"], "tools")
    except ValueError:  # past a limit (a constraint built without validation): the killable way
        return False
    return size.total <= LIGHT_PATTERN_SIZE


def _spec(c: Constraint) -> tuple[str, list[Any], dict[str, Any]]:
    """The `xgr.GrammarCompiler` method that compiles `c`, and its arguments (plain JSON, so that a
    child process can be sent them)."""
    whitespace = c.max_whitespace if isinstance(c, _Fitted) else MAX_WHITESPACE
    if c.kind == "json_schema":
        assert c.json_schema is not None
        schema = json.dumps(cap_strings(c.json_schema, None))  # length bounds as patterns: `capped_string`
        return "compile_json_schema", [schema], {"strict_mode": c.strict, "max_whitespace_cnt": whitespace}
    if c.kind == "json_object":
        return (
            "compile_json_schema",
            [json.dumps({"type": "object"})],
            {"strict_mode": False, "max_whitespace_cnt": whitespace},
        )
    if c.kind == "regex":
        assert c.pattern is not None
        return "compile_regex", [c.pattern], {}
    if c.kind == "choice":
        rule = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in c.choices)
        return "compile_grammar", [f"root ::= {rule}"], {}
    tools = tuple(
        {**t, "function": {**t["function"], "parameters": cap_strings(t["function"]["parameters"], None)}}
        for t in c.tools
    )
    tag = c.model_copy(update={"tools": tools}).structural_tag(whitespace)
    return "compile_structural_tag", [json.dumps(tag)], {}


def _compile(compiler: xgr.GrammarCompiler, c: Constraint) -> xgr.CompiledGrammar:
    method, args, kwargs = _spec(c)
    return getattr(compiler, method)(*args, **kwargs)


def _engine_error(err: Exception, c: Constraint) -> ConstraintError:
    """xgrammar's refusal of `c` (raised here or in a child) as the `ConstraintError` a request gets."""
    reason = _LOG_PREFIX.sub("", str(err)).strip()
    return ConstraintError(
        f"{_FIELD.get(c.kind, 'constraint')}: the grammar engine cannot compile this {c.kind} "
        f"constraint ({reason})"
    )
