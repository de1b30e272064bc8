"""Per-model files in branchwise's cache (`<cache>/<kind>/<model>.<suffix>`).

Why its own module: CGEE's calibration and SkipKV's steering vector are each saved per model, and
both need the same file-name-safe stem of a model id; kept here, neither acceleration module
imports the other for it.
"""

from __future__ import annotations

import re
from pathlib import Path

from branchwise.backends.hf.embedded import branchwise_cache_dir


def safe_model_name(model: str) -> str:
    """A file-name-safe stem for a model id or local path, so per-model caches never nest or collide
    on `/`; the tail is kept (it names the checkpoint) and capped below common file-name limits."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", model.strip("/"))[-120:]


def model_file(kind: str, model: str, suffix: str) -> Path:
    """Where a model's file of one `kind` lives: `<cache>/<kind>/<model>.<suffix>`."""
    return branchwise_cache_dir() / kind / f"{safe_model_name(model)}.{suffix}"
