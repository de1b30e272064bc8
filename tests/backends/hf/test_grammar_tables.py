"""A tokenizer's grammar tables are built once and read back after (`grammar_tables`): a second
backend on the same cache folder builds nothing, a cache file that cannot be used is built again
with a warning, what differs in the tokenizer changes the key, a call that needs the tables before
they are ready waits for them and says so (counted, logged, in its reply's notes), and a process
that ends while they build exits cleanly with the tables stored. The tiny tokenizer; no hub."""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from testkit import wait_until

from branchwise.backends.base import DecodeParams
from branchwise.backends.hf import grammar_tables
from branchwise.backends.hf.grammar import Grammars
from branchwise.backends.hf.grammar_tables import TablesLoader, fingerprint
from branchwise.constraints import Constraint

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every build of tables from a tokenizer (not a read from the cache) appends its vocabulary size."""
    real, made = grammar_tables.build, []

    def counted(tokenizer: Any, vocab_size: int, eos_ids: set[int]) -> grammar_tables.TokenizerTables:
        made.append(vocab_size)
        return real(tokenizer, vocab_size, eos_ids)

    monkeypatch.setattr(grammar_tables, "build", counted)
    return made


def _grammars(tokenizer: Any, folder: Path | None) -> Grammars:
    return Grammars(tokenizer, len(tokenizer), {tokenizer.eos_token_id}, cache_dir=folder)


def _stored(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.json"))


def test_a_second_backend_reads_the_tables_instead_of_building_them(
    tiny_tokenizer: Any, tmp_path: Path, builds: list[int]
) -> None:
    first = _grammars(tiny_tokenizer, tmp_path)
    first.start()
    wait_until(lambda: first.stats.compiled == 1, "json_object is compiled ahead, once the tables are")
    first.compile(Constraint.of_json_object())  # a cache hit
    assert first.stats.cache_hits == 1 and first.stats.compiled == 1
    assert (first.stats.tables.built, first.stats.tables.loaded, builds) == (1, 0, [len(tiny_tokenizer)])
    (path,) = _stored(tmp_path)
    assert path.stem == fingerprint(tiny_tokenizer, len(tiny_tokenizer), {tiny_tokenizer.eos_token_id})

    second = _grammars(tiny_tokenizer, tmp_path)
    second.start()
    plan_first = first.closer().plan(_matcher(first))
    assert second.closer().plan(_matcher(second)) == plan_first
    assert (second.stats.tables.built, second.stats.tables.loaded, len(builds)) == (0, 1, 1)
    assert second.tokenizer_info().serialize_json() == first.tokenizer_info().serialize_json()
    assert second.closer().pieces == first.closer().pieces
    assert second.longest_token() == first.longest_token()


def _matcher(grammars: Grammars) -> Any:
    import xgrammar as xgr

    return xgr.GrammarMatcher(grammars.compile(Constraint.of_json_schema({"type": "object"})))


@pytest.mark.parametrize(
    "spoil",
    [
        pytest.param(lambda text: text[: len(text) // 2], id="cut-short"),
        pytest.param(lambda text: json.dumps({**json.loads(text), "fingerprint": "other"}), id="other-key"),
        pytest.param(lambda text: json.dumps({**json.loads(text), "tokenizer_info": "{}"}), id="bad-info"),
        pytest.param(lambda text: json.dumps({**json.loads(text), "format": 0}), id="old-format"),
    ],
)
def test_a_cache_file_that_cannot_be_used_is_built_again(
    tiny_tokenizer: Any, tmp_path: Path, builds: list[int], caplog: pytest.LogCaptureFixture, spoil: Any
) -> None:
    _grammars(tiny_tokenizer, tmp_path).tokenizer_info()
    (path,) = _stored(tmp_path)
    good = path.read_text()
    path.write_text(spoil(good))
    with caplog.at_level(logging.WARNING, logger=grammar_tables.__name__):
        again = _grammars(tiny_tokenizer, tmp_path)
        again.closer()
    assert again.stats.tables.built == 1 and len(builds) == 2
    assert f"{path} cannot be used" in caplog.text
    assert path.read_text() == good  # stored again, whole
    third = _grammars(tiny_tokenizer, tmp_path)
    third.closer()
    assert third.stats.tables.loaded == 1 and len(builds) == 2


def test_an_unwritable_folder_builds_in_each_process_and_says_so(
    tiny_tokenizer: Any, tmp_path: Path, builds: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger=grammar_tables.__name__):
        for _ in range(2):
            _grammars(tiny_tokenizer, blocked).longest_token()
    assert len(builds) == 2
    assert caplog.text.count("not stored") == 2


def test_what_the_tables_are_made_of_changes_the_key(tiny_tokenizer: Any) -> None:
    eos = {tiny_tokenizer.eos_token_id}
    other = next(i for i in range(len(tiny_tokenizer)) if i not in eos)
    base = fingerprint(tiny_tokenizer, len(tiny_tokenizer), eos)
    assert base is not None and fingerprint(copy.deepcopy(tiny_tokenizer), len(tiny_tokenizer), eos) == base
    grown = copy.deepcopy(tiny_tokenizer)
    grown.add_tokens(["<tool_marker>"])
    others = {
        fingerprint(tiny_tokenizer, len(tiny_tokenizer) + 64, eos),  # a padded head
        fingerprint(tiny_tokenizer, len(tiny_tokenizer), eos | {other}),  # another stop token
        fingerprint(grown, len(tiny_tokenizer), eos),
    }
    assert base not in others and len(others) == 3


def _waiting_in(code: Any) -> bool:
    """Whether some thread is inside the function whose code is `code` now."""
    for frame in sys._current_frames().values():
        at: Any = frame
        while at is not None:
            if at.f_code is code:
                return True
            at = at.f_back
    return False


@pytest.fixture
def held_tables(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Loading tables blocks until the event is set (set at teardown, so no thread stays blocked)."""
    real, release = grammar_tables.load_or_build, threading.Event()

    def blocked(*args: Any) -> Any:
        release.wait(120)
        return real(*args)

    monkeypatch.setattr(grammar_tables, "load_or_build", blocked)
    yield release
    release.set()


def test_a_call_that_needs_the_tables_early_waits_and_says_so(
    tiny_llama_dir: Path, held_tables: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    """A decode asks for the tables while they still load: it waits (counted, logged), and its reply's
    notes say so, once: the next constrained reply says nothing."""
    from branchwise.backends.hf import HFBackend

    backend = HFBackend(tiny_llama_dir)
    tables = backend.engine.grammars.stats.tables
    assert (tables.built, tables.loaded, tables.waits) == (0, 0, 0)
    waiting = threading.Thread(
        target=wait_until,
        args=(lambda: _waiting_in(TablesLoader.get.__code__), "a call waits for the tables"),
    )
    waiting.start()
    threading.Thread(target=lambda: (waiting.join(), held_tables.set()), daemon=True).start()
    params = DecodeParams(max_tokens=6, constraint=Constraint.of_json_object())
    with caplog.at_level(logging.INFO, logger=grammar_tables.__name__):
        first = _decode(backend, params)
    assert tables.waits == 1 and tables.wait_s > 0
    assert any("waited" in note and "grammar tables" in note for note in first.notes), first.notes
    assert "waited" in caplog.text
    later = _decode(backend, params)
    assert not any("grammar tables" in note for note in later.notes)
    assert tables.waits == 1


def _decode(backend: Any, params: DecodeParams) -> Any:
    root = backend.prefill(backend.chat_prompt([{"role": "user", "content": "hi"}]))
    (gen,) = backend.extend([root], params)
    backend.release([root])
    return gen


def test_a_process_ending_while_the_tables_build_exits_cleanly(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The backend is made and the script ends at once: the build on its own thread is waited for
    (the tables are stored), and the interpreter exits with status 0."""
    cache = tmp_path / "cache"
    script = f"from branchwise.backends.hf import HFBackend\nHFBackend({str(tiny_llama_dir)!r})\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BRANCHWISE_CACHE_DIR": str(cache)}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert "terminate called" not in done.stderr, done.stderr[-3000:]
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(_stored(cache / "grammar")) == 1
