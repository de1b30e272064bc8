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
by its canonical key, so a schema compiles once per backend however many requests use it.
`RowGrammars` (one per `extend` call) keeps one matcher per constrained row; `mask` narrows each
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
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from branchwise.constraints import Constraint, ConstraintError
from branchwise.schema_budget import Shortest, cap_strings, shortest

__all__ = ["COMPILE_WORKERS", "BudgetFit", "ConstraintError", "GrammarStats", "Grammars", "RowGrammars"]

log = logging.getLogger(__name__)

_LOG_PREFIX = re.compile(r"\[[\d:]+\] \S+:\d+: ")
"""The position prefix of xgrammar's C++ error messages (time, source file and line)."""
MAX_WHITESPACE = 20
"""Longest run of whitespace JSON may hold between two tokens: room for pretty-printing four levels
deep, but a small model can no longer pad its JSON with whitespace until ``max_tokens`` runs out
(xgrammar's default is unbounded, and random or small models do exactly that)."""
TIGHT_WHITESPACE = 2
"""Longest whitespace run between two JSON tokens under a small budget: not 1, because trained
models have habits a single character breaks (SmolLM2 writes ``"expression":  "12 * 7"``, two
spaces; held to one it writes ``""``), and not more, because a random or small model pads every
gap it may."""
CAP_LIMIT = 256
"""Free strings are bounded (and whitespace held to `TIGHT_WHITESPACE`) only when the budget leaves
each fewer characters than this: a larger budget leaves the constraint (and its compiled grammar)
as it was, escapes and pretty-printing included. Without free strings, the whitespace is held only
when the budget leaves fewer than four tokens a gap."""
_FITS_KEPT = 1024
"""Budget fits remembered per backend (by constraint and max_tokens), oldest forgotten first."""


class _Fitted(Constraint):
    """A constraint fitted to a budget (`Grammars.fit`): it also bounds the whitespace JSON may hold
    between two tokens. A field of its own, so its key (the grammar cache's) differs from the
    unfitted constraint's and the cache, `Grammars.prepare` included, needs no other knob."""

    max_whitespace: int = MAX_WHITESPACE


@dataclass(frozen=True)
class BudgetFit:
    """A constraint fitted to a row's ``max_tokens`` (`Grammars.fit`): what to compile (the same
    constraint when nothing needed fitting), and the tokens its shortest valid output takes (None:
    not known, or a kind with no such bound)."""

    constraint: Constraint
    floor_tokens: int | None = None


@dataclass
class GrammarStats:
    """Compiles and cache hits of one backend's grammars, and the time compiling took."""

    compiled: int = 0
    cache_hits: int = 0
    compile_s: float = 0.0
    last_compile_s: float = 0.0


COMPILE_WORKERS = 2
"""Threads that compile grammars ahead of decoding (`Grammars.prepare`, called by the scheduler when
a request is queued). xgrammar releases the GIL while it compiles, so a compile there never stalls
the decode loop; two let a small grammar compile beside a large one instead of waiting behind it."""


@dataclass(eq=False)
class Grammars:
    """The engine's grammar compiler and its cache of compiled constraints (see the module docstring).

    Why compiles happen off the caller's thread: a large grammar takes seconds to compile, and the
    caller that needs it is often the one thread that decodes every request (the scheduler's worker,
    holding the engine). `prepare` starts a compile on a worker of its own and returns a future; the
    scheduler queues the request only once it is done, so its decode finds the grammar cached. The
    cache's lock is held only to look up and store, never while compiling: a cache hit never waits for
    another constraint's compile, and a constraint asked for twice while compiling compiles once.
    """

    tokenizer: PreTrainedTokenizerBase
    vocab_size: int
    eos_ids: set[int]
    stats: GrammarStats = field(default_factory=GrammarStats)
    _compiler: xgr.GrammarCompiler | None = None
    _cache: dict[str, xgr.CompiledGrammar] = field(default_factory=dict)
    _pending: dict[str, Future[xgr.CompiledGrammar]] = field(default_factory=dict)
    _fits: dict[tuple[str, int], BudgetFit] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _compiler_lock: threading.Lock = field(default_factory=threading.Lock)
    _workers: ThreadPoolExecutor | None = None

    def compiler(self) -> xgr.GrammarCompiler:
        with self._compiler_lock:  # built once, by whichever thread compiles first
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=sorted(self.eos_ids)
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    def compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        """The constraint's compiled grammar, compiled on first use (in this thread, unless a compile
        of it is under way already: then that one is awaited) and cached by its canonical key."""
        key, future, mine = self._claim(constraint)
        if mine:
            self._build(key, constraint, future)
        return future.result()

    def prepare(self, constraint: Constraint, max_tokens: int | None = None) -> Future[xgr.CompiledGrammar]:
        """The constraint's compiled grammar as a future: done at once on a cache hit, else compiled
        by a worker of this cache (`COMPILE_WORKERS`). A constraint the engine cannot compile
        fails the future with `ConstraintError`.

        With `max_tokens`, the grammar rows with that budget decode under: the constraint `fit` to
        it (`RowGrammars.attach`), done once the constraint's own grammar is compiled too (`extend`
        compiles that first, to refuse a bad constraint before any work): both are then cached.
        """
        fitted = constraint if max_tokens is None else self.fit(constraint, max_tokens).constraint
        if fitted.key() != constraint.key():
            return _both(self.prepare(constraint), self.prepare(fitted))
        key, future, mine = self._claim(constraint)
        if mine:
            with self._lock:
                if self._workers is None:
                    self._workers = ThreadPoolExecutor(
                        COMPILE_WORKERS, thread_name_prefix="branchwise-grammar"
                    )
                workers = self._workers
            workers.submit(self._build, key, constraint, future)
        return future

    def _claim(self, constraint: Constraint) -> tuple[str, Future[xgr.CompiledGrammar], bool]:
        """(key, the future of its grammar, whether the caller must compile it)."""
        key = constraint.key()
        with self._lock:
            future: Future[xgr.CompiledGrammar] | None = self._pending.get(key)
            if future is not None:
                return key, future, False
            future = Future()
            hit = self._cache.get(key)
            if hit is not None:
                self.stats.cache_hits += 1
                future.set_result(hit)
                return key, future, False
            self._pending[key] = future
            return key, future, True

    def _build(self, key: str, constraint: Constraint, future: Future[xgr.CompiledGrammar]) -> None:
        """Compile `constraint` into the cache and settle `future` (with the grammar or the error)."""
        start = time.perf_counter()
        try:
            compiled = _compile(self.compiler(), constraint)
        except BaseException as err:
            with self._lock:
                self._pending.pop(key, None)
            future.set_exception(err)
            if not isinstance(err, Exception):
                raise
            return
        took = time.perf_counter() - start
        with self._lock:
            self.stats.compiled += 1
            self.stats.compile_s += took
            self.stats.last_compile_s = took
            self._cache[key] = compiled
            self._pending.pop(key, None)
        future.set_result(compiled)

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
            self._fits.clear()

    def fit(self, constraint: Constraint, max_tokens: int) -> BudgetFit:
        """`constraint` fitted to `max_tokens`, so that a valid output fits where the schema allows.

        JSON Schema outputs, and the calls of ``tool_choice="required"`` or a named tool (the first
        call; under ``"auto"`` prose comes first and takes what it likes): the shortest valid output
        is counted in tokens; when the room left is small (`CAP_LIMIT`), the whitespace JSON may hold between two
        tokens drops to `TIGHT_WHITESPACE` characters (counted as one token a gap) and every free
        string (no ``maxLength``, ``pattern``, ``format``, ``enum`` or ``const``: `schema_budget`)
        gets an equal share of the rest as its longest length, counted at one token a character (a
        token holds a character or more, bar characters outside the tokenizer's merges). A budget
        below the shortest output itself cannot be helped: that is logged (once per constraint and
        budget), with the count.
        """
        key = (constraint.key(), max_tokens)
        with self._lock:
            known = self._fits.get(key)
        if known is not None:
            return known
        made = self._fit(constraint, max_tokens)
        with self._lock:
            if len(self._fits) >= _FITS_KEPT:
                self._fits.pop(next(iter(self._fits)))
            self._fits[key] = made
        return made

    def _fit(self, constraint: Constraint, max_tokens: int) -> BudgetFit:
        # (schema, the text around its value) of each output the constraint allows
        if constraint.kind == "json_schema" and constraint.json_schema is not None:
            shapes = [(constraint.json_schema, "", "")]
        elif constraint.kind == "tool_calls" and constraint.tool_choice != "auto":
            tag = constraint.structural_tag(MAX_WHITESPACE)["format"]
            while tag.get("type") in ("plus", "sequence"):  # down to the tag (or the `or` of tags)
                tag = tag["content"] if tag["type"] == "plus" else tag["elements"][0]
            shapes = [
                (t["content"]["json_schema"], t["begin"], t["end"])
                for t in (tag["elements"] if tag.get("type") == "or" else [tag])
            ]
        else:
            return BudgetFit(constraint)
        rooms: list[tuple[Shortest, int]] = []
        for schema, begin, end in shapes:
            least = shortest(schema)
            if least is None:
                return BudgetFit(constraint)
            tokens = len(self.tokenizer.encode(begin + least.text + end, add_special_tokens=False))
            rooms.append((least, max_tokens - tokens - 1))  # and the end-of-sequence token
        floor = max_tokens - max(room for _, room in rooms) - 1
        if floor > max_tokens:
            log.warning(
                "max_tokens=%d is below the %d tokens of the shortest output this %s constraint "
                "allows: the reply will be cut",
                max_tokens,
                floor,
                constraint.kind,
            )
        # a run of whitespace is one token in a trained model's tokenizer: one a gap
        shares = [(room - least.gaps) // least.free for least, room in rooms if least.free]
        cap = max(0, min(shares)) if shares and min(shares) < CAP_LIMIT else None
        tight = cap is not None or any(room < least.gaps * 4 for least, room in rooms)
        ws = TIGHT_WHITESPACE if tight else MAX_WHITESPACE
        if ws == MAX_WHITESPACE and cap is None:
            return BudgetFit(constraint, floor)
        fields = constraint.model_dump()
        if cap is not None and constraint.kind == "json_schema":
            fields["json_schema"] = cap_strings(fields["json_schema"], cap)
        elif cap is not None:
            for tool in fields["tools"]:
                tool["function"]["parameters"] = cap_strings(tool["function"]["parameters"], cap)
        return BudgetFit(_Fitted(**fields, max_whitespace=ws), floor)


def _both(
    first: Future[xgr.CompiledGrammar], second: Future[xgr.CompiledGrammar]
) -> Future[xgr.CompiledGrammar]:
    """A future done when both are: the first one's error, else the second one's result."""
    if first.done() and second.done():
        return first if first.exception() is not None else second
    both: Future[xgr.CompiledGrammar] = Future()
    lock = threading.Lock()

    def settle(_: Future[xgr.CompiledGrammar]) -> None:
        with lock:  # the two callbacks may run at once, in two workers
            if both.done() or not (first.done() and second.done()):
                return
            error = first.exception() or second.exception()
            if error is not None:
                both.set_exception(error)
            else:
                both.set_result(second.result())

    first.add_done_callback(settle)
    second.add_done_callback(settle)
    return both


def _compile(compiler: xgr.GrammarCompiler, c: Constraint) -> xgr.CompiledGrammar:
    field_name = {
        "json_schema": "json_schema",
        "regex": "pattern",
        "choice": "choices",
        "tool_calls": "tools",
    }
    whitespace = c.max_whitespace if isinstance(c, _Fitted) else MAX_WHITESPACE
    try:
        if c.kind == "json_schema":
            assert c.json_schema is not None
            return compiler.compile_json_schema(  # length bounds as patterns: `capped_string` says why
                json.dumps(cap_strings(c.json_schema, None)),
                strict_mode=c.strict,
                max_whitespace_cnt=whitespace,
            )
        if c.kind == "json_object":
            return compiler.compile_json_schema(
                json.dumps({"type": "object"}), strict_mode=False, max_whitespace_cnt=whitespace
            )
        if c.kind == "regex":
            assert c.pattern is not None
            return compiler.compile_regex(c.pattern)
        if c.kind == "choice":
            rule = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in c.choices)
            return compiler.compile_grammar(f"root ::= {rule}")
        tools = tuple(
            {**t, "function": {**t["function"], "parameters": cap_strings(t["function"]["parameters"], None)}}
            for t in c.tools
        )
        return compiler.compile_structural_tag(
            c.model_copy(update={"tools": tools}).structural_tag(whitespace)
        )
    except (RuntimeError, ValueError, TypeError) as err:
        where = field_name.get(c.kind, "constraint")
        reason = _LOG_PREFIX.sub("", str(err)).strip()
        raise ConstraintError(
            f"{where}: the grammar engine cannot compile this {c.kind} constraint ({reason})"
        ) from None


class RowGrammars:
    """One matcher per constrained row of one `extend` call, keyed by the row's segment id."""

    def __init__(self, grammars: Grammars) -> None:
        self.grammars = grammars
        self._matchers: dict[int, xgr.GrammarMatcher] = {}
        self._bitmask: torch.Tensor | None = None

    def attach(self, seg_id: int, constraint: Constraint | None, max_tokens: int | None = None) -> None:
        """Constrain the row of segment `seg_id` from its next token on (None: leave it free), fitted
        to the row's `max_tokens` where given (`Grammars.fit`)."""
        if constraint is not None and seg_id not in self._matchers:
            if max_tokens is not None:
                constraint = self.grammars.fit(constraint, max_tokens).constraint
            self._matchers[seg_id] = xgr.GrammarMatcher(self.grammars.compile(constraint))

    def __bool__(self) -> bool:
        return bool(self._matchers)

    def mask(self, logits: torch.Tensor, seg_ids: Sequence[int]) -> tuple[torch.Tensor, set[int]]:
        """Logits (float32, a copy) with each constrained row narrowed to its grammar's tokens, and the
        batch positions whose grammar allows no token now (their logits are left as they were)."""
        rows = [(pos, self._matchers[s]) for pos, s in enumerate(seg_ids) if s in self._matchers]
        if not rows:
            return logits, set()
        vocab = logits.shape[-1]
        if (
            self._bitmask is None
            or self._bitmask.shape[0] < len(seg_ids)
            or self._bitmask.shape[1] * 32 < vocab
        ):
            self._bitmask = xgr.allocate_token_bitmask(max(len(seg_ids), 8), self.grammars.vocab_size)
        bitmask = self._bitmask
        masked = logits.float().clone()
        dead: set[int] = set()
        positions = []
        for pos, matcher in rows:
            if matcher.is_terminated():
                dead.add(pos)
                continue
            matcher.fill_next_token_bitmask(bitmask, pos)
            positions.append(pos)
        if positions:
            on_device = bitmask[: len(seg_ids)].to(masked.device, non_blocking=True)
            xgr.apply_token_bitmask_inplace(masked, on_device, vocab_size=vocab, indices=positions)
            finite = torch.isfinite(masked[positions]).any(dim=-1).tolist()
            dead.update(pos for pos, ok in zip(positions, finite, strict=True) if not ok)
        for pos in dead:
            masked[pos] = logits[pos].float()
        return masked, dead

    def accept(self, seg_id: int, token: int) -> bool:
        """Advance the row's matcher by `token`; False when the grammar refuses it (the row ends)."""
        matcher = self._matchers.get(seg_id)
        return matcher is None or matcher.accept_token(token)

    def ends_here(self, seg_id: int) -> bool:
        """Whether the row's grammar allows nothing but the end of the sequence now: its output is
        whole, and the next token would be end-of-sequence whatever the model preferred."""
        matcher = self._matchers.get(seg_id)
        if matcher is None or not matcher.is_completed():
            return False
        if matcher.is_terminated():
            return True
        vocab = self.grammars.vocab_size
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        matcher.fill_next_token_bitmask(bitmask, 0)
        allowed = torch.zeros(1, vocab)
        xgr.apply_token_bitmask_inplace(allowed, bitmask, vocab_size=vocab)
        return set(torch.isfinite(allowed[0]).nonzero().flatten().tolist()) <= self.grammars.eos_ids

    def complete(self, seg_ids: Sequence[int]) -> bool:
        """Whether every constrained row among `seg_ids` could end here (its output is whole)."""
        return all(self._matchers[s].is_completed() for s in seg_ids if s in self._matchers)

    def drop(self, seg_id: int) -> None:
        self._matchers.pop(seg_id, None)
