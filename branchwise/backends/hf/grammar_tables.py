"""What every grammar of one tokenizer needs (`TokenizerTables`): xgrammar's vocabulary table, the
closing walk's pieces (`grammar_close`) and the longest token's length, built once per tokenizer,
in the background from the model's load on (`TablesLoader`), and kept on disk keyed by the
tokenizer's fingerprint so that a new process reads them instead of building them.

Why: these were built by the first constrained call of each process, which paid for them on top of
its own work. Measured on SmolLM2's 49,152-token vocabulary (2 busy cores): xgrammar's table
0.12-0.19 s, the closing pieces 0.12-0.28 s (a Python walk over every token), the longest token
0.02-0.04 s; a first JSON or tool call took 1.1-1.35 s where later ones took 0.65-0.7 s. They grow
with the vocabulary (three times as large for a 151,646-token one). Read back from the cache they
take 0.05-0.1 s, and at load nobody waits for them. Compiled grammars are not kept on disk: a
typical schema compiles in 0.01-0.16 s, while its compiled form (token-mask cache included) is
4-8 MB that takes longer to write and read than to compile again.

The fingerprint is a hash of what the tables are made of: the tokenizer's whole definition as the
``tokenizers`` library writes it (vocabulary, merges, added tokens, normalizer, decoder), the model's
vocabulary size, the stop and special ids, and the xgrammar version and this file's `TABLES_FORMAT`.
A tokenizer with no such definition (a slow, Python-only one) has no fingerprint: its tables are
built in each process, and the log says so. A cache file that cannot be read (cut short, edited, from
another version) is rebuilt and written again, with a warning; a folder that cannot be written
leaves the tables built in each process, with a warning too.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import xgrammar as xgr
from pydantic import BaseModel, Field
from transformers import PreTrainedTokenizerBase

from branchwise.backends.hf.grammar_close import closing_pieces
from branchwise.backends.hf.grammar_workers import Lane

__all__ = ["TABLES_FORMAT", "TablesLoader", "TablesStats", "TokenizerTables", "fingerprint", "load_or_build"]

log = logging.getLogger(__name__)

TABLES_FORMAT = 1
"""The layout of a cached tables file: part of the fingerprint, so a new layout never reads an old file."""


@dataclass(frozen=True)
class TokenizerTables:
    """One tokenizer's tables: xgrammar's `info`, the closing walk's `pieces` (`Closer`) and the
    most characters one vocabulary entry holds (`Grammars.longest_token`)."""

    info: xgr.TokenizerInfo
    pieces: dict[bytes, int]
    longest: int


class _TablesFile(BaseModel):
    """A cached tables file, validated whole before any of it is used."""

    format: Literal[1]
    fingerprint: str
    tokenizer_info: str
    longest: int = Field(ge=1)
    pieces: list[tuple[str, int]]
    """Each piece's bytes in hex, and its token."""


def _excluded(tokenizer: PreTrainedTokenizerBase, eos_ids: set[int]) -> set[int]:
    """Tokens the closing walk never writes: special, added and stop tokens (their text is never one
    token of a grammar's output)."""
    added = set(getattr(tokenizer, "added_tokens_decoder", {}))
    return {*tokenizer.all_special_ids, *added, *eos_ids}


def fingerprint(tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_ids: set[int]) -> str | None:
    """The key of the tokenizer's cached tables (see the module docstring); None when it has no
    definition to hash (a slow tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    digest = hashlib.sha256(backend.to_str().encode())
    parts = {
        "format": TABLES_FORMAT,
        "xgrammar": importlib.metadata.version("xgrammar"),
        "vocab_size": vocab_size,
        "stop": sorted(eos_ids),
        "excluded": sorted(_excluded(tokenizer, eos_ids)),
    }
    digest.update(json.dumps(parts, sort_keys=True).encode())
    return digest.hexdigest()[:32]


def build(tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_ids: set[int]) -> TokenizerTables:
    """The tables, built from the tokenizer (the cold path `load_or_build` avoids)."""
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_ids)
    )
    pieces = closing_pieces(info, _excluded(tokenizer, eos_ids))
    # a stored entry is never shorter than the text it decodes to (`Grammars.longest_token`)
    longest = max(1, max((len(t) for t in tokenizer.get_vocab()), default=1))
    return TokenizerTables(info, pieces, longest)


def _read(path: Path, key: str, vocab_size: int) -> TokenizerTables:
    """The tables stored at `path`; `FileNotFoundError` when there are none, `ValueError` (or
    xgrammar's `RuntimeError`) when the file cannot be used."""
    stored = _TablesFile.model_validate_json(path.read_bytes())
    if stored.fingerprint != key:
        raise ValueError(f"it holds the tables of fingerprint {stored.fingerprint}, not {key}")
    info = xgr.TokenizerInfo.deserialize_json(stored.tokenizer_info)
    if info.vocab_size != vocab_size:
        raise ValueError(f"its vocabulary holds {info.vocab_size} tokens, not {vocab_size}")
    return TokenizerTables(
        info, {bytes.fromhex(hex_): token for hex_, token in stored.pieces}, stored.longest
    )


def _write(path: Path, key: str, tables: TokenizerTables) -> None:
    """Store the tables at `path` whole or not at all (written aside, then renamed over it: two
    processes building the same tables at once each leave a whole file)."""
    stored = _TablesFile(
        format=TABLES_FORMAT,
        fingerprint=key,
        tokenizer_info=tables.info.serialize_json(),
        longest=tables.longest,
        pieces=[(piece.hex(), token) for piece, token in tables.pieces.items()],
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(stored.model_dump_json())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def load_or_build(
    tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_ids: set[int], folder: Path | None
) -> tuple[TokenizerTables, bool]:
    """The tables, read from `folder` where they are stored, else built (and stored there); and
    whether they were built. Every way but a plain read is logged (see the module docstring)."""
    start = time.perf_counter()
    key = None if folder is None else fingerprint(tokenizer, vocab_size, eos_ids)
    if folder is None or key is None:
        tables = build(tokenizer, vocab_size, eos_ids)
        why = "no cache folder" if folder is None else f"{type(tokenizer).__name__} has no fingerprint"
        log.info("grammar tables: built in %.2f s, not stored (%s)", time.perf_counter() - start, why)
        return tables, True
    path = folder / f"{key}.json"
    try:
        tables = _read(path, key, vocab_size)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, RuntimeError) as err:  # pydantic's ValidationError is a ValueError
        log.warning("grammar tables: %s cannot be used (%s): built again", path, str(err).splitlines()[0])
    else:
        log.info("grammar tables: read from %s in %.2f s", path, time.perf_counter() - start)
        return tables, False
    tables = build(tokenizer, vocab_size, eos_ids)
    took = time.perf_counter() - start
    try:
        _write(path, key, tables)
    except OSError as err:
        log.warning("grammar tables: built in %.2f s, not stored (%s): each process builds them", took, err)
    else:
        log.info("grammar tables: built in %.2f s, stored in %s", took, path)
    return tables, True


@dataclass
class TablesStats:
    """How one backend came by its tables, and what waited for them: `built` or `loaded` (from the
    cache), and `waits` (calls that needed them before they were ready) and `wait_s` (their time)."""

    built: int = 0
    loaded: int = 0
    waits: int = 0
    wait_s: float = 0.0


@dataclass(eq=False)
class TablesLoader:
    """One tokenizer's tables, loaded or built on a thread of their own (`start`, at the model's load),
    and handed to whoever needs them (`get`), who waits while they are not ready yet.

    Why their own thread (a `Lane` of one): a compile on the grammar lane's threads waits for the
    tables, so the tables must never queue behind it there. A lane's job is waited for at exit
    (`grammar_workers`), so a process that ends during the build exits cleanly. A wait is never
    silent: it is logged, counted (`stats`) and said once in the notes of the next constrained reply
    (`take_notes`)."""

    tokenizer: PreTrainedTokenizerBase
    vocab_size: int
    eos_ids: set[int]
    folder: Path | None = None
    stats: TablesStats = field(default_factory=TablesStats)
    _future: Future[TokenizerTables] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    lane: Lane = field(default_factory=lambda: Lane("grammar-tables", 1))
    """Where the tables load (one thread; `Grammars.close` ends it)."""
    _unsaid: list[str] = field(default_factory=list)

    def start(self, then: Callable[[], None] | None = None) -> Future[TokenizerTables]:
        """Start loading (or building) the tables unless under way; `then` runs on their thread once
        they are ready (not when they fail)."""
        with self._lock:
            if self._future is not None:
                return self._future
            future: Future[TokenizerTables] = Future()
            self._future = future
        self.lane.submit(lambda: self._load(future, then))
        return future

    def _load(self, future: Future[TokenizerTables], then: Callable[[], None] | None) -> None:
        try:
            tables, built = load_or_build(self.tokenizer, self.vocab_size, self.eos_ids, self.folder)
        except Exception as err:  # the tokenizer xgrammar cannot read: every constrained call says so
            log.warning("grammar tables could not be built: constrained calls will fail (%s)", err)
            future.set_exception(err)
            return
        with self._lock:
            self.stats.built += built
            self.stats.loaded += not built
        future.set_result(tables)
        if then is not None:
            then()

    def get(self) -> TokenizerTables:
        """The tables, started here if `start` was not called; a wait for them is counted and logged."""
        future = self.start()
        if future.done():
            return future.result()
        begin = time.perf_counter()
        tables = future.result()
        waited = time.perf_counter() - begin
        with self._lock:
            self.stats.waits += 1
            self.stats.wait_s += waited
            self._unsaid.append(
                f"a constrained call waited {waited:.2f} s for this tokenizer's grammar tables "
                "(built once per tokenizer, from the model's load on)"
            )
        log.info("a constrained call waited %.2f s for this tokenizer's grammar tables", waited)
        return tables

    def take_notes(self) -> list[str]:
        """The waits not said yet, each once (a constrained reply's notes carry them)."""
        with self._lock:
            notes, self._unsaid = self._unsaid, []
        return notes
