"""The process's loaded models: one `HFBackend` per (model, device, dtype, prepack), held weakly, and
the last one used kept warm for an idle period.

Why: every front end that is given a model *name* (`ChatBranchwise(model=...)`, DSPy's
`BranchwiseEngine`/`BranchwiseLM`, the commands) used to load its own copy of the weights. An app
that builds a chat model per request (a LangGraph node, a FastAPI handler, a test fixture) then held
one model per request, gigabytes within minutes. Through `shared_backend` they all get the same
backend while any of them still uses it, and requests from all of them batch together on it.

The registry holds its backends by weak reference, with one exception: the model used last is kept
alive for `keep_warm` seconds after its last use (`BRANCHWISE_KEEP_WARM_S`, default
`DEFAULT_KEEP_WARM_S`; 0 turns it off). Why: an app that builds its chat model per request (or a
script that builds one, drops it and builds the next) would otherwise load the weights, and compile
its grammars, once per request. When the idle period passes with no use, and no front end holds the
backend, it is freed with its weights and KV, and the next `shared_backend` call loads the model
again. One model at most is kept, so memory stays that of the models in use plus one.

The idle timer is a daemon thread that only waits; at exit the warm model is released before the
interpreter finalises (`_release_at_exit`), so no model's native state outlives Python's.

The key is what changes the loaded weights: the model (the embedded one, a hub id, or a local folder
by its resolved path), the device and dtype as resolved (``"auto"`` and the device it picks are one
key) and whether the linear layers are prepacked. A shared backend's settings (``kv_budget``,
``cache_bytes``, ``accel``, ...) are shared by all its users; whoever needs settings of their own
builds an `HFBackend` and passes it as ``backend=``.
"""

from __future__ import annotations

import atexit
import math
import os
import threading
import time
import weakref
from pathlib import Path

import torch

from branchwise.backends.hf import backend as backend_module
from branchwise.backends.hf.backend import HFBackend
from branchwise.backends.hf.embedded import EMBEDDED_MODEL

__all__ = [
    "DEFAULT_KEEP_WARM_S",
    "KEEP_WARM_ENV",
    "ModelKey",
    "keep_warm",
    "loaded_backends",
    "model_key",
    "shared_backend",
    "touch",
    "warm_backend",
]

KEEP_WARM_ENV = "BRANCHWISE_KEEP_WARM_S"
"""The environment variable that sets the idle period at import (seconds; 0 turns keeping off)."""
DEFAULT_KEEP_WARM_S = 300.0
"""Seconds the last used model stays loaded after its last use when the environment says nothing."""

ModelKey = tuple[str, str, str, bool]
"""(model, device, dtype, prepack), each as resolved: what makes two loads the same weights."""

_lock = threading.Lock()
_loaded: weakref.WeakValueDictionary[ModelKey, HFBackend] = weakref.WeakValueDictionary()
_loading: dict[ModelKey, threading.Lock] = {}
"""One lock per key being loaded, so that concurrent first users wait for one load instead of
loading the model once each (eight chat models built in eight threads: one model)."""


def _seconds(value: object, name: str) -> float:
    """`value` as an idle period: a finite number of seconds >= 0, else an error naming `name`."""
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(value, bool) or not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{name}={value!r} must be a number of seconds >= 0 (0: keep no model warm)")
    return seconds


class _Warm:
    """The model kept warm: a strong reference to one backend, dropped `period` seconds after its last
    use by a daemon thread that only waits (it starts when a model is kept, and ends when none is)."""

    def __init__(self, period: float) -> None:
        self.period = period
        self.backend: HFBackend | None = None
        self.until = 0.0
        # re-entrant: `touch` may run in a garbage collector's finalizer on a thread that holds it
        self.cv = threading.Condition(threading.RLock())
        self.thread: threading.Thread | None = None

    def keep(self, backend: HFBackend) -> None:
        with self.cv:
            if self.period <= 0:
                return
            old, self.backend = self.backend, backend
            self.until = time.monotonic() + self.period
            if self.thread is None:
                self.thread = threading.Thread(target=self._wait, name="branchwise-keep-warm", daemon=True)
                self.thread.start()
            self.cv.notify_all()
        del old  # the model kept before is freed here, outside the lock, if nobody holds it

    def drop(self) -> None:
        with self.cv:
            old, self.backend = self.backend, None
            self.cv.notify_all()
        del old

    def stop(self) -> None:
        """Keep no model (period 0), and wait for the timer thread to end: it only waits, so at once."""
        with self.cv:
            self.period = 0.0
            thread = self.thread
        self.drop()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _wait(self) -> None:
        while True:
            with self.cv:
                if self.backend is None:
                    self.thread = None  # under the lock: a `keep` after this starts a new thread
                    return
                left = self.until - time.monotonic()
                if left > 0:
                    self.cv.wait(left)
                    continue
                old, self.backend = self.backend, None
            del old  # freed outside the lock (a model's weights take a while to go)


_warm = _Warm(_seconds(os.environ.get(KEEP_WARM_ENV, DEFAULT_KEEP_WARM_S), KEEP_WARM_ENV))


def keep_warm(seconds: float | None = None) -> float:
    """The idle period, in seconds, for which the last used model stays loaded (see the module
    docstring); with `seconds`, set it first (0: keep none, and release the one kept now)."""
    if seconds is not None:
        period = _seconds(seconds, "keep_warm")
        if period <= 0:
            _warm.stop()
        with _warm.cv:
            _warm.period = period
            if _warm.backend is not None:
                _warm.until = time.monotonic() + period
            _warm.cv.notify_all()
    return _warm.period


def touch(key: ModelKey) -> None:
    """A use of the model of `key` just began or ended: it becomes the model kept warm, for
    `keep_warm()` seconds from now (nothing happens when it is no longer loaded)."""
    backend = _loaded.get(key)
    if backend is not None:
        _warm.keep(backend)


def warm_backend() -> HFBackend | None:
    """The backend kept warm now (None when none is)."""
    with _warm.cv:
        return _warm.backend


@atexit.register
def _release_at_exit() -> None:
    """The warm model goes before the interpreter finalises, not during (see the module docstring)."""
    _warm.stop()


def model_key(
    model: str | os.PathLike[str] | None = None,
    *,
    device: str = "auto",
    dtype: str | torch.dtype = "auto",
    prepack: bool = True,
) -> ModelKey:
    """The registry key of a load: bad device or dtype values fail here, before any loading."""
    dev = backend_module.resolve_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    torch_dtype = backend_module.resolve_dtype(dtype, dev)
    name = EMBEDDED_MODEL if model is None else str(model)
    if name != EMBEDDED_MODEL and Path(name).is_dir():
        name = str(Path(name).resolve())  # one folder, however it is spelled
    return (name, str(dev), str(torch_dtype).removeprefix("torch."), bool(prepack))


def shared_backend(
    model: str | os.PathLike[str] | None = None,
    *,
    device: str = "auto",
    dtype: str | torch.dtype = "auto",
    prepack: bool = True,
) -> HFBackend:
    """The loaded backend of `model` on `device` in `dtype`: the one already in use in this process
    if there is one, else a new `HFBackend` (which the registry then shares while anyone holds it).

    `model`: None for the embedded model, a hub id or a local folder (as for `HFBackend`).
    """
    key = model_key(model, device=device, dtype=dtype, prepack=prepack)
    with _lock:
        found = _loaded.get(key)
    if found is not None:
        _warm.keep(found)
        return found
    with _lock:
        loading = _loading.setdefault(key, threading.Lock())
    with loading:
        with _lock:
            found = _loaded.get(key)
        if found is not None:  # another thread loaded it while this one waited
            _warm.keep(found)
            return found
        try:
            loaded = HFBackend(model, device=device, dtype=dtype, prepack=prepack)
            with _lock:
                _loaded[key] = loaded
            _warm.keep(loaded)
            return loaded
        finally:
            with _lock:  # registered before this lock goes: a newcomer finds the model, not no lock
                if _loading.get(key) is loading:
                    del _loading[key]


def loaded_backends() -> dict[ModelKey, HFBackend]:
    """The backends the registry shares now, by key (only those some user still holds)."""
    with _lock:
        return dict(_loaded.items())
