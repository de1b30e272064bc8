"""The process's compute thread (`compute_thread.py`): every computation of the local backend runs on
one thread, whichever thread asks for it.

Why it matters: with GNU OpenMP, a second thread that computes makes every parallel region of a
decode step wait for sleeping workers (a third slower on 2 cores, measured in the module's
docstring). No timing is asserted here; what is asserted is where the work runs.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch

from branchwise.backends import DecodeParams
from branchwise.backends.compute_thread import COMPUTE, IDLE_AFTER_S, ComputeThread, ProcessExiting
from branchwise.backends.hf import HFBackend


def test_calls_from_any_thread_run_on_one_thread_and_nested_calls_run_at_once() -> None:
    worker = ComputeThread(name="test-compute")
    seen: list[str] = []

    def where() -> str:
        seen.append(threading.current_thread().name)
        return worker.run(lambda: threading.current_thread().name)  # nested: no deadlock

    assert worker.run(where) == "test-compute"
    box: list[str] = []
    other = threading.Thread(target=lambda: box.append(worker.run(where)))
    other.start()
    other.join()
    assert box == ["test-compute"] and seen == ["test-compute", "test-compute"]


def test_errors_come_back_to_the_caller_and_the_thread_goes_on() -> None:
    worker = ComputeThread(name="test-errors")

    def fail() -> None:
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        worker.run(fail)
    assert worker.run(lambda: 7) == 7


def test_an_interrupted_caller_stops_the_computation_it_waits_for() -> None:
    """Ctrl-C while waiting: the caller gets its KeyboardInterrupt, the computation running for it
    stops at its next `check` (a decode checks every step), and the thread serves the next call."""
    worker = ComputeThread(name="test-interrupt")
    steps: list[int] = []

    def long() -> str:
        for i in range(500):
            worker.check()
            steps.append(i)
            time.sleep(0.01)
        return "finished"

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            worker.run(long)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert worker.run(lambda: "next") == "next"  # runs once the stopped computation has unwound
    assert 0 < len(steps) < 500
    worker.check()  # nothing is interrupted any more (and off its thread, check never raises)


def test_the_callers_thread_count_goes_with_each_call() -> None:
    worker = ComputeThread(name="test-threads")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert worker.run(torch.get_num_threads) == 1
        torch.set_num_threads(max(before, 2))
        assert worker.run(torch.get_num_threads) == max(before, 2)
    finally:
        torch.set_num_threads(before)


def test_a_decode_runs_on_the_compute_thread_from_any_caller(tiny_llama_dir) -> None:
    """Loading, and a decode asked for from the main thread and from another thread (a scheduler's,
    a server's worker): every step runs on the compute thread, and the tokens are the same."""
    backend = HFBackend(tiny_llama_dir, cache_bytes=0)
    names: list[str] = []

    def decode() -> list[int]:
        root = backend.prefill(backend.encode("What is 12 + 7?"))
        gens = backend.extend(
            [root],
            DecodeParams(max_tokens=6, min_tokens=6),
            on_step=lambda _: names.append(threading.current_thread().name),
        )
        backend.release([root])
        return gens[0].token_ids

    here = decode()
    box: list[list[int]] = []
    other = threading.Thread(target=lambda: box.append(decode()))
    other.start()
    other.join()
    assert box == [here]
    assert set(names) == {COMPUTE.name} and len(names) == 12


def test_models_beside_the_backend_compute_on_the_same_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A PRM verifier's scores and ETS's sentence embeddings, asked for on the caller's thread, are
    computed on the compute thread where the backend decodes."""
    from branchwise.reasoners.search.cluster import MiniLMEmbedder
    from branchwise.reasoners.verifiers import PRMVerifier

    names: list[str] = []

    def record(*_: object) -> list[list[float]]:
        names.append(threading.current_thread().name)
        return [[1.0]]

    monkeypatch.setattr(PRMVerifier, "_step_scores", record)
    monkeypatch.setattr(MiniLMEmbedder, "_embed", record)
    prm = PRMVerifier.__new__(PRMVerifier)  # no model: only where its scoring runs is checked
    assert prm.step_scores("q", []) == [[1.0]]
    assert MiniLMEmbedder().embed(["a sentence"]) == [[1.0]]
    assert names == [COMPUTE.name, COMPUTE.name]


def _wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while not condition() and time.monotonic() < end:
        time.sleep(0.02)
    return condition()


def test_watchers_hear_busy_before_a_computation_and_idle_only_after_a_quiet_spell() -> None:
    worker = ComputeThread(name="test-watch")
    heard: list[tuple[bool, bool]] = []  # (busy, whether the computation had started)
    started = threading.Event()
    unwatch = worker.watch(lambda busy: heard.append((busy, started.is_set())))
    assert heard == [(False, False)]  # the current state, at once

    def compute() -> None:
        started.set()

    for _ in range(5):  # back to back: one busy spell, not five
        worker.run(compute)
    assert heard == [(False, False), (True, False)]  # told before the first computation ran
    assert _wait_for(lambda: len(heard) == 3)
    assert heard[-1] == (False, True)
    worker.run(compute)  # a new spell after the idle one
    assert heard[3] == (True, True)
    unwatch()
    assert _wait_for(lambda: not worker._busy)
    time.sleep(IDLE_AFTER_S * 2)
    assert len(heard) == 4  # no longer told


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process state from /proc")
def test_a_compile_worker_is_held_stopped_while_the_process_computes() -> None:
    """The step compiler's worker shares a CPU's cores with the steps it compiles for: it runs only
    while the compute thread is idle (SIGSTOP / SIGCONT), and says how long it was held."""
    import subprocess

    from branchwise.backends.hf.compile_worker import Worker

    proc = subprocess.Popen(["sleep", "60"])
    worker = object.__new__(Worker)  # the pacing alone, around a stand-in process
    worker._proc, worker.paused_s, worker._paused_at = proc, 0.0, None
    compute = ComputeThread(name="test-paced")
    try:
        unwatch = compute.watch(worker._pace)
        states: list[str] = []

        def look() -> None:
            time.sleep(0.2)
            states.append(_process_state(proc.pid))

        compute.run(look)
        assert states == ["T"]  # stopped while the computation ran
        assert _wait_for(lambda: _process_state(proc.pid) != "T")
        assert not worker.paused and worker.paused_s >= 0.2
        unwatch()
    finally:
        proc.kill()
        proc.wait()


def _process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def test_stop_ends_the_running_computation_fails_the_queued_and_refuses_the_rest() -> None:
    """What exit does (`atexit`): the running computation stops at its next check, what is queued
    fails, the thread ends; later, other threads are refused and the main thread computes itself."""
    worker = ComputeThread(name="test-stop")
    running = threading.Event()
    outcomes: list[BaseException | None] = [None, None]

    def loop() -> None:
        running.set()
        while True:  # a decode: a check every step
            worker.check()
            time.sleep(0.001)

    def call(i: int, fn: object) -> None:
        try:
            worker.run(fn)  # type: ignore[arg-type]
        except BaseException as exc:
            outcomes[i] = exc

    first = threading.Thread(target=call, args=(0, loop))
    first.start()
    assert running.wait(30)
    second = threading.Thread(target=call, args=(1, lambda: "never run"))
    second.start()
    time.sleep(0.05)  # queued behind the loop
    assert worker.stop(30)
    first.join(30)
    second.join(30)
    assert isinstance(outcomes[0], ProcessExiting) and isinstance(outcomes[1], ProcessExiting)
    outcomes[0] = None
    late = threading.Thread(target=call, args=(0, lambda: None))
    late.start()
    late.join(30)
    assert isinstance(outcomes[0], ProcessExiting)
    assert worker.run(lambda: threading.current_thread().name) == threading.main_thread().name
