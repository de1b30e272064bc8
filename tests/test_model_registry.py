"""One loaded model per process: front ends given a model name share it, and nothing keeps it alive
but the last used model, for its idle period.

What is checked is behaviour, not speed: the registry hands out one backend per (model, device,
dtype, prepack); chat models built, invoked and dropped in a loop leave no model, no scheduler
thread and no memory behind (with keeping warm off, as most tests here run); with it on, they load
the model once, and it goes once the idle period passes; concurrent chat models share one backend
and one batch; `close()` and ``with`` release a model's thread at once, and never under another
live user.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from branchwise.backends.base import DecodeParams
from branchwise.backends.compute_thread import COMPUTE
from branchwise.backends.hf import registry
from branchwise.backends.hf.pool import return_freed_memory
from branchwise.backends.hf.registry import (
    keep_warm,
    loaded_backends,
    model_key,
    shared_backend,
    warm_backend,
)
from branchwise.backends.scheduler import Job, Scheduler

pytest.importorskip("langchain_core")

from testkit import FakeBackend, wait_until

from branchwise.integrations._shared import shared_scheduler, users
from branchwise.integrations.langchain import ChatBranchwise

WARM_UP = 3
"""Chat models built before the memory baseline is read: the allocator keeps the first loads' freed
weights for reuse, so resident memory climbs over the first few loads (0.57, 0.78, 0.92 GiB on the
embedded model) and stays flat after; a leak instead adds a whole model per chat model (+1 GiB each)."""

SCHEDULER_THREADS = ("branchwise-scheduler", "branchwise-dspy-batcher")
_EARLIER: set[threading.Thread] = set()
"""Scheduler threads alive when the test began (another module's LM configured globally, say)."""


@pytest.fixture(autouse=True)
def _earlier_workers() -> None:
    _EARLIER.clear()
    _EARLIER.update(_workers())


@pytest.fixture(autouse=True)
def _not_warm() -> Iterator[None]:
    """Keeping warm off (the tests here check that a dropped model is freed), restored after."""
    before = keep_warm()
    keep_warm(0)
    yield
    keep_warm(before)


def _workers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name in SCHEDULER_THREADS and t.is_alive()}


def _scheduler_threads() -> int:
    """Scheduler threads started during this test and still running."""
    return len(_workers() - _EARLIER)


def _workers_ended() -> None:
    """Wait for this test's scheduler threads to end (a freed scheduler's worker exits once its
    step is done)."""
    for thread in _workers() - _EARLIER:
        thread.join(10)


def _settled() -> None:
    """Collect garbage (what a cycle holds), then wait for the freed schedulers' workers to end."""
    gc.collect()
    _workers_ended()


def _keys_of(path: Path) -> list[Any]:
    return [key for key in loaded_backends() if key[0] == str(path.resolve())]


def test_one_backend_per_key_held_weakly(tiny_llama_dir: Path) -> None:
    first = shared_backend(tiny_llama_dir)
    assert shared_backend(str(tiny_llama_dir) + "/") is first  # one folder, however spelled
    assert shared_backend(tiny_llama_dir, device="cpu", dtype="float32") is first
    other = shared_backend(tiny_llama_dir, prepack=False)  # other weights in memory: its own load
    assert other is not first
    assert len(_keys_of(tiny_llama_dir)) == 2
    gone = weakref.ref(first)
    del first, other
    _settled()
    assert gone() is None and _keys_of(tiny_llama_dir) == []


def test_chat_models_built_and_dropped_load_once_while_warm(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keeping warm on: chat models built, invoked and dropped one after another load the model once,
    hold one model between them, and the model is freed once the idle period passes unused."""
    _settled()
    loads: list[weakref.ref[Any]] = []
    load = registry.HFBackend

    def counted(*args: Any, **kwargs: Any) -> Any:
        backend = load(*args, **kwargs)
        loads.append(weakref.ref(backend))
        return backend

    monkeypatch.setattr(registry, "HFBackend", counted)
    keep_warm(60)
    for _ in range(5):
        chat = ChatBranchwise(model=str(tiny_llama_dir), max_tokens=2)
        chat.invoke("hi")
        del chat
        _workers_ended()
        assert len(_keys_of(tiny_llama_dir)) == 1  # kept, though no chat model holds it
    assert len(loads) == 1
    assert warm_backend() is loads[0]()
    keep_warm(0.2)  # a short idle period from now: the model goes when it passes
    wait_until(lambda: loads[0]() is None, "the warm model to be freed after its idle period")
    assert _keys_of(tiny_llama_dir) == [] and warm_backend() is None
    assert _scheduler_threads() == 0


def test_the_idle_period_counts_from_the_last_use(tiny_llama_dir: Path) -> None:
    """A model in use is never released by the timer (the registry's reference is not the only one),
    and its idle period restarts when its last user closes."""
    keep_warm(0.3)
    chat = ChatBranchwise(model=str(tiny_llama_dir), max_tokens=2)
    backend = weakref.ref(chat.backend)
    wait_until(lambda: warm_backend() is None, "the idle period to pass while the chat model is held")
    assert backend() is not None  # still held by its user
    chat.close()
    assert warm_backend() is backend()  # the end of the use kept it warm again
    del chat
    wait_until(lambda: backend() is None, "the model to go once its idle period after the last use passed")


def test_keep_warm_refuses_a_bad_period() -> None:
    for bad in (-1, float("nan"), "soon", True):
        with pytest.raises(ValueError, match=r"keep_warm=.* must be a number of seconds >= 0"):
            keep_warm(bad)  # type: ignore[arg-type]


def test_bad_device_or_dtype_fails_before_loading() -> None:
    with pytest.raises(ValueError, match="dtype='fp8'"):
        model_key("x", dtype="fp8")
    with pytest.raises(ValueError, match="device='tpu'"):
        model_key("x", device="tpu")


def test_concurrent_first_users_load_once(tiny_llama_dir: Path) -> None:
    got: list[Any] = []
    start = threading.Barrier(4)

    def load() -> None:
        start.wait(10)
        got.append(shared_backend(tiny_llama_dir))

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == 4 and all(b is got[0] for b in got)
    got.clear()
    _settled()


def test_chat_models_built_and_dropped_in_a_loop_leave_nothing(tiny_llama_dir: Path) -> None:
    """Chat models each built, invoked and dropped: memory and threads stay where the first ones
    left them (10 here, each a fresh load of the tiny model; the slow test below runs 50 on the real
    one)."""
    psutil = pytest.importorskip("psutil")
    process = psutil.Process()
    _settled()
    threads_before = set(threading.enumerate())
    rss: list[int] = []
    model_refs: list[weakref.ref[Any]] = []
    for _ in range(10):
        chat = ChatBranchwise(model=str(tiny_llama_dir), max_tokens=2)
        chat.invoke("hi")
        model_refs.append(weakref.ref(chat.backend))
        del chat
        _workers_ended()  # no garbage collection in the loop: dropping is enough (as in an app)
        assert _scheduler_threads() == 0
        if len(rss) == WARM_UP - 1:
            gc.collect()
        rss.append(process.memory_info().rss)
    gc.collect()
    rss.append(process.memory_info().rss)

    # a dropped model's idle grammar threads are told to end (`Lane.close`) and end at once; the
    # process's one compute thread, started by the first computation if none ran yet, stays
    def left() -> list[str]:
        return sorted(t.name for t in set(threading.enumerate()) - threads_before if t.name != COMPUTE.name)

    deadline = time.monotonic() + 10
    while left() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left() == [], f"threads the dropped models left: {left()}"
    assert _scheduler_threads() == 0
    assert all(ref() is None for ref in model_refs)  # every model was freed with its chat model
    assert _keys_of(tiny_llama_dir) == []
    assert rss[-1] <= rss[WARM_UP - 1] * 1.10, [r >> 20 for r in rss]


def test_concurrent_chat_models_share_one_model_and_one_batch(tiny_llama_dir: Path) -> None:
    start = threading.Barrier(8)
    chats: list[ChatBranchwise] = []
    replies: list[Any] = []
    lock = threading.Lock()

    def user() -> None:
        chat = ChatBranchwise(model=str(tiny_llama_dir), max_tokens=16)
        with lock:
            chats.append(chat)
        start.wait(60)
        reply = chat.invoke("What is 12 + 7?")
        with lock:
            replies.append(reply)

    threads = [threading.Thread(target=user) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(replies) == 8
    assert len({id(c.backend) for c in chats}) == 1  # one model
    assert len(_keys_of(tiny_llama_dir)) == 1
    stats = chats[0].batch_stats
    assert all(c.batch_stats is stats for c in chats)  # one scheduler
    assert stats.max_requests_per_call > 1, stats.as_dict()  # requests merged into shared passes
    assert sum(stats.histogram.values()) < 8
    assert users(shared_scheduler(chats[0].backend)) == 8
    for chat in chats:
        chat.close()
    assert _scheduler_threads() == 0
    chats.clear()
    replies.clear()
    _settled()
    assert _keys_of(tiny_llama_dir) == []


def test_close_and_with_release_the_thread_at_once(tiny_llama_dir: Path) -> None:
    _settled()
    with ChatBranchwise(model=str(tiny_llama_dir), max_tokens=2) as chat:
        chat.invoke("hi")
        assert _scheduler_threads() == 1
    assert _scheduler_threads() == 0  # joined by close(), no garbage collection needed
    with pytest.raises(RuntimeError, match="ChatBranchwise was closed"):
        chat.invoke("hi")
    chat.close()  # idempotent
    assert chat._name() == chat.model_name  # still named
    assert _keys_of(tiny_llama_dir) == []  # the closed chat model holds no model: it is freed

    other = ChatBranchwise(model=str(tiny_llama_dir), max_tokens=2)
    other.invoke("hi")
    other.close()
    assert _scheduler_threads() == 0


def test_a_model_in_use_is_not_released_when_another_user_closes(tiny_llama_dir: Path) -> None:
    a = ChatBranchwise(model=str(tiny_llama_dir), max_tokens=2)
    b = ChatBranchwise(model=str(tiny_llama_dir), max_tokens=2)
    assert a.backend is b.backend
    backend = weakref.ref(b.backend)
    sched = b._scheduler.scheduler
    a.invoke("hi")
    a.close()
    gc.collect()
    assert sched.worker_alive  # b still uses the scheduler: its worker was not stopped
    assert users(sched) == 1
    assert b.invoke("hi").content is not None
    assert backend() is not None and len(_keys_of(tiny_llama_dir)) == 1
    b.close()
    assert not sched.worker_alive
    del a, b, sched
    _settled()
    assert backend() is None


def test_dspy_engine_shares_the_chat_models_model(tiny_llama_dir: Path) -> None:
    pytest.importorskip("dspy")
    from branchwise.integrations.dspy import BranchwiseEngine

    chat = ChatBranchwise(model=str(tiny_llama_dir), max_tokens=2)
    try:
        engine = BranchwiseEngine(str(tiny_llama_dir))
    except ImportError as err:  # DSPy < 3.4 has no engine contract
        pytest.skip(str(err))
    assert engine.backend is chat.backend and engine.scheduler is chat._scheduler.scheduler
    with engine:
        assert users(engine.scheduler) == 2
    assert engine.model_name.startswith("branchwise/")
    with pytest.raises(RuntimeError, match="BranchwiseEngine was closed"):
        engine.backend.chat_prompt([])
    assert users(chat._scheduler.scheduler) == 1
    chat.close()


def test_a_user_backend_is_shared_not_owned(tiny_backend: Any) -> None:
    """A backend passed in stays the caller's: closing the chat models leaves it loaded and usable."""
    with ChatBranchwise(backend=tiny_backend, max_tokens=2) as chat:
        chat.invoke("hi")
    assert tiny_backend.encode("hi")  # untouched
    assert ChatBranchwise(backend=tiny_backend, max_tokens=2).invoke("hi").content is not None


class _Instant(FakeBackend):
    """A backend that answers "x" at once (the scheduler's lifetime is under test, not decoding)."""

    def reply(self, prompt: list[int]) -> str:
        return "x"


@pytest.mark.parametrize("how", ["dropped", "parked", "closed"])
def test_a_scheduler_never_keeps_its_backend_or_thread(how: str) -> None:
    backend = _Instant()
    scheduler = Scheduler(backend, window_s=0.0)  # type: ignore[arg-type]
    assert scheduler.submit(Job(prompt=[1], n=1, params=DecodeParams(max_tokens=1)))[0].text == "x"
    worker = scheduler._worker
    assert worker is not None and worker.is_alive()
    gone = weakref.ref(backend)
    if how == "dropped":
        del scheduler, backend
        gc.collect()
        worker.join(5)
        assert gone() is None
    elif how == "parked":
        assert scheduler.park(5)
        # a parked scheduler still serves: the next request starts a worker again
        assert scheduler.submit(Job(prompt=[1], n=1, params=DecodeParams(max_tokens=1)))[0].text == "x"
        assert scheduler.park(5)
    else:
        scheduler.close(5)
        with pytest.raises(RuntimeError, match="closed"):
            scheduler.enqueue(Job(prompt=[1], n=1, params=DecodeParams(max_tokens=1)))
    assert not worker.is_alive()


@pytest.mark.slow
def test_embedded_chat_models_in_a_loop_keep_memory_flat(embedded_dir: Path) -> None:
    """The issue's case on the real model: 50 chat models built, invoked once and dropped (before the
    fix, each kept its model and thread: 1.54, 2.56, 3.58, 4.59 GiB after the first four).

    Memory and threads are read after the warm-up loads: the process's own threads (the compute
    thread, tqdm's monitor) start with the first chat model and stay by design, and glibc's freed
    pages are handed back before each reading (`return_freed_memory`), since in a long test process
    a heap that kept them swung resident memory by 0.35 GiB from one load to the next."""
    psutil = pytest.importorskip("psutil")
    import torch

    process = psutil.Process()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def resident() -> int:
        return_freed_memory(torch.device("cpu"))
        return int(process.memory_info().rss)

    try:
        _settled()
        threads_before: set[threading.Thread] = set()
        rss: list[int] = []
        models: list[weakref.ref[Any]] = []
        for _ in range(50):
            chat = ChatBranchwise(max_tokens=4)
            chat.invoke("Say hi.")
            models.append(weakref.ref(chat.backend))
            del chat
            _workers_ended()
            if len(rss) == WARM_UP - 1:
                gc.collect()
                threads_before = set(threading.enumerate())
            rss.append(resident())
        gc.collect()
        rss.append(resident())
    finally:
        torch.set_num_threads(threads)
    wait_until(lambda: set(threading.enumerate()) <= threads_before, "the dropped models' threads to end", 10)
    assert rss[-1] <= rss[WARM_UP - 1] * 1.10, [round(r / 2**30, 2) for r in rss]
    assert all(ref() is None for ref in models)  # every model was freed with its chat model
