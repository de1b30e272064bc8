"""Grammar compiles are bounded in time: a compile past `Grammars.timeout_s` fails its request with
`GrammarTimeout` (a child process is killed, a thread abandoned and replaced), the failure is
remembered, a slow compile never holds up the small grammars behind it, and the process never waits
at exit for an abandoned compile.

The slow compiles are fakes that block until released (a real one would make these tests as slow as
what they guard against), except where a real child process is the point: the tiny tokenizer's
grammars compile there in well under a second. No model."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any

import pytest
from testkit import wait_until

from branchwise.backends.hf import grammar, grammar_workers
from branchwise.backends.hf.grammar import (
    COMPILE_TIMEOUT_S,
    COMPILE_WORKERS,
    LIGHT_PATTERN_SIZE,
    Grammars,
    GrammarTimeout,
)
from branchwise.backends.hf.grammar_workers import CompileProcess, Lane, both
from branchwise.constraints import Constraint, ConstraintError

ROOT = Path(__file__).resolve().parents[3]
SLOW = "slowmarker"
"""Constraints whose key holds this compile slowly (the fakes below)."""


def small(i: int) -> Constraint:
    return Constraint.of_regex(f"(yes|no) {i}[0-9]")


def large(tag: str, length: int = LIGHT_PATTERN_SIZE) -> Constraint:
    """A schema whose length bounds together pass `LIGHT_PATTERN_SIZE`: it compiles in a child."""
    props = {tag: {"type": "string", "maxLength": length}, "b": {"type": "string", "maxLength": 8}}
    return Constraint.of_json_schema({"type": "object", "properties": props, "required": [tag]})


@pytest.fixture
def grammars(tiny_tokenizer: Any) -> Iterator[Grammars]:
    made = Grammars(tiny_tokenizer, len(tiny_tokenizer), {tiny_tokenizer.eos_token_id})
    yield made
    made.close()


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, list[str]]]:
    """In-thread compiles of a `SLOW` constraint block until the event is set (set at teardown, so
    no blocked thread outlives the test); the list records each compile's constraint key."""
    real, release, calls = grammar._compile, threading.Event(), []

    def blocking(compiler: Any, constraint: Constraint) -> Any:
        calls.append(constraint.key())
        if SLOW in constraint.key():
            release.wait(120)
        return real(compiler, constraint)

    monkeypatch.setattr(grammar, "_compile", blocking)
    yield release, calls
    release.set()


def test_a_compile_past_the_limit_fails_and_is_remembered(grammars: Grammars, held: Any) -> None:
    release, calls = held
    grammars.timeout_s = 0.2
    slow = Constraint.of_regex(f"{SLOW}[0-9]")
    error = grammars.prepare(slow).exception(timeout=30)
    assert isinstance(error, GrammarTimeout) and isinstance(error, ConstraintError)
    assert str(error).startswith("pattern: ") and "within 0.2 s" in str(error)
    again = grammars.prepare(slow)
    assert again.done() and isinstance(again.exception(), GrammarTimeout)  # no second compile
    assert calls.count(slow.key()) == 1
    assert (grammars.stats.timeouts, grammars.stats.refused, grammars.stats.abandoned) == (1, 1, 1)
    with pytest.raises(GrammarTimeout):
        grammars.compile(slow)
    release.set()
    assert grammars.compile(small(0)) is not None  # the lane goes on


def test_a_refused_constraint_is_remembered_too(grammars: Grammars, held: Any) -> None:
    _, calls = held
    bad = Constraint.of_json_schema({"type": "string", "pattern": "(?<=a)b"})
    for _ in range(3):
        with pytest.raises(ConstraintError, match="cannot compile"):
            grammars.compile(bad)
    assert calls.count(bad.key()) == 1 and grammars.stats.refused == 2


def test_a_timed_out_constraint_is_tried_again_later(grammars: Grammars, held: Any) -> None:
    """A timeout may be the machine's load: it is remembered for `TIMEOUT_REMEMBERED_S`, not for good."""
    release, calls = held
    grammars.timeout_s = 0.2
    slow = Constraint.of_regex(f"{SLOW}[0-9]")
    assert isinstance(grammars.prepare(slow).exception(timeout=30), GrammarTimeout)
    release.set()
    key = slow.key()
    error, _ = grammars._failed[key]
    grammars._failed[key] = (error, time.monotonic() - 1)  # as if remembered long ago
    assert grammars.compile(slow) is not None and calls.count(key) == 2


def test_one_slow_thread_compile_holds_no_small_grammar(grammars: Grammars, held: Any) -> None:
    """A slow compile (still within its limit) takes one thread: eight small grammars compile on the
    other meanwhile."""
    release, _ = held
    slow = grammars.prepare(Constraint.of_regex(f"{SLOW}[0-9]"))
    wait_until(lambda: grammars._threads.busy == 1, "the slow compile runs")
    quick = [grammars.prepare(small(i)) for i in range(8)]
    done, _ = wait(quick, timeout=60)
    assert len(done) == 8 and all(f.exception() is None for f in quick)
    assert not slow.done()
    release.set()
    assert slow.result(timeout=30) is not None


def test_abandoned_threads_are_replaced_then_bounded(grammars: Grammars, held: Any) -> None:
    """Each thread abandoned to an overrun compile is replaced, so small grammars still compile;
    once `COMPILE_WORKERS` are abandoned, compiles go to a child process (killable) instead."""
    release, calls = held
    grammars.timeout_s = 0.2
    for i in range(COMPILE_WORKERS):
        error = grammars.prepare(Constraint.of_regex(f"{SLOW}{i}[0-9]")).exception(timeout=30)
        assert isinstance(error, GrammarTimeout)
        assert grammars._threads.stuck_now == i + 1
    grammars.timeout_s = 60.0
    assert grammars.compile(small(1)) is not None
    assert small(1).key() not in calls  # compiled in a child: the threads are all abandoned
    assert grammars.stats.in_child == 1
    release.set()
    wait_until(lambda: grammars._threads.stuck_now == 0, "the abandoned threads end")
    assert grammars.compile(small(2)) is not None and small(2).key() in calls


class _HeldChild:
    """A `CompileProcess` stand-in whose compile of a `SLOW` grammar blocks until released."""

    release = threading.Event()
    started = threading.Event()

    def __init__(self, *_: Any) -> None:
        self.real = CompileProcess(*_)

    def ready(self) -> None:
        self.real.ready()

    def compile(self, method: str, args: list[Any], kwargs: dict[str, Any], timeout_s: float) -> str:
        if SLOW in str(args):
            self.started.set()
            self.release.wait(120)
        return self.real.compile(method, args, kwargs, timeout_s)

    def close(self) -> None:
        self.real.close()


def test_a_large_grammar_in_a_child_holds_no_small_grammar(
    grammars: Grammars, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large grammar compiles in a child process, off the threads: while it compiles (held here),
    eight small grammars compile and are served."""
    monkeypatch.setattr(grammar, "CompileProcess", _HeldChild)
    _HeldChild.release.clear()
    _HeldChild.started.clear()
    try:
        slow = grammars.prepare(large(SLOW))
        assert _HeldChild.started.wait(120), "the large grammar never started compiling"
        quick = [grammars.prepare(small(i)) for i in range(8)]
        done, _ = wait(quick, timeout=60)
        assert len(done) == 8 and all(f.exception() is None for f in quick)
        assert not slow.done()
    finally:
        _HeldChild.release.set()
    assert slow.result(timeout=120) is not None and grammars.stats.in_child == 1


def test_a_child_past_the_limit_is_killed_and_the_next_one_compiles(grammars: Grammars) -> None:
    """A real child: its grammar comes back usable; past the limit it is killed (the process is
    gone), the request gets `GrammarTimeout`, and a new child compiles the next large grammar."""
    import xgrammar as xgr

    first = grammars.compile(large("first"))
    matcher = xgr.GrammarMatcher(first)
    assert matcher.accept_string('{"first": "ok"}') and matcher.is_completed()
    assert grammars.stats.in_child == 1
    (child,) = grammars._idle
    pid = child.pid
    assert pid is not None
    grammars.timeout_s = 0.0001
    with pytest.raises(GrammarTimeout, match=r"json_schema: .*within 0.0001 s"):
        grammars.compile(large("second"))
    assert child.pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped
    grammars.timeout_s = 60.0
    assert grammars.compile(large("third")) is not None
    assert child.started == 2 and grammars.stats.in_child == 2


def test_large_and_small_go_their_own_ways(grammars: Grammars) -> None:
    assert grammar._light(small(1))
    assert grammar._light(large("x", LIGHT_PATTERN_SIZE - 8))
    assert not grammar._light(large("x", LIGHT_PATTERN_SIZE))
    tools = Constraint.of_tools(
        [{"type": "function", "function": {"name": "f", "parameters": large("x").json_schema}}], "required"
    )
    assert not grammar._light(tools)


def test_the_process_never_waits_for_an_abandoned_compile(tmp_path: Path, tiny_tokenizer: Any) -> None:
    """A script whose compile overran (a fake that would run ten minutes) exits at once; one whose
    parent dies leaves no compile process behind."""
    tiny_tokenizer.save_pretrained(tmp_path / "tok")
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, sys, time
            from transformers import AutoTokenizer
            from branchwise.backends.hf import grammar
            from branchwise.backends.hf.grammar import Grammars, GrammarTimeout
            from branchwise.constraints import Constraint

            tok = AutoTokenizer.from_pretrained({str(tmp_path / "tok")!r})
            real = grammar._compile
            grammar._compile = lambda compiler, c: time.sleep(600) if "slow" in c.key() else real(compiler, c)
            g = Grammars(tok, len(tok), {{tok.eos_token_id}}, timeout_s=0.2)
            assert isinstance(g.prepare(Constraint.of_regex("slow")).exception(30), GrammarTimeout)
            child = grammar.CompileProcess(g.tokenizer_info().serialize_json())  # idle, or compiling
            child.ready()
            print(child.pid, flush=True)
            if sys.argv[1] == "die":
                os._exit(0)  # no clean-up at all: the child must notice on its own
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for how in ("exit", "die"):
        start = time.monotonic()
        done = subprocess.run(
            [sys.executable, str(script), how], capture_output=True, text=True, timeout=300, env=env
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert time.monotonic() - start < 120  # an import or two; the fake alone would take 600 s
        pid = int(done.stdout.split()[-1])
        wait_until(lambda pid=pid: not _alive(pid), f"compile process {pid} ends after its parent ({how})")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (its parent gone, not yet reaped by init) counts as ended
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"))


def test_a_future_joins_two(grammars: Grammars) -> None:
    """`both`: the first one's error wins, else the second one's result."""
    a: Future[int] = Future()
    b: Future[int] = Future()
    joined = both(a, b)
    b.set_result(2)
    assert not joined.done()
    a.set_result(1)
    assert joined.result(timeout=1) == 2


def test_the_serve_commands_default_limit_is_the_libraries() -> None:
    """``--grammar-timeout`` states its default as a number (the CLI imports no xgrammar): it is
    `COMPILE_TIMEOUT_S`."""
    typer = pytest.importorskip("typer")
    from branchwise.cli import app

    serve = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    (option,) = [p for p in serve.params if "--grammar-timeout" in p.opts]
    assert option.default == COMPILE_TIMEOUT_S


def test_the_cache_forgets_the_least_recently_used_past_its_bytes(
    grammars: Grammars, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second, third = (small(i) for i in range(3))
    one = grammars.compile(first).memory_size_bytes
    monkeypatch.setattr(grammar, "CACHE_BYTES", 2 * one + one // 2)  # room for two such grammars
    grammars.compile(second)
    grammars.compile(first)  # a hit: now the most recently used
    grammars.compile(third)  # past the bytes: `second` goes
    assert list(grammars._cache) == [first.key(), third.key()]
    assert grammars.stats.compiled == 3 and grammars.stats.cache_hits == 1


def test_a_lane_closed_from_a_finalizer_inside_its_own_fill_does_not_hang() -> None:
    """The engine's finalizer closes its grammar lanes on whatever thread a garbage collection
    happens, which may be one inside `Lane._fill` holding the lane's lock (it starts a thread, and
    starting one may collect): closing there must neither wait for that lock nor for a thread."""
    lane = Lane("finalizer-test", 1)
    ran = threading.Event()
    lane.submit(ran.set)
    wait_until(ran.is_set, "the lane's job to run")
    done = threading.Event()

    def close_holding_the_lock() -> None:
        with lane._lock:  # as `_fill` holds it when a collection runs the finalizer
            lane.close()
        done.set()

    threading.Thread(target=close_holding_the_lock, daemon=True).start()
    assert done.wait(5), "Lane.close waited on the lock its caller holds"
    wait_until(lambda: lane._threads == 0, "the lane's idle thread to end once told to")


def test_exit_waits_for_a_job_that_another_lanes_job_queued() -> None:
    """The tables' build queues the ``json_object`` compile on another lane before it ends; exit
    waits for both (lanes waited one after the other missed it, and the compile then ran into the
    interpreter's shutdown and aborted the process)."""
    first, second = Lane("exit-first", 1), Lane("exit-second", 1)
    finished = threading.Event()

    def slow() -> None:
        time.sleep(0.3)
        finished.set()

    first.submit(lambda: (time.sleep(0.1), second.submit(slow)))
    assert grammar_workers._PENDING.wait_none(time.monotonic() + 30)
    assert finished.is_set()
    first.close()
    second.close()


def test_exit_stops_waiting_only_once_a_job_and_what_it_holds_are_gone() -> None:
    """What a job's closure holds (tensors: a grammar's bitmask) is freed before exit stops waiting
    for the job: a lane thread that kept its last job until its next `get` freed it while the
    interpreter finalised, and torch's destructor aborted the process there (exit status 134)."""

    class Held:
        """Stands for what a job captures."""

    lane = Lane("exit-release", 1)
    held = Held()
    released = weakref.ref(held)

    def job(held: Held = held) -> None:
        assert isinstance(held, Held)

    lane.submit(job)
    del job, held
    assert grammar_workers._PENDING.wait_none(time.monotonic() + 30)
    assert released() is None, "exit would stop waiting while the lane's thread still holds the job"
    lane.close()


def test_a_thread_a_closed_lane_starts_ends_after_its_job() -> None:
    """A job may reach a lane after its owner closed it (the tables' build queues the
    ``json_object`` compile on the compile lane of a model dropped meanwhile): it runs, and its
    thread ends then instead of idling for a minute (dropped models once left such threads)."""
    lane = Lane("closed-test", 1)
    lane.close()
    ran = threading.Event()
    lane.submit(ran.set)
    wait_until(ran.is_set, "the job to run")
    wait_until(lambda: lane._threads == 0, "the thread to end without idling", 10)
    assert lane.busy == 0 and lane.stuck_now == 0
