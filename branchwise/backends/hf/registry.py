"""The process's loaded models: one `HFBackend` per (model, device, dtype, prepack), held weakly.

Why: every front end that is given a model *name* (`ChatBranchwise(model=...)`, DSPy's
`BranchwiseEngine`/`BranchwiseLM`, the commands) used to load its own copy of the weights. An app
that builds a chat model per request (a LangGraph node, a FastAPI handler, a test fixture) then held
one model per request, gigabytes within minutes. Through `shared_backend` they all get the same
backend while any of them still uses it, and requests from all of them batch together on it.

The registry holds its backends by weak reference only: it never keeps a model alive. When the
last front end holding a backend is closed or freed, the backend is freed with its weights and KV,
and the next `shared_backend` call loads the model again.

The key is what changes the loaded weights: the model (the embedded one, a hub id, or a local folder
by its resolved path), the device and dtype as resolved (``"auto"`` and the device it picks are one
key) and whether the linear layers are prepacked. A shared backend's settings (``kv_budget``,
``cache_bytes``, ``accel``, ...) are shared by all its users; whoever needs settings of their own
builds an `HFBackend` and passes it as ``backend=``.
"""

from __future__ import annotations

import os
import threading
import weakref
from pathlib import Path

import torch

from branchwise.backends.hf import backend as backend_module
from branchwise.backends.hf.backend import HFBackend
from branchwise.backends.hf.embedded import EMBEDDED_MODEL

__all__ = ["ModelKey", "loaded_backends", "model_key", "shared_backend"]

ModelKey = tuple[str, str, str, bool]
"""(model, device, dtype, prepack), each as resolved: what makes two loads the same weights."""

_lock = threading.Lock()
_loaded: weakref.WeakValueDictionary[ModelKey, HFBackend] = weakref.WeakValueDictionary()
_loading: dict[ModelKey, threading.Lock] = {}
"""One lock per key being loaded, so that concurrent first users wait for one load instead of
loading the model once each (eight chat models built in eight threads: one model)."""


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
            return found
        loading = _loading.setdefault(key, threading.Lock())
    with loading:
        with _lock:
            found = _loaded.get(key)
        if found is not None:  # another thread loaded it while this one waited
            return found
        try:
            loaded = HFBackend(model, device=device, dtype=dtype, prepack=prepack)
            with _lock:
                _loaded[key] = loaded
            return loaded
        finally:
            with _lock:  # registered before this lock goes: a newcomer finds the model, not no lock
                if _loading.get(key) is loading:
                    del _loading[key]


def loaded_backends() -> dict[ModelKey, HFBackend]:
    """The backends the registry shares now, by key (only those some user still holds)."""
    with _lock:
        return dict(_loaded.items())
